"""DeepSeek V2 / V3 (and Kimi K2, a `DeepseekV3ForCausalLM`) read as a `DecoderConfig`.

Their layers are Llama's with two differences:

- attention is multi-head latent attention (`pytgi.engine.models.mla`): the KV cache holds each
  token's latent row (`kv_lora_rank` + `qk_rope_head_dim` values a layer, one "head"), and the
  softmax scale is (qk_nope + qk_rope) ** -0.5, times YaRN's mscale(factor, `mscale_all_dim`)²
  where the rotary embedding is scaled (as DeepSeek's reference scales every query feature);
- after `first_k_dense_replace` dense layers, a mixture of experts: `n_routed_experts` routed experts
  (`num_experts_per_tok` a token) beside `n_shared_experts` shared ones (one MLP, ungated). V2 routes
  by softmax scores (`topk_method` greedy, or group_limited_greedy: within the `topk_group` groups of
  the best expert), V3 by sigmoid scores plus `e_score_correction_bias` within the `topk_group` groups
  of the best two experts' sum (`n_group` groups), renormalized by `norm_topk_prob`; both scale the
  weights by `routed_scaling_factor`.

GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`) is V3's layers with a kind of MLP per layer
(`mlp_layer_types`); Mistral 4 (`Mistral4ForCausalLM`) is V3's layers with softmax scores (grouped by
each group's best two) and its queries scaled per position by Llama 4's rule
(`llama_4_scaling_beta`).

The multi-token-prediction layers a checkpoint may carry after its last layer
(`num_nextn_predict_layers`) are not read. Not served (refused by name at load): biases on the
MLPs, an activation other than SiLU, another V2 `topk_method`, a rotary fraction other than the rope
features.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.decoder import DecoderConfig, MoEConfig
from pytgi.engine.models.mla import MLAConfig
from pytgi.engine.models.moe import Routing

log = logging.getLogger(__name__)


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's 0.1 · mscale · ln(factor) + 1 (1 for factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_scale(qk_head_dim: int, rope: dict[str, Any] | None) -> float:
    """MLA's softmax scale: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim)² where the rotary
    embedding is scaled and the config gives `mscale_all_dim` (transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim**-0.5
    kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if rope and kind != "default" and rope.get("mscale_all_dim"):
        scale *= _mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def deepseek_routing(cfg: dict[str, Any], arch: str) -> Routing:
    """V3's router (GLM-4.7-Flash's too): sigmoid scores plus the correction bias, grouped by the sum
    of each group's best two; Mistral 4's: softmax scores grouped so; V2's: softmax scores, grouped by
    each group's best where `topk_method` is group_limited_greedy (greedy: one group). All scale the
    weights by routed_scaling_factor."""
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    n_group, topk_group = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    if arch == "Mistral4ForCausalLM":
        return Routing("softmax", False, n_group, topk_group, "top2", scale)
    if arch != "DeepseekV2ForCausalLM":  # V3's, GLM-4.7-Flash's
        return Routing("sigmoid", True, n_group, topk_group, "top2", scale)
    method = cfg.get("topk_method") or "greedy"
    if method == "greedy":
        return Routing("softmax", False, 1, 1, "max", scale)
    if method == "group_limited_greedy":
        return Routing("softmax", False, n_group, topk_group, "max", scale)
    raise UnsupportedModel(
        f"DeepSeek V2's topk_method {method!r} is not served (greedy, group_limited_greedy)"
    )


def deepseek_moe(cfg: dict[str, Any], arch: str) -> MoEConfig | None:
    """The routed and shared experts after the dense layers (None: a model without experts)."""
    experts, dense = cfg.get("n_routed_experts"), cfg.get("first_k_dense_replace") or 0
    layers, freq = cfg["num_hidden_layers"], cfg.get("moe_layer_freq") or 1
    sparse = [i >= dense and i % freq == 0 for i in range(layers)]
    if arch == "Glm4MoeLiteForCausalLM":  # a kind per layer (its default: one dense layer, then experts)
        sparse = [t == "sparse" for t in cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)]
    if not experts or not any(sparse):
        return None
    inter, shared = cfg["moe_intermediate_size"], cfg.get("n_shared_experts") or 0
    return MoEConfig(
        experts,
        cfg["num_experts_per_tok"],
        inter,
        # V2's router never renormalizes (as transformers' DeepseekV2 reads it)
        arch != "DeepseekV2ForCausalLM" and bool(cfg.get("norm_topk_prob", True)),
        inter * shared or None,
        sparse,
        routing=deepseek_routing(cfg, arch),
        shared_gate=False,  # the shared experts' output is added as it is
    )


def deepseek_config(cfg: dict[str, Any]) -> DecoderConfig:
    arch = (cfg.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
    mistral4 = arch == "Mistral4ForCausalLM"
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{arch}: activation {cfg['hidden_act']!r} is not served (SiLU only)")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel(f"{arch}: biases on the MLPs (mlp_bias) are not served")
    params = cfg.get("rope_parameters") or {}
    rope = cfg.get("rope_scaling") or params or None
    if rope and rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = None
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    nope, rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    # the rotary features: the rope part of a head (Mistral 4 says so as a fraction of the head)
    partial = float(
        params.get("partial_rotary_factor", 1.0 if not mistral4 else rope_dim / (nope + rope_dim))
    )
    if abs(partial * (rope_dim if not mistral4 else nope + rope_dim) - rope_dim) > 1e-6:
        raise UnsupportedModel(f"{arch}: partial_rotary_factor {partial} turns other than the rope features")
    beta = params.get("llama_4_scaling_beta") if mistral4 else None
    if mistral4 and cfg.get(
        "pytgi_llama4_beta_unknown"
    ):  # a `mistral4` GGUF file's (`gguf_convert._mistral4`)
        log.warning(
            "Mistral 4 from a GGUF file: the file holds no llama_4_scaling_beta (how Llama 4's rule "
            "scales queries from position %d on), so only positions below %d are served, where the "
            "scale is 1",
            params["original_max_position_embeddings"],
            cfg["max_position_embeddings"],
        )
    mla = MLAConfig(
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=cfg["v_head_dim"],
        q_lora_rank=cfg.get("q_lora_rank"),
        # V2's rotary is complex-valued on pairs; the others' say so (transformers' default: True)
        rope_interleave=arch == "DeepseekV2ForCausalLM" or cfg.get("rope_interleave", True) is not False,
        llama4_scale=None if not beta else (float(beta), int(params["original_max_position_embeddings"])),
    )
    layers = cfg["num_hidden_layers"]
    mtp = cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0
    return DecoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=1,  # the latent row, one "head" every query head attends to
        head_dim=mla.cache_row,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=rope,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=bool(cfg.get("attention_bias", False)),  # on q_a, kv_a and o
        o_proj_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=False,
        qk_norm=False,
        attn_scale=mla_scale(nope + rope_dim, rope),
        moe=deepseek_moe(cfg, arch),
        rotary_dim=rope_dim,
        mla=mla,
        # the multi-token-prediction layers after the last one
        ignored_weights=tuple(f"model.layers.{i}." for i in range(layers, layers + mtp)),
    )
