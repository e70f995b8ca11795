"""A tensor-parallel worker (ranks 1..N-1): join the group, load this rank's shard, then run the
forward of every step rank 0 broadcasts until told to stop (or until a collective fails).

Started by rank 0 for local shards, or by hand / torchrun on other machines:
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=host0 MASTER_PORT=29500 pytgi serve --model-id ...
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from pytgi import distributed as dist
from pytgi.logs import setup_logging

log = logging.getLogger("pytgi.worker")


def run_worker(model: str, dtype: str, device: str, attention_backend: str, rank: int, world_size: int,
               master_addr: str, master_port: int, quantize: str = "auto") -> int:
    from pytgi.engine.runner import ModelRunner, set_cpu_threads

    set_cpu_threads(world_size if "WORLD_SIZE" not in os.environ else 1)
    try:
        runner = ModelRunner(Path(model), dtype, device, attention_backend, rank, world_size, master_addr, master_port,
                             quantize)
    except Exception:
        log.exception("rank %d failed to start", rank)
        return 1
    try:
        while True:
            cmd, a, b, c, d = dist.broadcast_command(dist.CMD_NOOP)[:5]
            if cmd == dist.CMD_NOOP:
                dist.barrier()
            elif cmd == dist.CMD_STEP:
                runner.worker_step(a, b, c, d)
            elif cmd == dist.CMD_ALLOC:
                runner.allocate_kv_cache(a, b)
            elif cmd == dist.CMD_CAPACITY:
                runner.auto_num_tokens(a, b / 1000)
            elif cmd == dist.CMD_SHUTDOWN:
                break
    except dist.DistributedError as exc:
        log.error("rank %d: %s", rank, exc)
        return 1
    finally:
        dist.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--master-addr", default="localhost")
    ap.add_argument("--master-port", type=int, required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process that started us decides when to stop
    setup_logging(prefix=f"rank{args.rank} ")
    return run_worker(args.model, args.dtype, args.device, args.attention_backend, args.rank, args.world_size,
                      args.master_addr, args.master_port, args.quantize)


if __name__ == "__main__":
    sys.exit(main())
