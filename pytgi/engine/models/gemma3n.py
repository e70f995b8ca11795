"""Gemma 3n (text) as a `DecoderConfig`: Gemma 4's attention (q/k norms with weights, values normed
without one, scores not scaled, sliding and full layers with their own RoPE base, the last
`num_kv_shared_layers` layers reading an earlier layer's KV cache) and per-layer inputs, with each
layer's MLP width its own, around the layers what `pytgi.engine.models.altup` adds: AltUp's residual
streams, LAuReL and the first layers' activation sparsity. The norms scale by `weight` in float32.

The multimodal checkpoints (`Gemma3nForConditionalGeneration`, the published E2B and E4B) are served
as text: the language model, the vision and audio towers not read. GGUF files (`gemma3n`, as llama.cpp's
converter writes them) are read by `pytgi.core.gguf_convert._gemma3n`. Refused at load, by name: RoPE
types other than default, an active stream other than the first, and `--num-shard` above 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.distributed import tp_size
from pytgi.engine.models.altup import AltUpConfig
from pytgi.engine.models.decoder import FULL, SLIDING, DecoderConfig, LayerAttention
from pytgi.engine.models.gemma4 import ACTIVATIONS, _kv_sources

VLM_IGNORED = (
    "model.vision_tower.",
    "model.embed_vision.",
    "model.audio_tower.",
    "model.embed_audio.",
)


def _refuse(feature: str) -> UnsupportedModel:
    return UnsupportedModel(f"Gemma 3n: {feature} is not supported by pytgi's own code")


def gemma3n_config(cfg: dict[str, Any]) -> DecoderConfig:
    if tp_size() > 1:
        raise _refuse("tensor parallelism (--num-shard > 1)")
    n = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(n)])
    if unknown := set(types) - {SLIDING, FULL}:
        raise _refuse(f"layer types {', '.join(sorted(unknown))}")
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise _refuse(f"the MLP activation {act!r}")
    rope = cfg.get("rope_parameters") or {}
    local = dict(rope.get(SLIDING) or {})
    full = dict(rope.get(FULL) or {})
    for kind, given in ((SLIDING, local), (FULL, full)):
        if given.get("rope_type", "default") != "default":
            raise _refuse(f"the {kind} layers' rope_type {given.get('rope_type')!r}")
    if int(cfg.get("altup_active_idx", 0)) != 0:
        raise _refuse("an active AltUp stream other than the first (altup_active_idx)")
    inter = cfg.get("intermediate_size", 16_384)
    widths = list(inter) if isinstance(inter, list) else [inter] * n
    sparsity = cfg.get("activation_sparsity_pattern")
    if sparsity is None:
        sparsity = [0.95] * (10 if n > 10 else 0) + [0.0] * (n - (10 if n > 10 else 0))
    elif not isinstance(sparsity, list):
        sparsity = [float(sparsity)] * n
    n_kv, head_dim = cfg.get("num_key_value_heads", 2), cfg.get("head_dim", 256)
    sources = _kv_sources(types, int(cfg.get("num_kv_shared_layers") or 0))
    specs = [
        LayerAttention(num_key_value_heads=n_kv, head_dim=head_dim, kv_source=src, intermediate_size=w)
        for src, w in zip(sources, widths)
    ]
    bias = cfg.get("attention_bias", False)
    return DecoderConfig(
        vocab_size=cfg.get("vocab_size", 262_400),
        hidden_size=cfg["hidden_size"],
        intermediate_size=widths[0],
        num_hidden_layers=n,
        num_attention_heads=cfg.get("num_attention_heads", 8),
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
        rope_scaling=None,
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
        max_position_embeddings=cfg.get("max_position_embeddings", 32_768),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=False,
        qk_norm=True,
        attn_scale=1.0,
        sliding_window=int(cfg.get("sliding_window") or 512),
        layer_types=types,
        activation=ACTIVATIONS[act],
        sandwich_norms=True,
        embed_scale=cfg["hidden_size"] ** 0.5,
        final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0),
        layer_attention=specs,
        v_norm=True,
        per_layer_input_size=int(cfg.get("hidden_size_per_layer_input", 256)),
        per_layer_vocab_size=int(cfg.get("vocab_size_per_layer_input", 262_144)),
        altup=AltUpConfig(
            num_inputs=int(cfg.get("altup_num_inputs", 4)),
            active=0,
            correct_scale=bool(cfg.get("altup_correct_scale", True)),
            laurel_rank=int(cfg.get("laurel_rank", 64)),
            sparsity=tuple(float(p) for p in sparsity),
        ),
    )


def gemma3n_vlm_config(cfg: dict[str, Any]) -> DecoderConfig:
    """A multimodal checkpoint's language model (`model.language_model.*`), served as text."""
    text = dict(cfg.get("text_config") or {})
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return dataclasses.replace(gemma3n_config(text), ignored_weights=VLM_IGNORED)
