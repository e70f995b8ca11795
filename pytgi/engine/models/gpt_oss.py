"""gpt-oss (OpenAI's open-weight MoE models) read as a `DecoderConfig`: Llama's layout with

- attention sinks: a learned logit per query head that joins every softmax's denominator and
  attends to nothing (`SinkAttention`);
- sliding-window layers alternating with full ones (`layer_types`, a 128-token window);
- biases on q, k, v and o;
- a top-k router with a bias, whose chosen logits are softmaxed (the same weights as a softmax
  renormalized over the chosen experts), and experts with biases and a clamped SwiGLU:
  (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit) (`moe.SparseMoE`,
  `oai`); the checkpoint keeps gate and up interleaved, [E, H, 2I];
- YaRN rope (`rope_parameters`).
"""

from __future__ import annotations

from typing import Any

from pytgi.engine.models.decoder import FULL, SLIDING, DecoderConfig, MoEConfig

ARCHITECTURES = ("GptOssForCausalLM",)


def gpt_oss_config(cfg: dict[str, Any]) -> DecoderConfig:
    layers = cfg["num_hidden_layers"]
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 150000.0
    if rope and rope.get("rope_type", rope.get("type")) == "default":
        rope = None
    types = cfg.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    window = cfg.get("sliding_window")
    bias = cfg.get("attention_bias", True)
    return DecoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta),
        rope_scaling=rope,
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=False,
        qk_norm=False,
        attn_scale=head_dim**-0.5,
        sliding_window=window if window and SLIDING in types else None,
        layer_types=types if window else None,
        attn_sinks=True,
        moe=MoEConfig(
            cfg["num_local_experts"],
            cfg["num_experts_per_tok"],
            cfg["intermediate_size"],
            True,
            None,
            [True] * layers,
            oai=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
        ),
    )
