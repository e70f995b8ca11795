"""A pooling model's encoder by its architecture: BERT's family (`encoder.EncoderModel`) or
ModernBERT (`modernbert.ModernEncoder`), loaded from its safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pytgi.core.errors import UnsupportedModel
from pytgi.core.families import ENCODER, family_of
from pytgi.engine.loading.safetensors_dir import iter_safetensors
from pytgi.engine.models.encoder import EncoderModel
from pytgi.engine.models.modernbert import ModernEncoder
from pytgi.engine.models.registry import model_class

Encoder = EncoderModel | ModernEncoder


def load_encoder(path: Path, dtype: torch.dtype) -> Encoder:
    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    family = family_of(arch)
    if family is None or family.kind != ENCODER:
        raise UnsupportedModel(f"{path.name}: {arch} is not one of pytgi's encoders")
    model: Encoder
    with torch.device("cpu"):
        model = model_class(family)(cfg)
    model.load_weights(iter_safetensors(path))
    return model.to(dtype).eval()
