"""GGUF files of the families beyond Llama/Qwen/Gemma (Mixtral, Qwen2-MoE, Qwen3-MoE, Phi-3, Granite,
gpt-oss, GLM-4.5 MoE, MiniMax-M2, DeepSeek V2/V3, the dense families of issue 63, Gemma 3n and 4): a tiny
random transformers model is written out as llama.cpp's converter writes it (tensor names, q/k row
interleaving, experts stacked per kind, Phi-3's fused tensors, the metadata keys, GLM-4.5's MTP block
after its layers), pytgi converts and serves the file, and its logits equal transformers' on the
original model (fp32).

The layout below was checked against files that llama.cpp's own `convert_hf_to_gguf.py` made from
such models (docs/models.md says how). Checked on 2026-12-07 with the llama-cpp-python 0.3.36 sdist's
converter (`--outtype f32`, 4-layer models with SmolLM2's tokenizer), pytgi serving each file with
transformers' logits:
- SmolLM3: tensor names and metadata as written here, q/k rows interleaved (no key for the NoPE
  layers), `tokenizer.ggml.pre` "smollm" (SmolLM2's tokenizer; SmolLM3's own is Llama 3's);
- OLMo 2 and OLMo 3 ("olmo2"; OLMo 3 with an 8-token window and YaRN on its full layers): the output
  norms as `post_attention_norm` / `post_ffw_norm`, q/k rows as the checkpoint has them, the window,
  its pattern, `rope.freq_base_swa` and YaRN's keys as written here;
- Exaone 4 (window 8 on three layers of four, llama3 scaling): as OLMo's plus per-head q/k norms,
  the llama3 scaling as a `rope_freqs.weight` of divisors (pytgi reads the scaling back from them);
- Seed-OSS (with an output bias): Llama's names but the MLP's input norm as `post_attention_norm`,
  q/k rows as the checkpoint has them, the biases as `attn_{q,k,v,output}.bias`;
- Cohere 2: Llama's names (one `attn_norm` a layer, no `ffn_norm`), q/k rows as the checkpoint has
  them (ggml's plain rotation pairs features as Cohere does), `logit_scale`, the window, no pattern
  key (llama.cpp's is every 4th layer global), `attention.layer_norm_epsilon`, zero biases dropped
  (others refused), no `output.weight` (tied). The converter needs `rotary_pct` in config.json
  (the Hub's configs have it; a tiny transformers 5 one was given 1.0);
- Gemma 4 with experts (test_tiny_models' "gemma4-moe" at Gemma 3 270m's vocabulary and tokenizer,
  checked the same way on 2026-12-07): `ffn_gate_up_exps` [E, 2I, H] and `ffn_down_exps` as
  transformers stacks them, the router as `ffn_gate_inp.weight` and its scale `ffn_gate_inp.scale`,
  the per-expert scale as `ffn_down_exps.scale`, the norms `pre_ffw_norm_2`, `post_ffw_norm_1`,
  `post_ffw_norm_2`, and `expert_count` / `expert_used_count` / `expert_feed_forward_length`;
- Gemma 3n (test_tiny_models' "gemma3n" at SmolLM2's vocabulary and tokenizer, checked the same way on
  2026-12-07): `altup_proj` and `altup_unembd_proj` stacked [3, H, H], the layers' `altup_*` and
  `laurel_*` tensors, `altup_correct_scale.weight`, no k/v in the shared layers, the norms as they are,
  `feed_forward_length` per layer, `activation_sparsity_scale` as normal quantiles (−inf for none);
- Mistral 4 ("mistral4", from a `Mistral3ForConditionalGeneration` config.json whose `text_config` is
  `MISTRAL4`'s, the weights under `model.language_model.`): the same `mistral4.*` keys and values and
  the same tensors, byte for byte, as `write_gguf` writes (no beta, no gating function, gate|up whole)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.model_files import resolve_model
from pytgi.engine.execution.runner import ModelRunner
from pytgi.engine.models.decoder import DecoderModel
from tests.model.test_tiny_models import CONFIGS as TINY

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # (some families' defaults are past 97)
FAMILIES = {
    "mixtral": (
        "llama",
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(BASE, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2moe": (
        "qwen2moe",
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            BASE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        ),
    ),
    "qwen3moe": (
        "qwen3moe",
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            BASE,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
        ),
    ),
    "phi3": ("phi3", transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(BASE, pad_token_id=0)),
    "granite": (
        "granite",
        transformers.GraniteConfig,
        transformers.GraniteForCausalLM,
        {**dict(TINY["granite"][1]), "tie_word_embeddings": False},
    ),
    # four layers: llama.cpp's smollm3 forward leaves every fourth without rotary embedding (no key
    # in the file says so), as SmolLM3's default no_rope_layers does; q/k rows interleaved
    "smollm3": (
        "smollm3",
        transformers.SmolLM3Config,
        transformers.SmolLM3ForCausalLM,
        dict(BASE, **TINY_IDS, num_hidden_layers=4),
    ),
    "olmo2": ("olmo2", transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(BASE, **TINY_IDS)),
    # OLMo 3 as "olmo2" with windows: three 8-token sliding layers of four, YaRN on the full one
    "olmo3": (
        "olmo2",
        transformers.Olmo3Config,
        transformers.Olmo3ForCausalLM,
        dict(
            BASE,
            **TINY_IDS,
            num_hidden_layers=4,
            sliding_window=8,
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "attention_factor": 1.25,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # Exaone 4: three 8-token sliding layers of four, the global one without RoPE, llama3 scaling
    # (as llama.cpp's rope_freqs divisors)
    "exaone4": (
        "exaone4",
        transformers.Exaone4Config,
        transformers.Exaone4ForCausalLM,
        dict(
            BASE,
            **TINY_IDS,
            num_hidden_layers=4,
            head_dim=32,
            sliding_window=8,
            sliding_window_pattern=4,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    # Seed-OSS: biases on q, k, v and the output (its MLP's input norm as `post_attention_norm`)
    "seed_oss": (
        "seed_oss",
        transformers.SeedOssConfig,
        transformers.SeedOssForCausalLM,
        dict(BASE, **TINY_IDS, head_dim=32, attention_out_bias=True),
    ),
    # Cohere 2: three 8-token sliding layers of four (llama.cpp's fixed pattern), q/k rows as the
    # checkpoint pairs them (interleaved), LayerNorms, scaled logits, tied embeddings
    "cohere2": (
        "cohere2",
        transformers.Cohere2Config,
        transformers.Cohere2ForCausalLM,
        dict(
            BASE, **TINY_IDS, num_hidden_layers=4, sliding_window=8, logit_scale=0.3, tie_word_embeddings=True
        ),
    ),
    # sinks, alternating 8-token windows (the 23-token prompt reaches past them), YaRN, the oai experts
    "gpt-oss": (
        "gpt-oss",
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        # test_tiny_models' gpt-oss, with the clamp's limit llama.cpp's fixed 7.0 (GGUF stores none)
        {k: v for k, v in dict(TINY["gpt-oss"][1]).items() if k != "swiglu_limit"},
    ),
    # DeepSeek V3's MLA and experts (test_tiny_models' V3, YaRN's mscale equal to mscale_all_dim: a
    # file keeps 0.1 · mscale_all_dim alone) and V2-Lite's (its q_proj, a greedy softmax router)
    "deepseek2-v3": (
        "deepseek2",
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        {
            **dict(TINY["deepseek-v3-moe"][1]),
            "rope_parameters": {**TINY["deepseek-v3-moe"][1]["rope_parameters"], "mscale": 0.7},
        },
    ),
    "deepseek2-v2-lite": (
        "deepseek2",
        transformers.DeepseekV2Config,
        transformers.DeepseekV2ForCausalLM,
        dict(TINY["deepseek-v2-lite-moe"][1]),
    ),
    # GLM-4.7-Flash: V3's layers, its dense layer first, an MTP block after them (not read)
    "deepseek2-glm4-moe-lite": (
        "deepseek2",
        transformers.Glm4MoeLiteConfig,
        transformers.Glm4MoeLiteForCausalLM,
        {**dict(TINY["glm4-moe-lite"][1]), "mlp_layer_types": ["dense", "sparse", "sparse"]},
    ),
    # GLM-4.5: as test_tiny_models' (groups, scale, shared expert, partial rotary, q/k norms, a dense layer)
    "glm4moe": (
        "glm4moe",
        transformers.Glm4MoeConfig,
        transformers.Glm4MoeForCausalLM,
        {**dict(TINY["glm4-moe"][1]), "tie_word_embeddings": False},
    ),
    "minimax-m2": (
        "minimax-m2",
        transformers.MiniMaxM2Config,
        transformers.MiniMaxM2ForCausalLM,
        {**dict(TINY["minimax-m2"][1]), "tie_word_embeddings": False},
    ),
}
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    # DeepSeek's (llama.cpp's `deepseek2`)
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",  # GLM-4.5's (ungated)
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# a sigmoid router's correction bias, as llama.cpp names it (GLM-4.5 keeps it in the router, MiniMax-M2
# beside it)
ROUTER_BIAS = ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias")


def deepseek2_metadata(w, cfg, mtp_blocks: int = 0) -> None:
    """The keys llama.cpp's DeepseekV2Model writes (MLA as one kv head of the latent row; the MTP
    layers skipped, but for GLM-4.7-Flash's: `mtp_blocks` after the model's; no gating function where
    the config names none: the correction bias says V3)."""
    rope = cfg.rope_parameters
    w.add_block_count(cfg.num_hidden_layers + mtp_blocks)
    if mtp_blocks:
        w.add_nextn_predict_layers(mtp_blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "yarn":
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.n_group is not None:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    kinds = getattr(cfg, "mlp_layer_types", None)  # GLM-4.7-Flash's: its dense layers come first
    dense = kinds.index("sparse") if kinds else cfg.first_k_dense_replace
    w.add_leading_dense_block_count(dense)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)


def deepseek2_tensors(cfg, rest: str, a: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """A layer tensor's GGUF name(s) and values where llama.cpp's converter changes them: kv_b_proj split
    per head into W_UK transposed (attn_k_b) and W_UV (attn_v_b); the router's correction bias."""
    if rest == "self_attn.kv_b_proj.weight":
        kv_b = a.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        k_b, v_b = kv_b[:, : cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim :]
        return [("attn_k_b.weight", k_b.swapaxes(1, 2)), ("attn_v_b.weight", v_b)]
    if rest == "mlp.gate.e_score_correction_bias":
        return [("exp_probs_b.bias", a)]
    return None


# gpt-oss's tensors as llama.cpp's converter writes them: gate and up apart (de-interleaved), each
# expert's weights transposed to [E, out, in]; sinks and the post-attention norm under their own names
GPT_OSS = {
    "self_attn.sinks": lambda a: [("attn_sinks.weight", a)],
    "post_attention_layernorm.weight": lambda a: [("post_attention_norm.weight", a)],
    "mlp.router.weight": lambda a: [("ffn_gate_inp.weight", a)],
    "mlp.router.bias": lambda a: [("ffn_gate_inp.bias", a)],
    "mlp.experts.gate_up_proj": lambda a: [
        ("ffn_gate_exps.weight", a.swapaxes(1, 2)[:, 0::2]),
        ("ffn_up_exps.weight", a.swapaxes(1, 2)[:, 1::2]),
    ],
    "mlp.experts.gate_up_proj_bias": lambda a: [
        ("ffn_gate_exps.bias", a[:, 0::2]),
        ("ffn_up_exps.bias", a[:, 1::2]),
    ],
    "mlp.experts.down_proj": lambda a: [("ffn_down_exps.weight", a.swapaxes(1, 2))],
    "mlp.experts.down_proj_bias": lambda a: [("ffn_down_exps.bias", a)],
}


# OLMo 2/3's and Exaone 4's norms of the sublayers' outputs
POST_NORMED = ("olmo2", "exaone4")
POST_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
PERMUTED = ("llama", "granite", "smollm3")  # llama.cpp's LlamaModel subclasses: q/k rows interleaved


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of the q/k rows of a "llama" file."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_divisors(dim: int, rope: dict) -> np.ndarray:
    """llama.cpp's `rope_freqs` for a llama3 scaling: 1 for short wavelengths, the factor for long ones,
    smoothed between."""
    factor, orig = rope["factor"], rope["original_max_position_embeddings"]
    short, long = orig / rope["high_freq_factor"], orig / rope["low_freq_factor"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * np.pi * rope["rope_theta"] ** (i / dim)
        smooth = (orig / wavelen - rope["low_freq_factor"]) / (
            rope["high_freq_factor"] - rope["low_freq_factor"]
        )
        out.append(
            1.0 if wavelen < short else factor if wavelen > long else 1 / ((1 - smooth) / factor + smooth)
        )
    return np.array(out, dtype=np.float32)


def common_metadata(w, cfg, mtp_blocks: int = 0) -> None:
    """The keys every family's file has, from a transformers config, as llama.cpp's converter writes them
    (`mtp_blocks`: multi-token-prediction blocks written after the model's, llama.cpp's nextn layers)."""
    w.add_block_count(cfg.num_hidden_layers + mtp_blocks)
    if mtp_blocks:
        w.add_nextn_predict_layers(mtp_blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None):  # (none where every layer has experts: Qwen3.5-MoE)
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if hasattr(cfg, "layer_norm_eps"):  # Cohere's LayerNorms
        w.add_layer_norm_eps(cfg.layer_norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # (OLMo 3: per layer type)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def byte_vocabulary(w, size: int) -> None:
    """A byte-level vocabulary of single characters, no merges."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(0x21 + i) for i in range(size)])
    w.add_token_merges([])
    w.add_token_types([1] * size)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)


def write_gguf(hf, arch: str, path: Path, quant=None, llama4_beta: bool = False) -> Path:
    """`quant(gguf_name, array)`: the GGUF type to store a tensor as (None, or no `quant`: as it is).
    `llama4_beta`: a `mistral4` file given Llama 4's query scaling under the keys llama.cpp's runtime
    reads (`attention.temperature_scale` / `temperature_length`), which its converter does not write."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)

    def add(name: str, a: np.ndarray) -> None:
        qtype = quant(name, a) if quant else None
        if qtype is None:
            w.add_tensor(name, a)
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a, np.float32), t), raw_dtype=t)

    # with an MTP block after the layers, as a published GLM-4.5's and GLM-4.7-Flash's file has
    mtp = arch == "glm4moe" or cfg.model_type == "glm4_moe_lite"
    if arch in ("deepseek2", "mistral4"):  # (llama.cpp's Mistral4Model is its DeepseekV2Model)
        deepseek2_metadata(w, cfg, mtp_blocks=int(mtp))
    else:
        common_metadata(w, cfg, mtp_blocks=int(mtp))
    if arch == "glm4moe":  # as llama.cpp's Glm4MoeModel writes it
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    if arch == "minimax-m2":  # as llama.cpp's MiniMaxM2Model writes it
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_rope_dimension_count(cfg.rotary_dim)
    if arch == "gpt-oss":  # as llama.cpp's GptOssModel writes it
        rope = cfg.rope_parameters
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "granite":  # as llama.cpp's GraniteModel writes it
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch == "olmo2" and getattr(cfg, "sliding_window", None):  # OLMo 3, as llama.cpp writes it
        full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_attn_factor(full["attention_factor"])
        w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "cohere2":  # as llama.cpp's Cohere2Model writes it (no pattern: llama.cpp's is 4)
        w.add_logit_scale(cfg.logit_scale)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "exaone4":  # as llama.cpp's Exaone4Model writes it
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        add("rope_freqs.weight", llama3_divisors(cfg.head_dim, cfg.rope_parameters))
    if llama4_beta:
        w.add_attn_temperature_scale(cfg.rope_parameters["llama_4_scaling_beta"])
        w.add_attn_temperature_length(cfg.rope_parameters["original_max_position_embeddings"])
    byte_vocabulary(w, cfg.vocab_size)
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", a)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                add("output.weight", a)
        elif name == "model.norm.weight":
            add("output_norm.weight", a)
        else:
            _, _, i, rest = name.split(".", 3)
            stem, _, kind = rest.rpartition(".")
            if arch in ("deepseek2", "mistral4") and (parts := deepseek2_tensors(cfg, rest, a)) is not None:
                for gguf_name, part in parts:
                    add(f"blk.{i}.{gguf_name}", np.ascontiguousarray(part))
                continue
            if arch == "gpt-oss" and rest in GPT_OSS:
                for gguf_name, part in GPT_OSS[rest](a):
                    add(f"blk.{i}.{gguf_name}", np.ascontiguousarray(part))
                continue
            if rest in (
                "mlp.experts.gate_up_proj",
                "mlp.experts.down_proj",
            ):  # stacked [E, 2I, H] / [E, H, I]; Mistral 4's gate|up kept whole
                if arch == "mistral4" and rest.endswith("gate_up_proj"):
                    add(f"blk.{i}.ffn_gate_up_exps.weight", a)
                elif rest.endswith("down_proj"):
                    add(f"blk.{i}.ffn_down_exps.weight", a)
                else:
                    gate, up = np.split(a, 2, axis=1)
                    add(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                    add(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(up))
                continue
            if rest in ROUTER_BIAS:
                add(f"blk.{i}.exp_probs_b.bias", a)
                continue
            if arch == "glm4moe" and stem == "post_attention_layernorm":
                add(f"blk.{i}.post_attention_norm.{kind}", a)
                continue
            if arch in PERMUTED and stem in ("self_attn.q_proj", "self_attn.k_proj"):
                a = _permute(
                    a, cfg.num_attention_heads if stem.endswith("q_proj") else cfg.num_key_value_heads
                )
            layer = {**LAYER, **POST_NORMS} if arch in POST_NORMED else LAYER
            if arch == "seed_oss":
                layer = {**LAYER, "post_attention_layernorm": "post_attention_norm"}
            add(f"blk.{i}.{layer[stem]}.{kind}", np.ascontiguousarray(a))
    if mtp:  # the MTP block's own tensors, and a layer's (not read)
        L, H = cfg.num_hidden_layers, cfg.hidden_size
        add(f"blk.{L}.nextn.eh_proj.weight", np.ones((H, 2 * H), np.float32))
        add(f"blk.{L}.nextn.enorm.weight", np.ones(H, np.float32))
        add(f"blk.{L}.exp_probs_b.bias", np.ones(cfg.n_routed_experts, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Gemma 4's tensors beyond Gemma 3's names, as llama.cpp's Gemma4Model writes them (norms as they are,
# not as 1 + w; the full layers' proportional RoPE as `rope_freqs`)
GEMMA4 = {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
GEMMA4_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
}
# the mixture-of-experts block (gemma-4-26B-A4B) as `Gemma4Model` writes it: the experts as transformers
# stacks them (gate|up fused), the router's scale and the per-expert scale as `.scale` tensors
GEMMA4_MOE = {
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}


def write_gemma4_gguf(hf, path: Path, quant=None) -> Path:
    """A Gemma 4 file as llama.cpp's converter (`Gemma4Model`) writes it: per-layer arrays for the kv
    heads and (double-wide) MLP widths, the sliding pattern, both head sizes, both RoPE bases."""
    import gguf

    cfg = hf.config
    n, types = cfg.num_hidden_layers, cfg.layer_types
    full = types.index("full_attention")
    full_heads, swa_heads = cfg.per_layer_config[full], cfg.per_layer_config[types.index("sliding_attention")]
    head_full, kv_full = full_heads.head_dim, full_heads.num_key_value_heads
    head_swa, kv_swa = swa_heads.head_dim, swa_heads.num_key_value_heads
    first_shared = n - cfg.num_kv_shared_layers
    w = gguf.GGUFWriter(str(path), "gemma4")

    def add(name: str, a: np.ndarray) -> None:
        qtype = quant(name, a) if quant else None
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(a))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a, np.float32), t), raw_dtype=t)

    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    ff = [
        cfg.intermediate_size * (2 if cfg.use_double_wide_mlp and i >= first_shared else 1) for i in range(n)
    ]
    w.add_feed_forward_length(ff if cfg.use_double_wide_mlp else cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([kv_swa if t == "sliding_attention" else kv_full for t in types])
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_full)
    w.add_value_length(head_full)
    if cfg.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    w.add_shared_kv_layers(cfg.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_key_length_swa(head_swa)
    w.add_value_length_swa(head_swa)
    w.add_rope_dimension_count(head_full)
    w.add_rope_dimension_count_swa(head_swa)
    if cfg.enable_moe_block:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.top_k_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    byte_vocabulary(w, cfg.vocab_size)
    turned = int(head_full * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor(
        "rope_freqs.weight", np.array([1.0] * turned + [1e30] * (head_full // 2 - turned), np.float32)
    )
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", a)
        elif name == "model.norm.weight":
            add("output_norm.weight", a)
        elif name in GEMMA4:
            add(GEMMA4[name], a)
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            if rest == "layer_scalar":
                add(f"blk.{i}.layer_output_scale.weight", a)
                continue
            if rest in GEMMA4_MOE:
                add(f"blk.{i}.{GEMMA4_MOE[rest]}", a)
                continue
            stem, _, kind = rest.rpartition(".")
            add(f"blk.{i}.{GEMMA4_LAYER.get(stem) or LAYER[stem]}.{kind}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Gemma 3n as `Gemma3NModel` writes it: its model's AltUp projections stacked [3, H, H], each layer's
# AltUp and LAuReL tensors (the bare `correct_output_scale` as `altup_correct_scale.weight`)
GEMMA3N = {
    **GEMMA4,
    "model.altup_projections": "altup_proj.weight",
    "model.altup_unembed_projections": "altup_unembd_proj.weight",
}
GEMMA3N_LAYER = {
    **GEMMA4_LAYER,
    "altup.correct_output_scale": "altup_correct_scale",
    "altup.correction_coefs": "altup_correct_coef",
    "altup.prediction_coefs": "altup_predict_coef",
    "altup.modality_router": "altup_router",
    "altup.router_norm": "altup_router_norm",
    "laurel.linear_left": "laurel_l",
    "laurel.linear_right": "laurel_r",
    "laurel.post_laurel_norm": "laurel_post_norm",
}


def write_gemma3n_gguf(hf, path: Path, quant=None) -> Path:
    """A Gemma 3n file as llama.cpp's converter (`Gemma3NModel`) writes it: per-layer MLP widths, the
    sliding pattern, both RoPE bases, the activation sparsity as normal quantiles (−inf: none), no
    k/v tensors in the layers that read another's cache, the norms as they are (no 1 + w)."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3n")

    def add(name: str, a: np.ndarray) -> None:
        qtype = quant(name, a) if quant else None
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(a))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a, np.float32), t), raw_dtype=t)

    normal = torch.distributions.normal.Normal(0, 1)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(list(cfg.intermediate_size))
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    w.add_altup_active_idx(cfg.altup_active_idx)
    w.add_altup_num_inputs(cfg.altup_num_inputs)
    w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input)
    w.add_shared_kv_layers(cfg.num_kv_shared_layers)
    w.add_activation_sparsity_scale(
        [normal.icdf(torch.tensor(p, dtype=torch.float32)).item() for p in cfg.activation_sparsity_pattern]
    )
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    byte_vocabulary(w, cfg.vocab_size)
    stacked: dict[str, list[np.ndarray]] = {}
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", a)
        elif name == "model.norm.weight":
            add("output_norm.weight", a)
        elif name in GEMMA3N:
            add(GEMMA3N[name], a)
        elif name.startswith(("model.altup_projections.", "model.altup_unembed_projections.")):
            stem = name.rsplit(".", 2)[0]
            stacked.setdefault(stem, []).append(a)
            if len(stacked[stem]) == cfg.altup_num_inputs - 1:
                add(GEMMA3N[stem], np.stack(stacked[stem]))
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            if rest == "altup.correct_output_scale":
                add(f"blk.{i}.altup_correct_scale.weight", a)
                continue
            stem, _, kind = rest.rpartition(".")
            add(f"blk.{i}.{GEMMA3N_LAYER.get(stem) or LAYER[stem]}.{kind}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(spec: tuple) -> tuple[str, dict, torch.nn.Module]:
    """A family's (GGUF arch, config kwargs, random float32 transformers model), seeded."""
    arch, cfg_cls, model_cls, kw = spec
    torch.manual_seed(0)
    return arch, kw, model_cls(cfg_cls(**kw)).float().eval()


def prompt_logits(runner: ModelRunner, seq: list[int]) -> torch.Tensor:
    """The logits of a prompt's tokens, computed by `runner` in one step over a fresh KV cache."""
    from tests.model.test_tiny_models import BLOCK, NUM_BLOCKS, Paged, step

    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK)
    pager = Paged()
    req = pager.request("r", seq)
    return step(runner, pager, [(req, req.num_tokens)])[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_of_the_family_serves_transformers_logits(tmp_path, monkeypatch, family):
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    arch, _, hf = tiny_model(FAMILIES[family])
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in hf.named_buffers():  # as test_tiny_models sets them
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.04)
    path = write_gguf(hf, arch, tmp_path / f"{family}.gguf")
    model_dir = resolve_model(str(path), progress=False).path  # converted once, as `pytgi serve` does
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    assert type(runner.model).__name__ == "DecoderModel"  # pytgi's own code, not the fallback
    from tests.model.test_tiny_models import reference

    seq = np.random.default_rng(1).integers(0, 97, 23).tolist()
    torch.testing.assert_close(prompt_logits(runner, seq), reference(hf, seq), atol=2e-5, rtol=1e-4)


# Mistral 4 (`mistral4`): test_tiny_models' (groups whose limit bites, YaRN, Llama 4's beta), its
# original context 32 so that prompts and answers fit below it
MISTRAL4 = {
    **dict(TINY["mistral4"][1]),
    "eos_token_id": None,  # (greedy answers of a set length)
    "rope_parameters": {
        **TINY["mistral4"][1]["rope_parameters"],
        "factor": 8.0,
        "original_max_position_embeddings": 32,
    },
}


def test_a_mistral4_gguf_serves_transformers_tokens_below_its_original_context(tmp_path, monkeypatch, caplog):
    """llama.cpp's converter writes no Llama 4 beta into a `mistral4` file: pytgi serves the positions
    where the query scale is 1 whatever beta is (below YaRN's original context), says so once at
    load, and there gives transformers' greedy tokens and logits; a longer request is refused."""
    from pytgi import LLM
    from pytgi.core.errors import InvalidRequest
    from pytgi.core.sampling_params import SamplingParams
    from tests.model.test_tiny_models import reference

    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    hf = transformers.Mistral4ForCausalLM(transformers.Mistral4Config(**MISTRAL4)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = write_gguf(hf, "mistral4", tmp_path / "mistral4.gguf")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 97, n).tolist() for n in (4, 11, 19)]
    with torch.no_grad():
        refs = [
            hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p) :]
            for p in prompts
        ]
    assert len({tuple(r.tolist()) for r in refs}) == len(prompts)
    with caplog.at_level("WARNING", logger="pytgi.engine.models.deepseek"):
        llm = LLM(model=str(path), dtype="float32", max_batch_total_tokens=256)
    try:
        assert llm.engine.info.max_total_tokens == 32  # the positions below the original context
        assert caplog.text.count("only positions below 32 are served") == 1  # one line, at load
        got = llm.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in got] == [r.tolist() for r in refs]
        with pytest.raises(InvalidRequest):
            llm.generate(prompts[-1], SamplingParams(max_new_tokens=14, temperature=0))
    finally:
        llm.shutdown()
    model_dir = resolve_model(str(path), progress=False).path
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    assert type(runner.model).__name__ == "DecoderModel"
    seq = rng.integers(0, 97, 32).tolist()
    torch.testing.assert_close(prompt_logits(runner, seq), reference(hf, seq), atol=2e-5, rtol=1e-4)


def test_a_deepseek2_gguf_with_llama4_scaling_is_refused(tmp_path, monkeypatch):
    """Llama 4's query scaling in a `deepseek2` file (Mistral Large 3 from Mistral's own format) says
    nothing of which model it is: refused by name, not served unscaled."""
    from pytgi.core.errors import GGUFConversionError

    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    hf = transformers.Mistral4ForCausalLM(transformers.Mistral4Config(**TINY["mistral4"][1])).float().eval()
    path = write_gguf(hf, "deepseek2", tmp_path / "deepseek2.gguf", llama4_beta=True)
    with pytest.raises(GGUFConversionError, match="temperature_scale"):
        resolve_model(str(path), progress=False)


def test_a_mistral4_gguf_with_llama4_beta_serves_its_scale(tmp_path, monkeypatch):
    """A `mistral4` file that holds the beta (under the keys llama.cpp's runtime reads) is served at
    every position, the queries scaled past the original context (8 here) as transformers does."""
    from tests.model.test_tiny_models import reference

    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    hf = transformers.Mistral4ForCausalLM(transformers.Mistral4Config(**TINY["mistral4"][1])).float().eval()
    path = write_gguf(hf, "mistral4", tmp_path / "mistral4.gguf", llama4_beta=True)
    model_dir = resolve_model(str(path), progress=False).path
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    assert runner.config.max_position_embeddings == 256
    seq = np.random.default_rng(1).integers(0, 97, 40).tolist()
    torch.testing.assert_close(prompt_logits(runner, seq), reference(hf, seq), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
@pytest.mark.parametrize("tiny", ["gemma4", "gemma4-moe"])
def test_gemma4_gguf_serves_transformers_logits(tmp_path, monkeypatch, dtype, tiny):
    """test_tiny_models' Gemma 4 (every per-layer feature) and Gemma 4 with experts from its file as
    llama.cpp writes it: float32 equals transformers; the fast path (bf16, the Q8_0 matrices and
    experts read from their blocks, the C loop stepping aside) stays within a few times transformers'
    own bf16 error (a smoke test of that path)."""
    from tests.model.test_tiny_models import randomize_gemma4_router

    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    cfg_cls, kw = TINY[tiny]
    torch.manual_seed(0)  # (a vocabulary of 128: the per-layer table's rows can be packed, 16 a tile)
    kw = {**kw, "vocab_size": 128, "vocab_size_per_layer_input": 128}
    hf = transformers.Gemma4ForCausalLM(cfg_cls(**kw)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    randomize_gemma4_router(hf)

    def q8(name: str, a: np.ndarray) -> str | None:  # the matrices, experts, per-layer table as Q8_0
        mat = a.ndim in (2, 3) and a.shape[-1] % 32 == 0 and not name.endswith(".scale")
        mat = mat and ("blk." in name or name.startswith("per_layer_token"))
        return "Q8_0" if dtype == "auto" and mat else None

    path = write_gemma4_gguf(hf, tmp_path / "gemma4.gguf", q8)
    model_dir = resolve_model(str(path), progress=False).path
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype=dtype, device="cpu"))
    assert isinstance(runner.model, DecoderModel)
    table = runner.model.embed_tokens_per_layer
    if tiny == "gemma4":
        assert table is not None and (table.packed is not None) == (
            dtype == "auto" and runner.model.kernels.vnni
        )
    else:
        assert table is None and all(layer.moe is not None for layer in runner.model.layers)
        moe = runner.model.layers[0].moe  # the Q8_0 experts packed from their blocks, gate|up one tensor
        assert (len(moe.packed) == 8 and moe.gate_up.numel() == 0) == (dtype == "auto")
        assert (moe.fused is not None) == (dtype == "auto" and runner.model.kernels.vnni)
        if moe.fused is not None:  # moe.c's GELU experts: the PyTorch loop's bits
            assert moe.fused.activation == "gelu_tanh"
            x = torch.randn(21, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
            with torch.no_grad():
                weights, experts = moe.route(x)
                fused = moe._routed(x, weights, experts)
                held, moe.fused = moe.fused, None
                assert torch.equal(fused, moe._routed(x, weights, experts))
                moe.fused = held
    from tests.model.test_tiny_models import reference

    seq = np.random.default_rng(1).integers(0, 97, 23).tolist()  # past the 8-token window
    got, want = prompt_logits(runner, seq), reference(hf, seq)
    if dtype == "float32":
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    else:  # this tiny model is sensitive: transformers' own bf16 is 0.11 from its float32
        with torch.no_grad():
            bf16 = hf.to(torch.bfloat16)(torch.tensor([seq])).logits[0].float()
        assert float((got - want).abs().max()) < 4 * float((bf16 - want).abs().max())


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_gemma3n_gguf_serves_transformers_logits(tmp_path, monkeypatch, dtype):
    """test_tiny_models' Gemma 3n from its file as llama.cpp writes it: float32 equals transformers; the
    fast path (bf16, the Q8_0 matrices read from their blocks) within a few times transformers' own
    bf16 error."""
    from tests.model.test_tiny_models import reference

    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    cfg_cls, kw = TINY["gemma3n"]
    torch.manual_seed(0)
    kw = {**kw, "vocab_size": 128, "vocab_size_per_layer_input": 128}
    hf = transformers.Gemma3nForCausalLM(cfg_cls(**kw)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if ".altup." in name or ".laurel." in name:
                p.add_(torch.randn_like(p) * 0.2)

    def q8(name: str, a: np.ndarray) -> str | None:  # the layers' matrices as Q8_0
        mat = a.ndim == 2 and a.shape[-1] % 32 == 0 and "blk." in name and "altup" not in name
        return "Q8_0" if dtype == "auto" and mat else None

    path = write_gemma3n_gguf(hf, tmp_path / "gemma3n.gguf", q8)
    model_dir = resolve_model(str(path), progress=False).path
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype=dtype, device="cpu"))
    assert isinstance(runner.model, DecoderModel) and runner.model.config.altup is not None
    seq = np.random.default_rng(1).integers(0, 97, 23).tolist()  # past the 8-token window
    got, want = prompt_logits(runner, seq), reference(hf, seq)
    if dtype == "float32":
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    else:
        with torch.no_grad():
            bf16 = hf.to(torch.bfloat16)(torch.tensor([seq])).logits[0].float()
        assert float((got - want).abs().max()) < 4 * float((bf16 - want).abs().max())


def test_the_gpt_4o_pre_tokenizer_splits_as_o200k():
    """gpt-oss's GGUF names its pre-tokenizer "gpt-4o" (o200k): case runs, contractions, digits in
    threes, punctuation with the slashes and newlines after it."""
    from tokenizers import Regex, pre_tokenizers

    from pytgi.core.gguf_convert import _GPT4O_REGEX

    split = pre_tokenizers.Split(Regex(_GPT4O_REGEX), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("HelloWorld's 12345 foo/bar\n\n  x")]
    assert pieces == ["Hello", "World's", " ", "123", "45", " foo", "/bar", "\n\n", " ", " x"]


@pytest.mark.parametrize(
    "theta, factor, orig", [(500000.0, 8.0, 8192), (1_000_000.0, 16.0, 8192), (500000.0, 32.0, 8192)]
)
def test_a_llama3_scaling_is_read_back_from_its_rope_freqs(theta, factor, orig):
    """Llama 3.1-3.3's and Exaone 4's published scalings (head_dim 128): the divisors pytgi's
    parameters give are the file's."""
    from types import SimpleNamespace

    from pytgi.core.gguf_convert import _llama3_factors, _rope_freqs

    rope = dict(
        rope_theta=theta,
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=orig,
    )
    divisors = llama3_divisors(128, rope)
    reader = SimpleNamespace(fields={}, tensors=[SimpleNamespace(name="rope_freqs.weight", data=divisors)])
    got = _rope_freqs(reader, "llama", theta, 128)
    assert got is not None and got["rope_type"] == "llama3" and got["factor"] == factor
    np.testing.assert_allclose(_llama3_factors(128, theta, got), divisors, rtol=1e-5)
    assert _rope_freqs(SimpleNamespace(fields={}, tensors=[]), "llama", theta, 128) is None


@pytest.mark.parametrize(
    "pre, pieces",
    [
        # cl100k's split (OLMo 2/3's tokenizer): digits in threes, a newline run joined to punctuation
        ("dbrx", ["Hello", " world", "!\n\n", "123", "45"]),
        # Seed-Coder's (Seed-OSS): digits one by one, newlines apart from punctuation
        ("seed-coder", ["Hello", " world", "!", "\n\n", "1", "2", "3", "4", "5"]),
        # Command-R's (Cohere 2): digits one by one, then GPT-2's split
        ("command-r", ["Hello", "Ġworld", "!", "ĊĊ", "1", "2", "3", "4", "5"]),
        ("exaone4", ["Hello", "Ġworld", "!", "Ċ", "Ċ", "12345"]),  # GPT-2's
    ],
)
def test_the_new_families_pre_tokenizers_split_as_llama_cpp_names_them(pre, pieces):
    """The `tokenizer.ggml.pre` names llama.cpp writes for these families' tokenizers."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from pytgi.core.gguf_convert import gguf_tokenizer_json

    values = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": ["a"],
        "tokenizer.ggml.token_type": [1],
        "tokenizer.ggml.merges": [],
    }
    reader = SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in values.items()})
    tok = Tokenizer.from_str(gguf_tokenizer_json(reader))
    got = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("Hello world!\n\n12345")]
    if pre in ("dbrx", "seed-coder"):  # the byte-level step renders spaces and newlines as Ġ and Ċ
        pieces = [p.replace(" ", "Ġ").replace("\n", "Ċ") for p in pieces]
    assert got == pieces
