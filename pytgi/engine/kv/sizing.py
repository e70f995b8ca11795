"""How much memory a model takes and how many KV-cache slots fit beside it.

Before loading, a model whose weights do not fit in the memory available is refused with the numbers
(`check_fits`), instead of being killed halfway. After loading, the KV cache takes a share
(`--kv-cache-memory-fraction`) of what is left: free GPU memory on CUDA, `MemAvailable` on CPU, split
evenly over the engines sharing the machine (local tensor-parallel ranks; replicas divide the
fraction themselves)."""

from __future__ import annotations

import os

import torch

from pytgi.core.errors import ModelTooLarge
from pytgi.engine import distributed as dist

GPU_HEADROOM = 1 << 30  # left free on a GPU for activations
RUNTIME_BYTES = 3 << 29  # CPU: Python, torch, the kernels and a step's activations (1.5 GiB)
DEFAULT_FRACTION = {"cuda": 0.9, "cpu": 0.25}
GIB = float(1 << 30)


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (8 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 8 << 30


def memory_fraction(fraction: float | None, device: torch.device) -> float:
    return DEFAULT_FRACTION["cuda" if device.type == "cuda" else "cpu"] if fraction is None else fraction


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory_bytes()


def kv_capacity_tokens(
    device: torch.device,
    bytes_per_token: int,
    fraction: float | None,
    engines: int = 1,
    cap_bytes: int | None = None,
) -> int:
    """KV slots for this engine: `fraction` of the memory free now (after the weights), shared by
    `engines` engines on this machine, at most `cap_bytes`."""
    budget = int(free_bytes(device) * memory_fraction(fraction, device) / max(engines, 1))
    if device.type == "cuda":
        budget -= GPU_HEADROOM
    if cap_bytes is not None:
        budget = min(budget, cap_bytes)
    return max(budget, 0) // bytes_per_token


def kv_tokens_on_every_rank(
    device: torch.device,
    bytes_per_token: int,
    fraction: float | None,
    replicas: int = 1,
    cap_bytes: int | None = None,
) -> int:
    """KV slots that fit on every tensor-parallel rank (each rank calls it: a collective): `fraction`
    of the memory left now, shared by the ranks on this machine and the engine `replicas` started
    here, at most `cap_bytes`."""
    engines = local_engines(dist.tp_size()) * replicas
    return dist.all_reduce_min(kv_capacity_tokens(device, bytes_per_token, fraction, engines, cap_bytes))


def local_engines(tp_size: int) -> int:
    """Ranks sharing this machine's memory: all of them, unless they were started elsewhere (torchrun,
    `pytgi shard`: LOCAL_WORLD_SIZE, or one)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return tp_size


def check_fits(weight_bytes: int, device: torch.device, what: str) -> None:
    """Refuse before loading a model whose weights (and, on CPU, the runtime) exceed the memory
    available now."""
    runtime = RUNTIME_BYTES if device.type == "cpu" else GPU_HEADROOM
    free = free_bytes(device)
    if weight_bytes + runtime > free:
        where = "GPU memory free" if device.type == "cuda" else "memory available (MemAvailable)"
        raise ModelTooLarge(
            f"{what} does not fit: it needs about {weight_bytes / GIB:.1f} GiB for its weights and "
            f"{runtime / GIB:.1f} GiB for the runtime, {(weight_bytes + runtime) / GIB:.1f} GiB in all, "
            f"and this machine has {free / GIB:.1f} GiB of {where}; serve a smaller or more quantized "
            "model, or shard it over more machines (--num-shard)"
        )
