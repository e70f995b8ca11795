"""Gemma 3 (text) over the paged KV cache: the Llama family's layers with Gemma's differences.

- RMSNorm scales by ``1 + weight`` (in float32), and there are four norms a layer: before and after
  attention, before and after the MLP; queries and keys are normed per head before the rotation;
- the MLP is ``down(gelu_tanh(gate) * up)``; the embedding is scaled by ``sqrt(hidden_size)``;
- attention scales by ``query_pre_attn_scalar ** -0.5``;
- most layers attend within a sliding window (``layer_types``, by default five of every six) and
  rotate with their own RoPE base; the others attend to the whole context.

The element-wise steps are PyTorch's (the fused C kernels implement Llama's norm); attention uses
the same backend, whose sliding-window metadata reads only the blocks inside the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytgi.distributed import check_heads, tp_size
from pytgi.models.attention import SlidingWindowBackend, TorchAttention, get_backend, layer_metadata
from pytgi.models.cpu import CpuKernels, TorchOps
from pytgi.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    merged_shards,
    qkv_shards,
)
from pytgi.models.llama import LlamaForCausalLM, local_heads

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(slots=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # full-attention layers
    rope_scaling: dict | None
    rope_local_theta: float  # sliding layers
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: list[str]
    final_logit_softcapping: float | None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Gemma3Config:
        cfg = cfg.get("text_config", cfg)
        n_layers = cfg["num_hidden_layers"]
        pattern = cfg.get("sliding_window_pattern", 6)
        types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
        rope = cfg.get("rope_parameters") or {}
        full = rope.get(FULL, {}) if isinstance(rope.get(FULL), dict) else {}
        local = rope.get(SLIDING, {}) if isinstance(rope.get(SLIDING), dict) else {}
        scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim", 256),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0),
            rope_scaling=scaling,
            rope_local_theta=float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            attention_bias=cfg.get("attention_bias", False),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            sliding_window=int(cfg.get("sliding_window") or 4096),
            layer_types=list(types),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) · (1 + w), all in float32, then cast (Gemma's weights are offsets from 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Gemma3Config, backend: TorchAttention, sliding: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = local_heads(cfg)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.backend, self.sliding = backend, sliding
        shards = qkv_shards(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, shards, cfg.attention_bias)
        self.o_proj = RowParallelLinear(shards[0], cfg.hidden_size, cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, rope, kv_cache, meta):  # type: ignore[no-untyped-def]
        T, H, KVH, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, : H * D].view(T, H, D))
        k = self.k_norm(qkv[:, H * D : (H + KVH) * D].view(T, KVH, D))
        v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.backend.forward(q, k, v.contiguous(), kv_cache[0], kv_cache[1], layer_metadata(meta, self.sliding),
                                 self.scale)
        return self.o_proj(o.reshape(T, H * D))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        shards = merged_shards([cfg.intermediate_size] * 2)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, shards)
        self.down_proj = RowParallelLinear(shards[0], cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, backend: TorchAttention, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = Gemma3Attention(cfg, backend, sliding)
        self.mlp = Gemma3MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, ropes, kv_cache, meta):  # type: ignore[no-untyped-def]
        rope = ropes[1] if self.sliding else ropes[0]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's loading and quantization, Gemma's layers."""

    def __init__(self, cfg: Gemma3Config, cpu: CpuKernels, attention: str = "torch") -> None:
        nn.Module.__init__(self)
        check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp_size())
        self.config, self.cpu, self.ops = cfg, cpu, TorchOps()
        inner = get_backend(attention, cpu, local_heads(cfg))
        self.attention = SlidingWindowBackend(inner, cfg.sliding_window)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, inner, t == SLIDING) for t in cfg.layer_types)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None)
        self.decoder_loop = None

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        ropes = (self.rotary(positions, x.dtype), self.rotary_local(positions, x.dtype))
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, ropes, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _decoder_loop(self) -> None:
        return None  # the one-call C loop runs Llama's layer
