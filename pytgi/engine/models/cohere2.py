"""Cohere 2 (Command R7B, Command A) read as a `DecoderConfig`: Llama's projections and MLP, laid out
differently.

- One norm a layer, a LayerNorm without bias (`layer_norm`); attention and the MLP both read its
  output and are added to the residual stream together (`parallel_block`); the final norm is a
  LayerNorm too. These run in PyTorch ops, and the C all-layers loop steps aside;
- the sliding layers (`layer_types`, by default three of four) attend within `sliding_window` and
  rotate q and k; the global layers attend to everything without rotary embedding (`rope_layers`);
- the rotation pairs features (2i, 2i + 1): the q/k rows are reordered per head at load into
  rotate-half's halves (`rope_interleaved`), which leaves every score as it was;
- the logits are multiplied by `logit_scale` (`DecoderConfig.logit_scale` divides: its inverse);
  the embeddings are tied.

llama.cpp writes these files as "cohere2" with the q/k rows as the checkpoint has them (interleaved,
ggml's plain rotation), so its GGUF name is marked `permuted_qk`: the GGUF loader reorders them (for
low-bit weights too), and the converted config says so (`pytgi_qk_rows`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.decoder import FULL, SLIDING, DecoderConfig
from pytgi.engine.models.llama import llama_config

ROTATE_HALF = "rotate_half"  # a converted GGUF file's config: its q/k rows are already in that order


def cohere2_config(cfg: dict[str, Any]) -> DecoderConfig:
    if (pct := cfg.get("rotary_pct", 1.0)) != 1.0:  # the Hub's configs carry it (transformers 5 reads none)
        raise UnsupportedModel(
            f"Cohere 2 with a partial rotary embedding (rotary_pct {pct}) is not supported"
        )
    n = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern", 4)
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    window = cfg.get("sliding_window")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    base = llama_config({**cfg, "use_sliding_window": False, "head_dim": hidden // heads})
    bias = bool(cfg.get("attention_bias", False))
    return dataclasses.replace(
        base,
        rms_norm_eps=cfg.get("layer_norm_eps", 1e-5),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        attention_bias=bias,
        o_proj_bias=bias,
        layer_norm=True,
        parallel_block=True,
        rope_interleaved=cfg.get("pytgi_qk_rows") != ROTATE_HALF,
        logit_scale=1.0 / float(cfg.get("logit_scale", 0.0625)),
        sliding_window=int(window) if window and SLIDING in types else None,
        layer_types=list(types) if window and SLIDING in types else None,
        # transformers' Cohere2Attention rotates only where a layer has a window
        rope_layers=[bool(window) and t == SLIDING for t in types],
    )
