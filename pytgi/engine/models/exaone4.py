"""Exaone 4 read as a `DecoderConfig`: Llama's projections and MLP, with OLMo 2's norm placement and
Qwen3's q/k norms.

- No norm before attention nor before the MLP: each sublayer's output is normed
  (`post_attention_layernorm`, `post_feedforward_layernorm`) before it joins the residual stream
  (`pre_norms` False: the C all-layers loop steps aside);
- q and k are normed per head before the rotation (`qk_norm`, as Qwen3);
- with a `sliding_window`, the layers `layer_types` (or `sliding_window_pattern`: an int, every
  n-th layer global, or a string such as "LLLG") calls sliding attend within it and rotate, and the
  global layers attend to everything without rotary embedding (`rope_layers`); without a window
  every layer rotates. RoPE may be llama3-scaled.

llama.cpp writes these files as "exaone4" (q/k rows as the checkpoint has them, the output norms as
`post_attention_norm` / `post_ffw_norm`, the window and its pattern as `exaone4.attention.*`, a llama3
scaling as a `rope_freqs` tensor, which pytgi.core.gguf_convert reads back into its parameters).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.engine.models.decoder import FULL, SLIDING, DecoderConfig
from pytgi.engine.models.llama import llama_config


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's attention, as transformers' Exaone4Config derives it."""
    n = cfg["num_hidden_layers"]
    if types := cfg.get("layer_types"):
        return list(types)
    pattern = cfg.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):  # "LLLG": L sliding, G global, repeated
        return [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(n)]
    return [SLIDING if pattern and (i + 1) % pattern else FULL for i in range(n)]


def exaone4_config(cfg: dict[str, Any]) -> DecoderConfig:
    window = cfg.get("sliding_window")
    types = layer_types(cfg) if window else [FULL] * cfg["num_hidden_layers"]
    base = llama_config({**cfg, "use_sliding_window": False})
    return dataclasses.replace(
        base,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        qk_norm=True,
        pre_norms=False,
        sliding_window=int(window) if window and SLIDING in types else None,
        layer_types=types if window and SLIDING in types else None,
        # with a window, the global layers do not rotate (transformers' Exaone4Attention)
        rope_layers=[t == SLIDING for t in types] if window else None,
    )
