"""A tensor-parallel worker (ranks 1..N-1): join the group, load this rank's shard, then run the
forward of every step rank 0 broadcasts until told to stop (or until a collective fails).

Rank 0 starts its local workers as `python -m pytgi.engine.distributed.worker --config JSON --rank R`, with
the config it loads itself; on other machines `pytgi shard` (pytgi.api.launcher) builds the config
from flags and the torchrun environment and calls `run_worker`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from pytgi.core.config import EngineConfig
from pytgi.core.logs import setup_logging
from pytgi.engine import distributed as dist
from pytgi.engine.distributed import commands

log = logging.getLogger("pytgi.worker")


def run_worker(config: EngineConfig, rank: int) -> int:
    from pytgi.engine.distributed.local_ranks import set_cpu_threads
    from pytgi.engine.execution.runner import ModelRunner

    set_cpu_threads(1 if "WORLD_SIZE" in os.environ else config.num_shard, config.threads)
    try:
        runner = ModelRunner(config, rank)
    except Exception:
        log.exception("rank %d failed to start", rank)
        return 1
    try:
        while True:
            match commands.receive():
                case commands.Ping():
                    dist.barrier()
                case commands.Step(header):
                    runner.worker_step(header)
                case commands.Allocate(num_blocks, block_size, state_slots):
                    runner.allocate_kv_cache(num_blocks, block_size, state_slots)
                case commands.Capacity(fraction, cap_bytes):
                    runner.auto_num_tokens(fraction, cap_bytes)
                case commands.Adapters(length):
                    runner.worker_adapters(length)
                case commands.CopyStates(count):
                    runner.worker_copy_states(count)
                case commands.Shutdown():
                    break
    except dist.DistributedError as exc:
        log.error("rank %d: %s", rank, exc)
        return 1
    finally:
        dist.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--config", required=True, help="rank 0's EngineConfig as JSON (model and rendezvous resolved)"
    )
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process that started us decides when to stop
    setup_logging(prefix=f"rank{args.rank} ")
    return run_worker(EngineConfig(**json.loads(args.config)), args.rank)


if __name__ == "__main__":
    sys.exit(main())
