"""The local tensor-parallel workers of rank 0: started before the group forms, watched, stopped.

With `WORLD_SIZE`/`RANK` in the environment (torchrun, or `pytgi shard` by hand on several
machines) the other ranks are started elsewhere and this group only knows the rendezvous address.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from pytgi.core.config import EngineConfig
from pytgi.core.cpus import engine_threads, process_cpus
from pytgi.core.errors import DistributedError
from pytgi.core.families import VISION, family_of
from pytgi.core.net import free_port
from pytgi.engine.distributed import check_heads
from pytgi.engine.models.registry import config_reader

log = logging.getLogger(__name__)


class ShardGroup:
    """`config.model` is the model's directory. `self.config` is the config every rank loads with:
    the rendezvous address and port fixed."""

    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.num_shard
        self.procs: list[subprocess.Popen] = []
        self.external = int(os.environ.get("WORLD_SIZE", "1")) > 1
        port = os.environ.get("MASTER_PORT") or config.master_port
        self.config = dataclasses.replace(
            config,
            master_addr=os.environ.get("MASTER_ADDR", config.master_addr),
            master_port=int(port) if port else (29500 if self.external else free_port()),
        )
        if self.world_size == 1:
            return
        cfg = json.loads((Path(str(config.model)) / "config.json").read_text())
        family = family_of((cfg.get("architectures") or [""])[0])
        if family is not None and family.kind == VISION:  # its language model is sharded (not its tower)
            cfg = config_reader(family)(cfg)
        # (a model without attention, Mamba's, has no heads: its layers split their channels on any count)
        if (heads := cfg.get("num_attention_heads")) is not None:
            check_heads(heads, cfg.get("num_key_value_heads") or heads, self.world_size)
            if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):  # Gemma 4's full layers
                check_heads(heads, cfg["num_global_key_value_heads"], self.world_size)
        if not self.external:
            self.procs = [self._spawn(rank) for rank in range(1, self.world_size)]

    @property
    def local_ranks(self) -> int:
        """Ranks sharing this machine's cores."""
        return 1 if self.external else self.world_size

    def _spawn(self, rank: int) -> subprocess.Popen:
        config = json.dumps(dataclasses.asdict(self.config))
        cmd = [
            sys.executable,
            "-m",
            "pytgi.engine.distributed.worker",
            "--config",
            config,
            "--rank",
            str(rank),
        ]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(engine_threads(self.config.threads, self.world_size)))
        return subprocess.Popen(cmd, env=env)

    def check(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise DistributedError(f"tensor-parallel rank {rank} exited with code {proc.returncode}")

    def stop(self, timeout: float = 10.0) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()


def set_cpu_threads(local_ranks: int = 1, threads: int | None = None) -> int:
    """The engine's threads (PyTorch's pool, which the C kernels share): `threads` (--threads), else
    OMP_NUM_THREADS, else the CPUs this process may use (its affinity mask and cgroup quota:
    `pytgi.core.cpus`) shared evenly by the ranks on this machine. More threads than CPUs makes
    OpenMP's waiting threads slow everyone down. Logged; returns the count."""
    import torch

    cpus = process_cpus()
    n = engine_threads(threads, local_ranks, cpus)
    torch.set_num_threads(n)
    how = "--threads" if threads else "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in os.environ else "usable CPUs"
    share = f", shared by {local_ranks} ranks" if local_ranks > 1 else ""
    log.info("CPU threads: %d (%s; %s%s)", n, how, cpus.describe(), share)
    return n
