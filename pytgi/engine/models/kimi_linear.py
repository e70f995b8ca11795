"""Kimi Linear (`KimiLinearForCausalLM`, model_type kimi_linear) read as a `DecoderConfig`: a hybrid
whose layers are mostly Kimi Delta Attention (`pytgi.engine.models.kda`, layer type
`linear_attention`), one in four (by default) multi-head latent attention (`pytgi.engine.models.mla`)
without a rotary embedding (the rope part of the keys is kept and shared, never rotated: the layers
take the identity's tables), softmax scale (qk_nope + qk_rope) ** -0.5; DeepSeek V3's experts after
the dense first layers (`mlp_layer_types`): sigmoid scores with a correction bias, grouped, renormalized
and scaled, beside ungated shared experts.

Its config.json names several keys its own way (`num_experts`, `num_experts_per_token`,
`num_shared_experts`, `moe_renormalize`, `num_expert_group`, `model_max_length`) and may give the
layers and the KDA sizes in `linear_attn_config` (1-indexed `kda_layers` and `full_attn_layers`,
`head_dim`, `num_heads`, `short_conv_kernel_size`); all read as transformers reads them. A KDA layer's
checkpoint tensors sit under `self_attn.` with the attention layers' (its own forget-gate and
convolution names: `f_a_proj`, `A_log`, `q_conv1d`, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.decoder import FULL, LINEAR, DecoderConfig, literal_renames
from pytgi.engine.models.deepseek import deepseek_config
from pytgi.engine.models.kda import KdaConfig


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k) is not None), default)


def kimi_linear_config(cfg: dict[str, Any]) -> DecoderConfig:
    layers = cfg["num_hidden_layers"]
    lin = cfg.get("linear_attn_config") or {}
    types = cfg.get("layer_types")
    if not types:
        if "full_attn_layers" in lin and "kda_layers" in lin:  # 1-indexed
            full = {i - 1 for i in lin["full_attn_layers"]}
            types = [FULL if i in full else LINEAR for i in range(layers)]
        else:  # transformers' default
            types = [FULL if i and i % 4 == 0 else LINEAR for i in range(layers)]
    dense = int(cfg.get("first_k_dense_replace", 1))
    mlp_types = cfg.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(layers)]
    refused = [
        f"{key} {cfg[key]!r}"
        for key, ok in (
            ("hidden_act", lambda v: v == "silu"),
            ("moe_router_activation_func", lambda v: v == "sigmoid"),
            ("mla_use_nope", lambda v: bool(v)),
        )
        if key in cfg and not ok(cfg[key])
    ]
    if refused:
        raise UnsupportedModel(f"Kimi Linear with {', '.join(refused)}: pytgi has no code for it")
    experts = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    ds = {
        **cfg,
        "architectures": ["DeepseekV3ForCausalLM"],
        "n_routed_experts": experts,
        "num_experts_per_tok": _first(cfg, "num_experts_per_token", "num_experts_per_tok"),
        "n_shared_experts": _first(cfg, "num_shared_experts", "n_shared_experts", default=0),
        "norm_topk_prob": _first(cfg, "moe_renormalize", "norm_topk_prob", default=True),
        "n_group": _first(cfg, "num_expert_group", "n_group", default=1),
        "max_position_embeddings": _first(
            cfg, "model_max_length", "max_position_embeddings", default=1048576
        ),
        "first_k_dense_replace": 0,  # (the MLPs' kinds are `mlp_layer_types`, below)
        "rope_interleave": False,  # (no rotation: the order of the rope features does not matter)
        "rope_parameters": None,
        "rope_scaling": None,
        "num_nextn_predict_layers": 0,
    }
    base = deepseek_config(ds)
    moe = base.moe
    if moe is not None:
        sparse = [t == "sparse" for t in mlp_types]
        moe = dataclasses.replace(moe, sparse_layers=sparse) if any(sparse) else None
    kda = [i for i, t in enumerate(types) if t == LINEAR]
    return dataclasses.replace(
        base,
        moe=moe,
        layer_types=list(types),
        rope_layers=[False] * layers,  # NoPE: the attention layers rotate nothing
        linear=KdaConfig(
            num_heads=int(lin.get("num_heads", cfg.get("linear_num_heads", 32))),
            head_dim=int(lin.get("head_dim", cfg.get("linear_head_dim", 128))),
            conv_kernel=int(lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))),
        )
        if kda
        else None,
        weight_renames=literal_renames(
            *((f"layers.{i}.self_attn.", f"layers.{i}.linear_attn.") for i in kda),
            (".forget_gate.", "."),  # (transformers' runtime names of the forget gate's tensors)
            (".q_conv1d.weight", ".q_conv1d"),
            (".k_conv1d.weight", ".k_conv1d"),
            (".v_conv1d.weight", ".v_conv1d"),
            (".o_norm.weight", ".o_norm"),
        ),
    )
