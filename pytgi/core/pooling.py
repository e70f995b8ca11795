"""Pooling models (embeddings): what a model directory says it is for, and how it pools (no torch).

A model is served for what its head is (`model_task`): a language-model head generates; an encoder
with no head (BERT, RoBERTa, XLM-RoBERTa) embeds, pooled as its sentence-transformers configuration
says (`modules.json`, `1_Pooling/config.json`, a `Normalize` module, `sentence_bert_config.json`'s
`max_seq_length`); anything else is refused at start, never served as a generator with a random head.
A causal LM packaged for sentence-transformers (Qwen3-Embedding, gte-Qwen2: a Pooling module) embeds
with its last token's state, and a decoder's `*ForSequenceClassification` scores pairs: both run on
the paged engine (`--task` says otherwise: a causal LM as an embedder, or as a reranker by two tokens'
logits, Qwen3-Reranker's). docs/embeddings.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import msgspec

from pytgi.core.errors import InvalidRequest, UnsupportedModel
from pytgi.core.families import DECODER, ENCODER, FAMILIES
from pytgi.core.sampling_params import check_token_ids

# The pooling architectures, from the family registry (pytgi.core.families): an encoder's embedders
# and cross-encoders (pytgi.engine.pooling.encoder_engine runs them), and a decoder's bare model (an
# embedder) and sequence classifier (a score head on its last token), which the paged engine runs as
# its causal LM
ENCODERS = frozenset(a for f in FAMILIES if f.kind == ENCODER for a in f.embedders)
CLASSIFIERS = frozenset(a for f in FAMILIES if f.kind == ENCODER for a in f.classifiers)
DECODER_EMBEDDERS = frozenset(a for f in FAMILIES if f.kind == DECODER for a in f.embedders)
DECODER_CLASSIFIERS = frozenset(a for f in FAMILIES if f.kind == DECODER for a in f.classifiers)
GENERATOR_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
POOLING_METHODS = ("mean", "cls", "last")
TASKS = ("auto", "generate", "embed", "classify")  # --task


class PoolingInfo(msgspec.Struct, frozen=True, kw_only=True):
    """How a pooling model's embeddings are made (in `EngineInfo`, so both processes know)."""

    method: str  # "mean" | "cls" | "last" (sentence-transformers' pooling_mode_*)
    normalize: bool  # the model's own default: a Normalize module after the pooling
    dimensions: int  # the embedding's size (the hidden size)
    max_seq_length: int | None = None  # sentence-transformers' limit, where the model sets one
    labels: tuple[str, ...] = ()  # a classifier's (config.json's id2label, in order); one: a reranker
    # a causal LM scoring by its logits (--classifier-tokens): the negative and the positive token's ids;
    # the one label's logit is the positive's minus the negative's
    label_token_ids: tuple[int, ...] = ()
    # a one-label cross-encoder's score from its logit (sentence-transformers' activation_fn): "sigmoid"
    # (its default) or "identity" (the logit itself)
    activation: str = "sigmoid"
    # config_sentence_transformers.json's: text put before an input by name (e.g. "query": "query: "),
    # and the one put before every input that names none
    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def architecture(path: Path) -> str | None:
    archs = (_read(path / "config.json") or {}).get("architectures") or []
    return archs[0] if archs else None


def is_encoder(path: Path) -> bool:
    """Whether the model is one of pytgi's encoders (pytgi.engine.pooling.encoder_engine runs it; a
    decoder's pooling runs on the paged engine)."""
    arch = architecture(path)
    return arch in ENCODERS or arch in CLASSIFIERS


def _has_pooling(path: Path) -> bool:
    """Whether the model is packaged for sentence-transformers with a pooling module."""
    modules = _read(path / "modules.json")
    return isinstance(modules, list) and any(
        str(m.get("type", "")).rsplit(".", 1)[-1] == "Pooling" for m in modules if isinstance(m, dict)
    )


def model_task(path: Path, task: str = "auto") -> str:
    """ "generate", "embed" or "classify": what the model serves, from config.json's architecture and
    its sentence-transformers files (`task` "auto"), or as `--task` asks where the model can;
    `UnsupportedModel` for a model that can serve none (a masked-LM head, say): its head must not be
    served as a generator."""
    if task not in TASKS:
        raise UnsupportedModel(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    arch = architecture(path)
    if arch in ENCODERS or arch in CLASSIFIERS or arch in DECODER_EMBEDDERS or arch in DECODER_CLASSIFIERS:
        own = "embed" if arch in ENCODERS or arch in DECODER_EMBEDDERS else "classify"
        if task not in ("auto", own):
            raise UnsupportedModel(f"{path.name}: a {arch} serves --task {own}, not {task}")
        return own
    if arch is None or arch.endswith(GENERATOR_SUFFIXES):
        if task != "auto":
            return task
        return "embed" if _has_pooling(path) else "generate"
    raise UnsupportedModel(
        f"{path.name}: architecture {arch!r} has no language-model head, so it cannot generate, and pytgi "
        "serves no pooling model of it (embedding models: "
        f"{', '.join(sorted(ENCODERS | DECODER_EMBEDDERS))} and causal LMs with a sentence-transformers "
        f"Pooling module; cross-encoders: {', '.join(sorted(CLASSIFIERS | DECODER_CLASSIFIERS))}; "
        "docs/embeddings.md)"
    )


def read_labels(path: Path) -> PoolingInfo:
    """A cross-encoder's: its labels (id2label, by id), the first token's state classified (an
    encoder's) or the last one's (a decoder's)."""
    cfg = _read(path / "config.json") or {}
    n = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
    id2label = cfg.get("id2label") or {}
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
    decoder = architecture(path) in DECODER_CLASSIFIERS
    return PoolingInfo(
        method="last" if decoder else "cls",
        normalize=False,
        dimensions=n,
        labels=labels,
        activation=_activation(path, cfg),
    )


ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}


def _activation(path: Path, cfg: dict[str, Any]) -> str:
    """sentence-transformers' CrossEncoder activation, as it saves it in config.json (v4+:
    `sentence_transformers.activation_fn`; before: `sbert_ce_default_activation_function`)."""
    st = cfg.get("sentence_transformers")
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or cfg.get(
        "sbert_ce_default_activation_function"
    )
    if not name:
        return "sigmoid"
    short = str(name).rsplit(".", 1)[-1]
    if short not in ACTIVATIONS:
        raise UnsupportedModel(
            f"{path.name}: the cross-encoder's activation {name!r} is not supported (Sigmoid, Identity)"
        )
    return ACTIVATIONS[short]


class PoolTarget(Protocol):
    """What `check_pool_request` reads of an engine's `EngineInfo` (pytgi.core.config)."""

    @property
    def task(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_input_tokens(self) -> int: ...
    @property
    def pooling(self) -> PoolingInfo | None: ...


class PoolAsk(Protocol):
    """What it reads of a request's `PoolParams` (pytgi.core.protocol)."""

    @property
    def tokens(self) -> bool: ...
    @property
    def dimensions(self) -> int | None: ...
    @property
    def pair_at(self) -> int | None: ...


def check_pool_request(info: PoolTarget, prompt_ids: list[int], params: PoolAsk) -> None:
    """An engine's checks of a pooling request (`EngineInfo`, the prompt, `PoolParams`): `InvalidRequest`."""
    if not prompt_ids:
        raise InvalidRequest("the input is empty", "inputs")
    if len(prompt_ids) > info.max_input_tokens:
        raise InvalidRequest(
            f"the input has {len(prompt_ids)} tokens, more than the {info.max_input_tokens} this model takes",
            "inputs",
            "context_length_exceeded",
        )
    check_token_ids(prompt_ids, info.vocab_size)
    if params.pair_at is not None and not 0 < params.pair_at < len(prompt_ids):
        raise InvalidRequest(f"pair_at must be in 1..{len(prompt_ids) - 1}, got {params.pair_at}")
    if info.task == "classify" and (params.tokens or params.dimensions is not None):
        raise InvalidRequest("a cross-encoder's answer is its labels' scores: no token states, no dimensions")
    dims = params.dimensions
    pooling = info.pooling
    assert pooling is not None, "a pooling model's engine knows its pooling"
    if dims is not None and not 0 < dims <= pooling.dimensions:
        raise InvalidRequest(f"dimensions must be in 1..{pooling.dimensions}, got {dims}", "dimensions")


def token_labels(path: Path, tokens: tuple[int, ...], names: tuple[str, ...]) -> PoolingInfo:
    """A causal LM as a reranker (Qwen3-Reranker): one label, the positive token's logit minus the
    negative's at the last position (its sigmoid: the positive token's probability of the two)."""
    if len(tokens) != 2:
        raise UnsupportedModel(
            f"{path.name}: --classifier-tokens takes two tokens, the negative then the positive (no,yes)"
        )
    return PoolingInfo(
        method="last",
        normalize=False,
        dimensions=1,
        labels=(names[1],),
        label_token_ids=tokens,
    )


def read_pooling(path: Path, hidden_size: int, decoder: bool = False) -> PoolingInfo:
    """The model's sentence-transformers pooling; without one, for a bare encoder mean pooling and no
    normalization, as sentence-transformers itself defaults to for a plain transformers model, and for
    a causal LM its last token's state, normalized (vLLM's default). `decoder`: a causal LM's, computed
    chunk by chunk on the paged engine (pytgi.engine.pooling.head)."""
    modules = _read(path / "modules.json")
    method, normalize, dims = ("last", True, hidden_size) if decoder else ("mean", False, hidden_size)
    if decoder and isinstance(modules, list):
        normalize = False  # the modules say
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
