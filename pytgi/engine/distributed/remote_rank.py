"""`pytgi shard`: a tensor-parallel rank > 0 on another machine (docs/sharding.md): its model resolved
and its worker run (its flags: `pytgi.core.flags.add_shard_arguments`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from pytgi.core import flags
from pytgi.core.config import EngineConfig
from pytgi.core.logs import setup_logging
from pytgi.core.model_files import resolve_or_none
from pytgi.engine.distributed.worker import run_worker


def shard(args: argparse.Namespace) -> int:
    setup_logging(prefix=f"rank{args.rank} ")
    log = logging.getLogger("pytgi.shard")
    if not 0 < args.rank < args.world_size:
        log.error(
            "pytgi shard needs 0 < --rank < --world-size, got rank %d of %d (rank 0 is `pytgi serve`)",
            args.rank,
            args.world_size,
        )
        return 2
    model = resolve_or_none(log, args.model, args.revision)
    if model is None:
        return 2
    config = EngineConfig(**flags.from_args(args, "engine"))
    config = dataclasses.replace(
        config, model=str(model.path), num_shard=args.world_size, master_port=config.master_port or 29500
    )
    return run_worker(config, args.rank)
