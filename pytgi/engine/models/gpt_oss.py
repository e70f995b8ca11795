"""gpt-oss (OpenAI's open-weight MoE models) read as a `DecoderConfig`: Llama's layout (`llama_config`,
which reads its heads, biases on q, k, v and o, and its YaRN `rope_parameters`) with

- attention sinks: a learned logit per query head that joins every softmax's denominator and
  attends to nothing (`SinkAttention`);
- sliding-window layers alternating with full ones (`layer_types`, a 128-token window);
- a top-k router with a bias, whose chosen logits are softmaxed (the same weights as a softmax
  renormalized over the chosen experts), and experts with biases and a clamped SwiGLU:
  (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit) (`moe.SparseMoE`'s `oai`);
  the checkpoint keeps gate and up interleaved, [E, H, 2I].
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.engine.models.decoder import FULL, SLIDING, DecoderConfig, MoEConfig
from pytgi.engine.models.llama import llama_config


def gpt_oss_config(cfg: dict[str, Any]) -> DecoderConfig:
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    window = cfg.get("sliding_window")
    return dataclasses.replace(
        llama_config({"attention_bias": True, "rms_norm_eps": 1e-5, **cfg}),
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
