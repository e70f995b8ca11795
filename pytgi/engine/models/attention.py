"""Paged attention over a flat batch of mixed prefills and decodes.

Interface: a backend, built once per model with the kernels it may use and the model's heads on
this rank, builds its per-step metadata once (`prepare`), then each layer calls
`forward(q, k, v, k_cache, v_cache, meta)`: write the step's keys/values into their cache
slots, attend every query token to its request's context. The `torch` backend gathers each
request's context from its blocks and runs SDPA twice per layer: once over all single-token
queries (decodes), once over all multi-token queries (prefill chunks), each padded to the
longest member. It is portable (CPU, CUDA) and the reference for faster backends.

On CPU, when the C kernels build (`pytgi.engine.kernels`; `Kernels.fused`), decodes skip the
gather: a paged kernel reads keys and values in place, since copying each decode's whole context
into a padded tensor costs more than attending to it. The same kernel also takes prefill chunks of
up to `Crossovers.paged_prefill` tokens (AVX-512's split-K kernel, with AMX tiles for bf16, or the
portable one elsewhere): a small chunk of a long prompt, scheduled next to running decodes, paid
more for its gather and mask than for its attention. Bigger chunks keep SDPA, whose flash kernel
wins on long chunks, unless the run is batch invariant (the default): then the paged kernel takes
every chunk, and every row (with AMX tiles where the CPU has them), so a row's numerics never
depend on its step (docs/batch-invariance.md). In sliding-window layers past the window the kernel
takes the decodes, each request's keys starting where its window does; prompt chunks are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch
import torch.nn.functional as F

from pytgi.engine import kernels
from pytgi.engine.models.cpu import Kernels

# One layer's cache: its keys and values [slots, KVH, D] (a linear-attention layer's: its convolution
# inputs and recurrent states, by request slot)
LayerCache: TypeAlias = tuple[torch.Tensor, ...]  # keys and values; a recurrent layer's states
# A rotary embedding's tables at the step's positions: cos and (signed) sin
Rope: TypeAlias = tuple[torch.Tensor, torch.Tensor]
# What one layer's attention reads: its backend's metadata for the step
LayerMetadata: TypeAlias = "TorchAttentionMetadata | TritonMetadata"


@dataclass(slots=True)
class StepLayout:
    """The flat batch of one step, as numpy arrays (built by the runner, backend-agnostic)."""

    query_lens: np.ndarray  # [B] tokens computed this step per request
    context_lens: np.ndarray  # [B] tokens in KV after this step (computed before + query)
    block_tables: np.ndarray  # [B, max_blocks] int64, padded with 0
    slot_mapping: np.ndarray  # [T] int64 cache slot of each new token
    block_size: int
    # [S, 3] int64 (request, lo, hi): positions [lo, hi) of the request that attend to each other both
    # ways (the rows of a Gemma 3 image, all in this step's chunk); None: causal everywhere
    spans: np.ndarray | None = None
    state_slots: np.ndarray | None = None  # [B] int64: each request's recurrent state (linear attention)


@dataclass(slots=True)
class _Group:
    token_idx: torch.Tensor  # [G, Q] flat token index of each query (padding: 0)
    valid: torch.Tensor | None  # [G, Q] bool, None when no padding (Q == 1)
    slots: torch.Tensor  # [G, L] cache slot of each context position (padding: 0)
    mask: torch.Tensor  # [G, 1, Q, L] bool: may attend


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decode: _Group | None
    prefill: _Group | None
    paged: kernels.PagedBatch | None = None  # requests whose attention the C kernel computes


@dataclass(slots=True)
class TritonMetadata:
    """One step's layout on the device, for the Triton paged attention kernel (`TritonAttention`,
    `pytgi.engine.models.triton_backend`; `gpu` below is `pytgi.engine.kernels.gpu`)."""

    slot_mapping: torch.Tensor  # [T] int64: each new token's cache slot
    programs: torch.Tensor  # [P, 2] int32: the kernel's programs (`gpu.attention_programs`)
    q_start: torch.Tensor  # [B + 1] int32: each request's first flat row (and the end)
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, M] int32
    block_m: int  # query tokens per program
    block_size: int
    splits: int = 1  # a decode step's programs per request and kv head (`gpu.decode_splits`)


def _group(
    layout: StepLayout, rows: np.ndarray, starts: np.ndarray, device: torch.device, window: int | None = None
) -> _Group:
    """`window`: keys more than `window - 1` positions before a query are not seen, and the positions
    before the first query's window are not gathered at all."""
    q_lens, ctx = layout.query_lens[rows], layout.context_lens[rows]
    first = np.zeros_like(ctx) if window is None else np.maximum(ctx - q_lens - window + 1, 0)
    Q, L, bs = int(q_lens.max()), int((ctx - first).max()), layout.block_size
    qi = np.arange(Q)
    valid = qi[None, :] < q_lens[:, None]
    token_idx = np.where(valid, starts[rows][:, None] + qi[None, :], 0)
    pos = first[:, None] + np.arange(L)[None, :]  # [G, L] the context positions gathered
    tables = layout.block_tables[rows]
    slots = np.take_along_axis(tables, np.minimum(pos // bs, tables.shape[1] - 1), axis=1) * bs + pos % bs
    # Query i of a request sits at position ctx - q_len + i and sees keys up to that position.
    q_pos = (ctx - q_lens)[:, None] + qi[None, :]
    mask = pos[:, None, :] <= q_pos[:, :, None]
    if layout.spans is not None:  # ... and, within a span, the keys after it (then the window, if any)
        where = {int(r): g for g, r in enumerate(rows)}
        for r, lo, hi in layout.spans.tolist():
            if r in where:
                g = where[r]
                inside = (q_pos[g] >= lo) & (q_pos[g] < hi)
                mask[g] |= inside[:, None] & ((pos[g] >= lo) & (pos[g] < hi))[None, :]
    if window is not None:
        mask &= pos[:, None, :] > q_pos[:, :, None] - window
    mask[~valid] = (np.arange(L) < 1)[None, :]  # padding queries see one key (no all-masked rows: NaN)
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
    return _Group(
        token_idx=to(token_idx),
        valid=to(valid) if Q > 1 else None,
        slots=to(np.where(pos < ctx[:, None], slots, 0)),
        mask=to(mask[:, None]),
    )


class TorchAttention:
    # what the runner may ask of a backend (declared, never probed): whether CUDA graphs can replay its
    # decode steps, and whether it reads and writes an FP8 cache (plain causal attention on Triton)
    captures_decode = False
    fp8_cache = False

    def __init__(self, cpu: Kernels, heads: tuple[int, int, int]) -> None:
        """heads: (query heads, kv heads, head dim) on this rank."""
        self.paged = cpu.fused  # decodes (and small prefill chunks) in the paged C kernel
        self.paged_prefill_max = cpu.paged_prefill_max()
        self.invariant, self.group, self.kv_heads = cpu.batch_invariant, heads[0] // heads[1], heads[1]
        self.head_dim = heads[2]
        # tiles for every row (batch invariant): only through the kernel's prefill entry
        self.tiles = bool(self.paged_prefill_max and kernels.amx_supported())

    def prepare(
        self, layout: StepLayout, device: torch.device, window: int | None = None
    ) -> TorchAttentionMetadata:
        """`window`: a sliding window for every query. The paged kernel starts each request's keys
        where its window does, which is exact for one query token: it takes the decodes then, and
        prefill chunks are gathered and masked."""
        starts = np.concatenate(([0], np.cumsum(layout.query_lens)[:-1]))
        is_decode = layout.query_lens == 1
        dec, pre = np.nonzero(is_decode)[0], np.nonzero(~is_decode)[0]
        paged = None
        if self.paged:
            small = layout.query_lens[pre] <= self.paged_prefill_max
            if layout.spans is not None:  # the paged kernel is causal: spans take the masked path
                small &= ~np.isin(pre, layout.spans[:, 0])
            if small.any() and window is None:
                dec, pre = np.sort(np.concatenate([dec, pre[small]])), pre[~small]
            if len(dec):
                paged = self._paged(layout, dec, starts, window)
        return TorchAttentionMetadata(
            slot_mapping=torch.from_numpy(layout.slot_mapping).to(device),
            decode=_group(layout, dec, starts, device, window) if len(dec) and paged is None else None,
            prefill=_group(layout, pre, starts, device, window) if len(pre) else None,
            paged=paged,
        )

    def _paged(
        self, layout: StepLayout, rows: np.ndarray, starts: np.ndarray, window: int | None = None
    ) -> kernels.PagedBatch:
        """The paged kernel's batch for requests `rows`, and which of them use AMX tiles (where the CPU
        has them, for bf16). Batch invariant, every row does, decodes included: a row's numerics are
        then the same whatever else its chunk holds, and the tiles cost a lone decode no more than the
        vector path (a few more rows, such as a verified draft, far less). Else the tiles pay off from
        16 query rows per kv head. `window` (decodes only): a request's last token sees its last
        `window` positions."""
        q_starts, q_lens, ctx = starts[rows], layout.query_lens[rows], layout.context_lens[rows]
        tables = layout.block_tables[rows]
        tiles = np.full(len(rows), self.tiles) if self.invariant else q_lens * self.group >= 16
        i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)
        return kernels.PagedBatch(
            q_starts=i64(q_starts),
            q_lens=i64(q_lens),
            block_tables=i64(tables),
            context_lens=i64(ctx),
            block_size=layout.block_size,
            decodes_only=bool((q_lens == 1).all() and not tiles.any()),
            tiles=i64(tiles) if tiles.any() else None,
            first=None if window is None else i64(np.maximum(ctx - window, 0)),
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor | None,  # [T, KVH, D]; None: the caller wrote the step's keys and values
        v: torch.Tensor | None,
        k_cache: torch.Tensor,  # [num_blocks * block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: LayerMetadata,  # what this backend's `prepare` made
        scale: float,
        sinks: torch.Tensor | None = None,  # [H] a logit per query head in each softmax (SinkAttention)
    ) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata), "the gather path reads its own metadata"
        kv8 = kernels.kv8(k_cache)
        if k is not None and v is not None:
            if kv8:
                kernels.write_kv8(k, v, meta.slot_mapping, k_cache, v_cache)
            else:
                k_cache.index_copy_(0, meta.slot_mapping, k)
                v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.paged is not None:
            kernels.paged_attention(q.contiguous(), k_cache, v_cache, out, meta.paged, scale, sinks)
        for g in (meta.decode, meta.prefill):
            if g is None:
                continue
            qg = q[g.token_idx].transpose(1, 2)  # [G, H, Q, D]
            kg, vg = k_cache[g.slots], v_cache[g.slots]  # [G, L, KVH, D]
            if kv8:
                kg, vg = kernels.kv8_values(kg, q.dtype), kernels.kv8_values(vg, q.dtype)
            kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)  # [G, KVH, L, D]
            if sinks is None:
                o = self._attend(qg, kg, vg, g.mask, scale).transpose(1, 2)  # [G, Q, H, D]
            else:
                o = _attend_sinks(qg, kg, vg, g.mask, scale, sinks).transpose(1, 2)
            if g.valid is None:
                out[g.token_idx[:, 0]] = o[:, 0]
            else:
                out[g.token_idx[g.valid]] = o[g.valid]
        return out

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [G, H, Q, D], k and v [G, KVH, L, D], mask [G, 1, Q, L] → [G, H, Q, D]."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _attend_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, `sinks[h]`, that attends to nothing: the
    weights of the real keys sum to less than one. Two matmuls, the softmax in float32."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = ((q @ k.transpose(-1, -2)) * scale).float().masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return p.to(q.dtype) @ v


class SinkAttention(TorchAttention):
    """Attention with sinks (gpt-oss): the paged C kernel takes them (its rows' softmax has one more
    logit per query head); SDPA does not, so the gathered path attends with `_attend_sinks`."""


class SoftcapAttention(TorchAttention):
    """Attention whose scores are soft-capped before the softmax, cap·tanh(s / cap) (Gemma 2).
    Neither SDPA nor the paged kernel takes a cap, so every request's context is gathered and
    attended with two matmuls, the softmax in float32 (as transformers' eager attention)."""

    def __init__(self, cpu: Kernels, heads: tuple[int, int, int], cap: float) -> None:
        super().__init__(cpu, heads)
        self.paged, self.paged_prefill_max, self.cap = False, 0, cap

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = torch.tanh((q @ k.transpose(-1, -2)) * scale / self.cap) * self.cap
        p = torch.softmax(s.masked_fill(~mask, float("-inf")).float(), dim=-1).to(q.dtype)
        return p @ v


@dataclass(slots=True)
class WindowedMetadata:
    """A step's metadata for a model with sliding-window layers: `full` for the layers that see the
    whole context, `sliding` for the others (the same object while no context reaches past the window)."""

    full: TorchAttentionMetadata
    sliding: TorchAttentionMetadata

    @property
    def uniform(self) -> TorchAttentionMetadata | None:
        """The one metadata every layer can use, if there is one."""
        return self.full if self.full is self.sliding else None

    def paged_window(self) -> np.ndarray | None:
        """When every query of the step is in the paged kernel on both kinds of layer (decodes: the
        same requests), the sliding layers' first keys: `full` with these serves every layer."""
        full, sliding = self.full.paged, self.sliding.paged
        if full is None or sliding is None or sliding.first is None:
            return None
        gathered = (self.full.decode, self.full.prefill, self.sliding.decode, self.sliding.prefill)
        if any(g is not None for g in gathered):
            return None
        if not np.array_equal(full.q_starts, sliding.q_starts):
            return None
        return sliding.first


class SlidingWindowBackend:
    """A backend for models whose sliding layers see the last `window` positions only."""

    captures_decode = False
    fp8_cache = False

    def __init__(self, inner: TorchAttention, window: int) -> None:
        self.inner, self.window = inner, window

    def prepare(self, layout: StepLayout, device: torch.device) -> WindowedMetadata:
        full = self.inner.prepare(layout, device)
        if int(layout.context_lens.max()) <= self.window:
            return WindowedMetadata(full, full)
        return WindowedMetadata(full, self.inner.prepare(layout, device, window=self.window))

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.inner.forward(*args, **kwargs)
