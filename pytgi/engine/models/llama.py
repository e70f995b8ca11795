"""The Llama family's configs (Llama 2/3, Mistral, Qwen2/2.5/3 and their mixtures of experts, Phi-3,
SmolLM) as `DecoderConfig`s: the model is `pytgi.engine.models.decoder.DecoderModel`."""

from __future__ import annotations

from typing import Any

from pytgi.engine.models.decoder import SLIDING, DecoderConfig, MoEConfig


def moe_config(cfg: dict[str, Any]) -> MoEConfig | None:
    """The sparse MLP of a config with experts (Mixtral, Qwen2-MoE, Qwen3-MoE; Qwen3-Next's)."""
    if not (cfg.get("num_local_experts") or cfg.get("num_experts")):
        return None
    if "moe_intermediate_size" not in cfg:  # Mixtral's experts: the dense MLP's size, no shared one
        return MoEConfig(
            cfg["num_local_experts"],
            cfg["num_experts_per_tok"],
            cfg["intermediate_size"],
            True,
            None,
            [True] * cfg["num_hidden_layers"],
        )
    step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
    experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 5 names Qwen3-MoE's so
    return MoEConfig(
        experts,
        cfg["num_experts_per_tok"],
        cfg["moe_intermediate_size"],
        bool(cfg.get("norm_topk_prob", False)),
        cfg.get("shared_expert_intermediate_size") or None,
        [i not in dense and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"])],
    )


def llama_config(cfg: dict[str, Any]) -> DecoderConfig:
    arch = (cfg.get("architectures") or [""])[0]
    n_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
    # a rotary embedding on each head's first features only (the decoder's `rotary_dim`)
    partial = float(cfg.get("partial_rotary_factor") or (rope or {}).get("partial_rotary_factor") or 1.0)
    if rope and "partial_rotary_factor" in rope:
        rope = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
    max_positions = cfg.get("max_position_embeddings", 2048)
    if rope and rope.get("rope_type", rope.get("type")) == "dynamic":
        # transformers scales the base from max_position_embeddings on: pytgi serves factor times it
        rope = {**rope, "original_max_position_embeddings": max_positions}
        max_positions = int(max_positions * rope["factor"])
    # as transformers reads it: Llama has no window; Qwen's families attend within `sliding_window`
    # only with `use_sliding_window`; the others (Mistral, Mixtral, Phi-3) whenever it is set
    qwen = arch.startswith("Qwen")
    uses_window = arch != "LlamaForCausalLM" and cfg.get("use_sliding_window", not qwen)
    window = cfg.get("sliding_window") if uses_window else None
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    qwen2 = arch.startswith("Qwen2")  # Qwen2 and Qwen2-MoE: biases on q, k, v only
    return DecoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=rope,
        max_position_embeddings=max_positions,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("qkv_bias", True)
        if arch == "Qwen2MoeForCausalLM"
        else cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
        o_proj_bias=cfg.get("attention_bias", False) and not qwen2,
        mlp_bias=cfg.get("mlp_bias", False),
        qk_norm=arch.startswith("Qwen3"),
        attn_scale=head_dim**-0.5,
        moe=moe_config(cfg),
        sliding_window=window,
        layer_types=(cfg.get("layer_types") or [SLIDING] * cfg["num_hidden_layers"]) if window else None,
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
    )
