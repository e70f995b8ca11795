"""Kimi Delta Attention (KDA), the linear-attention layers of Kimi Linear, over a pool of states.

KDA is gated DeltaNet (`pytgi.engine.models.linear_attention`) with a decay per key channel rather
than per head: token t updates each head's state S [K, V] (float32) by

    S ← diag(exp(g_t)) · S;   u_t = β_t (v_t − Sᵀ k_t);   S ← S + k_t u_tᵀ;   o_t = Sᵀ q_t

with q and k L2-normalized (q also scaled by K^-½), β = sigmoid(b_proj(x)) per head and the log
decay per channel g = −exp(A_log) · softplus(f_b(f_a(x)) + dt_bias). q, k and v each pass a short
causal convolution (SiLU after it) first; the output is RMS-normed per head and gated by
sigmoid(g_b(g_a(x))) before `o_proj`. A request's state: the convolution's last `conv_kernel − 1`
inputs (the model's dtype) and S per head.

A decode is one step of the rule, all decodes of a step at once. A prefill chunk runs the chunked
form: within C tokens the updates solve one unit-triangular system, as gated DeltaNet's do, with the
pairwise decays exp(G_i − G_j) kept per channel ([C, C, K] a head: every exponent ≤ 0, so nothing
overflows); the chunks' states are sequential.

On the CPU the C kernels run everything between the projections (mamba1.c's convolution, kda.c's
rule with the output's norm and gate), a step's decodes and prompt chunks in one call each; there a
prompt's tokens run the recurrence one by one, not the chunked form (the state stays in cache, and a
prompt leaves the same state to the bit however it is cut). The PyTorch path stays for CUDA and as
their reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pytgi.engine import kernels
from pytgi.engine.distributed import local_range, tp_size
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear, _set_loader
from pytgi.engine.models.linear_attention import StateSpec

if TYPE_CHECKING:
    from pytgi.engine.models.attention import Rope
    from pytgi.engine.models.linear_attention import StateMetadata

CHUNK = 32  # tokens per chunk of the chunked rule (its pairwise decays are [C, C, K] a head)


@dataclass(frozen=True, slots=True)
class KdaConfig:
    num_heads: int
    head_dim: int  # the keys' and the values' (K = V)
    conv_kernel: int

    def build(self, hidden: int, eps: float, fused: bool) -> KimiDeltaAttention:
        """The layer of this kind (a `RecurrentMixer`); fused: the C kernels run it between its
        projections (CPU)."""
        return KimiDeltaAttention(self, hidden, eps, fused)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / √(Σx² + 1e-6), as FLA's kernels (and transformers after them) compute it."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of each of B requests: q, k, g [B, H, K], v [B, H, V], beta [B, H] (float32); `state`
    [B, H, K, V] is updated in place. Returns o [B, H, V]."""
    state.mul_(g.exp()[..., None])
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
    """L tokens of one request: q, k, g [L, H, K], v [L, H, V], beta [L, H] (float32), from `state`
    [H, K, V]. Returns (o [L, H, V], the state after them).

    Within a chunk, with G_i the log decay from the chunk's start through token i (per channel) and
    D_ij = exp(G_i − G_j) for j ≤ i: u = (I + A)⁻¹ (β v − β (e^G ⊙ k) S0), A_ij = β_i Σ_c k_i D_ij k_j
    below the diagonal; o_i = (e^G_i ⊙ q_i) S0 + Σ_j≤i (Σ_c q_i D_ij k_j) u_j; the state after it
    e^G_C ⊙ S0 + Σ_j (e^(G_C − G_j) ⊙ k_j) u_jᵀ."""
    L, H = k.shape[:2]
    V = v.shape[-1]
    pad = -L % chunk
    q, k, v, g = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v, g))  # [H, L + pad, .]
    beta = F.pad(beta.transpose(0, 1), (0, pad))
    n = (L + pad) // chunk
    q, k, v, g = (x.reshape(H, n, chunk, -1) for x in (q, k, v, g))
    beta = beta.reshape(H, n, chunk, 1)
    G = g.cumsum(-2)  # [H, n, C, K]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(v)
    for c in range(n):
        Gc, qc, kc, vc, bc = G[:, c], q[:, c], k[:, c], v[:, c], beta[:, c]
        # D_ij ⊙ k_j [H, C (i), C (j), K], built in place (one [C, C, K] tensor a head), then its
        # products with k_i and q_i in one matmul
        kj = (Gc[:, :, None, :] - Gc[:, None, :, :]).masked_fill_(~causal[..., None], float("-inf"))
        kj = kj.exp_().mul_(kc[:, None, :, :])
        products = kj @ torch.stack([kc, qc], dim=-1)  # [H, C, C, 2]
        system = (products[..., 0] * bc).masked_fill(~causal, 0.0)  # (the diagonal: unit, as solved)
        rhs = torch.cat([vc * bc, kc * bc * Gc.exp()], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u = solved[..., :V] - solved[..., V:] @ state
        out[:, c] = (qc * Gc.exp()) @ state + products[..., 1] @ u
        k_to_end = kc * (Gc[:, -1:] - Gc).exp()
        state = state * Gc[:, -1, :, None].exp() + k_to_end.transpose(-1, -2) @ u
    return out.reshape(H, n * chunk, V)[:, :L].transpose(0, 1), state


class KimiDeltaAttention(nn.Module):
    """A KDA layer; this rank holds whole heads (their projections' rows, convolution channels, decays
    and states)."""

    # `chunked_rule`'s chunks: a call started off them solves other triangular systems and sums other
    # matmuls, and the state differs in the last bits (measured: splits at multiples of 32 are exact,
    # at 16, 48 or 100 not)
    state_grid = CHUNK

    def __init__(self, cfg: KdaConfig, hidden: int, eps: float, fused: bool = False) -> None:
        """fused: the C kernels run the convolution (`kernels.causal_conv`) and the rule with the output's
        norm and gate (`kernels.kda_rule`), each once a step for its decodes and prompt chunks; the
        PyTorch path stays for CUDA and as their reference."""
        super().__init__()
        self.fused = fused
        self._f32: tuple[torch.Tensor, ...] | None = None  # the kernels' float32 weights
        H, K = cfg.num_heads, cfg.head_dim
        if H % tp_size():
            raise ValueError(f"cannot shard {H} KDA heads over {tp_size()} ranks")
        self.cfg, self.eps = cfg, eps
        h0, self.heads = (x // K for x in local_range(H, K))
        rows = (h0 * K, self.heads * K)  # this rank's rows of a [H·K] projection
        self.q_proj = ColumnParallelLinear(hidden, [rows])
        self.k_proj = ColumnParallelLinear(hidden, [rows])
        self.v_proj = ColumnParallelLinear(hidden, [rows])
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Parameter(torch.zeros(rows[1], cfg.conv_kernel), requires_grad=False) for _ in range(3)
        )
        self.rows, self.first_head = rows, h0
        for p in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            _set_loader(p, self._load_conv)
        # the forget gate: f_a (every rank's) then f_b's rows of this rank's heads
        self.f_a_proj = ColumnParallelLinear(hidden, [(0, K)])
        self.f_b_proj = ColumnParallelLinear(K, [rows])
        self.dt_bias = nn.Parameter(torch.zeros(rows[1]), requires_grad=False)
        _set_loader(self.dt_bias, self._load_rows)
        self.A_log = nn.Parameter(
            torch.zeros(self.heads), requires_grad=False
        )  # the checkpoint's [1, 1, H, 1]
        _set_loader(self.A_log, self._load_heads)
        self.b_proj = ColumnParallelLinear(hidden, [(h0, self.heads)])
        self.g_a_proj = ColumnParallelLinear(hidden, [(0, K)])
        self.g_b_proj = ColumnParallelLinear(K, [rows])
        self.o_norm = nn.Parameter(torch.ones(K), requires_grad=False)  # the checkpoint's o_norm.weight
        self.o_proj = RowParallelLinear(rows, hidden)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """This rank's channels of a convolution: the checkpoint's [H·K, 1, kernel], or a GGUF file's
        [1, H·K, 1, kernel]."""
        start, n = self.rows
        param.data.copy_(loaded.reshape(-1, self.cfg.conv_kernel)[start : start + n])

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """This rank's rows of dt_bias [H·K]."""
        start, n = self.rows
        param.data.copy_(loaded.reshape(-1)[start : start + n])

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """This rank's heads of A_log (the checkpoint's [1, 1, H, 1])."""
        param.data.copy_(loaded.reshape(-1)[self.first_head : self.first_head + self.heads])

    def state_specs(self) -> tuple[StateSpec, ...]:
        """Per request: the convolution's last inputs [3 · heads · K, kernel − 1] in the model's dtype,
        the rule's state [heads, K, V] in float32."""
        K = self.cfg.head_dim
        return (
            StateSpec((3 * self.heads * K, self.cfg.conv_kernel - 1)),
            StateSpec((self.heads, K, K), torch.float32),
        )

    def forward(
        self, x: torch.Tensor, rope: Rope, state: tuple[torch.Tensor, ...], meta: StateMetadata
    ) -> torch.Tensor:
        conv_states, rec_states = state
        T, H, K = x.shape[0], self.heads, self.cfg.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.fused:
            return self.o_proj(self._fused(x, qkv, state, meta))
        weight = torch.cat([self.q_conv1d, self.k_conv1d, self.v_conv1d]).float()
        g = F.softplus(self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(T, H, K)
        g = -self.A_log.float().exp()[:, None] * g
        beta = self.b_proj(x).sigmoid().float()
        mixed = torch.empty_like(qkv)
        o = torch.empty(T, H, K, dtype=torch.float32, device=x.device)
        if meta.reset is not None:
            conv_states[meta.reset], rec_states[meta.reset] = 0, 0
        if len(meta.decodes):
            rows, slots = meta.decode_rows, meta.slots[meta.decodes]
            window = torch.cat([conv_states[slots], qkv[rows].unsqueeze(-1)], dim=-1)  # [B, C, kernel]
            conv_states[slots] = window[..., 1:]
            mixed[rows] = F.silu((window.float() * weight).sum(-1)).to(qkv.dtype)
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
                y = F.conv1d(window.unsqueeze(0).float(), weight.unsqueeze(1), groups=window.shape[0])
                mixed[rows_i] = F.silu(y[0].T).to(qkv.dtype)
                q, k, v = self._heads(mixed[rows_i])
                init = torch.zeros_like(rec_states[slot]) if fresh else rec_states[slot]
                o[rows_i], rec_states[slot] = chunked_rule(q, k, v, g[rows_i], beta[rows_i], init)
            start += n
        # the output: RMS-normed per head in float32 (the weight too), gated by sigmoid(g_b(g_a(x)))
        o = o.to(x.dtype).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.float()
        gate = self.g_b_proj(self.g_a_proj(x)).float().view(T, H, K).sigmoid()
        return self.o_proj((o * gate).to(x.dtype).reshape(T, H * K))

    def _fused(
        self, x: torch.Tensor, qkv: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata
    ) -> torch.Tensor:
        """The C kernels' path (mamba1.c's convolution, kda.c's rule): the step's decodes and prompt
        chunks in one call each, the prompts' tokens through the recurrence one by one (a prompt then
        leaves the same state however it is cut). Returns the normed, gated output [T, heads · K]."""
        conv_states, rec_states = state
        conv_w, *weights = self._kernel_weights()
        step = kernels.StepRequests.of(meta.query_lens, meta.slots, meta.fresh)
        mixed = kernels.causal_conv(qkv, step, conv_states, conv_w, None)
        f, gate = self.f_b_proj(self.f_a_proj(x)), self.g_b_proj(self.g_a_proj(x))
        A, dt_bias, norm_w = weights
        return kernels.kda_rule(
            mixed, f, self.b_proj(x), gate, step, rec_states, (A, dt_bias, norm_w), self.eps
        )

    def _kernel_weights(self) -> tuple[torch.Tensor, ...]:
        """The convolutions' weights (q | k | v), A = −exp(A_log), dt_bias and the output norm's weight
        in float32, as the C kernels read them (made once: the weights do not change once loaded)."""
        if self._f32 is None:
            conv = torch.cat([self.q_conv1d, self.k_conv1d, self.v_conv1d]).float().contiguous()
            A = -self.A_log.detach().float().exp()
            self._f32 = (conv, A, self.dt_bias.detach().float().contiguous(), self.o_norm.detach().float())
        return self._f32

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (L2-normalized, q scaled by K^-½) and v [T, heads, K], float32."""
        T, K = mixed.shape[0], self.cfg.head_dim
        q, k, v = (t.float().reshape(T, self.heads, K) for t in mixed.chunk(3, dim=-1))
        return l2norm(q) * K**-0.5, l2norm(k), v
