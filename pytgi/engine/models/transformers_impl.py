"""A causal LM that transformers implements, run by transformers' own model code inside pytgi's
engine (as vLLM's `--model-impl transformers`): pytgi schedules, batches, caches and samples; the
model's layers are transformers'.

transformers lets a model's attention be a registered function. pytgi registers `pytgi_paged`: it
gets each layer's queries, keys and values (rotary already applied by the model's code), writes keys
and values into pytgi's paged cache and attends with pytgi's attention backend over the step's flat
batch (one sequence of all scheduled tokens, with pytgi's per-request positions). transformers builds
no mask for an attention it does not know, and keeps no cache of its own (`use_cache=False`).

A call's `sliding_window` argument (else the layer's attribute) is its window; `s_aux` sinks go to the
paged kernel; values narrower than keys (latent attention) are padded to the keys' width in the cache.
Not supported: attention logit soft-capping (Gemma 2), tensor parallelism, the low-bit CPU kernels.

The fallback proves a model before it serves it (`refusal`, `_probe`, `_disagreement`): the model's
cache layer types (transformers' own `get_layer_types_and_kwargs`) must all be full or sliding-window
attention; a 4-token forward must call the attention function once per attention layer with no
argument the paged kernel would drop (and gives the shapes the cache is sized from); and a probe past
every window the config declares, in two chunks and a decode on a paged cache of its own, must give
each layer's output as transformers' own forward (SDPA or eager, its own masks) does, within float
noise. A recurrent or state-space layer, chunked or sparse attention, shared KV, soft-capping, layers
that drop their keyword arguments, and any difference the probe finds are refused by name (the first
layer that differs, and where), since this path would serve them wrong without a word.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
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
    | {"s_aux", "sinks"}  # honoured: a learned logit per head in every softmax (gpt-oss)
)
ARG_NAMES: dict[str, str] = {}
# the probe's logits may differ from transformers' by float noise only: relative to each layer's output
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
TOLERANCE_HALF = 0.05  # bfloat16, float16
LOGIT_ROWS = 16  # the probe's last positions whose logits are compared (the second chunk's end, the decode)


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
        raise NoStep("the pytgi_paged attention runs only inside pytgi's engine")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by pytgi's attention")
    kv_caches, ctx = step
    k_cache, v_cache = kv_caches[module.layer_idx]
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    # the window this call asks for wins over the layer's attribute (Exaone 4 sets one on every layer)
    window = (
        kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    )
    meta = ctx.metadata(window)
    width = v.shape[-1]
    if width < k.shape[-1]:  # values narrower than keys (latent attention): the cache's rows are keys'
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - width))
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    extra = {} if sinks is None else {"sinks": sinks.float()}
    out = ctx.backend.forward(q, k, v, k_cache, v_cache, meta, scale, **extra)
    return out[..., :width].unsqueeze(0), None


class NoStep(RuntimeError):
    """The attention function was called without the step (a model whose layers drop the keyword
    arguments its forward was given)."""


class _Probe:
    """The check's forward: records each call's layer and arguments, attends causally with SDPA."""

    def __init__(self) -> None:
        self.calls: list[tuple[int | None, set[str], bool]] = []
        self.shapes: dict[int | None, tuple[int, int]] = {}  # layer → (kv heads, the cache row's width)

    def record(self, module, query, key, value, scaling, kwargs) -> tuple[torch.Tensor, None]:
        extra = {k for k, v in kwargs.items() if k not in HARMLESS_ARGS and v is not None}
        capped = kwargs.get("softcap") is not None or kwargs.get("is_causal") is False
        layer = getattr(module, "layer_idx", None)
        self.calls.append((layer, extra, capped))
        self.shapes[layer] = (key.shape[1], max(key.shape[-1], value.shape[-1]))
        rep = query.shape[1] // key.shape[1]
        k, v = (t.repeat_interleave(rep, dim=1) for t in (key, value))
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2), None


def _supported(own: tuple[str, ...]) -> str:
    return (
        f"pytgi runs {', '.join(own)} with its own code (docs/models.md), and through transformers' "
        "code (--model-impl auto|transformers) causal LMs whose layers are all softmax attention, "
        "full or sliding-window, that it serves as transformers does"
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


def _probe(decoder, layers: int, vocab: int, device: torch.device, probe: _Probe) -> str | None:
    """Why a 4-token forward shows this path would serve the model wrong (None: it would not)."""
    ids = torch.arange(1, 5, device=device)[None] % max(vocab, 1)
    with torch.no_grad():
        positions = torch.arange(4, device=device)[None]
        try:
            decoder(input_ids=ids, position_ids=positions, use_cache=False, pytgi_step=probe)
        except NoStep:
            return (
                "its layers do not pass their keyword arguments on to the attention function, so "
                "transformers' code for it cannot attend over pytgi's paged cache"
            )
        except Exception as e:  # noqa: BLE001  # transformers' own code fails on the probe
            return f"a 4-token forward of transformers' code for it fails ({type(e).__name__}: {e})"
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
    if len(set(probe.shapes.values())) > 1:
        shapes = ", ".join(f"layer {i}: {h}×{d}" for i, (h, d) in sorted(probe.shapes.items()))
        return f"its layers' keys and values differ in shape (kv heads × width: {shapes})"
    return None


def _first(out):
    """A layer's hidden states (transformers' layers return them, or a tuple that starts with them)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _decoder_layers(decoder, n: int) -> nn.ModuleList | None:
    """The decoder's list of `n` layers (`layers`, `h`, `blocks`...: the ModuleList of that length)."""
    for child in decoder.children():
        if isinstance(child, nn.ModuleList) and len(child) == n:
            return child
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
        """own: the families pytgi's own code runs (named when a model is refused)."""
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
        heads = getattr(cfg, "num_attention_heads", None)
        if not heads:
            why = "its config declares no attention heads (not a transformer decoder pytgi can page)"
            raise UnsupportedModel(f"{arch} ({path.name}) cannot be served: {why}. {_supported(own)}")
        attending = sum(1 for t in cache_layer_types(cfg) if t != "dummy") or cfg.num_hidden_layers
        probe = _Probe()
        why = _probe(self.hf.get_decoder(), attending, cfg.vocab_size, device, probe)
        if why:
            raise UnsupportedModel(f"{arch} ({path.name}) cannot be served: {why}. {_supported(own)}")
        # the cache's shape is what the attention calls write (latent attention's keys are wider than
        # its values, and than `head_dim`, which is the rotary part only)
        n_kv, width = next(iter(probe.shapes.values()))
        self.config = TransformersConfig(
            vocab_size=cfg.vocab_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=n_kv,
            head_dim=width,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 2048),
        )
        c = self.config
        self.attention = _Backend(get_backend(attention, cpu, (c.num_attention_heads, n_kv, width)))
        # What the runner sizes the KV cache from: one entry per layer.
        self.layers = [_LayerShape(n_kv, width) for _ in range(c.num_hidden_layers)]
        self.final_logit_softcapping: float | None = getattr(cfg, "final_logit_softcapping", None)
        # a scale the causal LM multiplies its logits by (Cohere's `logit_scale`); the probe checks it
        scale = getattr(self.hf, "logit_scale", None)
        self.logit_scale = float(scale) if isinstance(scale, (int, float)) else None
        try:
            why = self._disagreement(cfg, dtype, device)
        except Exception as e:  # noqa: BLE001  # whatever fails here would fail every request
            why = f"the probe comparing it with transformers' own forward fails ({type(e).__name__}: {e})"
        if why:
            raise UnsupportedModel(f"{arch} ({path.name}) cannot be served: {why}. {_supported(own)}")
        log.info(
            "%s runs through transformers' model code (%s): pytgi does not implement it",
            type(self.hf).__name__,
            path,
        )

    def _disagreement(self, cfg, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why this path's forward differs from transformers' own on a probe that passes every window
        the config declares (None: it does not, past float noise): a prompt in two chunks on a paged
        cache of its own, then one decode, each layer's output against transformers' (SDPA or eager
        attention, its own masks) at every position, each layer given the reference's input to it (so
        16-bit noise does not grow with depth). The first layer that differs is named."""
        windows = [
            w for w in (getattr(cfg, k, None) for k in ("sliding_window", "attention_chunk_size")) if w
        ]
        n = max(24, max((int(w) for w in windows if isinstance(w, int)), default=0) + 16)
        n = min(n, int(getattr(cfg, "max_position_embeddings", None) or n))
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, max(cfg.vocab_size, 4), (n,), generator=gen).to(device)
        decoder = self.hf.get_decoder()
        layers = _decoder_layers(decoder, cfg.num_hidden_layers)
        if layers is None:
            return "its decoder's layers cannot be found to compare them with transformers' own forward"
        inputs: list[list[torch.Tensor]] = [[] for _ in layers]
        seen: list[list[torch.Tensor]] = [[] for _ in layers]
        chunk: list[int] = [0, n]  # the paged run's chunk: its rows of the reference's inputs
        forced: list[torch.Tensor] = []  # the reference's input of each layer (empty: the reference runs)
        heads: list[torch.Tensor] = []  # the paged run's final hidden states, chunk by chunk

        def before(i: int, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            """Each layer's input, and in the paged run the reference's input instead, so that each
            layer is compared on its own (no difference carried over from the layers before it)."""
            states = args[0] if args else kwargs["hidden_states"]
            if not forced:
                inputs[i].append(states.detach()[0])
                return None
            states = forced[i][chunk[0] : chunk[1]][None].to(states.dtype)
            return ((states, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": states})

        hooks = [
            handle
            for i, layer in enumerate(layers)
            for handle in (
                layer.register_forward_pre_hook(lambda _m, a, kw, i=i: before(i, a, kw), with_kwargs=True),
                layer.register_forward_hook(lambda _m, _a, out, i=i: seen[i].append(_first(out).detach()[0])),
            )
        ]
        try:
            with torch.no_grad():
                whole = {
                    "input_ids": ids[None],
                    "position_ids": torch.arange(n, device=device)[None],
                    "use_cache": False,
                }
                for impl, keep in (("sdpa", True), ("sdpa", False), ("eager", True), ("eager", False)):
                    for s in (*seen, *inputs):  # (what a failed try recorded)
                        s.clear()
                    try:
                        self.hf.set_attn_implementation(impl)
                        # the last rows' logits only, where the model takes `logits_to_keep` (a
                        # vocabulary's width a row)
                        out = self.hf(**whole, logits_to_keep=LOGIT_ROWS) if keep else self.hf(**whole)
                        logits = out.logits[0, -LOGIT_ROWS:]
                        break
                    except (ValueError, ImportError, NotImplementedError, TypeError):
                        continue
                else:
                    return "transformers' own attention (sdpa, eager) cannot run it for the probe"
                reference = [torch.cat(s) for s in seen]
                forced.extend(torch.cat(s) for s in inputs)
                for s in seen:
                    s.clear()
                self.hf.set_attn_implementation(ATTENTION)
                block = 16
                blocks = -(-n // block)
                shapes = [(blocks * block, sh.self_attn.n_kv, sh.self_attn.head_dim) for sh in self.layers]
                caches = [
                    (torch.zeros(sh, dtype=dtype, device=device), torch.zeros(sh, dtype=dtype, device=device))
                    for sh in shapes
                ]
                for lo, hi in ((0, n // 2), (n // 2, n - 1), (n - 1, n)):
                    chunk[:] = [lo, hi]
                    layout = StepLayout(
                        query_lens=np.array([hi - lo]),
                        context_lens=np.array([hi]),
                        block_tables=np.arange(blocks, dtype=np.int64)[None],
                        slot_mapping=np.arange(lo, hi, dtype=np.int64),
                        block_size=block,
                    )
                    meta = self.attention.prepare(layout, device)
                    hidden = self.forward(ids[lo:hi], torch.arange(lo, hi, device=device), caches, meta)
                    heads.append(hidden)
                paged = [torch.cat(s) for s in seen]
        finally:
            for h in hooks:
                h.remove()
            self.hf.set_attn_implementation(ATTENTION)
        tolerance = TOLERANCE.get(dtype, TOLERANCE_HALF)
        worst = (0.0, 0, 0)  # the largest relative difference, its layer and position
        for i, (ref, got) in enumerate(zip(reference, paged)):
            ref, got = ref.float(), got.float()
            rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
            rel = torch.nan_to_num(rel, nan=float("inf"))
            at = int(rel.argmax())
            if float(rel[at]) > tolerance:
                return (
                    f"its forward through pytgi's paged attention differs from transformers' own at "
                    f"layer {i} (position {at} of a {n}-token probe: relative difference "
                    f"{float(rel[at]):.3g}, float noise is under {tolerance:g})"
                )
            worst = max(worst, (float(rel[at]), i, at))
        # then what the model makes of its last layer's output: its final norm and head, as pytgi
        # computes the logits, against the whole model's (a head of its own, a scale, a cap)
        with torch.no_grad():
            got = self.compute_logits(torch.cat(heads)[-LOGIT_ROWS:]).float()
        ref = logits.float()
        rel = torch.nan_to_num((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6), nan=float("inf"))
        if float(rel.max()) > tolerance:
            return (
                f"its logits through pytgi's paged attention and LM head differ from transformers' own "
                f"(position {n - len(rel) + int(rel.argmax())} of a {n}-token probe: relative difference "
                f"{float(rel.max()):.3g}, float noise is under {tolerance:g})"
            )
        log.info(
            "its forward equals transformers' own on a %d-token probe (largest relative difference "
            "%.2g, layer %d; logits %.2g)",
            n,
            worst[0],
            worst[1],
            float(rel.max()),
        )
        return None

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
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
