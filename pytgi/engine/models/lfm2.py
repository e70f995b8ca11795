"""LFM2 and LFM2-MoE (Liquid AI) read as a `DecoderConfig`: hybrid models whose layers are mostly
short convolutions (`pytgi.engine.models.short_conv`, layer type `conv`), some softmax attention
layers (`full_attention`), with

- attention: Llama's, with per-head RMSNorms of q and k before the rotation (`q_layernorm`,
  `k_layernorm`), no biases, the output projection named `out_proj`;
- norms: plain RMSNorms, `operator_norm` before the mixer, `ffn_norm` before the MLP, and the
  final one named `embedding_norm` (it is applied after the last layer, not to the embeddings);
- the MLP: SwiGLU as `feed_forward.w1` (gate), `w3` (up), `w2` (down); LFM2's width from
  `block_ff_dim` adjusted as transformers adjusts it (`block_auto_adjust_ff_dim`);
- LFM2-MoE: `num_dense_layers` dense MLPs first, then a mixture of experts in every layer, routed by
  sigmoid scores plus a per-expert bias to choose (`feed_forward.expert_bias`, when
  `use_expert_bias`), the chosen scores renormalized (`norm_topk_prob`, their sum plus 1e-6) and
  scaled by `routed_scaling_factor`; no shared expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.engine.models.decoder import CONV, FULL, DecoderConfig, MoEConfig, literal_renames
from pytgi.engine.models.llama import llama_config
from pytgi.engine.models.moe import Routing
from pytgi.engine.models.short_conv import ShortConvConfig

# LFM2's checkpoint names → the decoder's (a GGUF file's come in the decoder's already)
RENAMES = (
    (".conv.conv.weight", ".linear_attn.conv"),
    (".conv.conv.bias", ".linear_attn.conv_bias"),
    (".conv.", ".linear_attn."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.expert_bias", ".mlp.gate.e_score_correction_bias"),
    (".feed_forward.", ".mlp."),
    (".mlp.w1.", ".mlp.gate_proj."),  # the dense MLP's (the experts' w1, w2, w3 are `SparseMoE`'s)
    (".mlp.w3.", ".mlp.up_proj."),
    (".mlp.w2.", ".mlp.down_proj."),
    ("embedding_norm.", "norm."),
)


def _ff_dim(cfg: dict[str, Any]) -> int:
    """LFM2's MLP width: `block_ff_dim` (else `intermediate_size`), with `block_auto_adjust_ff_dim`
    two thirds of it, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`."""
    ff = int(cfg["block_ff_dim"] if "block_ff_dim" in cfg else cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        if (mult := cfg.get("block_ffn_dim_multiplier", 1.0)) is not None:
            ff = int(mult * ff)
            step = int(cfg.get("block_multiple_of", 256))
            ff = step * ((ff + step - 1) // step)
    return ff


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    layers = cfg["num_hidden_layers"]
    if types := cfg.get("layer_types"):
        return [FULL if t == FULL else CONV for t in types]
    # transformers' default: every layer attends where the config names no attention layers
    full = cfg.get("full_attn_idxs")
    full = set(range(layers) if full is None else full)
    return [FULL if i in full else CONV for i in range(layers)]


def lfm2_config(cfg: dict[str, Any]) -> DecoderConfig:
    arch = (cfg.get("architectures") or [""])[0]
    moe = arch == "Lfm2MoeForCausalLM"
    types = _layer_types(cfg)
    tie = cfg["tie_embedding"] if "tie_embedding" in cfg else cfg.get("tie_word_embeddings", True)
    eps = cfg.get("norm_eps", cfg.get("rms_norm_eps", 1e-5))
    plain = {
        **cfg,
        "intermediate_size": int(cfg["intermediate_size"]) if moe else _ff_dim(cfg),
        "rms_norm_eps": eps,
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "sliding_window": None,
        "num_experts": 0,  # (the experts are read below)
        "num_local_experts": 0,
    }
    plain.setdefault("rope_theta", 1000000.0)  # transformers' default for both
    base = llama_config(plain)
    experts = None
    if moe:
        layers = cfg["num_hidden_layers"]
        dense = int(cfg.get("num_dense_layers", 2))
        experts = MoEConfig(
            cfg["num_experts"],
            cfg["num_experts_per_tok"],
            cfg["moe_intermediate_size"],
            bool(cfg.get("norm_topk_prob", True)),
            None,
            [i >= dense for i in range(layers)],
            routing=Routing(
                "sigmoid",
                correction_bias=bool(cfg.get("use_expert_bias", True)),
                scale=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
                norm_eps=1e-6,
            ),
        )
    conv = any(t == CONV for t in types)
    return dataclasses.replace(
        base,
        qk_norm=True,
        moe=experts,
        layer_types=types,
        linear=ShortConvConfig(int(cfg.get("conv_L_cache", 3)), bool(cfg.get("conv_bias", False)))
        if conv
        else None,
        weight_renames=literal_renames(*RENAMES),
    )
