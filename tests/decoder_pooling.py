"""Tiny random Qwen3 pooling models, saved as their Hugging Face repos are, with all-MiniLM-L6-v2's
tokenizer (its vocabulary: 30522): an embedder (Qwen3-Embedding's layout: the bare `Qwen3Model` under a
`Qwen3ForCausalLM` config, with sentence-transformers' last-token pooling and Normalize), a sequence
classifier (`Qwen3ForSequenceClassification`, a converted Qwen3-Reranker's), and a causal LM to score
pairs by two tokens' logits (Qwen3-Reranker's own)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def qwen3_config(**kw: Any) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **kw,
    )


def _tokenizer(path: Path, minilm: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (minilm / name).is_file():
            shutil.copy(minilm / name, path / name)


def qwen3_embedder(
    path: Path, minilm: Path, seed: int = 0, pooling: str = "lasttoken"
) -> transformers.PreTrainedModel:
    """`pooling`: sentence-transformers' mode, lasttoken (Qwen3-Embedding's), mean_tokens or cls_token."""
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(qwen3_config()).eval()
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    (path / "modules.json").write_text(json.dumps(MODULES))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, f"pooling_mode_{pooling}": True})
    )
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 400}))
    _tokenizer(path, minilm)
    return model


def qwen3_classifier(
    path: Path, minilm: Path, labels: int = 1, seed: int = 1
) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = qwen3_config(pad_token_id=0)
    cfg.num_labels = labels
    model = transformers.Qwen3ForSequenceClassification(cfg).eval()
    model.save_pretrained(path)
    _tokenizer(path, minilm)
    return model


def qwen3_causal(path: Path, minilm: Path, seed: int = 2) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(qwen3_config()).eval()
    model.save_pretrained(path)
    _tokenizer(path, minilm)
    return model
