"""Gemma 4 (text) as a `DecoderConfig`: Gemma 3's layers (four norms a layer, q/k norms, GELU·up, a
scaled embedding, sliding and full layers with their own RoPE) with what Gemma 4 declares per layer,
as data (`pytgi.engine.models.decoder`):

- the full-attention layers have their own head size (`global_head_dim`) and, where keys are values
  (`attention_k_eq_v`: no v_proj, the keys' projection is the values'), their own kv heads
  (`num_global_key_value_heads`); transformers 5 writes both as `per_layer_config` overrides;
- their RoPE is "proportional": the first `partial_rotary_factor` of the angles turn, over the whole
  head (the rest have frequency 0);
- values are normed per head (RMSNorm without a weight) before they are cached;
- the norms scale by ``weight`` (not Gemma 3's ``1 + weight``), and attention does not scale the
  scores (the q/k norms do: scale 1);
- per-layer inputs (`hidden_size_per_layer_input`, as Gemma 3n): a second embedding table and a
  projection of the embeddings give each layer an input, gated by the layer's output and projected
  back into the residual stream; then each layer's output is multiplied by its `layer_scalar`;
- the last `num_kv_shared_layers` layers read the keys and values of the last earlier layer of their
  kind (its KV cache: they write none, and the cache's budget counts it once), and with
  `use_double_wide_mlp` their MLP is twice as wide;
- the mixture-of-experts block (`enable_moe_block`, gemma-4-26B-A4B: `_moe`), in every layer beside
  the MLP (`MoEConfig.beside_dense`): the router reads the residual stream (RMS-normed without a
  weight, times `router.scale` and 1/√hidden; softmax top-k, renormalized, times the chosen experts'
  `per_expert_scale`), the GELU·up experts `pre_feedforward_layernorm_2` of it; the MLP's and the
  experts' outputs, each normed (`post_feedforward_layernorm_1`, `_2`), are summed.

These run in PyTorch ops where the fused C kernels do not take them (q, k, v, the per-layer input, the
router; the experts in moe.c where they are packed low-bit; the C all-layers loop steps aside). Not
implemented, and refused at load with the feature named: bidirectional attention over all tokens
(`use_bidirectional_attention: "all"`), RoPE types other than default and proportional,
and per-layer overrides of anything but head size and kv heads. Sharded (`--num-shard`), each layer splits
by its own kv heads (so the shards are at most the fewest kv heads of any layer); the per-layer inputs'
table and projection are whole on every rank. A multimodal checkpoint
(`Gemma4ForConditionalGeneration`) is served as text: its language model, the vision and audio towers
not read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.decoder import FULL, SLIDING, DecoderConfig, LayerAttention, MoEConfig
from pytgi.engine.models.moe import Routing

# a multimodal checkpoint's tensors that are not its language model's
VLM_IGNORED = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def _refuse(feature: str) -> UnsupportedModel:
    return UnsupportedModel(f"Gemma 4: {feature} is not supported by pytgi's own code")


def _layer_heads(cfg: dict[str, Any], types: list[str]) -> list[tuple[int, int]]:
    """Each layer's (kv heads, head dim): the config's, with the full layers' overrides
    (`per_layer_config`, as transformers 5 saves them, or `global_head_dim` and, where k == v,
    `num_global_key_value_heads`, as the published config.json files have them)."""
    n_kv, head_dim = cfg.get("num_key_value_heads", 4), cfg.get("head_dim", 256)
    overrides: dict[int, dict[str, Any]] = {}
    given = cfg.get("per_layer_config")
    if given is not None:
        for key, values in given.items():
            if extra := set(values) - {"head_dim", "num_key_value_heads"}:
                raise _refuse(f"a per-layer override of {', '.join(sorted(extra))} (per_layer_config)")
            overrides[int(key)] = values
    else:
        full: dict[str, Any] = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(types) if t == FULL}
    out = []
    for i in range(len(types)):
        o = overrides.get(i, {})
        out.append((int(o.get("num_key_value_heads", n_kv)), int(o.get("head_dim", head_dim))))
    return out


def _kv_sources(types: list[str], shared: int) -> list[int | None]:
    """Each layer's KV source: None for its own cache, else the last layer of its kind before the
    shared ones (transformers' `kv_sharing_modes`)."""
    n = len(types)
    if not shared:
        return [None] * n
    first = n - shared
    if first <= 0:
        raise _refuse("every layer sharing another's keys and values (num_kv_shared_layers = layers)")
    last = {t: i for i, t in enumerate(types[:first])}
    if missing := set(types[first:]) - set(last):
        raise _refuse(f"a shared layer of a kind no earlier layer computes ({', '.join(sorted(missing))})")
    return [None if i < first else last[t] for i, t in enumerate(types)]


def gemma4_config(cfg: dict[str, Any]) -> DecoderConfig:
    if cfg.get("use_bidirectional_attention") == "all":
        raise _refuse('bidirectional attention over all tokens (use_bidirectional_attention: "all")')
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise _refuse(f"the MLP activation {act!r}")
    n = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    types[-1] = FULL  # as transformers forces it
    if unknown := set(types) - {SLIDING, FULL}:
        raise _refuse(f"layer types {', '.join(sorted(unknown))}")
    rope = {**DEFAULT_ROPE, **(cfg.get("rope_parameters") or {})}
    local, full = rope[SLIDING], rope[FULL]
    if local.get("rope_type", "default") != "default":
        raise _refuse(f"the sliding layers' rope_type {local.get('rope_type')!r}")
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise _refuse(f"the full layers' rope_type {kind!r}")
    heads = _layer_heads(cfg, types)
    sources = _kv_sources(types, int(cfg.get("num_kv_shared_layers") or 0))
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    double = bool(cfg.get("use_double_wide_mlp", False))
    inter = cfg.get("intermediate_size", 9216)
    for i, src in enumerate(sources):  # a shared layer reads its source's cache: the same heads
        if src is not None and heads[i] != heads[src]:
            raise _refuse(f"layer {i} reading layer {src}'s keys and values with other heads")
    specs = [
        LayerAttention(
            num_key_value_heads=h[0],
            head_dim=h[1],
            kv_source=src,
            k_eq_v=k_eq_v and t == FULL,
            intermediate_size=2 * inter if double and src is not None else None,
        )
        for h, src, t in zip(heads, sources, types)
    ]
    bias = cfg.get("attention_bias", False)
    per_layer = int(cfg.get("hidden_size_per_layer_input", 256) or 0)
    return DecoderConfig(
        vocab_size=cfg.get("vocab_size", 262_144),
        hidden_size=cfg["hidden_size"],
        intermediate_size=inter,
        num_hidden_layers=n,
        num_attention_heads=cfg.get("num_attention_heads", 8),
        num_key_value_heads=cfg.get("num_key_value_heads", 4),
        head_dim=cfg.get("head_dim", 256),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_scaling=dict(full) if kind == "proportional" else None,
        rope_local_theta=float(local.get("rope_theta", 10_000.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
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
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        layer_attention=specs,
        v_norm=True,
        per_layer_input_size=per_layer,
        per_layer_vocab_size=int(cfg.get("vocab_size_per_layer_input", 262_144)) if per_layer else 0,
        layer_scalar=True,
        moe=_moe(cfg, n, ACTIVATIONS[act]),
    )


def _moe(cfg: dict[str, Any], layers: int, activation: str) -> MoEConfig | None:
    """The mixture-of-experts block (`enable_moe_block`, gemma-4-26B-A4B), in every layer beside its MLP:
    a softmax top-k router over the residual stream (RMS-normed without a weight, times `router.scale`
    and 1/√hidden), its chosen weights renormalized, then times each expert's `per_expert_scale`;
    GELU·up experts (the MLP's activation) over `pre_feedforward_layernorm_2` of the stream."""
    if not cfg.get("enable_moe_block"):
        return None
    return MoEConfig(
        num_experts=int(cfg["num_experts"]),
        top_k=int(cfg["top_k_experts"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk=True,
        shared_intermediate_size=None,
        sparse_layers=[True] * layers,
        routing=Routing(input_norm=True, expert_scale=True),
        activation=activation,
        beside_dense=True,
    )


def gemma4_vlm_config(cfg: dict[str, Any]) -> DecoderConfig:
    """A multimodal checkpoint's language model (`model.language_model.*`), served as text: the vision
    and audio towers and their embedders are not read."""
    text = dict(cfg.get("text_config") or {})
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return dataclasses.replace(gemma4_config(text), ignored_weights=VLM_IGNORED)
