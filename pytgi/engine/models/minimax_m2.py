"""MiniMax-M2 (`MiniMaxM2ForCausalLM`, model_type minimax_m2) read as a `DecoderConfig`: Llama's
layers with

- q and k RMSNorms over each token's whole projection (all heads at once: `qk_norm_whole`), before
  the rotation;
- a rotary embedding on each head's first `rotary_dim` features (rotate_half pairs);
- a mixture of experts in every layer (each expert of `intermediate_size`, Mixtral's
  `block_sparse_moe.experts.{e}.w1/w2/w3` names), routed by sigmoid scores with a correction bias to
  choose (`block_sparse_moe.e_score_correction_bias`), the chosen scores renormalized; no shared expert.

What the published config.json says beyond transformers' config (`scoring_func`, `use_routing_bias`,
`use_qk_norm`, `qk_norm_type`, `shared_intermediate_size`, `attn_type_list`) is read where it departs
from that, and refused where pytgi has no code for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.decoder import DecoderConfig, MoEConfig
from pytgi.engine.models.llama import llama_config
from pytgi.engine.models.moe import Routing


def minimax_m2_config(cfg: dict[str, Any]) -> DecoderConfig:
    layers = cfg["num_hidden_layers"]
    refused = [
        f"{key} {cfg[key]!r}"
        for key, ok in (
            ("scoring_func", lambda v: v == "sigmoid"),
            ("qk_norm_type", lambda v: v == "per_layer"),
            ("shared_intermediate_size", lambda v: not v),
            ("attn_type_list", lambda v: all(t == 1 for t in v)),  # 0: a linear-attention layer
            ("hidden_act", lambda v: v == "silu"),
        )
        if key in cfg and not ok(cfg[key])
    ]
    if refused:
        raise UnsupportedModel(f"MiniMax-M2 with {', '.join(refused)}: pytgi has no code for it")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rotary_dim = cfg.get("rotary_dim") or int(head_dim * (rope.get("partial_rotary_factor") or 1.0))
    base = llama_config({**cfg, "partial_rotary_factor": 1.0, "attention_bias": False})
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    moe = MoEConfig(
        experts,
        cfg["num_experts_per_tok"],
        cfg["intermediate_size"],
        True,  # transformers' router always renormalizes the chosen scores
        None,
        [True] * layers,
        routing=Routing("sigmoid", correction_bias=bool(cfg.get("use_routing_bias", True))),
    )
    qk_norm = bool(cfg.get("use_qk_norm", True))
    return dataclasses.replace(
        base,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        qk_norm=qk_norm,
        qk_norm_whole=qk_norm,
        moe=moe,
        # multi-token-prediction modules, where a checkpoint holds them: not read
        ignored_weights=("mtp.", "model.mtp.", *(f"model.layers.{layers + i}." for i in range(4))),
    )
