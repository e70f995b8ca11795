"""ModernBERT, for embeddings and as a cross-encoder: pre-norm layers without biases, rotary
positions (a base per layer kind), a GeGLU feed-forward, and bidirectional attention that every
third layer is global and otherwise sees the tokens within half of `local_attention` either side.

The same face as `encoder.EncoderModel` (forward over a step's prompts laid out flat, `classify`),
and the same batch invariance: each linear and each attention runs per prompt.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.encoder import ACTIVATIONS, copy_weights, per_prompt

GLOBAL, LOCAL = "full_attention", "sliding_attention"


def _layer_kinds(cfg: dict[str, Any]) -> list[str]:
    kinds = cfg.get("layer_types")
    if kinds:
        return list(kinds)
    every = cfg.get("global_attn_every_n_layers", 3)
    return [LOCAL if i % every else GLOBAL for i in range(cfg["num_hidden_layers"])]


def _rope_bases(cfg: dict[str, Any]) -> dict[str, float]:
    """Each layer kind's RoPE base: transformers 5's rope_parameters, or the checkpoints' older keys."""
    params = cfg.get("rope_parameters") or {}
    bases = {GLOBAL: cfg.get("global_rope_theta", 160_000.0), LOCAL: cfg.get("local_rope_theta", 10_000.0)}
    for kind in (GLOBAL, LOCAL):
        p = params.get(kind) or {}
        if p.get("rope_type", "default") != "default":
            raise UnsupportedModel(f"ModernBERT with {p['rope_type']!r} RoPE scaling is not supported")
        bases[kind] = p.get("rope_theta", bases[kind])
    return bases


class ModernLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], first: bool, kind: str) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        eps, norm_bias = cfg.get("norm_eps", 1e-5), cfg.get("norm_bias", False)
        attn_bias, mlp_bias = cfg.get("attention_bias", False), cfg.get("mlp_bias", False)
        self.heads = cfg["num_attention_heads"]
        self.head_dim = hidden // self.heads
        self.kind = kind
        self.window = cfg.get("local_attention", 128) // 2 if kind == LOCAL else None
        self.attn_norm = nn.Identity() if first else nn.LayerNorm(hidden, eps=eps, bias=norm_bias)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=attn_bias)
        self.o = nn.Linear(hidden, hidden, bias=attn_bias)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias)
        self.wi = nn.Linear(hidden, 2 * inter, bias=mlp_bias)
        self.wo = nn.Linear(inter, hidden, bias=mlp_bias)
        self.act = ACTIVATIONS[cfg.get("hidden_activation", "gelu")]

    def forward(
        self, x: torch.Tensor, lens: list[int], rope: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        qkv = per_prompt(self.qkv, self.attn_norm(x), lens)
        ctx = torch.cat([self._attend(part, *r) for part, r in zip(qkv.split(lens), rope, strict=True)])
        x = x + per_prompt(self.o, ctx, lens)
        up, gate = per_prompt(self.wi, self.mlp_norm(x), lens).chunk(2, dim=-1)
        return x + per_prompt(self.wo, self.act(up) * gate, lens)

    def _attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        L = qkv.shape[0]
        q, k, v = qkv.view(1, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 4-D: the flash kernel
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        mask = None
        if self.window is not None and L > self.window + 1:
            pos = torch.arange(L)
            mask = (pos[:, None] - pos[None, :]).abs() <= self.window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return out[0].transpose(0, 1).reshape(L, -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves (x: [1, heads, L, D]), in float32 as transformers computes it."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class ModernHead(nn.Module):
    """ModernBERT's classification head: dense, activation, LayerNorm, then the labels' logits."""

    def __init__(self, cfg: dict[str, Any], num_labels: int) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.dense = nn.Linear(hidden, hidden, bias=cfg.get("classifier_bias", False))
        self.act = ACTIVATIONS[cfg.get("classifier_activation", "gelu")]
        self.norm = nn.LayerNorm(hidden, eps=cfg.get("norm_eps", 1e-5), bias=cfg.get("norm_bias", False))
        self.out = nn.Linear(hidden, num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.act(self.dense(pooled[None]))))[0]


class ModernEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.hidden_size = hidden
        self.segments = 1  # no token types
        self.max_positions = cfg.get("max_position_embeddings", 8192)
        self.word = nn.Embedding(cfg["vocab_size"], hidden)
        self.embed_norm = nn.LayerNorm(
            hidden, eps=cfg.get("norm_eps", 1e-5), bias=cfg.get("norm_bias", False)
        )
        self.kinds = _layer_kinds(cfg)
        self.layers = nn.ModuleList(ModernLayer(cfg, i == 0, kind) for i, kind in enumerate(self.kinds))
        self.final_norm = nn.LayerNorm(
            hidden, eps=cfg.get("norm_eps", 1e-5), bias=cfg.get("norm_bias", False)
        )
        head_dim = hidden // cfg["num_attention_heads"]
        self.inv_freq = {
            kind: 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            for kind, base in _rope_bases(cfg).items()
        }
        arch = (cfg.get("architectures") or ["ModernBertModel"])[0]
        labels = cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2
        self.head = ModernHead(cfg, labels) if arch == "ModernBertForSequenceClassification" else None
        self.head_pooling = cfg.get("classifier_pooling", "cls")

    def _rope(self, kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[kind]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, lens: list[int], types: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_norm(self.word(ids))
        tables = {kind: [self._rope(kind, n) for n in lens] for kind in self.inv_freq}
        for layer, kind in zip(self.layers, self.kinds, strict=True):
            x = layer(x, lens, tables[kind])
        return self.final_norm(x)

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
        assert self.head is not None
        head = self.head
        if self.head_pooling == "mean":
            return [head(h.sum(0) / h.shape[0]).float() for h in hidden.split(lens)]
        starts = [0, *itertools.accumulate(lens)][:-1]
        return [head(hidden[s]).float() for s in starts]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        copy_weights(self, _renamed(tensors))


_NAMES = {
    "embeddings.tok_embeddings": "word",
    "embeddings.norm": "embed_norm",
    "final_norm": "final_norm",
    "head.dense": "head.dense",
    "head.norm": "head.norm",
    "classifier": "head.out",
}
_LAYER = {
    "attn_norm": "attn_norm",
    "attn.Wqkv": "qkv",
    "attn.Wo": "o",
    "mlp_norm": "mlp_norm",
    "mlp.Wi": "wi",
    "mlp.Wo": "wo",
}


def _renamed(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str | None, torch.Tensor]]:
    for name, t in tensors:
        name = name.removeprefix("model.")
        module, _, leaf = name.rpartition(".")
        if module in _NAMES:
            yield f"{_NAMES[module]}.{leaf}", t
        elif module.startswith("layers."):
            index, _, rest = module.removeprefix("layers.").partition(".")
            new = _LAYER.get(rest)
            yield (None if new is None else f"layers.{index}.{new}.{leaf}"), t
        else:
            yield None, t
