"""IBM Granite 3.x (dense) read as a `DecoderConfig`: Llama's layers with four scalars of its own.

- the embeddings are multiplied by `embedding_multiplier` (`embed_scale`);
- attention scales its scores by `attention_multiplier` instead of head_dim ** -0.5 (`attn_scale`);
- each sublayer's output is multiplied by `residual_multiplier` before it joins the residual stream
  (`residual_scale`: the C all-layers loop steps aside for it);
- the logits are divided by `logits_scaling` (`logit_scale`).

llama.cpp writes these files as "granite", with its q/k rows interleaved as a "llama" file's and the
four scalars under `granite.attention.scale`, `granite.embedding_scale`, `granite.residual_scale`
and `granite.logit_scale` (the registry's GGUF name map, pytgi.core.families).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.engine.models.decoder import DecoderConfig
from pytgi.engine.models.llama import llama_config


def granite_config(cfg: dict[str, Any]) -> DecoderConfig:
    base = llama_config(cfg)
    return dataclasses.replace(
        base,
        embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
        attn_scale=float(cfg.get("attention_multiplier", base.attn_scale)),
        residual_scale=float(cfg.get("residual_multiplier", 1.0)),
        logit_scale=float(cfg.get("logits_scaling", 1.0)),
    )
