"""Paged attention over a flat batch of mixed prefills and decodes.

Interface: a backend builds its per-step metadata once (`prepare`), then each layer calls
`forward(q, k, v, k_cache, v_cache, meta)`: write the step's keys/values into their cache
slots, attend every query token to its request's context. The `torch` backend gathers each
request's context from its blocks and runs SDPA twice per layer: once over all single-token
queries (decodes), once over all multi-token queries (prefill chunks), each padded to the
longest member. It is portable (CPU, CUDA) and the reference for faster backends.

On CPU, when the C kernels build (`pytgi.kernels`), decodes skip the gather: a paged decode
kernel reads keys and values in place. Gathering each decode's whole context into a padded copy
was half of a 16-request decode step; prefill chunks keep SDPA, where the gather is small next to
the attention itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import ctypes

import numpy as np
import torch
import torch.nn.functional as F

from pytgi import kernels


@dataclass(slots=True)
class StepLayout:
    """The flat batch of one step, as numpy arrays (built by the runner, backend-agnostic)."""

    query_lens: np.ndarray  # [B] tokens computed this step per request
    context_lens: np.ndarray  # [B] tokens in KV after this step (computed before + query)
    block_tables: np.ndarray  # [B, max_blocks] int64, padded with 0
    slot_mapping: np.ndarray  # [T] int64 cache slot of each new token
    block_size: int


@dataclass(slots=True)
class _Group:
    token_idx: torch.Tensor  # [G, Q] flat token index of each query (padding: 0)
    valid: torch.Tensor | None  # [G, Q] bool, None when no padding (Q == 1)
    slots: torch.Tensor  # [G, L] cache slot of each context position (padding: 0)
    mask: torch.Tensor  # [G, 1, Q, L] bool: may attend


@dataclass(slots=True)
class _PagedDecode:
    """Arguments of the C decode kernel (numpy arrays stay referenced while the step runs)."""

    rows: np.ndarray  # [Bd] flat token index of each decode
    block_tables: np.ndarray  # [Bd, max_blocks]
    context_lens: np.ndarray  # [Bd]
    block_size: int


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decode: _Group | None
    prefill: _Group | None
    paged_decode: _PagedDecode | None = None


def _group(layout: StepLayout, rows: np.ndarray, starts: np.ndarray, device: torch.device) -> _Group:
    q_lens, ctx = layout.query_lens[rows], layout.context_lens[rows]
    Q, L, bs = int(q_lens.max()), int(ctx.max()), layout.block_size
    qi = np.arange(Q)
    valid = qi[None, :] < q_lens[:, None]
    token_idx = np.where(valid, starts[rows][:, None] + qi[None, :], 0)
    pos = np.arange(L)
    tables = layout.block_tables[rows]
    slots = tables[:, np.minimum(pos // bs, tables.shape[1] - 1)] * bs + pos % bs
    # Query i of a request sits at position ctx - q_len + i and sees keys up to that position.
    q_pos = (ctx - q_lens)[:, None] + qi[None, :]
    mask = pos[None, None, :] <= q_pos[:, :, None]
    mask[~valid] = pos[None, :] < 1  # padding queries see one key (no all-masked rows: NaN)
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)  # noqa: E731
    return _Group(
        token_idx=to(token_idx),
        valid=to(valid) if Q > 1 else None,
        slots=to(np.where(pos[None, :] < ctx[:, None], slots, 0)),
        mask=to(mask[:, None]),
    )


_KERNELS = {torch.float32: "pytgi_decode_attention_f32", torch.bfloat16: "pytgi_decode_attention_bf16"}


def _ptr(t: torch.Tensor | np.ndarray) -> int:
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data


class TorchAttention:
    name = "torch"

    def __init__(self, use_kernels: bool = True) -> None:
        self.use_kernels = use_kernels
        self.dtype: torch.dtype | None = None  # the model's; set by the runner

    def prepare(self, layout: StepLayout, device: torch.device) -> TorchAttentionMetadata:
        starts = np.concatenate(([0], np.cumsum(layout.query_lens)[:-1]))
        is_decode = layout.query_lens == 1
        dec, pre = np.nonzero(is_decode)[0], np.nonzero(~is_decode)[0]
        paged = None
        if len(dec) and self._kernel(device) is not None:
            paged = _PagedDecode(
                rows=np.ascontiguousarray(starts[dec], dtype=np.int64),
                block_tables=np.ascontiguousarray(layout.block_tables[dec], dtype=np.int64),
                context_lens=np.ascontiguousarray(layout.context_lens[dec], dtype=np.int64),
                block_size=layout.block_size,
            )
        return TorchAttentionMetadata(
            slot_mapping=torch.from_numpy(layout.slot_mapping).to(device),
            decode=_group(layout, dec, starts, device) if len(dec) and paged is None else None,
            prefill=_group(layout, pre, starts, device) if len(pre) else None,
            paged_decode=paged,
        )

    def _kernel(self, device: torch.device):  # type: ignore[no-untyped-def]
        if not self.use_kernels or device.type != "cpu" or self.dtype not in _KERNELS:
            return None
        lib = kernels.load()
        return None if lib is None else getattr(lib, _KERNELS[self.dtype])

    def _paged_decode(self, q, k_cache, v_cache, out, p: _PagedDecode, scale: float) -> None:  # type: ignore[no-untyped-def]
        _, H, D = q.shape
        failed = self._kernel(q.device)(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(out), _ptr(p.rows), _ptr(p.block_tables),
            _ptr(p.context_lens), len(p.rows), p.block_tables.shape[1], p.block_size, H, k_cache.shape[1], D,
            ctypes.c_float(scale),
        )
        if failed:
            raise MemoryError("paged decode attention: out of memory")

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks * block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if k is not None:  # None: the caller already wrote this step's keys and values
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.paged_decode is not None:
            self._paged_decode(q.contiguous(), k_cache, v_cache, out, meta.paged_decode, scale)
        for g in (meta.decode, meta.prefill):
            if g is None:
                continue
            qg = q[g.token_idx].transpose(1, 2)  # [G, H, Q, D]
            kg = k_cache[g.slots].transpose(1, 2)  # [G, KVH, L, D]
            vg = v_cache[g.slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
            o = o.transpose(1, 2)  # [G, Q, H, D]
            if g.valid is None:
                out[g.token_idx[:, 0]] = o[:, 0]
            else:
                out[g.token_idx[g.valid]] = o[g.valid]
        return out


BACKENDS = {"torch": TorchAttention}


def get_backend(name: str) -> TorchAttention:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")
    return BACKENDS[name]()
