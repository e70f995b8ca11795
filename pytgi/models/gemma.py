"""Gemma 3 (text) and Gemma 2 over the paged KV cache: the Llama family's layers with Gemma's differences.

- RMSNorm scales by ``1 + weight`` (in float32), and there are four norms a layer: before and after
  attention, before and after the MLP; queries and keys are normed per head before the rotation;
- the MLP is ``down(gelu_tanh(gate) * up)``; the embedding is scaled by ``sqrt(hidden_size)``;
- attention scales by ``query_pre_attn_scalar ** -0.5``;
- most layers attend within a sliding window (``layer_types``, by default five of every six) and
  rotate with their own RoPE base; the others attend to the whole context.

Gemma 2 is the same but for: no q/k norms, one RoPE base, every other layer sliding, and
attention scores soft-capped (cap·tanh(s / cap), `SoftcapAttention`) as the final logits are.

With the fused C kernels (`CpuKernels.fused`) each sandwich of norms around a residual add, the
per-head q/k norms, the rotation with its K/V cache write and GELU·up are one call each
(`pytgi/kernels/fused.c`); otherwise they are PyTorch ops. Attention uses the same backend as
Llama, whose sliding-window metadata reads only the blocks inside the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytgi import kernels
from pytgi.distributed import check_heads, tp_size
from pytgi.models.attention import (
    SlidingWindowBackend,
    SoftcapAttention,
    TorchAttention,
    get_backend,
    layer_metadata,
)
from pytgi.models.cpu import CpuKernels
from pytgi.models.decoder_loop import GemmaDecoderLoop
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
    attn_logit_softcapping: float | None = None  # Gemma 2
    qk_norm: bool = True  # Gemma 3's per-head q/k norms (Gemma 2 has none)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Gemma3Config:
        cfg = cfg.get("text_config", cfg)
        gemma2 = cfg.get("model_type") == "gemma2"
        n_layers = cfg["num_hidden_layers"]
        pattern = cfg.get("sliding_window_pattern", 2 if gemma2 else 6)
        types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
        rope = cfg.get("rope_parameters") or {}
        if "rope_theta" in rope:  # one set of parameters for every layer (Gemma 2)
            rope = {FULL: rope, SLIDING: rope}
        full = rope.get(FULL, {}) if isinstance(rope.get(FULL), dict) else {}
        local = rope.get(SLIDING, {}) if isinstance(rope.get(SLIDING), dict) else {}
        if gemma2 and not local:
            local = {"rope_theta": cfg.get("rope_theta", 10_000.0)}
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
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma2 else None,
            qk_norm=not gemma2,
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

    def scale(self) -> torch.Tensor:
        """`1 + weight` in float32, what the fused kernels multiply by (made once per weight)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_scale_key", None) != key:
            self._scale, self._scale_key = (1.0 + self.weight.detach().float()).contiguous(), key
        return self._scale


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Gemma3Config, backend: TorchAttention, sliding: bool, fused: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = local_heads(cfg)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.backend, self.sliding, self.fused = backend, sliding, fused
        shards = qkv_shards(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, shards, cfg.attention_bias)
        self.o_proj = RowParallelLinear(shards[0], cfg.hidden_size, cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, rope, kv_cache, meta):  # type: ignore[no-untyped-def]
        T, H, KVH, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = self.qkv_proj(x)
        if self.fused:  # rope: float32 [T, D] tables
            qkv = qkv.contiguous()
            if self.q_norm is not None:
                kernels.qk_norm_(qkv, self.q_norm.scale(), self.k_norm.scale(), H, KVH, D, self.q_norm.eps)
            own = layer_metadata(meta, self.sliding)
            q = kernels.rope_write_kv(qkv, *rope, own.slot_mapping, kv_cache[0], kv_cache[1], H, KVH, D)
            o = self.backend.forward(q, None, None, kv_cache[0], kv_cache[1], own, self.scale)
            return self.o_proj(o.reshape(T, H * D))
        q, k = qkv[:, : H * D].view(T, H, D), qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.backend.forward(
            q, k, v.contiguous(), kv_cache[0], kv_cache[1], layer_metadata(meta, self.sliding), self.scale
        )
        return self.o_proj(o.reshape(T, H * D))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Gemma3Config, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        shards = merged_shards([cfg.intermediate_size] * 2)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, shards)
        self.down_proj = RowParallelLinear(shards[0], cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(kernels.gelu_tanh_mul(self.gate_up_proj(x).contiguous()))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, backend: TorchAttention, sliding: bool, fused: bool) -> None:
        super().__init__()
        self.sliding, self.fused = sliding, fused
        self.self_attn = Gemma3Attention(cfg, backend, sliding, fused)
        self.mlp = Gemma3MLP(cfg, fused)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, ropes, kv_cache, meta):  # type: ignore[no-untyped-def]
        rope = ropes[1] if self.sliding else ropes[0]
        if self.fused:  # x, the residual stream, is updated in place
            eps = self.input_layernorm.eps
            h = kernels.norm_add_norm(None, x, None, self.input_layernorm.scale(), eps)
            a = self.self_attn(h, rope, kv_cache, meta)
            h = kernels.norm_add_norm(
                a, x, self.post_attention_layernorm.scale(), self.pre_feedforward_layernorm.scale(), eps
            )
            kernels.norm_add_norm(self.mlp(h), x, self.post_feedforward_layernorm.scale(), None, eps)
            return x
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's loading and quantization, Gemma's layers."""

    def __init__(self, cfg: Gemma3Config, cpu: CpuKernels, attention: str = "torch") -> None:
        nn.Module.__init__(self)
        check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp_size())
        self.config, self.cpu = cfg, cpu
        self.ops = cpu.ops()  # its rope tables: float32 [T, D] for the fused kernels
        inner = get_backend(attention, cpu, local_heads(cfg))
        if cfg.attn_logit_softcapping:
            inner = SoftcapAttention(cpu, local_heads(cfg), cfg.attn_logit_softcapping)
        self.attention = SlidingWindowBackend(inner, cfg.sliding_window)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, inner, t == SLIDING, cpu.fused) for t in cfg.layer_types
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.rotary_local = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None
        )
        self.decoder_loop = None

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        ropes = (
            self.ops.rope_tables(self.rotary, positions, x.dtype),
            self.ops.rope_tables(self.rotary_local, positions, x.dtype),
        )
        if (
            self.decoder_loop is not None
            and meta.uniform is not None
            and (out := self.decoder_loop(x, ropes, kv_caches, meta.uniform)) is not None
        ):
            return self.norm(out)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, ropes, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _decoder_loop(self) -> GemmaDecoderLoop | None:
        return GemmaDecoderLoop.build(self, self.cpu)
