"""A causal LM that transformers implements, run by transformers' own model code inside pytgi's
engine (as vLLM's `--model-impl transformers`): pytgi schedules, batches, caches and samples; the
model's layers are transformers'.

transformers lets a model's attention be a registered function. pytgi registers `pytgi_paged`: it
gets each layer's queries, keys and values (rotary already applied by the model's code), writes keys
and values into pytgi's paged cache and attends with pytgi's attention backend over the step's flat
batch (one sequence of all scheduled tokens, with pytgi's per-request positions). transformers builds
no mask for an attention it does not know, and keeps no cache of its own (`use_cache=False`).

A layer with a `sliding_window` attribute (Mistral, Gemma, ...) attends within it. Not supported:
attention logit soft-capping (Gemma 2), tensor parallelism, and the low-bit CPU kernels.

The fallback checks a model before it serves it (`refusal`, `_probe`): the model's cache layer types
(transformers' own `get_layer_types_and_kwargs`) must all be full or sliding-window attention, and a
4-token forward must call the attention function once per attention layer with no argument the paged
kernel would drop. A recurrent or state-space layer (Qwen3-Next's and Qwen3.5's Gated DeltaNet,
Granite-4.0-H's and OLMo-Hybrid's), attention sinks (gpt-oss's `s_aux`), chunked or sparse attention,
shared KV and soft-capping are refused by name, since this path would serve them wrong without a word:
it keeps no state between steps and joins a step's requests into one sequence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.attention import StepLayout, TorchAttention, TorchAttentionMetadata
from pytgi.engine.models.backends import get_backend
from pytgi.engine.models.cpu import Kernels

log = logging.getLogger(__name__)
ATTENTION = "pytgi_paged"

# the cache layer types this path serves: softmax attention over the paged cache, with or without a window
PLAIN_LAYERS = frozenset({"full_attention", "sliding_attention"})
LAYER_TYPES = {
    "linear_attention": "linear-attention or state-space layers (a recurrent state between steps)",
    "conv": "convolution layers (a state between steps)",
    "hybrid": "hybrid layers (a recurrent state between steps)",
    "hybrid_sliding": "hybrid layers (a recurrent state between steps)",
    "chunked_attention": "chunked attention",
    "indexed_attention": "indexed (sparse) attention",
}
# arguments transformers' layers pass to an attention function that this path honours or that do not
# change attention's result
HARMLESS_ARGS = frozenset(
    {"position_ids", "use_cache", "output_router_logits", "output_attentions", "cache_position"}
    | {"past_key_values", "past_key_value", "sliding_window", "pytgi_step", "is_causal", "softcap"}
)
ARG_NAMES = {"s_aux": "attention sinks (s_aux)", "sinks": "attention sinks"}


@dataclass(slots=True)
class StepContext:
    """What a step's attention calls need; the sliding-window metadata is built the first time a
    layer with that window asks."""

    backend: TorchAttention
    layout: StepLayout
    device: torch.device
    full: TorchAttentionMetadata
    windows: dict[int, TorchAttentionMetadata] = field(default_factory=dict)

    def metadata(self, window: int | None) -> TorchAttentionMetadata:
        if not window or int(self.layout.context_lens.max()) <= window:
            return self.full
        if window not in self.windows:
            self.windows[window] = self.backend.prepare(self.layout, self.device, window=window)
        return self.windows[window]


class _Backend:
    """The runner's view of attention: one `StepContext` per step."""

    # what the runner may ask of a backend (`TorchAttention`'s): neither, for transformers' code (the
    # runner asks only of a family's model)
    captures_decode = False
    fp8_cache = False

    def __init__(self, inner: TorchAttention) -> None:
        self.inner = inner

    def prepare(self, layout: StepLayout, device: torch.device) -> StepContext:
        return StepContext(self.inner, layout, device, self.inner.prepare(layout, device))


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function interface: [1, H, T, D] in, [1, T, H, D] out."""
    step: tuple[list, StepContext] | None = kwargs.get("pytgi_step")
    if isinstance(step, _Probe):
        return step.record(module, query, key, value, scaling, kwargs)
    if step is None:
        raise RuntimeError("the pytgi_paged attention runs only inside pytgi's engine")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by pytgi's attention")
    kv_caches, ctx = step
    k_cache, v_cache = kv_caches[module.layer_idx]
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    meta = ctx.metadata(getattr(module, "sliding_window", None))
    return ctx.backend.forward(q, k, v, k_cache, v_cache, meta, scale).unsqueeze(0), None


class _Probe:
    """The check's forward: records each call's layer and arguments, attends causally with SDPA."""

    def __init__(self) -> None:
        self.calls: list[tuple[int | None, set[str], bool]] = []

    def record(self, module, query, key, value, scaling, kwargs) -> tuple[torch.Tensor, None]:
        extra = {k for k, v in kwargs.items() if k not in HARMLESS_ARGS and v is not None}
        capped = kwargs.get("softcap") is not None or kwargs.get("is_causal") is False
        self.calls.append((getattr(module, "layer_idx", None), extra, capped))
        rep = query.shape[1] // key.shape[1]
        k, v = (t.repeat_interleave(rep, dim=1) for t in (key, value))
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2), None


def _supported(own: tuple[str, ...]) -> str:
    return (
        f"pytgi runs {', '.join(own)} with its own code, and through transformers' "
        "code (--model-impl auto|transformers) causal LMs whose layers are all softmax attention, "
        "full or sliding-window"
    )


def cache_layer_types(text_config) -> list[str]:
    """The kind of cache each layer keeps, as transformers' caches read it from the config."""
    from transformers import cache_utils

    read = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    return list(read(text_config)[0]) if read else list(getattr(text_config, "layer_types", None) or [])


def refusal(hf_config) -> str | None:
    """Why this path cannot serve a model of this config (None: it can), before any weight is read."""
    cfg = hf_config.get_text_config(decoder=True)
    try:
        types = cache_layer_types(cfg)
    except Exception as e:  # noqa: BLE001  # a config transformers' own reader does not understand
        return f"its layer types cannot be read ({type(e).__name__}: {e})"
    if "reuse" in (getattr(cfg, "kv_sharing_modes", None) or []):
        return "some layers reuse another layer's keys and values (shared KV)"
    odd = [t for t in dict.fromkeys(types) if t not in PLAIN_LAYERS | {"dummy"}]
    if odd:
        what = "; ".join(f"{LAYER_TYPES.get(t, repr(t))}: {types.count(t)} of {len(types)}" for t in odd)
        return f"its layers are not all softmax attention ({what})"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "it soft-caps attention logits"
    return None


def _probe(decoder, layers: int, vocab: int, device: torch.device) -> str | None:
    """Why a 4-token forward shows this path would serve the model wrong (None: it would not)."""
    probe = _Probe()
    ids = torch.arange(1, 5, device=device)[None] % max(vocab, 1)
    with torch.no_grad():
        positions = torch.arange(4, device=device)[None]
        decoder(input_ids=ids, position_ids=positions, use_cache=False, pytgi_step=probe)
    extra = sorted({a for _, args, _ in probe.calls for a in args})
    if extra:
        return "its attention takes arguments pytgi's paged attention would drop: " + ", ".join(
            ARG_NAMES.get(a, a) for a in extra
        )
    if any(capped for *_, capped in probe.calls):
        return "its attention is soft-capped or not causal"
    idx = [i for i, *_ in probe.calls]
    if None in idx or len(set(idx)) != len(idx) or len(idx) != layers:
        return (
            f"{len(idx)} attention calls for {layers} attention layers: some layers attend outside "
            "transformers' attention interface (or share one cache layer)"
        )
    return None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _paged_attention)


@dataclass(slots=True)
class TransformersConfig:
    """The facts the runner reads from a model's config."""

    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int


class _LayerShape:
    class _Attn:
        def __init__(self, n_kv: int, head_dim: int) -> None:
            self.n_kv, self.head_dim = n_kv, head_dim

    def __init__(self, n_kv: int, head_dim: int) -> None:
        self.self_attn = self._Attn(n_kv, head_dim)


class TransformersModel(nn.Module):
    def __init__(
        self,
        path: Path,
        dtype: torch.dtype,
        device: torch.device,
        cpu: Kernels,
        attention: str = "auto",
        own: tuple[str, ...] = (),
    ) -> None:
        """own: the architectures pytgi's own code runs (named when a model is refused)."""
        super().__init__()
        try:
            import transformers
        except ImportError:
            raise ImportError(
                "this architecture runs through transformers' model code: pip install transformers"
            ) from None
        from pytgi.engine.distributed import tp_size

        if tp_size() > 1:
            raise ValueError("a model run by transformers' code cannot be sharded (--num-shard 1)")
        _register()
        hf_config = transformers.AutoConfig.from_pretrained(str(path))
        arch = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
        why = refusal(hf_config)
        if why:
            raise UnsupportedModel(f"{arch} ({path.name}) cannot be served: {why}. {_supported(own)}")
        self.hf = (
            transformers.AutoModelForCausalLM.from_pretrained(
                str(path), dtype=dtype, attn_implementation=ATTENTION
            )
            .to(device)  # type: ignore[arg-type]  # transformers' decorator on `to` misleads mypy
            .eval()
        )
        cfg = self.hf.config.get_text_config()
        heads = cfg.num_attention_heads
        self.config = TransformersConfig(
            vocab_size=cfg.vocab_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 2048),
        )
        c = self.config
        self.attention = _Backend(
            get_backend(attention, cpu, (c.num_attention_heads, c.num_key_value_heads, c.head_dim))
        )
        # What the runner sizes the KV cache from: one entry per layer.
        self.layers = [_LayerShape(c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
        self.final_logit_softcapping: float | None = getattr(cfg, "final_logit_softcapping", None)
        attending = sum(1 for t in cache_layer_types(cfg) if t != "dummy") or c.num_hidden_layers
        why = _probe(self.hf.get_decoder(), attending, c.vocab_size, device)
        if why:
            raise UnsupportedModel(f"{arch} ({path.name}) cannot be served: {why}. {_supported(own)}")
        log.info(
            "%s runs through transformers' model code (%s): pytgi does not implement it",
            type(self.hf).__name__,
            path,
        )

    def forward(self, input_ids, positions, kv_caches, meta: StepContext) -> torch.Tensor:
        out = self.hf.get_decoder()(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            pytgi_step=(kv_caches, meta),
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden).float()
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
