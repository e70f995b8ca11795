"""GLM-4.5 / GLM-4.6 / GLM-4.7 (`Glm4MoeForCausalLM`, model_type glm4_moe) read as a `DecoderConfig`:
Llama's layers with

- biases on q, k and v (not on the output projection), optional per-head q/k RMSNorms
  (`use_qk_norm`);
- a rotary embedding on each head's first `partial_rotary_factor` of features (half by default),
  its pairs split in halves (rotate_half) as in Llama;
- dense MLPs in the first `first_k_dense_replace` layers, then a mixture of experts routed by
  sigmoid scores with DeepSeek-V3's correction bias (`mlp.gate.e_score_correction_bias`, to choose),
  grouped selection (`n_group`, `topk_group`), renormalized (`norm_topk_prob`) and scaled
  (`routed_scaling_factor`), beside `n_shared_experts` ungated shared experts (one MLP).

The checkpoints' multi-token-prediction layers (`num_nextn_predict_layers`, stored as
`model.layers.{num_hidden_layers + i}.*`) are not read. From a GGUF file (`glm4moe`) the same keys
come from the registry entry's metadata map (`rotary_dim` from `rope.dimension_count`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.decoder import DecoderConfig, MoEConfig
from pytgi.engine.models.llama import llama_config
from pytgi.engine.models.moe import Routing

SIGMOID = 2  # llama.cpp's expert_gating_func for sigmoid scores (a GGUF file's)


def glm4_moe_config(cfg: dict[str, Any]) -> DecoderConfig:
    layers = cfg["num_hidden_layers"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"GLM-4.5 MoE with hidden_act {cfg['hidden_act']!r}: pytgi runs SiLU only")
    if cfg.get("expert_gating_func", SIGMOID) != SIGMOID:
        raise UnsupportedModel(
            f"GLM-4.5 MoE with expert_gating_func {cfg['expert_gating_func']}: sigmoid only"
        )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5
    base = llama_config(
        {**cfg, "partial_rotary_factor": partial, "attention_bias": cfg.get("attention_bias", False)}
    )
    if cfg.get("rotary_dim"):  # a GGUF file's rope.dimension_count
        base = dataclasses.replace(base, rotary_dim=int(cfg["rotary_dim"]))
    experts, dense = cfg["n_routed_experts"], cfg.get("first_k_dense_replace", 1)
    shared = cfg.get("n_shared_experts") or 0
    routing = Routing(
        "sigmoid",
        correction_bias=True,
        n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1,
        scale=float(cfg.get("routed_scaling_factor", 1.0)),
    )
    moe = MoEConfig(
        experts,
        cfg["num_experts_per_tok"],
        cfg["moe_intermediate_size"],
        bool(cfg.get("norm_topk_prob", True)),
        cfg["moe_intermediate_size"] * shared or None,
        [i >= dense for i in range(layers)],
        routing=routing,
        shared_gate=False,
    )
    mtp = int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0)
    return dataclasses.replace(
        base,
        o_proj_bias=False,
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        moe=moe,
        ignored_weights=tuple(f"model.layers.{layers + i}." for i in range(max(mtp, 1))),
    )
