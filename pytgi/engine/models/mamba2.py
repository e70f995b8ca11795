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

from pytgi.engine.distributed import tp_size
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

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: x, then B and C of every group."""
        return self.inner + 2 * self.n_groups * self.d_state

    def build(self, hidden: int, eps: float, fused: bool) -> Mamba2Mixer:
        """The layer of this kind (a `RecurrentMixer`); `fused` is unused: PyTorch's ops run it."""
        return Mamba2Mixer(self, hidden, eps)


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
    norm after the gate (`norm_before_gate` False), as transformers' `RMSNormGated` computes it."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        h = h.view(*h.shape[:-1], self.groups, -1)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight.float() * h


class Mamba2Mixer(nn.Module):
    """A Mamba-2 layer, whole on one rank (the projection's z | x B C | dt are not sharded yet)."""

    def __init__(self, cfg: Mamba2Config, hidden: int, eps: float) -> None:
        super().__init__()
        if tp_size() > 1:
            raise ValueError("Mamba-2 layers are not sharded yet: serve this model with --num-shard 1")
        if cfg.num_heads % cfg.n_groups:
            raise ValueError(f"{cfg.num_heads} Mamba-2 heads do not split in {cfg.n_groups} groups")
        self.cfg = cfg
        H, inner, conv = cfg.num_heads, cfg.inner, cfg.conv_dim
        self.in_proj = ColumnParallelLinear(hidden, [(0, inner + conv + H)], cfg.proj_bias)
        self.conv1d = nn.Parameter(torch.zeros(conv, cfg.conv_kernel), requires_grad=False)
        self.conv1d_bias = nn.Parameter(torch.zeros(conv), requires_grad=False) if cfg.conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(H), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(H), requires_grad=False)
        self.D = nn.Parameter(torch.ones(H), requires_grad=False)
        self.norm = GroupedGatedRMSNorm(inner, cfg.n_groups, eps)
        self.out_proj = RowParallelLinear((0, inner), hidden, cfg.proj_bias)
        # a GGUF file's shapes: the convolution [C, K], A and D [H, 1], the norm [groups, inner / groups]
        for p in (self.conv1d, self.A_log, self.D, self.dt_bias, self.norm.weight):
            _set_loader(p, lambda p, t, _=0: p.data.copy_(t.reshape(p.shape)))

    def state_specs(self) -> tuple[StateSpec, ...]:
        """Per request: the convolution's last inputs [conv_dim, kernel − 1] in the model's dtype, the
        SSM state [heads, head_dim, d_state] in float32."""
        cfg = self.cfg
        return (
            StateSpec((cfg.conv_dim, cfg.conv_kernel - 1)),
            StateSpec((cfg.num_heads, cfg.head_dim, cfg.d_state), torch.float32),
        )

    def _conv_out(self, window: torch.Tensor) -> torch.Tensor:
        """silu(conv + bias) of `window` [R, conv_dim, kernel − 1 + T] (float32) → [R, conv_dim, T]."""
        bias = None if self.conv1d_bias is None else self.conv1d_bias.float()
        y = F.conv1d(window.float(), self.conv1d.float().unsqueeze(1), bias, groups=window.shape[1])
        return F.silu(y)

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H, P], B and C [T, H, N] (each group's repeated for its heads), float32."""
        cfg, T = self.cfg, xbc.shape[0]
        gn = cfg.n_groups * cfg.d_state
        x, B, C = xbc.float().split([cfg.inner, gn, gn], dim=-1)
        rep = cfg.num_heads // cfg.n_groups
        B, C = (t.view(T, cfg.n_groups, cfg.d_state).repeat_interleave(rep, dim=1) for t in (B, C))
        return x.view(T, cfg.num_heads, cfg.head_dim), B, C

    def forward(
        self, h: torch.Tensor, rope: Rope, state: tuple[torch.Tensor, ...], meta: StateMetadata
    ) -> torch.Tensor:
        cfg, T = self.cfg, h.shape[0]
        conv_states, ssm_states = state
        z, xbc, dt = self.in_proj(h).split([cfg.inner, cfg.conv_dim, cfg.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*cfg.dt_limit)
        A = -self.A_log.float().exp()
        mixed = torch.empty(T, cfg.conv_dim, dtype=torch.float32, device=h.device)
        y = torch.empty(T, cfg.num_heads, cfg.head_dim, dtype=torch.float32, device=h.device)
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
        x = mixed[:, : cfg.inner].view(T, cfg.num_heads, cfg.head_dim)
        y = (y + self.D.float()[:, None] * x).reshape(T, cfg.inner)
        return self.out_proj(self.norm(y, z).to(h.dtype))
