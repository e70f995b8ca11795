"""Gemma 3n's text model around a decoder's layers (`pytgi.engine.models.gemma3n` reads its config):

- **AltUp** (alternating updates): the residual stream is `num_inputs` streams of the hidden size. The
  first is the embeddings; the others are projections of them, rescaled to the embeddings' RMS. Before
  each layer the streams are mixed by coefficients a router computes from the active stream
  (`predict`); the layer runs on the active stream only; after it, every stream moves by the layer's
  innovation (its output less its prediction) times its own coefficient (`correct`). At the end the
  other streams are projected back, rescaled, and all of them averaged before the final norm.
- **LAuReL** (a learned low-rank residual): the layer's normed input through a rank-r pair of linears,
  normed, added to the attention's residual and the sum scaled by 1/√2.
- the per-layer input (Gemma 4's) gates the corrected active stream and joins the other streams.
- **activation sparsity** in the first layers' MLPs: the gate's values below mean + std · Φ⁻¹(p) of
  each row are cut to zero before the activation.

Everything here runs in PyTorch ops (the C all-layers loop steps aside); the attention, the MLP's
linears and the norms are the decoder's own. The streams are [n, T, hidden]: tokens flat, as every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytgi.engine.models.layers import RMSNorm


@dataclass(frozen=True, slots=True)
class AltUpConfig:
    num_inputs: int  # the streams (4)
    active: int  # the stream the layers run on (0)
    correct_scale: bool  # the corrected active stream is scaled (`correct_output_scale`) before the gate
    laurel_rank: int
    sparsity: tuple[float, ...]  # per layer, the MLP's activation sparsity (0: none)


class Linear(nn.Module):
    """A small linear kept in PyTorch (the quantizers pass it by: its rows are coefficients)."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, k), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class AltUp(nn.Module):
    def __init__(self, cfg: AltUpConfig, hidden: int, eps: float) -> None:
        super().__init__()
        n = cfg.num_inputs
        self.cfg, self.hidden = cfg, hidden
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden), requires_grad=False)
        self.correction_coefs = Linear(n, n)
        self.prediction_coefs = Linear(n, n * n)
        self.modality_router = Linear(hidden, n)
        self.router_norm = RMSNorm(hidden, eps)

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * torch.tensor(1.0 / self.hidden, dtype=x.dtype))
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        n, T = streams.shape[:2]
        coefs = self.prediction_coefs(self._modalities(streams[self.cfg.active]))
        coefs = coefs.reshape(T, n, n).permute(0, 2, 1)
        out = torch.matmul(streams.permute(1, 2, 0), coefs).permute(2, 0, 1)  # [n, T, hidden]
        return (out + streams).contiguous()

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        innovation = activated - predictions[self.cfg.active]
        coefs = self.correction_coefs(self._modalities(activated)) + 1.0  # [T, n]
        return innovation.unsqueeze(0) * coefs.permute(1, 0).unsqueeze(-1) + predictions


class Laurel(nn.Module):
    def __init__(self, rank: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.linear_left = Linear(hidden, rank)
        self.linear_right = Linear(rank, hidden)
        self.post_laurel_norm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


def add_modules(model: Any, cfg: AltUpConfig) -> None:
    """The model's stream projections and each layer's AltUp and LAuReL, named as the checkpoints do
    (`model`: the `DecoderModel`, which imports this module)."""
    hidden, eps = model.config.hidden_size, model.config.rms_norm_eps
    model.altup_projections = nn.ModuleList(Linear(hidden, hidden) for _ in range(cfg.num_inputs - 1))
    model.altup_unembed_projections = nn.ModuleList(Linear(hidden, hidden) for _ in range(cfg.num_inputs - 1))
    for layer in model.layers:
        layer.altup = AltUp(cfg, hidden, eps)
        layer.laurel = Laurel(cfg.laurel_rank, hidden, eps)


def _rescaled(x: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
    """x scaled to the RMS `rms` (per row)."""
    mine = torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * rms / mine


def _mlp(layer: Any, x: torch.Tensor, sparsity: float) -> torch.Tensor:
    if sparsity <= 0.0:
        return layer.mlp(x)
    mlp = layer.mlp
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    cut = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(sparsity, dtype=torch.float32))
    cutoff = gate.mean(-1, keepdim=True) + gate.std(-1, keepdim=True, unbiased=False) * cut.to(gate.dtype)
    gate = torch.relu(gate - cutoff)
    return mlp.down_proj(mlp.ops.act_mul(mlp.activation, torch.cat([gate, up], dim=-1)))


def forward(
    model: Any,
    x: torch.Tensor,
    ropes: tuple[Any, ...],
    kv_caches: list[Any],
    meta: Any,
    per_layer: torch.Tensor,
) -> torch.Tensor:
    """The decoder's forward for Gemma 3n: `x` the scaled embeddings [T, hidden], `per_layer` each layer's
    input [T, layers, size]. Returns the final norm of the averaged streams."""
    cfg = model.config.altup
    assert cfg is not None
    rms = torch.mean(x * x, dim=-1, keepdim=True) ** 0.5
    streams = torch.stack([x, *(_rescaled(p(x), rms) for p in model.altup_projections)])
    for i, (layer, kv_cache) in enumerate(zip(model.layers, kv_caches)):
        predictions = layer.altup.predict(streams)
        active = predictions[cfg.active]
        h = layer.input_layernorm(active)
        laurel = layer.laurel(h)
        rope = ropes[1] if layer.sliding else ropes[0]
        attn = layer.post_attention_layernorm(layer.self_attn(h, rope, kv_cache, meta))
        mixed = (active + attn + laurel) / math.sqrt(2)
        out = _mlp(layer, layer.pre_feedforward_layernorm(mixed), cfg.sparsity[i])
        out = layer.post_feedforward_layernorm(out)
        streams = layer.altup.correct(predictions, mixed + out)
        first = streams[cfg.active]
        if cfg.correct_scale:
            first = first * layer.altup.correct_output_scale
        g = layer.per_layer_input_gate(first)
        g = F.gelu(g, approximate="tanh") if layer.activation == "gelu_tanh" else F.silu(g)
        streams[1:] += layer.post_per_layer_input_norm(layer.per_layer_projection(g * per_layer[:, i]))
    rms = torch.mean(streams[0] * streams[0], dim=-1, keepdim=True) ** 0.5
    unembed = model.altup_unembed_projections
    back = [streams[0], *(_rescaled(p(s), rms) for p, s in zip(unembed, streams[1:]))]
    return model.norm(torch.stack(back).mean(0))
