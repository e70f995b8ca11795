"""The families on Mamba-1 mixers (`pytgi.engine.models.mamba1`, a recurrent state per request) read as
`DecoderConfig`s.

- Jamba (AI21's Jamba 1.5/1.7): Llama's layers with Mamba-1 mixers except every `attn_layer_period`-th
  (from `attn_layer_offset`: attention without rotary embedding), a mixture of experts every
  `expert_layer_period`-th (softmax top-k, the chosen weights not renormalized); RMS norms with
  weights on the mixer's dt, B and C.
- Mamba and FalconMamba: Mamba-1 mixers only, one a layer with its own pre-norm and residual
  (`single_mixer`), no attention and no MLP; FalconMamba RMS-norms dt, B and C without weights
  (`mixer_rms_eps`). With no attention layer the KV cache has no bytes: the engine sizes the state
  pool alone (`pytgi.engine.llm_engine._with_states`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.decoder import FULL, MAMBA, DecoderConfig, MoEConfig
from pytgi.engine.models.llama import llama_config
from pytgi.engine.models.mamba1 import PLAIN, WEIGHTED, Mamba1Config

# the convolution's bias beside its weight, as every Mamba checkpoint names it
_CONV_BIAS = (r"\.linear_attn\.conv1d\.bias$", ".linear_attn.conv1d_bias")
# Mamba-1 models without positions of their own have no limit but the KV cache's; this many by default
_MAMBA_POSITIONS = 1 << 16
_NOTIONAL_HEADS = 16


def _dt_rank(value: Any, hidden: int) -> int:
    return math.ceil(hidden / 16) if value in (None, "auto") else int(value)


def _silu(cfg: dict[str, Any], family: str) -> None:
    """The mixer's convolution (and Jamba's MLP) take `hidden_act`: SiLU is what pytgi runs."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{family} with hidden_act {cfg['hidden_act']!r} is not served (SiLU only)")


def jamba_config(cfg: dict[str, Any]) -> DecoderConfig:
    _silu(cfg, "Jamba")
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    attn_period, attn_offset = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
    moe_period, moe_offset = cfg.get("expert_layer_period", 2), cfg.get("expert_layer_offset", 1)
    experts = cfg.get("num_experts", 16)
    kinds = [FULL if i % attn_period == attn_offset else MAMBA for i in range(layers)]
    sparse = [experts > 1 and i % moe_period == moe_offset for i in range(layers)]
    base = llama_config({**cfg, "sliding_window": None, "num_local_experts": 0, "num_experts": 0})
    moe = None
    if any(sparse):
        moe = MoEConfig(
            num_experts=experts,
            top_k=cfg.get("num_experts_per_tok", 2),
            intermediate_size=cfg["intermediate_size"],
            norm_topk=False,  # Jamba's router keeps the softmax's weights of the chosen experts
            shared_intermediate_size=None,
            sparse_layers=sparse,
        )
    return dataclasses.replace(
        base,
        moe=moe,
        layer_types=kinds,
        rope_layers=[False] * layers,  # Jamba's attention has no rotary embedding
        linear=Mamba1Config(
            inner=cfg.get("mamba_expand", 2) * hidden,
            d_state=cfg.get("mamba_d_state", 16),
            dt_rank=_dt_rank(cfg.get("mamba_dt_rank"), hidden),
            conv_kernel=cfg.get("mamba_d_conv", 4),
            conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            proj_bias=bool(cfg.get("mamba_proj_bias", False)),
            bcdt_norms=WEIGHTED,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
        ),
        weight_renames=(
            (r"\.mamba\.", ".linear_attn."),
            (r"\.feed_forward\.", ".mlp."),
            (r"\.pre_ff_layernorm\.", ".post_attention_layernorm."),
            (r"^model\.final_layernorm\.", "model.norm."),
            _CONV_BIAS,
        ),
    )


def mamba_config(cfg: dict[str, Any]) -> DecoderConfig:
    """Mamba's and FalconMamba's (`mixer_rms_eps`: its norms on dt, B and C)."""
    _silu(cfg, "Mamba")
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    falcon = cfg.get("model_type") == "falcon_mamba" or "FalconMambaForCausalLM" in (
        cfg.get("architectures") or ()
    )
    base = llama_config(
        {
            "architectures": cfg.get("architectures"),
            "vocab_size": cfg["vocab_size"],
            "hidden_size": hidden,
            "intermediate_size": 0,
            "num_hidden_layers": layers,
            # no attention layer: notional heads that no layer builds (every layer is Mamba), as many as
            # any --num-shard splits (the backend and the rotary tables are sized from them)
            "num_attention_heads": _NOTIONAL_HEADS,
            "num_key_value_heads": _NOTIONAL_HEADS,
            "head_dim": _NOTIONAL_HEADS,
            "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
            "max_position_embeddings": cfg.get("max_position_embeddings") or _MAMBA_POSITIONS,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
            "attention_bias": False,
        }
    )
    return dataclasses.replace(
        base,
        layer_types=[MAMBA] * layers,
        rope_layers=[False] * layers,
        single_mixer=True,
        linear=Mamba1Config(
            inner=cfg.get("intermediate_size") or cfg.get("expand", 2) * hidden,
            d_state=cfg.get("state_size", 16),
            dt_rank=_dt_rank(cfg.get("time_step_rank"), hidden),
            conv_kernel=cfg.get("conv_kernel", 4),
            conv_bias=bool(cfg.get("use_conv_bias", True)),
            proj_bias=bool(cfg.get("use_bias", False)),
            bcdt_norms=PLAIN if falcon else None,
            norm_eps=cfg.get("mixer_rms_eps", 1e-6),
        ),
        weight_renames=(
            (r"^backbone\.", "model."),
            (r"^model\.embeddings\.", "model.embed_tokens."),
            (r"^model\.norm_f\.", "model.norm."),
            (r"\.layers\.(\d+)\.norm\.", r".layers.\1.input_layernorm."),
            (r"\.layers\.(\d+)\.mixer\.", r".layers.\1.linear_attn."),
            _CONV_BIAS,
        ),
    )
