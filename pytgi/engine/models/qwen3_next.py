"""Qwen3-Next and Qwen3.5 (text) read as a `DecoderConfig`: hybrid models whose layers are mostly
gated DeltaNet linear attention (`pytgi.engine.models.linear_attention`), one in
`full_attention_interval` (4) a softmax attention layer, with

- norms that scale by 1 + weight in float32 (`norm_offset`), q/k norms on the attention heads;
- attention whose output is gated: each query head's projection has a second half, the gate, and
  the output is o · sigmoid(gate) (`attn_output_gate`);
- a rotary embedding on the first quarter of each head's features (`partial_rotary_factor`);
- Qwen3-Next and Qwen3.5-MoE: a sparse mixture of experts with a gated shared expert (Qwen2-MoE's).

The two differ in the linear layers' projections: Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` are
grouped by key head, Qwen3.5 has `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.engine.models.decoder import FULL, LINEAR, DecoderConfig
from pytgi.engine.models.linear_attention import LinearAttnConfig
from pytgi.engine.models.llama import llama_config, moe_config

# checkpoint tensors these models do not use: the multi-token-prediction layers, a VLM's vision tower
IGNORED = ("mtp.", "model.mtp.")
VLM_IGNORED = (*IGNORED, "model.visual.")


def qwen3_5_vlm_config(cfg: dict[str, Any]) -> DecoderConfig:
    """A Qwen3.5 vision-language checkpoint's language model (`model.language_model.*`)."""
    text = dict(cfg.get("text_config") or {})
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    # Qwen3_5ForConditionalGeneration → Qwen3_5ForCausalLM, the MoE's alike
    text["architectures"] = [cfg["architectures"][0].replace("ForConditionalGeneration", "ForCausalLM")]
    return dataclasses.replace(qwen3_next_config(text), ignored_weights=VLM_IGNORED)


def qwen3_next_config(cfg: dict[str, Any]) -> DecoderConfig:
    arch = (cfg.get("architectures") or [""])[0]
    given = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(cfg.get("partial_rotary_factor") or given.get("partial_rotary_factor") or 0.25)
    # Qwen3.5's M-RoPE sections: text positions are the same on every axis, so plain RoPE
    rope = {
        k: v
        for k, v in given.items()
        if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
    }
    if rope.get("rope_type", rope.get("type")) in ("mrope", None, "default"):
        rope = {}
    layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types") or [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    plain = {
        k: v for k, v in cfg.items() if k not in ("partial_rotary_factor", "rope_parameters", "rope_scaling")
    }
    if arch == "Qwen3_5MoeForCausalLM":  # experts in every layer, no dense MLP; the router renormalizes
        plain = {**plain, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
        plain.setdefault("intermediate_size", cfg.get("moe_intermediate_size"))
    if rope:
        plain["rope_parameters"] = rope
    theta = cfg.get("rope_theta") or given.get("rope_theta") or 10000.0
    base = llama_config({**plain, "rope_theta": theta, "attention_bias": cfg.get("attention_bias", False)})
    head_dim = base.head_dim
    layout = cfg.get("linear_layout") or {}  # a GGUF file's, as pytgi's conversion notes it
    moe = None
    if arch != "Qwen3_5ForCausalLM" and (cfg.get("num_experts") or 0) > 0:
        moe = moe_config(plain)
    return dataclasses.replace(
        base,
        intermediate_size=cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or 0,
        qk_norm=True,
        norm_offset=True,
        o_proj_bias=False,
        moe=moe,
        layer_types=types,
        sliding_window=None,
        attn_output_gate=True,
        rotary_dim=int(head_dim * partial),
        ignored_weights=IGNORED,
        linear=LinearAttnConfig(
            num_k_heads=cfg["linear_num_key_heads"],
            num_v_heads=cfg["linear_num_value_heads"],
            k_head_dim=cfg["linear_key_head_dim"],
            v_head_dim=cfg["linear_value_head_dim"],
            conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
            fused_qkvz=arch == "Qwen3NextForCausalLM" and not layout.get("split_qkvz", False),
            grouped_ba=arch == "Qwen3NextForCausalLM",
            tiled_v_heads=bool(layout.get("tiled_v_heads", False)),
        ),
    )
