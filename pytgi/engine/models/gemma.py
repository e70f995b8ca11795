"""Gemma 3 (text) and Gemma 2 configs as `DecoderConfig`s: the Llama family's decoder with Gemma's
differences, as data (`pytgi.engine.models.decoder`):

- RMSNorm scales by ``1 + weight`` (in float32), and there are four norms a layer: before and after
  attention, before and after the MLP; queries and keys are normed per head before the rotation;
- the MLP is ``down(gelu_tanh(gate) * up)``; the embedding is scaled by ``sqrt(hidden_size)``;
- attention scales by ``query_pre_attn_scalar ** -0.5``;
- most layers attend within a sliding window (``layer_types``, by default five of every six) and
  rotate with their own RoPE base; the others attend to the whole context.

Gemma 2 is the same but for: no q/k norms, one RoPE base, every other layer sliding, and
attention scores soft-capped (cap·tanh(s / cap), `SoftcapAttention`) as the final logits are.

With the fused C kernels (`Kernels.fused`) each sandwich of norms around a residual add, the
per-head q/k norms, the rotation with its K/V cache write and GELU·up are one call each
(`pytgi/engine/kernels/fused.c`); otherwise they are PyTorch ops. Attention uses the same backend as
Llama, whose sliding-window metadata reads only the blocks inside the window.
"""

from __future__ import annotations

from typing import Any

from pytgi.engine.models.decoder import FULL, SLIDING, DecoderConfig


def gemma_config(cfg: dict[str, Any]) -> DecoderConfig:
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
    if scaling and scaling.get("rope_type", scaling.get("type")) == "dynamic":
        raise ValueError("dynamic rope scaling is not supported for Gemma models (its local layers' rope)")
    bias = cfg.get("attention_bias", False)
    return DecoderConfig(
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
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=False,
        qk_norm=not gemma2,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        sliding_window=int(cfg.get("sliding_window") or 4096),
        layer_types=list(types),
        activation="gelu_tanh",
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=cfg["hidden_size"] ** 0.5,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma2 else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )
