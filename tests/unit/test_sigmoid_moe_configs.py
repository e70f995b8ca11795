"""GLM-4.5 MoE's and MiniMax-M2's config readers: what they read into a `DecoderConfig`, and what they
refuse by name (published config.json keys pytgi has no code for)."""

from __future__ import annotations

import pytest

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.glm4_moe import glm4_moe_config
from pytgi.engine.models.minimax_m2 import minimax_m2_config
from pytgi.engine.models.moe import Routing

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
)
# GLM-4.5-Air's published config.json, shrunk (num_nextn_predict_layers, top-level partial_rotary_factor)
GLM = dict(
    COMMON,
    architectures=["Glm4MoeForCausalLM"],
    intermediate_size=96,
    attention_bias=True,
    partial_rotary_factor=0.5,
    rope_theta=1000000,
    use_qk_norm=False,
    first_k_dense_replace=1,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
)
# MiniMax-M2's published config.json keys (remote code's), shrunk
MINIMAX = dict(
    COMMON,
    architectures=["MiniMaxM2ForCausalLM"],
    intermediate_size=48,
    num_local_experts=4,
    num_experts_per_tok=2,
    rotary_dim=16,
    rope_theta=5000000,
    scoring_func="sigmoid",
    use_routing_bias=True,
    use_qk_norm=True,
    qk_norm_type="per_layer",
    shared_intermediate_size=0,
    attn_type_list=[1, 1, 1, 1],
)


def test_glm_reads_its_router_rotary_and_dense_layers():
    cfg = glm4_moe_config(GLM)
    assert cfg.rotary_dim == 16 and cfg.attention_bias and not cfg.o_proj_bias and not cfg.qk_norm
    assert cfg.rope_theta == 1000000.0
    assert cfg.moe is not None and cfg.moe.sparse_layers == [False, True, True, True]
    assert cfg.moe.routing == Routing("sigmoid", correction_bias=True)
    assert cfg.moe.shared_intermediate_size == 48 and not cfg.moe.shared_gate
    assert "model.layers.4." in cfg.ignored_weights  # the MTP layer after the model's
    grouped = glm4_moe_config({**GLM, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5})
    assert grouped.moe is not None
    assert grouped.moe.routing == Routing("sigmoid", correction_bias=True, n_group=4, topk_group=2, scale=2.5)
    # transformers 5 writes the factor into rope_parameters; a GGUF file gives rotary_dim itself
    moved = {k: v for k, v in GLM.items() if k not in ("partial_rotary_factor", "rope_theta")}
    moved["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert glm4_moe_config(moved).rotary_dim == 8
    assert glm4_moe_config({**GLM, "rotary_dim": 8}).rotary_dim == 8


def test_minimax_reads_its_whole_projection_norms_and_router():
    cfg = minimax_m2_config(MINIMAX)
    assert cfg.qk_norm_whole and cfg.qk_norm and cfg.rotary_dim == 16
    assert cfg.moe is not None and cfg.moe.intermediate_size == 48 and cfg.moe.norm_topk
    assert cfg.moe.routing == Routing("sigmoid", correction_bias=True)
    assert cfg.moe.sparse_layers == [True] * 4 and cfg.moe.shared_intermediate_size is None
    assert minimax_m2_config({**MINIMAX, "rotary_dim": 32}).rotary_dim is None  # all of each head


@pytest.mark.parametrize(
    "key, value",
    [
        ("scoring_func", "softmax"),
        ("qk_norm_type", "per_head"),
        ("shared_intermediate_size", 128),
        ("attn_type_list", [0, 1, 1, 1]),
        ("hidden_act", "gelu"),
    ],
)
def test_minimax_refuses_what_it_has_no_code_for(key, value):
    with pytest.raises(UnsupportedModel, match=key):
        minimax_m2_config({**MINIMAX, key: value})


@pytest.mark.parametrize("key, value", [("hidden_act", "gelu"), ("expert_gating_func", 1)])
def test_glm_refuses_what_it_has_no_code_for(key, value):
    with pytest.raises(UnsupportedModel, match=key):
        glm4_moe_config({**GLM, key: value})
