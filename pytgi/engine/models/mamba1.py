"""Mamba-1's selective state-space layer, the recurrent mixer of Mamba, FalconMamba and Jamba, over a
pool of states.

Per request and layer the state is the last `conv_kernel - 1` inputs of a causal depthwise convolution
over x (in the model's dtype) and the SSM state S [d_inner, d_state] (float32). The layer projects
the input to x and the gate z, convolves x (then SiLU), projects that to dt (of rank `dt_rank`), B
and C [d_state] (Jamba and FalconMamba RMS-norm the three first), dt = softplus(dt_proj(dt)) per
channel, and with A = −exp(A_log) [d_inner, d_state] token t does, per channel d,

    S_d ← exp(dt_d · A_d) ⊙ S_d + dt_d · x_d · B_t;   y_d = S_d · C_t + D_d · x_d

then y · silu(z) is projected out. A decode is one step of it, all decodes of a step at once. A
prompt chunk runs the recurrence token by token (`selective_scan`): unlike Mamba-2's one decay per
head, Mamba-1's decay differs by channel and state, so the attention-like chunked form would need a
[chunk, chunk, d_inner, d_state] tensor of decays; the loop touches one [d_inner, d_state] state a
token. A request's slot starts from zero at its first token, so a chunk that cuts a prompt carries
the state to the next chunk exactly as the recurrence does.

On the CPU the C kernels (mamba1.c) run the convolution and the scan, each once a step for its decodes
and prompt chunks together; the per-token loop above stays for CUDA and as their reference. They keep
the recurrence's property to the bit: a token's arithmetic does not depend on where its chunk starts,
so a prompt leaves the same states however it is cut (the projections between them aside).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pytgi.engine import kernels
from pytgi.engine.distributed import local_range
from pytgi.engine.models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, _set_loader
from pytgi.engine.models.linear_attention import StateSpec
from pytgi.engine.models.mamba2 import Mamba2Mixer

if TYPE_CHECKING:
    from pytgi.engine.models.attention import Rope
    from pytgi.engine.models.linear_attention import StateMetadata

# the RMS norms on dt (before dt_proj), B and C (`Mamba1Config.bcdt_norms`)
WEIGHTED = "weighted"  # Jamba's, each with its weight
PLAIN = "plain"  # FalconMamba's, without weights


@dataclass(slots=True)
class Mamba1Config:
    inner: int  # d_inner: the channels of x, z and the state
    d_state: int
    dt_rank: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False  # on in_proj and out_proj
    bcdt_norms: str | None = None  # None (Mamba) | WEIGHTED (Jamba) | PLAIN (FalconMamba)
    norm_eps: float = 1e-6  # those norms' (FalconMamba's `mixer_rms_eps`, Jamba's `rms_norm_eps`)

    def build(self, hidden: int, eps: float, fused: bool) -> Mamba1Mixer:
        """The layer of this kind (a `RecurrentMixer`); fused: the C kernels run its convolution and scan
        (CPU)."""
        return Mamba1Mixer(self, hidden, fused)


def selective_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One token of each of R requests: x, dt [R, D], A [D, N], B, C [R, N] (float32); `state`
    [R, D, N] is updated in place. Returns y [R, D] (without D's skip)."""
    state.mul_((dt[..., None] * A).exp())
    state.add_((dt * x)[..., None] * B[:, None, :])
    return (state @ C[..., None]).squeeze(-1)


def selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of one request: x, dt [L, D], A [D, N], B, C [L, N] (float32), from `state` [D, N].
    Returns (y [L, D] without D's skip, the state after them)."""
    out = torch.empty_like(x)
    state = state.clone()
    for t in range(x.shape[0]):
        out[t] = selective_step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], state[None])[0]
    return out, state


class Mamba1Mixer(nn.Module):
    """A Mamba-1 layer; with tensor parallelism each rank holds an equal share of the channels (their
    rows of in_proj, dt_proj, the convolution, A, D and the states); x_proj and out_proj read this
    rank's channels and are all-reduced."""

    # `selective_scan` is the recurrence token by token and the convolution's taps are summed per
    # output position: a prefill split anywhere gives the state and outputs of one unsplit (measured)
    state_grid = 1

    def __init__(self, cfg: Mamba1Config, hidden: int, fused: bool = False) -> None:
        """fused: mamba1.c's kernels run the convolution (`kernels.causal_conv`) and the scan with D's
        skip and the gate (`kernels.mamba1_scan`), each once a step; the projections between them stay
        PyTorch's. The PyTorch path stays for CUDA and as their reference."""
        super().__init__()
        self.cfg, self.fused = cfg, fused
        self._f32: tuple[torch.Tensor | None, ...] | None = None  # the kernels' float32 weights
        d0, n = local_range(cfg.inner)
        self.local = n
        mine = Mamba2Mixer._rows([(d0, n)])
        parts = [(d0, n), (cfg.inner + d0, n)]  # this rank's rows of x | z
        self.in_proj = ColumnParallelLinear(hidden, parts, cfg.proj_bias)
        _set_loader(self.in_proj.weight, Mamba2Mixer._rows(parts))
        if self.in_proj.bias is not None:
            _set_loader(self.in_proj.bias, Mamba2Mixer._rows(parts))
        self.conv1d = nn.Parameter(torch.zeros(n, cfg.conv_kernel), requires_grad=False)
        _set_loader(self.conv1d, mine)
        self.conv1d_bias: nn.Parameter | None = None
        if cfg.conv_bias:
            self.conv1d_bias = nn.Parameter(torch.zeros(n), requires_grad=False)
            _set_loader(self.conv1d_bias, mine)
        self.x_proj = RowParallelLinear((d0, n), cfg.dt_rank + 2 * cfg.d_state)
        self.dt_proj = ColumnParallelLinear(cfg.dt_rank, [(d0, n)], bias=True)
        self.A_log = nn.Parameter(torch.zeros(n, cfg.d_state), requires_grad=False)
        self.D = nn.Parameter(torch.ones(n), requires_grad=False)
        for p in (self.A_log, self.D):
            _set_loader(p, mine)
        self.out_proj = RowParallelLinear((d0, n), hidden, cfg.proj_bias)
        self.dt_layernorm: RMSNorm | None = None
        self.b_layernorm: RMSNorm | None = None
        self.c_layernorm: RMSNorm | None = None
        if cfg.bcdt_norms == WEIGHTED:
            self.dt_layernorm = RMSNorm(cfg.dt_rank, cfg.norm_eps)
            self.b_layernorm = RMSNorm(cfg.d_state, cfg.norm_eps)
            self.c_layernorm = RMSNorm(cfg.d_state, cfg.norm_eps)

    def state_specs(self) -> tuple[StateSpec, ...]:
        """Per request: the convolution's last inputs [d_inner, kernel − 1] in the model's dtype, the
        SSM state [d_inner, d_state] in float32 (this rank's channels)."""
        return (
            StateSpec((self.local, self.cfg.conv_kernel - 1)),
            StateSpec((self.local, self.cfg.d_state), torch.float32),
        )

    def _conv_out(self, window: torch.Tensor) -> torch.Tensor:
        """silu(conv + bias) of `window` [R, d_inner, kernel − 1 + T] (float32) → [R, d_inner, T]."""
        bias = None if self.conv1d_bias is None else self.conv1d_bias.float()
        y = F.conv1d(window.float(), self.conv1d.float().unsqueeze(1), bias, groups=window.shape[1])
        return F.silu(y)

    def _norm(self, t: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """Jamba's norm (with its weight), FalconMamba's (without), or none (Mamba)."""
        if norm is not None:
            return norm(t)
        if self.cfg.bcdt_norms != PLAIN:
            return t
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)).to(t.dtype)

    def forward(
        self, h: torch.Tensor, rope: Rope, state: tuple[torch.Tensor, ...], meta: StateMetadata
    ) -> torch.Tensor:
        if self.fused:
            return self.out_proj(self._fused(self.in_proj(h), state, meta))
        T, n = h.shape[0], self.local
        conv_states, ssm_states = state
        x, z = self.in_proj(h).split([n, n], dim=-1)
        # the convolution's output, in the model's dtype as the projections after it read it
        mixed = torch.empty(T, n, dtype=h.dtype, device=h.device)
        if meta.reset is not None:
            conv_states[meta.reset], ssm_states[meta.reset] = 0, 0
        rows, slots = meta.decode_rows, meta.slots[meta.decodes]
        if len(meta.decodes):
            window = torch.cat([conv_states[slots], x[rows].unsqueeze(-1)], dim=-1)  # [R, D, kernel]
            conv_states[slots] = window[..., 1:]
            mixed[rows] = self._conv_out(window)[..., 0].to(h.dtype)
        prompts = []  # (slot, rows, fresh) of the requests with several tokens
        start = 0
        for i, (q, fresh) in enumerate(zip(meta.query_lens, meta.fresh)):
            if q > 1:
                slot, rows_i = meta.slots[i], slice(start, start + q)
                prev = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
                window = torch.cat([prev, x[rows_i].T], dim=-1)  # [D, kernel − 1 + q]
                conv_states[slot] = window[:, -prev.shape[-1] :]
                mixed[rows_i] = self._conv_out(window.unsqueeze(0))[0].T.to(h.dtype)
                prompts.append((slot, rows_i, fresh))
            start += q
        dt, B, C = self._projections(mixed)
        B, C, dt = B.float(), C.float(), F.softplus(dt.float())
        A = -self.A_log.float().exp()
        xf = mixed.float()
        y = torch.empty(T, n, dtype=torch.float32, device=h.device)
        if len(meta.decodes):
            s = ssm_states[slots]
            y[rows] = selective_step(xf[rows], dt[rows], A, B[rows], C[rows], s)
            ssm_states[slots] = s
        for slot, rows_i, fresh in prompts:
            init = torch.zeros_like(ssm_states[slot]) if fresh else ssm_states[slot]
            scanned = selective_scan(xf[rows_i], dt[rows_i], A, B[rows_i], C[rows_i], init)
            y[rows_i], ssm_states[slot] = scanned
        y = (y + self.D.float() * xf) * F.silu(z.float())
        return self.out_proj(y.to(h.dtype))

    def _projections(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dt (dt_proj's output, before the softplus), B and C from the convolution's output, each
        normed where the family norms it."""
        cfg = self.cfg
        dt, B, C = self.x_proj(mixed).split([cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        dt = self._norm(dt, self.dt_layernorm)
        return self.dt_proj(dt), self._norm(B, self.b_layernorm), self._norm(C, self.c_layernorm)

    def _fused(self, xz: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        """The C kernels' path (mamba1.c): the step's decodes and prompt chunks in one call for the
        convolution and one for the scan, with the PyTorch path's roundings (the convolution's output
        and the gated output in the model's dtype, all else float32). Returns the gated output [T, n]."""
        conv_states, ssm_states = state
        xz = xz.contiguous()
        conv_w, conv_b, A, D = self._kernel_weights()
        assert conv_w is not None and A is not None and D is not None
        step = kernels.StepRequests.of(meta.query_lens, meta.slots, meta.fresh)
        mixed = kernels.causal_conv(xz, step, conv_states, conv_w, conv_b)
        dt, B, C = self._projections(mixed)
        bc = torch.cat([B, C], dim=-1).float()
        return kernels.mamba1_scan(xz, mixed, dt, bc, step, ssm_states, A, D)

    def _kernel_weights(self) -> tuple[torch.Tensor | None, ...]:
        """The convolution's weights and bias, A = −exp(A_log) and D in float32, as the C kernels read
        them (made once: the weights do not change once loaded)."""
        if self._f32 is None:
            f32 = lambda t: None if t is None else t.detach().float().contiguous()
            A = -self.A_log.detach().float().exp()
            self._f32 = tuple(f32(t) for t in (self.conv1d, self.conv1d_bias, A, self.D))
        return self._f32
