"""Any causal LM that transformers implements, run by transformers' own model code inside pytgi's
engine (as vLLM's `--model-impl transformers`): pytgi schedules, batches, caches and samples; the
model's layers are transformers'.

transformers lets a model's attention be a registered function. pytgi registers `pytgi_paged`: it
gets each layer's queries, keys and values (rotary already applied by the model's code), writes keys
and values into pytgi's paged cache and attends with pytgi's attention backend over the step's flat
batch (one sequence of all scheduled tokens, with pytgi's per-request positions). transformers builds
no mask for an attention it does not know, and keeps no cache of its own (`use_cache=False`).

A layer with a `sliding_window` attribute (Mistral, Gemma, ...) attends within it. Not supported:
attention logit soft-capping (Gemma 2), tensor parallelism, and the low-bit CPU kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pytgi.engine.models.attention import StepLayout, TorchAttention, TorchAttentionMetadata
from pytgi.engine.models.backends import get_backend
from pytgi.engine.models.cpu import Kernels

log = logging.getLogger(__name__)
ATTENTION = "pytgi_paged"


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

    def __init__(self, inner: TorchAttention) -> None:
        self.inner = inner

    def prepare(self, layout: StepLayout, device: torch.device) -> StepContext:
        return StepContext(self.inner, layout, device, self.inner.prepare(layout, device))


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function interface: [1, H, T, D] in, [1, T, H, D] out."""
    step: tuple[list, StepContext] | None = kwargs.get("pytgi_step")
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
        self, path: Path, dtype: torch.dtype, device: torch.device, cpu: Kernels, attention: str = "auto"
    ) -> None:
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
