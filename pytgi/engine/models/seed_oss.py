"""ByteDance Seed-OSS read as a `DecoderConfig`: Llama's layers with biases on q, k and v
(`attention_bias`, by default on) and, where `attention_out_bias` says, on the output projection.
Its dropouts are training's only.

llama.cpp writes these files as "seed_oss", with q/k rows as the checkpoint has them and the MLP's
input norm (Llama's `post_attention_layernorm`) under the name `post_attention_norm`
(pytgi.core.gguf_convert).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.engine.models.decoder import DecoderConfig
from pytgi.engine.models.llama import llama_config


def seed_oss_config(cfg: dict[str, Any]) -> DecoderConfig:
    return dataclasses.replace(
        llama_config(cfg),
        attention_bias=bool(cfg.get("attention_bias", True)),
        o_proj_bias=bool(cfg.get("attention_out_bias", False)),
    )
