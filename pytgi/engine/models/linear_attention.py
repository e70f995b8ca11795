"""Gated DeltaNet, the linear-attention layers of Qwen3-Next and Qwen3.5, over a pool of states.

A linear-attention layer keeps no keys and values: each request carries, per layer, a fixed-size
state: the last `conv_kernel - 1` inputs of a short causal convolution (in the model's dtype) and a
recurrent state S [v_heads, k_dim, v_dim] (float32). Token t updates it by the gated delta rule

    S ← exp(g_t) · S;   u_t = β_t (v_t − Sᵀ k_t);   S ← S + k_t u_tᵀ;   o_t = Sᵀ q_t

with q and k L2-normalized (q also scaled by k_dim^-½), β = sigmoid(b) and the log decay
g = −exp(A_log) · softplus(a + dt_bias). The states live in a pool (`StatePool` in
`pytgi.engine.kv.blocks` hands out the slots, `PagedModel.allocate` the tensors); a request's slot
starts from zero at its first token (a preempted request is recomputed from its tokens, as its
KV blocks are), or from a copy of the prefix cache's checkpoint where it resumes on cached blocks
(the slot is copied before the step; `fresh` is false, as for any later chunk).

A decode is one step of the recurrence, all decodes of a step at once. A prefill chunk runs the
chunked form: within a chunk of C tokens, the updates of the rule solve one unit-triangular system
(the WY form of the products of (I − β k kᵀ)), so the chunk costs matmuls and one triangular solve,
and only the chunks' states are sequential.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pytgi.engine import kernels
from pytgi.engine.distributed import local_range, tp_size
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear, _set_loader

if TYPE_CHECKING:
    from pytgi.engine.models.attention import (
        LayerMetadata,
        Rope,
        SlidingWindowBackend,
        StepLayout,
        TorchAttention,
        WindowedMetadata,
    )

CHUNK = 64  # tokens per chunk of the chunked delta rule


@dataclass(slots=True)
class LinearAttnConfig:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    fused_qkvz: (
        bool  # Qwen3-Next's in_proj_qkvz (grouped by key head); else Qwen3.5's in_proj_qkv and in_proj_z
    )
    grouped_ba: bool = (
        False  # Qwen3-Next's in_proj_ba (b then a, grouped by key head); else in_proj_b, in_proj_a
    )
    # value heads in tiled order (key head j % num_k_heads), as llama.cpp's converter writes Qwen3.5's;
    # else grouped (j // (num_v_heads / num_k_heads))
    tiled_v_heads: bool = False

    def build(self, hidden: int, eps: float, fused: bool) -> GatedDeltaNet:
        """The layer of this kind (a `RecurrentMixer`); fused: the C kernels run the model (CPU)."""
        return GatedDeltaNet(self, hidden, eps, fused)


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One tensor of a recurrent layer's per-request state: its shape (without the slot axis) and dtype
    (None: the model's). Every recurrent layer kind (`RecurrentMixer`) declares its own; the pool
    (`PagedModel.allocate`) makes one [slots, *shape] tensor of each, and the state's slot is the same
    row of each, which is all that preemption, abort and the prefix cache's checkpoints handle."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


class RecurrentMixer(Protocol):
    """A layer kind that keeps a per-request state in the pool instead of keys and values (gated
    DeltaNet here; Mamba's and short convolutions' alike): `forward(x, rope, state, meta)` reads and
    writes `state` (its tensors in `state_specs()`'s order) at `meta.slots`.

    A kind may also say `state_grid: int`: the tokens its prefill's state is exact on, the bits a
    cold prefill from zero has there whenever every chunk so far began on a multiple of it (its chunked
    form's chunk; 1 where any split gives the same bits). The prefix cache keeps checkpoints only on
    that grid (`BlockManager`), and only for a model whose every recurrent kind says it: a kind that
    does not runs without the prefix cache."""

    def state_specs(self) -> tuple[StateSpec, ...]: ...

    def __call__(
        self, x: torch.Tensor, rope: Rope, state: tuple[torch.Tensor, ...], meta: StateMetadata
    ) -> torch.Tensor: ...


class RecurrentConfig(Protocol):
    """A recurrent layer kind's config (`DecoderConfig.linear`): builds the model's layers of that kind."""

    def build(self, hidden: int, eps: float, fused: bool) -> RecurrentMixer: ...


@dataclass(slots=True)
class StateMetadata:
    """A step's metadata for a model with linear-attention layers: `attn` is the attention layers'
    own; the rest says which state each request reads and writes."""

    attn: LayerMetadata | WindowedMetadata
    slots: torch.Tensor  # [B] each request's state slot
    query_lens: list[int]
    fresh: list[bool]  # the request starts here: its state starts from zero
    decodes: torch.Tensor  # the requests computing one token (the recurrent step, all at once)
    decode_rows: torch.Tensor  # their flat rows
    reset: torch.Tensor | None  # the slots of the decodes that start here (a one-token prompt): zeroed first
    decode_fresh: torch.Tensor  # [decodes] int64: 1 where the decode starts here (the C kernel's `reset`)


class StateBackend:
    """Wraps a model's attention backend: `prepare` adds the state slots to its metadata."""

    # what the runner may ask of a backend (`TorchAttention`'s): neither, for a model with recurrent states
    captures_decode = False
    fp8_cache = False

    def __init__(self, inner: TorchAttention | SlidingWindowBackend) -> None:
        self.inner = inner

    def prepare(self, layout: StepLayout, device: torch.device) -> StateMetadata:
        slots = layout.state_slots
        assert slots is not None, "a model with linear attention needs each request's state slot"
        q_lens = layout.query_lens
        starts = np.concatenate(([0], np.cumsum(q_lens)[:-1]))
        dec = np.nonzero(q_lens == 1)[0]
        fresh = layout.context_lens == q_lens
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
        return StateMetadata(
            attn=self.inner.prepare(layout, device),
            slots=to(slots),
            query_lens=q_lens.tolist(),
            fresh=fresh.tolist(),
            decodes=to(dec),
            decode_rows=to(starts[dec]),
            reset=to(slots[dec[fresh[dec]]]) if fresh[dec].any() else None,
            decode_fresh=to(fresh[dec]),
        )

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.inner.forward(*args, **kwargs)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of each of B requests: q, k [B, H, K], v [B, H, V], g, beta [B, H] (float32); `state`
    [B, H, K, V] is updated in place. Returns o [B, H, V]."""
    state.mul_(g.exp()[..., None, None])
    u = (v - torch.einsum("bhk,bhkv->bhv", k, state)) * beta[..., None]
    state.add_(k[..., :, None] * u[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q, state)


def chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of one request: q, k [L, H, K], v [L, H, V], g, beta [L, H] (float32), from `state`
    [H, K, V]. Returns (o [L, H, V], the state after them)."""
    L, H = k.shape[:2]
    pad = -L % chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, L + pad, .]
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))
    n = (L + pad) // chunk
    q, k, v = (x.reshape(H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    G = g.cumsum(-1)  # [H, n, C] the log decay from the chunk's start through each token
    # decay[i, j] = exp(G_i − G_j) for j ≤ i (zero above the diagonal)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    # u = T (β v − β e^G k S0), T = (I + A)⁻¹, A_ij = β_i e^(G_i − G_j) k_i·k_j below the diagonal
    system = (kb @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~causal, 0.0).diagonal_scatter(torch.ones_like(G), dim1=-2, dim2=-1)
    rhs = torch.cat([v * beta[..., None], kb * G.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u0, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    inner = (q @ k.transpose(-1, -2)) * decay  # o_i's weights on u_j within the chunk
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    end_decay = G[..., -1].exp()
    out = torch.empty_like(v)
    for c in range(n):
        u = u0[:, c] - w[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + inner[:, c] @ u
        state = state * end_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.reshape(H, n * chunk, -1)[:, :L].transpose(0, 1), state


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times silu(z) (float32 math; the weight in the model's dtype)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(x.dtype)).float() * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer; this rank holds whole key-head groups (each key head with its
    num_v_heads / num_k_heads value heads)."""

    state_grid = CHUNK  # `chunked_rule`'s chunks: a call started off them rounds otherwise

    def __init__(self, cfg: LinearAttnConfig, hidden: int, eps: float, fused: bool = False) -> None:
        """fused: the C kernels run everything between the projections (`kernels.gdn_decode_layer` the
        decodes, `kernels.gdn_prefill_layer` each prompt chunk)."""
        super().__init__()
        self.fused = fused
        nk, nv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim
        if nk % tp_size():
            raise ValueError(f"cannot shard {nk} linear-attention key heads over {tp_size()} ranks")
        if cfg.tiled_v_heads and tp_size() > 1:
            raise ValueError("a Qwen3.5 GGUF file's value heads (tiled by llama.cpp) are not sharded yet")
        self.cfg, self.rep = cfg, nv // nk
        k0, self.nk = (x // dk for x in local_range(nk, dk))
        self.nv = self.nk * self.rep
        v0 = k0 * self.rep
        # the convolution's channels: [q | k | v] of this rank's heads
        self.channels = [
            (k0 * dk, self.nk * dk),
            (nk * dk + k0 * dk, self.nk * dk),
            (2 * nk * dk + v0 * dv, self.nv * dv),
        ]
        if cfg.fused_qkvz:
            group = 2 * dk + 2 * self.rep * dv
            self.in_proj_qkvz = ColumnParallelLinear(hidden, [(k0 * group, self.nk * group)])
        else:
            self.in_proj_qkv = ColumnParallelLinear(hidden, self.channels)
            _set_loader(self.in_proj_qkv.weight, self._load_rows)
            self.in_proj_z = ColumnParallelLinear(hidden, [(v0 * dv, self.nv * dv)])
        if cfg.grouped_ba:
            self.in_proj_ba = ColumnParallelLinear(hidden, [(k0 * 2 * self.rep, self.nk * 2 * self.rep)])
        else:
            self.in_proj_b = ColumnParallelLinear(hidden, [(v0, self.nv)])
            self.in_proj_a = ColumnParallelLinear(hidden, [(v0, self.nv)])
        width = sum(n for _, n in self.channels)
        self.conv1d = nn.Parameter(torch.zeros(width, cfg.conv_kernel), requires_grad=False)
        _set_loader(self.conv1d, self._load_rows)
        self.dt_bias = nn.Parameter(torch.ones(self.nv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.nv), requires_grad=False)
        for p in (self.dt_bias, self.A_log):
            _set_loader(p, lambda p, t, _=0: p.data.copy_(t[v0 : v0 + len(p)]))
        self.norm = GatedRMSNorm(dv, eps)
        self.out_proj = RowParallelLinear((v0 * dv, self.nv * dv), hidden)
        self._f32: tuple[torch.Tensor, ...] | None = None  # `_kernel_weights`

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """This rank's channels of a [q | k | v] tensor (the convolution's [C, 1, K] or [C, K])."""
        loaded = loaded.reshape(loaded.shape[0], -1)
        param.data.copy_(torch.cat([loaded[s : s + n] for s, n in self.channels]))

    def state_specs(self) -> tuple[StateSpec, ...]:
        """Per request: the convolution's last inputs [channels, kernel − 1] in the model's dtype, the
        delta rule's state in float32."""
        cfg = self.cfg
        return (
            StateSpec((self.conv1d.shape[0], cfg.conv_kernel - 1)),
            StateSpec((self.nv, cfg.k_head_dim, cfg.v_head_dim), torch.float32),
        )

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q | k | v) [T, channels], z [T, nv, dv], b, a [T, nv]."""
        T, cfg = x.shape[0], self.cfg
        dk, dv, r = cfg.k_head_dim, cfg.v_head_dim, self.rep
        if cfg.grouped_ba:
            b, a = (
                t.reshape(T, self.nv)
                for t in self.in_proj_ba(x).view(T, self.nk, 2 * r).split([r, r], dim=-1)
            )
        else:
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        if not cfg.fused_qkvz:
            return self.in_proj_qkv(x), self.in_proj_z(x).view(T, self.nv, dv), b, a
        qkvz = self.in_proj_qkvz(x).view(T, self.nk, -1)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, self.nv, dv), b, a

    def forward(
        self, x: torch.Tensor, rope: Rope, state: tuple[torch.Tensor, ...], meta: StateMetadata
    ) -> torch.Tensor:
        qkv, z, b, a = self._project(x)
        if self.fused:
            return self.out_proj(self._fused(qkv, z, b, a, state, meta))
        conv_states, rec_states = state
        T, dv = x.shape[0], self.cfg.v_head_dim
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        mixed = torch.empty_like(qkv)
        o = torch.empty(T, self.nv, dv, dtype=torch.float32, device=x.device)
        if len(meta.decodes):
            if meta.reset is not None:
                conv_states[meta.reset], rec_states[meta.reset] = 0, 0
            rows, slots = meta.decode_rows, meta.slots[meta.decodes]
            window = torch.cat([conv_states[slots], qkv[rows].unsqueeze(-1)], dim=-1)  # [B, C, kernel]
            conv_states[slots] = window[..., 1:]
            mixed[rows] = F.silu((window.float() * self.conv1d.float()).sum(-1)).to(qkv.dtype)
            q, k, v = self._heads(mixed[rows])
            s = rec_states[slots]
            o[rows] = recurrent_step(q, k, v, g[rows], beta[rows], s)
            rec_states[slots] = s
        start = 0
        for i, (n, fresh) in enumerate(zip(meta.query_lens, meta.fresh)):
            if n > 1:
                slot = meta.slots[i]
                rows_i = slice(start, start + n)
                prev = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
                window = torch.cat([prev, qkv[rows_i].T], dim=-1)  # [C, kernel − 1 + n]
                conv_states[slot] = window[:, -prev.shape[-1] :]
                y = F.conv1d(
                    window.unsqueeze(0).float(), self.conv1d.float().unsqueeze(1), groups=window.shape[0]
                )
                mixed[rows_i] = F.silu(y[0].T).to(qkv.dtype)
                q, k, v = self._heads(mixed[rows_i])
                init = torch.zeros_like(rec_states[slot]) if fresh else rec_states[slot]
                o[rows_i], rec_states[slot] = chunked_rule(q, k, v, g[rows_i], beta[rows_i], init)
            start += n
        return self.out_proj(self.norm(o.to(x.dtype), z).reshape(T, -1))

    def _fused(
        self,
        qkv: torch.Tensor,
        z: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        state: tuple[torch.Tensor, ...],
        meta: StateMetadata,
    ) -> torch.Tensor:
        """The C kernels' path (delta.c): everything between the projections, the decodes in one call,
        each prompt chunk in one call. Returns the gated norm's output [T, nv · dv]."""
        conv_states, rec_states = state  # (two pools: any more would be another kind's)
        T, cfg = qkv.shape[0], self.cfg
        out = torch.empty(T, self.nv * cfg.v_head_dim, dtype=qkv.dtype, device=qkv.device)
        args = (self.nk, cfg.k_head_dim, cfg.tiled_v_heads, self.norm.eps)
        weights = self._kernel_weights()
        if len(meta.decodes):
            slots = meta.slots[meta.decodes]
            kernels.gdn_decode_layer(
                qkv, z, b, a, meta.decode_rows, slots, meta.decode_fresh, conv_states, rec_states,
                weights, out, *args,
            )  # fmt: skip
        start = 0
        for i, (n, fresh) in enumerate(zip(meta.query_lens, meta.fresh)):
            if n > 1:
                rows = slice(start, start + n)
                slot = int(meta.slots[i])
                kernels.gdn_prefill_layer(
                    qkv[rows], z[rows], b[rows], a[rows], slot, fresh, conv_states, rec_states, weights,
                    out[rows], *args, CHUNK,
                )  # fmt: skip
            start += n
        return out

    def _kernel_weights(self) -> tuple[torch.Tensor, ...]:
        """The convolution's weights, A_log, dt_bias and the norm's weight in float32, as the C kernel
        reads them (made once: the weights do not change once loaded)."""
        if self._f32 is None:
            weights = (self.conv1d, self.A_log, self.dt_bias, self.norm.weight)
            self._f32 = tuple(t.detach().float().contiguous() for t in weights)
        return self._f32

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [T, nv, dk] (L2-normalized, q scaled, each key head repeated for its value heads) and
        v [T, nv, dv], float32."""
        T, cfg = mixed.shape[0], self.cfg
        q, k, v = mixed.float().split([n for _, n in self.channels], dim=-1)
        q, k = (l2norm(t.view(T, self.nk, cfg.k_head_dim)) for t in (q, k))
        if cfg.tiled_v_heads:  # value head j reads key head j % nk
            q, k = q.repeat(1, self.rep, 1), k.repeat(1, self.rep, 1)
        else:  # ... or j // rep
            q, k = q.repeat_interleave(self.rep, dim=1), k.repeat_interleave(self.rep, dim=1)
        return q * cfg.k_head_dim**-0.5, k, v.view(T, self.nv, cfg.v_head_dim)
