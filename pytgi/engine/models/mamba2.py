"""Mamba-2's selective state-space layer (SSD), the recurrent mixer of Nemotron-H, Granite-4.0-H and
Bamba, over a pool of states.

Per request and layer the state is the last `conv_kernel - 1` inputs of a short causal convolution
(over x | B | C, in the model's dtype) and the SSM state S [heads, head_dim, d_state] (float32).
Token t, with dt = softplus(dt_raw + dt_bias) (clamped to `dt_limit`) and A = −exp(A_log), does

    S ← exp(dt·A) · S + dt · x_t B_tᵀ;   y_t = S C_t + D · x_t

per head (B and C shared by the heads of a group), then y · silu(z) is RMS-normed per group and
projected out. A decode is one step of it, all decodes of a step at once. A prompt chunk runs the
chunked form (`ssd_chunked`): within a chunk of `CHUNK` tokens the outputs are a causal matmul with
the decays between positions (attention-like), and only the chunks' states are sequential. A request's
slot starts from zero at its first token (a preempted request recomputes it from its tokens), so a
chunk that cuts a prompt carries the state to the next chunk exactly as the recurrence does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pytgi.engine import kernels
from pytgi.engine.distributed import all_reduce, local_range, tp_size
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear, _set_loader
from pytgi.engine.models.linear_attention import StateSpec

if TYPE_CHECKING:
    from pytgi.engine.models.attention import Rope
    from pytgi.engine.models.linear_attention import StateMetadata

CHUNK = 64  # tokens per chunk of the chunked scan (the checkpoints' own chunk_size changes no result)


@dataclass(slots=True)
class Mamba2Config:
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False  # on in_proj and out_proj
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    # False: y · silu(z) goes to out_proj as it is, without the grouped RMS norm (Falcon-H1's
    # `mamba_rms_norm` False)
    gate_norm: bool = True
    out_bias: bool | None = None  # on out_proj where it differs from in_proj's (Falcon-H1's projectors_bias)

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: x, then B and C of every group."""
        return self.inner + 2 * self.n_groups * self.d_state

    def build(self, hidden: int, eps: float, fused: bool) -> Mamba2Mixer:
        """The layer of this kind (a `RecurrentMixer`); fused: the C kernels run the model (CPU)."""
        return Mamba2Mixer(self, hidden, eps, fused)


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One token of each of R requests: x [R, H, P], dt [R, H], A [H], B, C [R, H, N] (float32);
    `state` [R, H, P, N] is updated in place. Returns y [R, H, P] (without D's skip)."""
    state.mul_((dt * A).exp()[..., None, None])
    state.add_((x * dt[..., None])[..., :, None] * B[..., None, :])
    return (state @ C[..., :, None]).squeeze(-1)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of one request: x [L, H, P], dt [L, H], A [H], B, C [L, H, N] (float32), from `state`
    [H, P, N]. Returns (y [L, H, P] without D's skip, the state after them). Padded positions have
    dt = 0: no decay and no input, so they change nothing."""
    L, H = x.shape[:2]
    pad = -L % chunk
    n = (L + pad) // chunk
    xdt, B, C = (
        F.pad(t.transpose(0, 1), (0, 0, 0, pad)).reshape(H, n, chunk, -1) for t in (x * dt[..., None], B, C)
    )
    a = F.pad((dt * A).transpose(0, 1), (0, pad)).reshape(H, n, chunk)
    G = a.cumsum(-1)  # [H, n, Q] the log decay from the chunk's start through each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    inner = (C @ B.transpose(-1, -2)) * decay  # y_i's weights on x_j dt_j within the chunk
    y_inner = inner @ xdt  # [H, n, Q, P]
    c_decayed = C * G.exp()[..., None]  # what the chunk's first state gives each token
    b_to_end = B * (G[..., -1:] - G).exp()[..., None]  # each token's input as it reaches the chunk's end
    end_decay = G[..., -1].exp()
    out = torch.empty_like(y_inner)
    for c in range(n):
        out[:, c] = y_inner[:, c] + c_decayed[:, c] @ state.transpose(-1, -2)
        state = state * end_decay[:, c, None, None] + xdt[:, c].transpose(-1, -2) @ b_to_end[:, c]
    return out.reshape(H, n * chunk, -1)[:, :L].transpose(0, 1), state


class GroupedGatedRMSNorm(nn.Module):
    """y · silu(z), RMS-normed over each group's features, times the weight (float32 math): Mamba-2's
    norm after the gate (`norm_before_gate` False), as transformers' `RMSNormGated` computes it.

    On a rank holding `groups` whole groups the norm is local; where a group is split over ranks
    (`shared`: one group, Granite-4.0-H's, over two ranks) each rank holds its part of the group's
    features, `first` the group's index, of `total` groups, and the squares are all-reduced."""

    def __init__(
        self,
        dim: int,
        groups: int,
        eps: float,
        group_size: int,
        shared: bool = False,
        first: int = 0,
        total: int = 1,
    ) -> None:
        super().__init__()
        self.groups, self.eps, self.group_size = groups, eps, group_size
        self.shared, self.first, self.total = shared, first, total
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        h = h.view(*h.shape[:-1], self.groups, -1)
        squares = h.pow(2).sum(-1, keepdim=True)
        if self.shared:  # every rank's part of every group, summed
            whole = squares.new_zeros(*squares.shape[:-2], self.total, 1)
            whole[..., self.first : self.first + self.groups, :] = squares
            squares = all_reduce(whole)[..., self.first : self.first + self.groups, :]
        h = (h * torch.rsqrt(squares / self.group_size + self.eps)).flatten(-2)
        return self.weight.float() * h


class Mamba2Mixer(nn.Module):
    """A Mamba-2 layer; with tensor parallelism each rank holds an equal share of the heads and the
    B, C of their groups (whole groups where the ranks divide them; else each group, Granite-4.0-H's
    one, split over ranks: its B and C on each of them, its norm's squares all-reduced), their
    convolution channels, decays and states; the output projection is all-reduced."""

    # `ssd_chunked`'s chunks: a call that starts off them sums its chunks' matmuls over other tokens,
    # and the state after them differs in the last bits. The C kernel (`mamba2_prefill_layer`) runs
    # the recurrence token by token, exact at any split (measured), so 64 is where both paths are:
    # a checkpoint is the same bits whichever path computed it
    state_grid = CHUNK

    def __init__(self, cfg: Mamba2Config, hidden: int, eps: float, fused: bool = False) -> None:
        """fused: the C kernels run everything between the projections (`kernels.mamba2_decode_layer`
        the decodes, `kernels.mamba2_prefill_layer` each prompt chunk), except where a group's norm is
        split over ranks (its squares all-reduced between the steps)."""
        super().__init__()
        H, G, P, N = cfg.num_heads, cfg.n_groups, cfg.head_dim, cfg.d_state
        if H % G:
            raise ValueError(f"{H} Mamba-2 heads do not split in {G} groups")
        tp = tp_size()
        if H % tp or (G % tp and tp % G):
            raise ValueError(f"cannot shard {H} Mamba-2 heads in {G} groups over {tp} ranks")
        self.cfg = cfg
        h0, self.heads = local_range(H)  # (even: H % tp == 0)
        g0 = h0 // (H // G)
        self.groups = max(1, G // tp)
        self.inner, self.conv_dim = self.heads * P, self.heads * P + 2 * self.groups * N
        inner, gn = cfg.inner, G * N
        # this rank's rows of z | x | B | C | dt, and its convolution's channels (x | B | C)
        self.channels = [
            (inner + h0 * P, self.heads * P),
            (2 * inner + g0 * N, self.groups * N),
            (2 * inner + gn + g0 * N, self.groups * N),
        ]
        rows = [(h0 * P, self.heads * P), *self.channels, (2 * inner + 2 * gn + h0, self.heads)]
        self.in_proj = ColumnParallelLinear(hidden, rows, cfg.proj_bias)
        load_rows = self._rows(rows)
        _set_loader(self.in_proj.weight, load_rows)
        if self.in_proj.bias is not None:
            _set_loader(self.in_proj.bias, load_rows)
        self.conv1d = nn.Parameter(torch.zeros(self.conv_dim, cfg.conv_kernel), requires_grad=False)
        channels = [(s - inner, n) for s, n in self.channels]  # (the convolution's rows start at x)
        _set_loader(self.conv1d, self._rows(channels))
        self.conv1d_bias: nn.Parameter | None = None
        if cfg.conv_bias:
            self.conv1d_bias = nn.Parameter(torch.zeros(self.conv_dim), requires_grad=False)
            _set_loader(self.conv1d_bias, self._rows(channels))
        self.dt_bias = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.heads), requires_grad=False)
        for p in (self.dt_bias, self.A_log, self.D):  # (a GGUF file's A and D are [H, 1])
            _set_loader(p, self._rows([(h0, self.heads)]))
        self.norm: GroupedGatedRMSNorm | None = None
        if cfg.gate_norm:
            self.norm = GroupedGatedRMSNorm(
                self.inner, self.groups, eps, inner // G, shared=tp > G, first=g0, total=G
            )
            # (GGUF: [groups, inner / G])
            _set_loader(self.norm.weight, self._rows([(h0 * P, self.heads * P)]))
        out_bias = cfg.proj_bias if cfg.out_bias is None else cfg.out_bias
        self.out_proj = RowParallelLinear((h0 * P, self.heads * P), hidden, out_bias)
        # the C kernels (mamba.c) take a gated norm whose groups this rank holds whole
        self.fused = fused and self.norm is not None and not self.norm.shared
        self._f32: tuple[torch.Tensor | None, ...] | None = None  # `_kernel_weights`

    @staticmethod
    def _rows(parts: list[tuple[int, int]]):
        """A loader taking these (start, size) rows of a checkpoint tensor (flattened past its first
        axis: the convolution's [C, 1, K] or [C, K]; vectors as GGUF files shape them)."""

        def load(param: nn.Parameter, loaded: torch.Tensor, _: int = 0) -> None:
            flat = loaded.reshape(-1) if param.dim() == 1 else loaded.reshape(loaded.shape[0], -1)
            param.data.copy_(torch.cat([flat[s : s + n] for s, n in parts]).reshape(param.shape))

        return load

    def state_specs(self) -> tuple[StateSpec, ...]:
        """Per request: the convolution's last inputs [conv_dim, kernel − 1] in the model's dtype, the
        SSM state [heads, head_dim, d_state] in float32."""
        cfg = self.cfg
        return (
            StateSpec((self.conv_dim, cfg.conv_kernel - 1)),
            StateSpec((self.heads, cfg.head_dim, cfg.d_state), torch.float32),
        )

    def _conv_out(self, window: torch.Tensor) -> torch.Tensor:
        """silu(conv + bias) of `window` [R, conv_dim, kernel − 1 + T] (float32) → [R, conv_dim, T]."""
        bias = None if self.conv1d_bias is None else self.conv1d_bias.float()
        y = F.conv1d(window.float(), self.conv1d.float().unsqueeze(1), bias, groups=window.shape[1])
        return F.silu(y)

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H, P], B and C [T, H, N] (each group's repeated for its heads), float32."""
        cfg, T = self.cfg, xbc.shape[0]
        gn = self.groups * cfg.d_state
        x, B, C = xbc.float().split([self.inner, gn, gn], dim=-1)
        rep = self.heads // self.groups
        B, C = (t.view(T, self.groups, cfg.d_state).repeat_interleave(rep, dim=1) for t in (B, C))
        return x.view(T, self.heads, cfg.head_dim), B, C

    def forward(
        self, h: torch.Tensor, rope: Rope, state: tuple[torch.Tensor, ...], meta: StateMetadata
    ) -> torch.Tensor:
        if self.fused:
            return self.out_proj(self._fused(self.in_proj(h), state, meta))
        cfg, T = self.cfg, h.shape[0]
        conv_states, ssm_states = state
        z, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*cfg.dt_limit)
        A = -self.A_log.float().exp()
        mixed = torch.empty(T, self.conv_dim, dtype=torch.float32, device=h.device)
        y = torch.empty(T, self.heads, cfg.head_dim, dtype=torch.float32, device=h.device)
        if meta.reset is not None:
            conv_states[meta.reset], ssm_states[meta.reset] = 0, 0
        if len(meta.decodes):
            rows, slots = meta.decode_rows, meta.slots[meta.decodes]
            window = torch.cat([conv_states[slots], xbc[rows].unsqueeze(-1)], dim=-1)  # [R, C, kernel]
            conv_states[slots] = window[..., 1:]
            mixed[rows] = self._conv_out(window)[..., 0]
            x, B, C = self._split(mixed[rows])
            s = ssm_states[slots]
            y[rows] = ssd_step(x, dt[rows], A, B, C, s)
            ssm_states[slots] = s
        start = 0
        for i, (n, fresh) in enumerate(zip(meta.query_lens, meta.fresh)):
            if n > 1:
                slot, rows_i = meta.slots[i], slice(start, start + n)
                prev = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
                window = torch.cat([prev, xbc[rows_i].T], dim=-1)  # [C, kernel − 1 + n]
                conv_states[slot] = window[:, -prev.shape[-1] :]
                mixed[rows_i] = self._conv_out(window.unsqueeze(0))[0].T
                x, B, C = self._split(mixed[rows_i])
                init = torch.zeros_like(ssm_states[slot]) if fresh else ssm_states[slot]
                y[rows_i], ssm_states[slot] = ssd_chunked(x, dt[rows_i], A, B, C, init)
            start += n
        x = mixed[:, : self.inner].view(T, self.heads, cfg.head_dim)
        y = (y + self.D.float()[:, None] * x).reshape(T, self.inner)
        if self.norm is None:
            return self.out_proj((y * F.silu(z.float())).to(h.dtype))
        return self.out_proj(self.norm(y, z).to(h.dtype))

    def _fused(
        self, proj: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata
    ) -> torch.Tensor:
        """The C kernels' path (mamba.c): everything between the projections, the decodes in one call,
        each prompt chunk in one call, from the input projection's rows. Returns the gated norm's output
        [T, inner] in the model's dtype."""
        conv_states, ssm_states = state
        assert self.norm is not None  # (`fused`: a gated norm)
        T, groups, limit, eps = proj.shape[0], self.groups, self.cfg.dt_limit, self.norm.eps
        proj = proj.contiguous()
        out = torch.empty(T, self.inner, dtype=proj.dtype, device=proj.device)
        weights = self._kernel_weights()
        if len(meta.decodes):
            slots = meta.slots[meta.decodes]
            kernels.mamba2_decode_layer(
                proj, meta.decode_rows, slots, meta.decode_fresh, conv_states, ssm_states, weights, out,
                groups, limit, eps,
            )  # fmt: skip
        start = 0
        for i, (n, fresh) in enumerate(zip(meta.query_lens, meta.fresh)):
            if n > 1:
                rows = slice(start, start + n)
                kernels.mamba2_prefill_layer(
                    proj[rows], int(meta.slots[i]), fresh, conv_states, ssm_states, weights, out[rows],
                    groups, limit, eps,
                )  # fmt: skip
            start += n
        return out

    def _kernel_weights(self) -> tuple[torch.Tensor | None, ...]:
        """The convolution's weights and bias, dt_bias, A = −exp(A_log), D and the norm's weight in
        float32, as the C kernels read them (made once: the weights do not change once loaded)."""
        if self._f32 is None:
            assert self.norm is not None
            f32 = lambda t: None if t is None else t.detach().float().contiguous()
            A = -self.A_log.detach().float().exp()
            self._f32 = tuple(
                f32(t) for t in (self.conv1d, self.conv1d_bias, self.dt_bias, A, self.D, self.norm.weight)
            )
        return self._f32
