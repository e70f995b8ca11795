"""Tensor-parallel state. World size 1 is the common case; ranks > 1 arrive with --num-shard."""

from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
