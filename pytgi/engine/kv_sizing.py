"""How many KV-cache slots fit on this rank: a fraction of free GPU memory on CUDA, on CPU up to a
cap in bytes and a quarter of the memory available (the weights, activations and the OS need the
rest)."""

from __future__ import annotations

import torch

GPU_HEADROOM = 1 << 30  # left free on a GPU for activations


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (8 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 8 << 30


def kv_capacity_tokens(
    device: torch.device, bytes_per_token: int, cpu_cap_bytes: int, gpu_fraction: float
) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_fraction) - GPU_HEADROOM
    else:
        budget = min(cpu_cap_bytes, available_memory_bytes() // 4)
    return max(budget, 0) // bytes_per_token
