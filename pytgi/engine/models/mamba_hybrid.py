"""The Mamba-2 hybrids read as `DecoderConfig`s: most layers Mamba-2 mixers (`pytgi.engine.models.mamba2`,
a recurrent state per request), a few softmax attention layers.

- Nemotron-H (NVIDIA Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): each layer is one mixer with its own
  pre-norm and residual (`single_mixer`), named by `hybrid_override_pattern` or `layers_block_type`:
  Mamba-2 (`M`), attention without rotary embedding (`*`), an MLP without a gate, relu² (`-`), or a
  mixture of such experts (`E`: sigmoid router with DeepSeek-V3's correction bias and groups, an
  ungated shared expert). The checkpoint's modules are `backbone.layers.N.mixer.*` whatever the kind.
- Granite-4.0-H (`granitemoehybrid`): Bamba's layers (a Mamba-2 mixer or attention, then the MLP) with
  Granite's four multipliers; the MLP is `shared_mlp` (gate | up in one `input_linear`), beside
  softmax-routed experts (`block_sparse_moe`) where the model has them; attention with RoPE only when
  `position_embedding_type` is "rope" (Granite-4.0-H's own models have none).
- Bamba: Llama's layers with Mamba-2 mixers except at `attn_layer_indices`, RoPE on half of each
  head's features.
- Falcon-H1: attention and a Mamba-2 mixer side by side in every layer (`parallel_mixers`), with its µP
  multipliers folded into the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.decoder import FFN, FULL, MAMBA, DecoderConfig, MoEConfig
from pytgi.engine.models.llama import llama_config
from pytgi.engine.models.mamba2 import Mamba2Config
from pytgi.engine.models.moe import Routing

# what every Mamba-2 checkpoint names alike: the convolution's bias beside its weight
_CONV_BIAS = (r"\.linear_attn\.conv1d\.bias$", ".linear_attn.conv1d_bias")
# the layer kinds as the configs spell them (Nemotron-H's pattern letters, transformers' and the
# original checkpoints' names) → pytgi's; "moe" becomes FFN with experts
_KINDS = {
    "M": MAMBA,
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "*": FULL,
    "attention": FULL,
    "full_attention": FULL,
    "-": FFN,
    "mlp": FFN,
    "E": "moe",
    "moe": "moe",
}


def _limit(value: Any) -> tuple[float, float]:
    """`time_step_limit` as config.json holds it (transformers writes infinity as {"__float__": ...})."""
    if not value:
        return (0.0, float("inf"))
    lo, hi = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in value)
    return (lo, hi)


def _kinds(types: list[str]) -> list[str]:
    try:
        return [_KINDS[t] for t in types]
    except KeyError as e:
        raise UnsupportedModel(f"unknown Mamba-2 hybrid layer kind {e.args[0]!r}") from None


def _mamba(cfg: dict[str, Any]) -> Mamba2Config:
    """Bamba's and Granite-4.0-H's Mamba-2 keys (`mamba_n_heads`, `mamba_d_head`, ...)."""
    heads = cfg["mamba_n_heads"]
    head_dim = cfg.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = cfg.get("mamba_expand", 2) * cfg["hidden_size"] // heads
    return Mamba2Config(
        num_heads=heads,
        head_dim=int(head_dim),
        n_groups=cfg.get("mamba_n_groups", 1),
        d_state=cfg["mamba_d_state"],
        conv_kernel=cfg.get("mamba_d_conv", 4),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        dt_limit=_limit(cfg.get("time_step_limit")),
    )


def nemotron_h_config(cfg: dict[str, Any]) -> DecoderConfig:
    pattern = cfg.get("hybrid_override_pattern")
    given = cfg.get("layers_block_type") or cfg.get("layer_types") or (list(pattern) if pattern else None)
    if not given:
        raise UnsupportedModel("a Nemotron-H config without its layers' kinds (hybrid_override_pattern)")
    kinds = _kinds(given)
    if cfg.get("moe_latent_size"):
        raise UnsupportedModel(
            "Nemotron-H's latent projections of the experts (moe_latent_size) are not served"
        )
    if cfg.get("mamba_hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"Nemotron-H's Mamba activation {cfg['mamba_hidden_act']!r} is not served")
    layers, heads = len(kinds), cfg["num_attention_heads"]
    base = llama_config(
        {
            "architectures": cfg.get("architectures"),
            "vocab_size": cfg["vocab_size"],
            "hidden_size": cfg["hidden_size"],
            "intermediate_size": cfg.get("intermediate_size") or 0,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
            "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
            "attention_bias": False,  # (the config's key exists; the layers have no biases)
            "mlp_bias": cfg.get("mlp_bias", False),
        }
    )
    moe = None
    if "moe" in kinds:
        shared = cfg.get("moe_shared_expert_intermediate_size") if cfg.get("n_shared_experts", 1) else None
        moe = MoEConfig(
            num_experts=cfg.get("n_routed_experts") or cfg["num_local_experts"],
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"],
            norm_topk=bool(cfg.get("norm_topk_prob", True)),
            shared_intermediate_size=shared,
            sparse_layers=[k == "moe" for k in kinds],
            routing=Routing(
                "sigmoid",
                True,
                cfg.get("n_group") or 1,
                cfg.get("topk_group") or 1,
                "top2",
                float(cfg.get("routed_scaling_factor") or 1.0),
            ),
            shared_gate=False,
            activation="relu2",
        )
    kinds = [FFN if k == "moe" else k for k in kinds]
    # each layer's `mixer.` is the module of its kind
    attrs = {MAMBA: "linear_attn", FULL: "self_attn", FFN: "mlp"}
    renames = [(r"^backbone\.", "model."), (r"^model\.embeddings\.", "model.embed_tokens.")]
    renames += [
        (r"^model\.norm_f\.", "model.norm."),
        (r"\.layers\.(\d+)\.norm\.", r".layers.\1.input_layernorm."),
    ]
    for kind, attr in attrs.items():
        if idx := [str(i) for i, k in enumerate(kinds) if k == kind]:
            renames.append((rf"\.layers\.({'|'.join(idx)})\.mixer\.", rf".layers.\1.{attr}."))
    return dataclasses.replace(
        base,
        moe=moe,
        layer_types=kinds,
        rope_layers=[False] * layers,  # no rotary embedding: the Mamba layers give the positions
        single_mixer=True,
        mlp_gated=False,
        activation=cfg.get("mlp_hidden_act", "relu2"),
        linear=Mamba2Config(
            num_heads=cfg["mamba_num_heads"],
            head_dim=cfg["mamba_head_dim"],
            n_groups=cfg.get("n_groups", cfg.get("mamba_n_groups", 1)),
            d_state=cfg["ssm_state_size"],
            conv_kernel=cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4)),
            conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
            proj_bias=bool(cfg.get("use_bias", False)),
            dt_limit=_limit(cfg.get("time_step_limit", cfg.get("mamba_dt_limit"))),
        ),
        ignored_weights=("mtp.", "model.mtp.", "backbone.mtp."),
        weight_renames=(*renames, _CONV_BIAS),
    )


def bamba_config(cfg: dict[str, Any]) -> DecoderConfig:
    layers = cfg["num_hidden_layers"]
    attn = set(cfg.get("attn_layer_indices") or [])
    base = llama_config({**cfg, "sliding_window": None})
    return dataclasses.replace(
        base,
        layer_types=[FULL if i in attn else MAMBA for i in range(layers)],
        linear=_mamba(cfg),
        weight_renames=(
            (r"\.mamba\.", ".linear_attn."),
            (r"\.feed_forward\.", ".mlp."),
            (r"\.pre_ff_layernorm\.", ".post_attention_layernorm."),
            (r"^model\.final_layernorm\.", "model.norm."),
            _CONV_BIAS,
        ),
    )


def granite_hybrid_config(cfg: dict[str, Any]) -> DecoderConfig:
    layers = cfg["num_hidden_layers"]
    kinds = _kinds(cfg.get("layer_types") or cfg.get("layers_block_type") or [MAMBA] * layers)
    if any(k not in (MAMBA, FULL) for k in kinds):
        raise UnsupportedModel(f"Granite-4.0-H layer kinds {sorted(set(kinds))}: mamba and attention only")
    rope = cfg.get("position_embedding_type") == "rope"
    experts = cfg.get("num_local_experts") or 0
    # the dense MLP is `shared_mlp`, of shared_intermediate_size; `intermediate_size` is each expert's
    base = llama_config(
        {
            **cfg,
            "intermediate_size": cfg["shared_intermediate_size"],
            "sliding_window": None,
            "num_local_experts": 0,
        }
    )
    moe = None
    where = ".mlp."
    if experts:
        moe = MoEConfig(
            num_experts=experts,
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["intermediate_size"],
            norm_topk=True,  # the chosen experts' logits softmaxed: the renormalized softmax
            shared_intermediate_size=cfg["shared_intermediate_size"],
            sparse_layers=[True] * layers,
            shared_gate=False,
        )
        where = ".mlp.shared_expert."
    return dataclasses.replace(
        base,
        moe=moe,
        layer_types=kinds,
        rope_layers=None if rope else [False] * layers,
        embed_scale=float(cfg.get("embedding_multiplier") or 1.0),
        attn_scale=float(cfg.get("attention_multiplier") or base.attn_scale),
        residual_scale=float(cfg.get("residual_multiplier") or 1.0),
        logit_scale=float(cfg.get("logits_scaling") or 1.0),
        linear=_mamba(cfg),
        weight_renames=(
            (r"\.mamba\.", ".linear_attn."),
            (r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),
            (r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down_proj"),
            (r"\.block_sparse_moe\.router\.layer\.", ".mlp.gate."),
            (r"\.shared_mlp\.input_linear\.", f"{where}gate_up_proj."),
            (r"\.shared_mlp\.output_linear\.", f"{where}down_proj."),
            _CONV_BIAS,
        ),
    )


def falcon_h1_config(cfg: dict[str, Any]) -> DecoderConfig:
    """Falcon-H1: each layer runs attention (RoPE) and a Mamba-2 mixer side by side on the same normed
    input, both added to the residual stream, then its MLP. Its µP multipliers are folded into the
    weights at load (`DecoderConfig.weight_scales`): the attention's input (on q, k, v) and output
    (o_proj), the keys' (k_proj), the Mamba mixer's input (in_proj) and output (out_proj), the
    per-section `ssm_multipliers` on in_proj's z | x | B | C | dt rows (transformers' `mup_vector`),
    the MLP's gate and down projections; the embeddings and logits are scaled as Granite's are."""
    if cfg.get("hidden_act", "silu") != "silu":  # (the MLP's and the Mamba convolution's)
        raise UnsupportedModel(f"Falcon-H1 with hidden_act {cfg['hidden_act']!r} is not served (SiLU only)")
    if cfg.get("mamba_rms_norm") and cfg.get("mamba_norm_before_gate", True):
        raise UnsupportedModel(
            "Falcon-H1 with its Mamba norm before the gate (mamba_norm_before_gate) is not served"
        )
    hidden, heads = cfg["hidden_size"], cfg["mamba_n_heads"]
    inner = cfg.get("mamba_d_ssm") or cfg.get("mamba_expand", 2) * hidden
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    groups, d_state = cfg.get("mamba_n_groups", 1), cfg["mamba_d_state"]
    layers = cfg["num_hidden_layers"]
    base = llama_config({**cfg, "sliding_window": None, "num_local_experts": 0})
    gate_m, down_m = cfg.get("mlp_multipliers") or (1.0, 1.0)
    z_m, x_m, b_m, c_m, dt_m = cfg.get("ssm_multipliers") or (1.0,) * 5
    ssm_in = float(cfg.get("ssm_in_multiplier") or 1.0)
    attn_in = float(cfg.get("attention_in_multiplier") or 1.0)
    key_m = float(cfg.get("key_multiplier") or 1.0)
    mup = ((inner, z_m), (inner, x_m), (groups * d_state, b_m), (groups * d_state, c_m), (heads, dt_m))

    def every(f: float) -> tuple[tuple[int, float], ...]:
        return ((-1, float(f)),)

    return dataclasses.replace(
        base,
        layer_types=[FULL] * layers,
        parallel_mixers=True,
        embed_scale=float(cfg.get("embedding_multiplier") or 1.0),
        logit_scale=1.0 / float(cfg.get("lm_head_multiplier") or 1.0),
        linear=Mamba2Config(
            num_heads=heads,
            head_dim=head_dim,
            n_groups=groups,
            d_state=d_state,
            conv_kernel=cfg.get("mamba_d_conv", 4),
            conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            proj_bias=bool(cfg.get("mamba_proj_bias", False)),
            dt_limit=_limit(cfg.get("time_step_limit")),
            gate_norm=bool(cfg.get("mamba_rms_norm", False)),
            out_bias=bool(cfg.get("projectors_bias", False)),
        ),
        weight_renames=(
            (r"\.mamba\.", ".linear_attn."),
            (r"\.feed_forward\.", ".mlp."),
            (r"\.pre_ff_layernorm\.", ".post_attention_layernorm."),
            (r"^model\.final_layernorm\.", "model.norm."),
            _CONV_BIAS,
        ),
        weight_scales=(
            (r"\.linear_attn\.in_proj\.weight$", tuple((n, float(m) * ssm_in) for n, m in mup)),
            (r"\.linear_attn\.in_proj\.bias$", tuple((n, float(m)) for n, m in mup)),
            (r"\.linear_attn\.out_proj\.(weight|bias)$", every(cfg.get("ssm_out_multiplier") or 1.0)),
            (r"\.self_attn\.(q|v)_proj\.weight$", every(attn_in)),
            (r"\.self_attn\.k_proj\.weight$", every(attn_in * key_m)),
            (r"\.self_attn\.k_proj\.bias$", every(key_m)),
            (r"\.self_attn\.o_proj\.(weight|bias)$", every(cfg.get("attention_out_multiplier") or 1.0)),
            (r"\.mlp\.gate_proj\.(weight|bias)$", every(gate_m)),
            (r"\.mlp\.down_proj\.(weight|bias)$", every(down_m)),
        ),
    )
