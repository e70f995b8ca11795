"""Pooling models (embeddings): what a model directory says it is for, and how it pools (no torch).

A model is served for what its head is (`model_task`): a language-model head generates; an encoder
with no head (BERT, RoBERTa, XLM-RoBERTa) embeds, pooled as its sentence-transformers configuration
says (`modules.json`, `1_Pooling/config.json`, a `Normalize` module, `sentence_bert_config.json`'s
`max_seq_length`); anything else is refused at start, never served as a generator with a random head.
docs/embeddings.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from pytgi.core.errors import UnsupportedModel

# The encoders pytgi runs itself (pytgi.engine.models.encoder), by architecture → family
ENCODERS = {
    "BertModel": "bert",
    "RobertaModel": "roberta",
    "XLMRobertaModel": "roberta",
    "ModernBertModel": "modernbert",
}
# ... and their cross-encoders (a classification head on the first token): scores for pairs, labels
CLASSIFIERS = {
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
    "ModernBertForSequenceClassification": "modernbert",
}
GENERATOR_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
POOLING_METHODS = ("mean", "cls", "last")


class PoolingInfo(msgspec.Struct, frozen=True, kw_only=True):
    """How a pooling model's embeddings are made (in `EngineInfo`, so both processes know)."""

    method: str  # "mean" | "cls" | "last" (sentence-transformers' pooling_mode_*)
    normalize: bool  # the model's own default: a Normalize module after the pooling
    dimensions: int  # the embedding's size (the hidden size)
    max_seq_length: int | None = None  # sentence-transformers' limit, where the model sets one
    labels: tuple[str, ...] = ()  # a classifier's (config.json's id2label, in order); one: a reranker
    # config_sentence_transformers.json's: text put before an input by name (e.g. "query": "query: "),
    # and the one put before every input that names none
    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def model_task(path: Path) -> str:
    """ "generate" or "embed", from config.json's architecture; `UnsupportedModel` for a model that
    is neither (a masked-LM or classification head, say): its head must not be served as a generator."""
    cfg = _read(path / "config.json")
    archs = (cfg or {}).get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None or arch.endswith(GENERATOR_SUFFIXES):
        return "generate"
    if arch in ENCODERS:
        return "embed"
    if arch in CLASSIFIERS:
        return "classify"
    raise UnsupportedModel(
        f"{path.name}: architecture {arch!r} has no language-model head, so it cannot generate, and pytgi "
        f"serves no pooling model of it (embedding models: {', '.join(ENCODERS)}; cross-encoders: "
        f"{', '.join(CLASSIFIERS)}; docs/embeddings.md)"
    )


def read_labels(path: Path) -> PoolingInfo:
    """A cross-encoder's: its labels (id2label, by id), the first token's state classified."""
    cfg = _read(path / "config.json") or {}
    n = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
    id2label = cfg.get("id2label") or {}
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
    return PoolingInfo(method="cls", normalize=False, dimensions=n, labels=labels)


def read_pooling(path: Path, hidden_size: int) -> PoolingInfo:
    """The model's sentence-transformers pooling; without one (a bare encoder), mean pooling and no
    normalization, as sentence-transformers itself defaults to for a plain transformers model."""
    modules = _read(path / "modules.json")
    method, normalize, dims = "mean", False, hidden_size
    if isinstance(modules, list):
        for m in modules:
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Normalize":
                normalize = True
            elif kind == "Pooling":
                method, dims = _pooling_config(path / m.get("path", "1_Pooling") / "config.json", hidden_size)
            elif kind not in ("Transformer", ""):
                raise UnsupportedModel(
                    f"{path.name}: its sentence-transformers module {m.get('type')!r} is not supported "
                    "(Transformer, Pooling and Normalize are)"
                )
    st = _read(path / "sentence_bert_config.json") or {}
    limit = st.get("max_seq_length")
    st_config = _read(path / "config_sentence_transformers.json") or {}
    prompts = {str(k): str(v) for k, v in (st_config.get("prompts") or {}).items()}
    default = st_config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise UnsupportedModel(f"{path.name}: default_prompt_name {default!r} names no prompt")
    return PoolingInfo(
        method=method,
        normalize=normalize,
        dimensions=dims,
        max_seq_length=limit if isinstance(limit, int) and limit > 0 else None,
        prompts=prompts,
        default_prompt_name=default,
    )


def _pooling_config(file: Path, hidden_size: int) -> tuple[str, int]:
    cfg = _read(file) or {}
    if cfg.get("include_prompt") is False:
        raise UnsupportedModel(
            f"{file}: pooling without the prompt's tokens (include_prompt false) is not supported"
        )
    modes = [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    names = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "last"}
    if len(modes) != 1 or modes[0] not in names:
        raise UnsupportedModel(
            f"{file}: pooling {'+'.join(modes) or 'none'} is not supported (one of mean_tokens, cls_token, "
            "lasttoken)"
        )
    return names[modes[0]], int(cfg.get("word_embedding_dimension", hidden_size))
