"""SmolLM3 read as a `DecoderConfig`: Llama's layers, with no rotary embedding on some of them.

`no_rope_layers` says per layer whether it rotates q and k (1) or not (0: NoPE, by default every
fourth layer); those layers' keys go to the cache as projected (`rope_layers`: they rotate by the
identity's tables, and the C all-layers loop runs them in calls of their own). A window, where
`use_sliding_window` sets one, is on the layers `layer_types` names. The embeddings are tied by
default.

llama.cpp writes these files as "smollm3" (a "llama" file's interleaved q/k rows) and keeps the NoPE
layers' pattern in no key of the file: its `smollm3` forward rotates every layer but each fourth,
as this reader's default `no_rope_layer_interval` 4 does for a converted file's config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.engine.models.decoder import DecoderConfig
from pytgi.engine.models.llama import llama_config


def smollm3_config(cfg: dict[str, Any]) -> DecoderConfig:
    n = cfg["num_hidden_layers"]
    rope = cfg.get("no_rope_layers")
    if rope is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        rope = [int((i + 1) % interval != 0) for i in range(n)]
    if len(rope) != n:
        raise ValueError(f"no_rope_layers has {len(rope)} entries for {n} layers")
    base = llama_config(cfg)
    return dataclasses.replace(
        base,
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        rope_layers=None if all(rope) else [bool(r) for r in rope],
    )
