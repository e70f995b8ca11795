"""SmolLM3 read as a `DecoderConfig`: Llama's layers, with no rotary embedding on some of them.

`no_rope_layers` says per layer whether it rotates q and k (1) or not (0: NoPE, by default every
fourth layer); those layers' keys go to the cache as projected (`rope_layers`: the C all-layers loop
steps aside for them). A window, where `use_sliding_window` sets one, is on the layers `layer_types`
names. The embeddings are tied by default.

llama.cpp writes these files as "smollm3" (q/k rows as the checkpoint has them) and keeps the NoPE
layers' pattern in no key of the file: its `smollm3` forward rotates every layer but each fourth,
so the conversion restores `no_rope_layer_interval` 4 (pytgi.core.gguf_convert).
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
