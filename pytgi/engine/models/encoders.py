"""A pooling model's encoder by its architecture: BERT's family (`encoder.EncoderModel`) or
ModernBERT (`modernbert.ModernEncoder`), loaded from its safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pytgi.core.pooling import CLASSIFIERS, ENCODERS
from pytgi.engine.models.encoder import EncoderModel
from pytgi.engine.models.modernbert import ModernEncoder
from pytgi.engine.models.safetensors_files import iter_safetensors

Encoder = EncoderModel | ModernEncoder


def load_encoder(path: Path, dtype: torch.dtype) -> Encoder:
    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    model: Encoder
    with torch.device("cpu"):
        modern = {**ENCODERS, **CLASSIFIERS}.get(arch) == "modernbert"
        model = ModernEncoder(cfg) if modern else EncoderModel(cfg)
    model.load_weights(iter_safetensors(path))
    return model.to(dtype).eval()
