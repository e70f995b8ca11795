"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

Rank 0 is the engine: it schedules, broadcasts each step's inputs, samples. Ranks 1..N-1 run
`pytgi.engine.distributed.worker`: receive a command, run their shard of the forward, repeat. Sizes that N
does not divide are split as evenly as their unit allows (the first ranks take one unit more): attention
by key/value heads (with their query heads), the MLP by columns, the vocabulary by rows.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from pytgi.core.errors import DistributedError

_TP_RANK = 0
_TP_SIZE = 1
_CMD_GROUP = None  # commands: a long timeout, since workers wait on it while the engine is idle
DEFAULT_TIMEOUT_S = float(os.environ.get("PYTGI_DIST_TIMEOUT", "20"))


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


@contextlib.contextmanager
def unsharded() -> Iterator[None]:
    """Build or run a model on this rank alone (the draft model on rank 0), whatever the group: its
    layers are whole and no collective runs. The engine is single-threaded, so this is safe."""
    global _TP_RANK, _TP_SIZE
    saved = _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = 0, 1
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE = saved


def init(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    global _TP_RANK, _TP_SIZE
    if world_size == 1:
        return
    # On CUDA, tensors go through NCCL and the small CPU control tensors through gloo.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        loopback = _loopback(master_addr)
        if loopback is None:  # ranks on several machines: torch's rendezvous, on every interface
            dist.init_process_group(
                backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
        else:
            store = _loopback_store(loopback, master_port, rank, world_size, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except Exception as exc:
        raise DistributedError(
            f"rank {rank}/{world_size} could not join the group at {master_addr}:{master_port}: {exc} "
            "(is the port in use, or did another rank fail to start?)"
        ) from exc
    global _CMD_GROUP
    _CMD_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
    _TP_RANK, _TP_SIZE = rank, world_size


def _loopback(address: str) -> str | None:
    """The loopback address to rendezvous on, when `address` names this machine's loopback (all ranks
    on one machine: the default), else None."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
        ips = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    except (OSError, ValueError):
        return None
    if not ips or not all(ip.is_loopback for ip in ips):
        return None
    return next((str(ip) for ip in ips if ip.version == 4), str(ips[0]))


def _loopback_store(
    address: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """The rendezvous store, listening on loopback only: torch's TCPStore server listens on every
    interface, so rank 0 hands it a socket bound to `address`; gloo's own connections are kept to the
    loopback interface too (GLOO_SOCKET_IFNAME, unless set). Nothing of a one-machine group is then
    reachable from another machine (docs/security.md)."""
    names = [name for _, name in socket.if_nameindex()]
    lo = next((n for n in ("lo", "lo0") if n in names), None)
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    if rank != 0:
        return dist.TCPStore(address, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.create_server((address, port), family=family, backlog=128)
    return dist.TCPStore(  # the store owns the socket from here (detached: Python never closes it)
        address,
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        use_libuv=False,
    )


def shutdown() -> None:
    global _TP_RANK, _TP_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1


# -- partitioning ---------------------------------------------------------------------------------
def split(n: int, parts: int | None = None) -> list[int]:
    """n units over `parts` ranks, as evenly as possible, the first ranks taking the remainder."""
    parts = parts or _TP_SIZE
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def local_range(n: int, unit: int = 1) -> tuple[int, int]:
    """(start, size) in elements of this rank's share of n units of `unit` elements each."""
    sizes = split(n)
    return sum(sizes[:_TP_RANK]) * unit, sizes[_TP_RANK] * unit


def check_heads(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """Attention is split by key/value heads; every rank needs at least one."""
    if world_size > num_kv_heads:
        raise ValueError(
            f"cannot shard a model with {num_kv_heads} key/value heads over {world_size} ranks: "
            f"use --num-shard <= {num_kv_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")


# -- collectives ------------------------------------------------------------------------------------
def _guard(op, *args):
    try:
        return op(*args)
    except Exception as exc:  # gloo/nccl errors: a peer died, hung past the timeout, or the group broke
        raise DistributedError(f"tensor-parallel collective failed: {exc}") from exc


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        _guard(dist.all_reduce, x)
    return x


def all_reduce_min(value: int) -> int:
    if _TP_SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    _guard(dist.all_reduce, t, dist.ReduceOp.MIN)
    return int(t.item())


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    _guard(dist.all_gather, parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_command(cmd: int, *args: int) -> tuple[int, ...]:
    """Rank 0 sends (cmd, up to 9 ints); the others receive it. Returns what was broadcast."""
    t = torch.zeros(10, dtype=torch.int64)
    if _TP_RANK == 0:
        t[: 1 + len(args)] = torch.tensor((cmd, *args))
    _guard(dist.broadcast, t, 0, _CMD_GROUP)
    return tuple(t.tolist())


def barrier() -> None:
    """A collective on the short-timeout group: a stuck rank shows up within the timeout."""
    all_reduce_min(1)


def broadcast_tensor(x: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank 0's tensor `x` (of `shape` and `dtype`, on the CPU), received by the others."""
    if _TP_RANK == 0:
        assert x is not None
        t = x.detach().to("cpu", dtype).contiguous()
    else:
        t = torch.empty(shape, dtype=dtype)
    _guard(dist.broadcast, t, 0)
    return t


def broadcast_arrays(arrays: list[np.ndarray] | None, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Rank 0's int64 arrays of the given shapes, in one broadcast."""
    total = sum(int(np.prod(s)) for s in shapes)
    if _TP_RANK == 0:
        assert arrays is not None
        flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays]).astype(np.int64))
    else:
        flat = torch.empty(total, dtype=torch.int64)
    _guard(dist.broadcast, flat, 0)
    out, offset, data = [], 0, flat.numpy()
    for s in shapes:
        n = int(np.prod(s))
        out.append(data[offset : offset + n].reshape(s))
        offset += n
    return out
