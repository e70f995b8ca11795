"""Describe a GGUF file as a Hugging Face model directory: config, tokenizer, the tensors' types.

A GGUF file is read once into a small directory in the cache (config.json, tokenizer.json,
tokenizer_config.json, generation_config.json, quantization.json with every tensor's type, and
gguf.json naming the file's parts). The weights stay in the GGUF file: the loader reads them from
there at every start, one tensor at a time (`pytgi.engine.loading.gguf`), so no copy of the model
is ever written. `pytgi.engine.loading.gguf.export_float` writes a float32 safetensors copy for
tools that want one (transformers, as the fidelity tests do).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from pytgi.core.errors import GGUFConversionError
from pytgi.core.families import FAMILIES, gguf_architecture, gguf_names

if TYPE_CHECKING:
    from gguf import GGUFReader
    from tokenizers import Tokenizer

# A GGUF file's metadata and tensor index: one file's reader, or a split file's parts read as one
Reader: TypeAlias = "GGUFReader | _SplitReader"

# the model types of the GGUF names of the gated-DeltaNet families (Qwen3-Next, Qwen3.5: their linear
# layers' tensors, stored −exp(A_log) and 1 + w norms), of Mamba-2's (Nemotron-H's, Granite-4.0-H's)
# and of LFM2's (its short convolutions' tensors)
DELTANET_TYPES = frozenset(g.model_type for f in FAMILIES if f.module == "qwen3_next" for g in f.gguf)
MAMBA_TYPES = frozenset(g.model_type for f in FAMILIES if f.module == "mamba_hybrid" for g in f.gguf)
LFM2_TYPES = frozenset(g.model_type for f in FAMILIES if f.module == "lfm2" for g in f.gguf)
# ... and Kimi Linear's (its KDA layers' tensors; ssm_a is −exp(A_log) there too)
KDA_TYPES = frozenset(g.model_type for f in FAMILIES if f.module == "kimi_linear" for g in f.gguf)
# ... and Mamba-1's (Mamba's, Jamba's; FalconMamba's, which a "mamba" file becomes with `ssm.dt_b_c_rms`)
MAMBA1_TYPES = frozenset(g.model_type for f in FAMILIES if f.module == "mamba1_models" for g in f.gguf) | {
    "falcon_mamba"
}
# Gemma's layers have four norms: llama.cpp's ffn_norm is the one before the MLP there.
GEMMA_LAYER_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, the experts stacked ([E, I, H], [E, H, I]), a shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # a sigmoid router's correction bias (DeepSeek-V3, GLM-4.5, MiniMax-M2): a bare parameter
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
}
# GLM-4.5's MLP input norm has the name llama.cpp gives a post-attention norm
GLM4_MOE_LAYER_TENSORS = {"post_attention_norm": "post_attention_layernorm"}
# gpt-oss: the post-attention norm has its own name; sinks; the router; each expert tensor stacked
# per kind with its bias ([E, I, H], [E, H, I]: the names keep .weight/.bias, `SparseMoE._load_oai`)
GPT_OSS_LAYER_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
}
# Qwen3-Next / Qwen3.5: the linear-attention layers' tensors (llama.cpp's converter splits Qwen3-Next's
# in_proj_qkvz into Qwen3.5's q|k|v and z; ssm_a is −exp(A_log), `GGUFWeights.dense` takes it back)
HYBRID_LAYER_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Mamba-2's tensors (ssm_a, ssm_d and ssm_dt.bias are bare parameters: `hf_tensor_name`); ssm_a is
# −exp(A_log) [H, 1], ssm_d [H, 1], ssm_norm [groups, inner / groups], ssm_conv1d [channels, kernel]
MAMBA_LAYER_TENSORS = {
    "ssm_in": "linear_attn.in_proj",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
MAMBA_BARE = {"ssm_a": "A_log", "ssm_d": "D", "ssm_dt": "dt_bias"}
# Mamba-1's tensors: ssm_a is −exp(A_log) [d_inner, d_state] and ssm_d [d_inner], bare parameters;
# ssm_dt is dt_proj (weight and bias), ssm_x x_proj; Jamba's norms on dt, B and C
MAMBA1_LAYER_TENSORS = {
    "ssm_in": "linear_attn.in_proj",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_x": "linear_attn.x_proj",
    "ssm_dt": "linear_attn.dt_proj",
    "ssm_out": "linear_attn.out_proj",
    "ssm_dt_norm": "linear_attn.dt_layernorm",
    "ssm_b_norm": "linear_attn.b_layernorm",
    "ssm_c_norm": "linear_attn.c_layernorm",
}
MAMBA1_BARE = {"ssm_a": "A_log", "ssm_d": "D"}
# OLMo 2/3 and Exaone 4 norm the sublayers' outputs (and not their inputs)
POST_NORM_TYPES = frozenset({"olmo2", "olmo3", "exaone4"})
POST_NORM_LAYER_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 4: the per-layer input's gate, projection and norm, the layer's output scale (a bare parameter)
GEMMA4_LAYER_TENSORS = {
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale": "layer_scalar",
    # the mixture-of-experts block beside the MLP (gemma-4-26B-A4B): its norms, router and experts
    # (`ffn_gate_up_exps` [E, 2I, H] as transformers stacks them; the router's `.scale` and the
    # experts' `ffn_down_exps.scale`, the per-expert scale: bare parameters, `GEMMA4_SCALES`)
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj",
}
# ... whose scales are bare parameters of the router's
GEMMA4_SCALES = {"ffn_gate_inp": "router.scale", "ffn_down_exps": "router.per_expert_scale"}
# ... and its model's per-layer input tables; `rope_freqs` (the full layers' proportional RoPE, as
# llama.cpp's frequency factors: read into config.json's rope_parameters) is not a weight
GEMMA4_TENSORS = {
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
    "rope_freqs": "model.rotary_emb.rope_freqs",
}
# Gemma 3n: its model's AltUp projections (the three streams' [H, H] stacked: `altup_projections.weight`
# [3, H, H], split at load) and each layer's AltUp coefficients, router, LAuReL (the converter names
# the bare `correct_output_scale` parameter `altup_correct_scale.weight`)
GEMMA3N_TENSORS = {
    **GEMMA4_TENSORS,
    "altup_proj": "model.altup_projections",
    "altup_unembd_proj": "model.altup_unembed_projections",
}
GEMMA3N_LAYER_TENSORS = {
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "altup_correct_coef": "altup.correction_coefs",
    "altup_predict_coef": "altup.prediction_coefs",
    "altup_router": "altup.modality_router",
    "altup_router_norm": "altup.router_norm",
    "laurel_l": "laurel.linear_left",
    "laurel_r": "laurel.linear_right",
    "laurel_post_norm": "laurel.post_laurel_norm",
}
# DeepSeek V2 / V3 (`deepseek2`) and Mistral 4 (`mistral4`): multi-head latent attention's projections;
# kv_b_proj split per head into W_UK transposed (attn_k_b, [H, latent, nope]) and W_UV (attn_v_b,
# [H, v, latent]) by the converter (older files keep attn_kv_b whole); the router's correction bias
# (`exp_probs_b`); Mistral 4's experts' gate|up stacked as its checkpoint has them ([E, 2I, H])
DEEPSEEK_LAYER_TENSORS = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
DEEPSEEK_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "mistral4"})
# Kimi Linear's KDA layers (their q, k, v and output projections under the attention's names, which
# `kimi_linear_config` renames per layer); the convolutions, A_log, dt_bias and o_norm: bare parameters
KDA_LAYER_TENSORS = {
    "ssm_f_a": "linear_attn.f_a_proj",
    "ssm_f_b": "linear_attn.f_b_proj",
    "ssm_beta": "linear_attn.b_proj",
    "ssm_g_a": "linear_attn.g_a_proj",
    "ssm_g_b": "linear_attn.g_b_proj",
}
KDA_PARAMETERS = {
    "ssm_conv1d_q.weight": "q_conv1d",
    "ssm_conv1d_k.weight": "k_conv1d",
    "ssm_conv1d_v.weight": "v_conv1d",
    "ssm_a": "A_log",
    "ssm_dt.bias": "dt_bias",
    "ssm_norm.weight": "o_norm",
}
# Phi-3 keeps q, k, v and gate, up fused
PHI3_LAYER_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) → the regular expressions that split text
# before BPE, applied in order, each match and each stretch between matches a piece of its own (as
# llama.cpp's `llm_tokenizer_bpe` lists them per LLAMA_VOCAB_PRE_TYPE_*; where llama.cpp rewrote a
# model's own tokenizer.json expression for its regex engine, the original, which `tokenizers`'
# Oniguruma runs as the model's tokenizer does).
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_REGEX = (  # cl100k (Llama 3, DBRX, GLM-4)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_REGEX = (  # o200k (gpt-oss, GPT-4o, Llama 4, MiniMax-M2)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER_REGEX = (  # Seed-Coder's tokenizer.json: digits one by one, no newline joined to punctuation
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_REGEX = (  # Qwen2's with combining marks kept in words
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_REGEX = (  # Mistral's Tekken (Nemo, Small 3, Mistral 4)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_KIMI_K2_REGEX = (  # Kimi K2's tiktoken pattern: Han runs apart, o200k's words without Han in them
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_REGEXES = (  # DeepSeek V3 (and R1, V3.x), Hunyuan dense, JoyAI
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
)
_DEEPSEEK_LLM_REGEXES = (  # DeepSeek LLM and V2 (the Sequence of Splits of their tokenizer.json)
    r"[\r\n]",
    (  # letters of cased scripts
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
        "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
        "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-"
        "\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
        "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
        "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
        "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
        "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-"
        "\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
        "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-"
        "\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-"
        "\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-"
        "\U0001e943]+"
    ),
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
_GPT2_DIGITS = (r"\p{N}", _GPT2_REGEX)  # StarCoder's: digits one by one, then GPT-2's split
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"  # BLOOM's, Poro's
# llama.cpp's names for Llama 3's split (its LLAMA3 type)
_LLAMA3_NAMES = (
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
)

_PRE_GROUPS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (
        ("default", ""),  # a file without the name (llama.cpp warns: generation quality degraded)
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"),
    ),
    (
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ),
        (_GPT2_REGEX,),
    ),
    (
        (
            *_LLAMA3_NAMES,
            "dbrx",
            "smaug-bpe",
            "chatglm-bpe",
            "glm4",
            "glm5",
        ),
        (_LLAMA3_REGEX,),
    ),
    (
        ("jais-2",),
        (
            (
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
                r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
            ),
        ),
    ),
    (
        (
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "stablelm2",
            "megrez",
            "hunyuan",
            "solar-open",
            "grok-2",
        ),
        (_QWEN2_REGEX,),
    ),
    (("qwen35",), (_QWEN35_REGEX,)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_GPT4O_REGEX,)),
    (("tekken",), (_TEKKEN_REGEX,)),
    (("kimi-k2",), (_KIMI_K2_REGEX,)),
    (("deepseek-llm",), _DEEPSEEK_LLM_REGEXES),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3_REGEXES),
    (
        ("deepseek-coder",),
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
    ),
    (
        ("spark2_5",),
        (
            r"\p{N}{1,3}",
            "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
            (
                r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
            ),
            r"\p{N}",
        ),
    ),
    (("seed-coder",), (_SEED_CODER_REGEX,)),
    (
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        _GPT2_DIGITS,
    ),
    (("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_REGEX, r"[0-9][0-9][0-9]")),
    (("poro-chat", "bloom", "gpt3-finnish"), (_BLOOM,)),
    (("viking",), (_BLOOM, r"\p{N}")),
    (
        ("bailingmoe", "bailingmoe2", "llada-moe"),  # Ling's tokenizer.json, possessive quantifiers
        (
            (
                r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"
                r"|\s+(?!\S)|\s+"
            ),
        ),
    ),
    (
        ("exaone-moe",),
        (
            (
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
            ),
        ),
    ),
    (
        ("youtu",),
        (
            "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
            _GPT4O_REGEX.replace(r"\p{N}{1,3}", r"\p{N}"),
        ),
    ),
    (
        ("minicpm5",),
        (
            r"\p{N}{1,3}",
            (
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
        ),
    ),
    (
        ("ufakzeka",),  # Qwen2's without the English contractions
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    ),
    (
        ("granite-embed-multi-97m",),
        (  # llama.cpp's (o200k's with marks in words)
            (
                r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
                r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
        ),
    ),
    (("laguna",), (r"[^\n]+|[\n]+", _QWEN2_REGEX)),
    (
        ("chameleon",),
        (
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            _GPT2_REGEX,
        ),
    ),
    (
        ("tiny_aya", "cohere2moe"),  # Tiny Aya's tokenizer.json: digits in threes from the right
        (r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O_REGEX),
    ),
)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    name: regexes for names, regexes in _PRE_GROUPS for name in names
}
# llama.cpp's `ignore_merges`: a piece that is a token of the vocabulary is that token, merges or not
# (as Llama 3's tokenizer.json says)
_IGNORE_MERGES = frozenset(
    {
        *_LLAMA3_NAMES,
        "glm4",
        "glm5",
        "tekken",
        "youtu",
        "minicpm5",
        "granite-embed-multi-97m",
    }
)
# names llama.cpp knows whose vocabulary is not byte-level (SentencePiece-style BPE over raw UTF-8,
# or a custom digit splitter with no regular expression to write it as)
_UNREPRODUCED_PRE = frozenset(
    {
        "gemma4",
        "granite-embed-multi-311m",
        "sarvam-moe",
        "whitespace",
        "afmoe",
        "superbpe",
    }
)


def _field(reader: Reader, key: str, default: object = None) -> Any:
    """The metadata value at `key` as the file holds it (a number, a string, a list...), or `default`."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: Reader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFConversionError(f"the GGUF file has no {key!r}: it is incomplete or not a model file")
    return value


def _first(value: Any) -> Any:
    """A per-layer array's first layer's value (Gemma 4 writes some keys per layer), or the value."""
    return value[0] if isinstance(value, list) else value


def _gemma4(reader: Reader, arch: str, config: dict[str, Any], names: set[str]) -> None:
    """Gemma 4's config.json keys from what llama.cpp's converter writes: per-layer kv heads and MLP
    widths, the full layers' head size (key_length; the sliding ones' key_length_swa), their
    proportional RoPE as frequency factors (`rope_freqs`: 1 for the angles that turn, 1e30 for the
    others), k == v where a full layer has no attn_v, the per-layer input table's rows."""
    layers = config["num_hidden_layers"]
    pattern = _required(reader, f"{arch}.attention.sliding_window_pattern")
    types = ["sliding_attention" if s else "full_attention" for s in pattern]
    full = types.index("full_attention")
    sliding = types.index("sliding_attention") if "sliding_attention" in types else full
    kv = _field(reader, f"{arch}.attention.head_count_kv", config["num_attention_heads"])
    kv = kv if isinstance(kv, list) else [kv] * layers
    ff = _required(reader, f"{arch}.feed_forward_length")
    ff = ff if isinstance(ff, list) else [ff] * layers
    shared = int(_field(reader, f"{arch}.attention.shared_kv_layers", 0))
    head_full = int(_required(reader, f"{arch}.attention.key_length"))
    head_swa = int(_field(reader, f"{arch}.attention.key_length_swa", head_full))
    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        values = [float(v) for v in freqs.data.reshape(-1)]
        turned = sum(v == 1.0 for v in values)
        if any(v != 1.0 and v < 1e29 for v in values) or values[:turned] != [1.0] * turned:
            raise GGUFConversionError(
                "Gemma 4's rope_freqs: frequency factors other than proportional RoPE's"
            )
        full_rope = {
            "rope_type": "proportional",
            "partial_rotary_factor": 2 * turned / head_full,
            "rope_theta": config["rope_theta"],
        }
    per_layer_table = next((t for t in reader.tensors if t.name == "per_layer_token_embd.weight"), None)
    first_shared = layers - shared
    config.update(
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        layer_types=types,
        head_dim=head_swa,
        num_key_value_heads=int(kv[sliding]),
        intermediate_size=int(ff[0]),
        use_double_wide_mlp=shared > 0 and int(ff[-1]) == 2 * int(ff[0]) != int(ff[0]),
        attention_k_eq_v=f"blk.{full}.attn_v.weight" not in names,
        per_layer_config={
            str(i): {"head_dim": head_full, "num_key_value_heads": int(kv[i])}
            for i, t in enumerate(types)
            if t == "full_attention"
        },
        rope_parameters={
            "full_attention": full_rope,
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
            },
        },
        vocab_size_per_layer_input=int(per_layer_table.shape[-1]) if per_layer_table is not None else 0,
        hidden_size_per_layer_input=0,  # unless the file says (the family's keys)
        enable_moe_block=bool(_field(reader, f"{arch}.expert_count")),
        tie_word_embeddings=True,
    )
    if config["enable_moe_block"]:  # gemma-4-26B-A4B's experts, beside every layer's MLP
        config.update(
            num_experts=int(_required(reader, f"{arch}.expert_count")),
            top_k_experts=int(_required(reader, f"{arch}.expert_used_count")),
            moe_intermediate_size=int(_required(reader, f"{arch}.expert_feed_forward_length")),
        )
    if any(
        int(ff[i]) != int(ff[0]) * (2 if config["use_double_wide_mlp"] and i >= first_shared else 1)
        for i in range(layers)
    ):
        raise GGUFConversionError("Gemma 4: MLP widths per layer other than the double-wide shared layers'")


def _gemma3n(reader: Reader, arch: str, config: dict[str, Any]) -> None:
    """Gemma 3n's config.json keys from what llama.cpp's converter writes: per-layer MLP widths, the
    sliding pattern, both RoPE bases, LAuReL's rank (its tensors'), and the activation sparsity as the
    converter stores it, the normal quantile of each layer's target (−inf: none), read back to the target."""
    pattern = _required(reader, f"{arch}.attention.sliding_window_pattern")
    ff = _required(reader, f"{arch}.feed_forward_length")
    layers = config["num_hidden_layers"]
    scales = _field(reader, f"{arch}.activation_sparsity_scale") or [-math.inf] * layers
    per_layer_table = next((t for t in reader.tensors if t.name == "per_layer_token_embd.weight"), None)
    laurel = next((t for t in reader.tensors if t.name == "blk.0.laurel_l.weight"), None)
    config.update(
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        laurel_rank=int(laurel.shape[-1]) if laurel is not None else 64,
        layer_types=["sliding_attention" if s else "full_attention" for s in pattern],
        intermediate_size=[int(f) for f in ff] if isinstance(ff, list) else [int(ff)] * layers,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
            },
        },
        activation_sparsity_pattern=[
            0.0 if not math.isfinite(x) else 0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) for x in scales
        ],
        vocab_size_per_layer_input=int(per_layer_table.shape[-1]) if per_layer_table is not None else 0,
        tie_word_embeddings=True,
    )


def gguf_config(reader: Reader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    experts = _field(reader, f"{arch}.expert_count")
    name = gguf_architecture(str(arch), bool(experts))  # a "llama" file with experts is Mixtral
    if name is None:
        raise GGUFConversionError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(gguf_names())})"
        )
    hf_arch, model_type = name.architecture, name.model_type
    n_heads = int(_required(reader, f"{arch}.attention.head_count"))
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_required(reader, "tokenizer.ggml.tokens"))
    # (a Mamba file has no attention heads: head_count 0)
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // max(n_heads, 1)
    # llama.cpp's converter writes a model's multi-token-prediction layers as blocks after its own
    # (GLM-4.5, Qwen3.5): not read (`mtp_tensor`)
    nextn = int(_field(reader, f"{arch}.nextn_predict_layers", 0) or 0)
    # a model with experts in every layer may have no dense MLP size (Qwen3.5-MoE)
    ffn = _field(reader, f"{arch}.feed_forward_length") or _field(
        reader, f"{arch}.expert_feed_forward_length"
    )
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_first(ffn or _required(reader, f"{arch}.feed_forward_length"))),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")) - nextn,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_first(_field(reader, f"{arch}.attention.head_count_kv", n_heads))),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if model_type in ("gemma3_text", "gemma2"):
        config.update(
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(_field(reader, f"{arch}.attention.sliding_window", 4096)),
            query_pre_attn_scalar=int(head_dim),
            tie_word_embeddings=True,
        )
    if model_type == "gemma3_text":
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    if model_type == "gemma2":
        config.update(
            attn_logit_softcapping=_field(reader, f"{arch}.attn_logit_softcapping", 50.0),
            final_logit_softcapping=_field(reader, f"{arch}.final_logit_softcapping", 30.0),
        )
    if model_type == "gemma4_text":
        _gemma4(reader, str(arch), config, names)
    if model_type == "gemma3n_text":
        _gemma3n(reader, str(arch), config)
    if model_type == "qwen2":
        config["attention_bias"] = True
    if model_type == "mixtral":
        config.update(
            num_local_experts=int(experts),
            num_experts_per_tok=int(_required(reader, f"{arch}.expert_used_count")),
        )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        config.update(
            num_experts=int(experts),
            num_experts_per_tok=int(_required(reader, f"{arch}.expert_used_count")),
            moe_intermediate_size=int(_required(reader, f"{arch}.expert_feed_forward_length")),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if model_type == "qwen2_moe":
        config.update(
            attention_bias=True,
            norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", False)),
            shared_expert_intermediate_size=int(
                _field(reader, f"{arch}.expert_shared_feed_forward_length", 0)
            ),
        )
    if model_type == "qwen3_moe":
        config["norm_topk_prob"] = bool(_field(reader, f"{arch}.expert_weights_norm", True))
    if model_type == "phi3":
        if "rope_factors_long.weight" in names:
            raise GGUFConversionError("Phi-3's long-context rope (rope_factors_long) is not supported yet")
        config.update(
            original_max_position_embeddings=config["max_position_embeddings"],
            pad_token_id=None,
            tie_word_embeddings="output.weight" not in names,
        )
    if model_type == "gpt_oss":
        rope = _rope(reader, arch, config["rope_theta"], truncate=False)  # gpt-oss's (llama.cpp stores none)
        layers = config["num_hidden_layers"]
        config.update(
            num_local_experts=int(experts),
            num_experts_per_tok=int(_required(reader, f"{arch}.expert_used_count")),
            intermediate_size=int(
                _field(reader, f"{arch}.expert_feed_forward_length", config["intermediate_size"])
            ),
            sliding_window=int(_required(reader, f"{arch}.attention.sliding_window")),
            # llama.cpp's pattern for gpt-oss: even layers slide (as transformers' default)
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            attention_bias=True,
            rope_parameters=rope,
        )
    if model_type == "olmo2":  # OLMo 2; with windows OLMo 3 (llama.cpp writes both as "olmo2")
        config.update(rope_parameters=_rope(reader, arch, config["rope_theta"]))
        if window := _field(reader, f"{arch}.attention.sliding_window"):
            layers = config["num_hidden_layers"]
            pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
            pattern = [(i + 1) % 4 != 0 for i in range(layers)] if pattern is None else pattern
            local = float(_field(reader, f"{arch}.rope.freq_base_swa", config["rope_theta"]))
            config.update(
                architectures=["Olmo3ForCausalLM"],
                model_type="olmo3",
                sliding_window=int(window),
                layer_types=["sliding_attention" if p else "full_attention" for p in pattern],
                rope_parameters={
                    "full_attention": config["rope_parameters"],
                    "sliding_attention": {"rope_type": "default", "rope_theta": local},
                },
            )
    if model_type in DELTANET_TYPES:
        layers = config["num_hidden_layers"]
        recurrent = _field(reader, f"{arch}.attention.recurrent_layers")
        interval = int(_field(reader, f"{arch}.full_attention_interval", 4))
        if recurrent is None:
            recurrent = [(i + 1) % interval != 0 for i in range(layers)]
        recurrent = list(recurrent)[:layers]  # (an MTP block's entry after the model's)
        k_heads = int(_required(reader, f"{arch}.ssm.group_count"))
        v_heads = int(_required(reader, f"{arch}.ssm.time_step_rank"))
        config.update(
            layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
            full_attention_interval=interval,
            partial_rotary_factor=int(_required(reader, f"{arch}.rope.dimension_count")) / head_dim,
            linear_num_key_heads=k_heads,
            linear_num_value_heads=v_heads,
            linear_key_head_dim=int(_required(reader, f"{arch}.ssm.state_size")),
            linear_value_head_dim=int(_required(reader, f"{arch}.ssm.inner_size")) // v_heads,
            linear_conv_kernel_dim=int(_field(reader, f"{arch}.ssm.conv_kernel", 4)),
            attention_bias=False,
            # how llama.cpp's converter laid the linear layers out (`linear_attention.LinearAttnConfig`):
            # q|k|v and z apart; Qwen3.5's value heads reordered from grouped by key head to tiled
            linear_layout={"split_qkvz": True, "tiled_v_heads": arch != "qwen3next" and k_heads != v_heads},
        )
        if experts:
            config.update(
                num_experts=int(experts),
                num_experts_per_tok=int(_required(reader, f"{arch}.expert_used_count")),
                moe_intermediate_size=int(_required(reader, f"{arch}.expert_feed_forward_length")),
                shared_expert_intermediate_size=int(
                    _field(reader, f"{arch}.expert_shared_feed_forward_length", 0)
                ),
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
    if model_type in MAMBA_TYPES:
        _mamba_hybrid(reader, str(arch), config, names)
    if model_type in LFM2_TYPES:
        config.update(_lfm2(reader, str(arch), config, names))
    if model_type in KDA_TYPES:
        config.update(_kimi_linear(reader, str(arch), config))
    if model_type in MAMBA1_TYPES:
        _mamba1(reader, str(arch), config, names)
    if model_type == "exaone4":
        if window := _field(reader, f"{arch}.attention.sliding_window"):
            pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
            layers = config["num_hidden_layers"]
            if pattern is None or isinstance(pattern, int):  # llama.cpp's default: every 4th layer global
                pattern = [(i + 1) % int(pattern or 4) != 0 for i in range(layers)]
            config.update(
                sliding_window=int(window),
                layer_types=["sliding_attention" if p else "full_attention" for p in pattern],
            )
        else:
            config.update(sliding_window=None, layer_types=["full_attention"] * config["num_hidden_layers"])
    if model_type == "cohere2":
        layers = config["num_hidden_layers"]
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
        if pattern is None or isinstance(pattern, int):  # llama.cpp's default: every 4th layer global
            pattern = [(i + 1) % int(pattern or 4) != 0 for i in range(layers)]
        config.update(
            layer_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_epsilon", 1e-5)),
            sliding_window=int(_required(reader, f"{arch}.attention.sliding_window")),
            layer_types=["sliding_attention" if p else "full_attention" for p in pattern],
            # its GGUF name is `permuted_qk`: the loader puts the q/k rows in rotate-half's order
            pytgi_qk_rows="rotate_half",
        )
    if model_type == "seed_oss":
        config.update(
            attention_bias="blk.0.attn_q.bias" in names, attention_out_bias="blk.0.attn_output.bias" in names
        )
    if (llama3 := _rope_freqs(reader, arch, config["rope_theta"], int(head_dim))) is not None:
        config["rope_scaling"] = llama3
    if model_type in DEEPSEEK_TYPES:
        config.update(_deepseek2(reader, str(arch), config, names))
    if model_type == "glm4_moe":  # its q/k norms: no key says so, the tensors do
        config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
    config.setdefault("attention_bias", "blk.0.attn_q.bias" in names)
    for key, hf_key in name.keys:  # the family's own keys (its registry entry)
        if (value := _field(reader, f"{arch}.{key}")) is not None:
            config[hf_key] = value
    return config


def _lfm2(reader: Reader, arch: str, config: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """An `lfm2` or `lfm2moe` file's config.json keys, as llama.cpp's converter wrote them from
    LFM2's: the layers' kinds from the kv heads per layer (0: a short convolution), the convolution's
    taps (`shortconv.l_cache`), the MLP's width as the model uses it (already adjusted); LFM2-MoE's
    dense first layers and its router (sigmoid scores, the correction bias where the file has
    `exp_probs_b`, renormalized unless the file says not)."""
    layers = config["num_hidden_layers"]
    kv = _field(reader, f"{arch}.attention.head_count_kv", config["num_attention_heads"])
    kv = [int(k) for k in kv] if isinstance(kv, list) else [int(kv)] * layers
    out: dict[str, Any] = {
        "layer_types": ["full_attention" if k else "conv" for k in kv[:layers]],
        "num_key_value_heads": max(kv),
        "conv_L_cache": int(_required(reader, f"{arch}.shortconv.l_cache")),
        "norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "block_auto_adjust_ff_dim": False,
        "conv_bias": any(n.endswith(".shortconv.conv.bias") for n in names),
    }
    experts = _field(reader, f"{arch}.expert_count")
    if experts:
        gating = _field(reader, f"{arch}.expert_gating_func")
        if gating not in (None, 2):  # llama.cpp's ExpertGatingFuncType: 1 softmax, 2 sigmoid
            raise GGUFConversionError(
                f"an {arch!r} file whose router's gating function is {gating}: LFM2-MoE's is sigmoid"
            )
        out.update(
            num_experts=int(experts),
            num_experts_per_tok=int(_required(reader, f"{arch}.expert_used_count")),
            moe_intermediate_size=int(_required(reader, f"{arch}.expert_feed_forward_length")),
            num_dense_layers=int(_field(reader, f"{arch}.leading_dense_block_count", 0)),
            use_expert_bias=any(n.endswith(".exp_probs_b.bias") for n in names),
            norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", True)),
            routed_scaling_factor=float(_field(reader, f"{arch}.expert_weights_scale", 1.0) or 1.0),
        )
    return out


def _kimi_linear(reader: Reader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """A `kimi-linear` file's config.json keys, as llama.cpp's converter wrote them from Kimi Linear's:
    the layers' kinds from the kv heads per layer (1: a latent-attention layer, 0: KDA), the KDA heads'
    size (`kda.head_dim`) and count (`ssm_beta`'s rows), the convolution's taps, MLA's ranks and head
    sizes, the experts (DeepSeek V3's sigmoid router: renormalized unless the file says not)."""
    layers = config["num_hidden_layers"]
    kv = _field(reader, f"{arch}.attention.head_count_kv", 1)
    kv = [int(k) for k in kv] if isinstance(kv, list) else [int(kv)] * layers
    types = ["full_attention" if k else "linear_attention" for k in kv[:layers]]
    kda = next((i for i, t in enumerate(types) if t == "linear_attention"), None)
    heads = 0
    if kda is not None:
        beta = next((t for t in reader.tensors if t.name == f"blk.{kda}.ssm_beta.weight"), None)
        if beta is None:
            raise GGUFConversionError(f"a {arch!r} file's KDA layer {kda} has no ssm_beta tensor")
        heads = int(beta.shape[1])  # (ggml's order: [hidden, heads])
    rope_dim = int(_required(reader, f"{arch}.rope.dimension_count"))
    q_lora = _field(reader, f"{arch}.attention.q_lora_rank")
    out: dict[str, Any] = {
        "layer_types": types,
        "num_key_value_heads": config["num_attention_heads"],  # MLA's heads (llama.cpp writes 1)
        "linear_num_heads": heads,
        "linear_head_dim": int(_field(reader, f"{arch}.kda.head_dim", 128)),
        "linear_conv_kernel_dim": int(_field(reader, f"{arch}.ssm.conv_kernel", 4)),
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "kv_lora_rank": int(_required(reader, f"{arch}.attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": int(_required(reader, f"{arch}.attention.key_length_mla")) - rope_dim,
        "v_head_dim": int(_required(reader, f"{arch}.attention.value_length_mla")),
        "first_k_dense_replace": int(_field(reader, f"{arch}.leading_dense_block_count", 0)),
    }
    if experts := _field(reader, f"{arch}.expert_count"):
        gating = _field(reader, f"{arch}.expert_gating_func")
        if gating not in (None, 2):  # llama.cpp's ExpertGatingFuncType: 1 softmax, 2 sigmoid
            raise GGUFConversionError(
                f"a {arch!r} file whose router's gating function is {gating}: Kimi's is sigmoid"
            )
        out.update(
            num_experts=int(experts),
            num_experts_per_token=int(_required(reader, f"{arch}.expert_used_count")),
            moe_intermediate_size=int(_required(reader, f"{arch}.expert_feed_forward_length")),
            num_shared_experts=int(_field(reader, f"{arch}.expert_shared_count", 0)),
            routed_scaling_factor=float(_field(reader, f"{arch}.expert_weights_scale", 1.0) or 1.0),
            moe_renormalize=bool(_field(reader, f"{arch}.expert_weights_norm", True)),
            num_expert_group=int(_field(reader, f"{arch}.expert_group_count", 1) or 1),
            topk_group=int(_field(reader, f"{arch}.expert_group_used_count", 1) or 1),
        )
    return out


def _rope(reader: Reader, arch: str, theta: float, truncate: bool | None = None) -> dict[str, Any]:
    """The RoPE parameters a file stores: plain, or YaRN's (`truncate`: the family's, if it has one
    llama.cpp does not store)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "yarn"):
        raise GGUFConversionError(f"the GGUF file's {kind!r} RoPE scaling is not supported for {arch!r}")
    if kind == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": float(_required(reader, f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(
                _required(reader, f"{arch}.rope.scaling.original_context_length")
            ),
            "beta_fast": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        }
        if (attn := _field(reader, f"{arch}.rope.scaling.yarn_attn_factor")) is not None:
            rope["attention_factor"] = float(attn)
        if truncate is not None:
            rope["truncate"] = truncate
    return rope


def _llama3_factors(dim: int, theta: float, rope: dict[str, Any]) -> list[float]:
    """What llama.cpp's converter writes as `rope_freqs` for a llama3 scaling: each frequency's divisor."""
    import math

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    orig = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _rope_freqs(reader: Reader, arch: str, theta: float, dim: int) -> dict[str, Any] | None:
    """A llama3 scaling back from the `rope_freqs` tensor llama.cpp writes for it (Llama 3.1+,
    Exaone 4): its factor is the largest divisor, its low/high bounds (up to a common scale with the
    original context, which leaves the frequencies as they are) from the smoothed ones; checked by
    recomputing every divisor. None: the file has no such tensor."""
    import math

    import numpy as np

    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    got = [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    factor = max(got)
    orig = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    wavelens = [2 * math.pi * theta ** (i / dim) for i in range(0, dim, 2)]
    close = lambda a, b: abs(a - b) <= 1e-5 * max(1.0, abs(b))
    band = [(orig / w, f) for w, f in zip(wavelens, got) if not close(f, 1.0) and not close(f, factor)]
    if factor <= 1.0 or len(got) != len(wavelens):
        raise GGUFConversionError(
            f"the GGUF file's rope_freqs ({len(got)} divisors) are not a llama3 scaling"
        )
    # smooth = (x - low) / (high - low) for x = orig / wavelen, between the factor's x (below low) and
    # 1's (above high): fitted through two smoothed divisors, or, with fewer, any bounds that put
    # each x in its group
    lows = [x for x, f in zip((orig / w for w in wavelens), got) if close(f, factor)]
    highs = [x for x, f in zip((orig / w for w in wavelens), got) if close(f, 1.0)]
    x_low, x_high = max(lows, default=0.0), min(highs, default=2 * orig / wavelens[0])
    smooth = [(x, (1 / f - 1 / factor) / (1 - 1 / factor)) for x, f in band]
    candidates: list[tuple[float, float]] = []
    if len(smooth) >= 2:
        (x1, s1), (x2, s2) = smooth[0], smooth[-1]
        slope = (s2 - s1) / (x2 - x1)
        candidates.append((x1 - s1 / slope, x1 - s1 / slope + 1 / slope))
    elif smooth:
        x1, s1 = smooth[0]
        for share in (0.5, 0.9, 0.99, 0.1):
            low = x_low + share * (x1 - x_low)
            candidates.append((low, low + (x1 - low) / s1))
    else:
        candidates.append((x_low + (x_high - x_low) / 3, x_low + 2 * (x_high - x_low) / 3))
    for low, high in candidates:
        rope = {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": orig,
        }
        if all(close(a, b) for a, b in zip(_llama3_factors(dim, theta, rope), got)):
            return rope
    raise GGUFConversionError("the GGUF file's rope_freqs are not a llama3 scaling pytgi can read back")


def _deepseek2(reader: Reader, arch: str, config: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A `deepseek2` file's config.json keys, as llama.cpp's converter wrote them from DeepSeek V2 / V3's:
    MLA's ranks and head sizes (`key_length_mla` / `value_length_mla`, or, in older files, the
    per-head `key_length` / `value_length`), the dense layers first, the experts, and the router: V3's
    (sigmoid scores and a correction bias: `expert_gating_func` 2, or `exp_probs_b` tensors without the
    key) or V2's (softmax; grouped when the file has expert groups). YaRN's `yarn_log_multiplier` is
    0.1 · mscale_all_dim, which llama.cpp reads as both mscales (the rotary tables unscaled, the
    softmax scaled by mscale²): so here too. A `mistral4` file is Mistral 4's (`_mistral4`)."""
    rope_dim = int(_required(reader, f"{arch}.rope.dimension_count"))
    key_mla = _field(reader, f"{arch}.attention.key_length_mla")
    if key_mla is not None:
        nope, v_dim = int(key_mla) - rope_dim, int(_required(reader, f"{arch}.attention.value_length_mla"))
    else:  # files from before the MLA keys: the per-head sizes, kv_b_proj whole
        nope = int(_required(reader, f"{arch}.attention.key_length")) - rope_dim
        v_dim = int(_required(reader, f"{arch}.attention.value_length"))
    q_lora = _field(reader, f"{arch}.attention.q_lora_rank")
    layers = config["num_hidden_layers"]  # (without the MTP blocks GLM-4.7-Flash's file counts)
    out: dict[str, Any] = {
        "num_key_value_heads": config["num_attention_heads"],  # MLA's heads (llama.cpp writes 1)
        "head_dim": rope_dim,
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "kv_lora_rank": int(_required(reader, f"{arch}.attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_dim,
        "rope_interleave": True,  # llama.cpp keeps DeepSeek's paired rotary features
        "first_k_dense_replace": int(_field(reader, f"{arch}.leading_dense_block_count", 0)),
        "num_nextn_predict_layers": int(_field(reader, f"{arch}.nextn_predict_layers", 0) or 0),
    }
    experts = _field(reader, f"{arch}.expert_count")
    gating = _field(reader, f"{arch}.expert_gating_func")
    v3 = gating == 2 or (gating is None and any(n.endswith(".exp_probs_b.bias") for n in names))
    if experts:
        groups = int(_field(reader, f"{arch}.expert_group_count", 1) or 1)
        out.update(
            n_routed_experts=int(experts),
            num_experts_per_tok=int(_required(reader, f"{arch}.expert_used_count")),
            moe_intermediate_size=int(_required(reader, f"{arch}.expert_feed_forward_length")),
            n_shared_experts=int(_field(reader, f"{arch}.expert_shared_count", 0)),
            routed_scaling_factor=float(_field(reader, f"{arch}.expert_weights_scale", 1.0)),
            norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", False)),
            n_group=groups,
            topk_group=int(_field(reader, f"{arch}.expert_group_used_count", 1) or 1),
            topk_method="group_limited_greedy" if groups > 1 else "greedy",
        )
    else:
        out["first_k_dense_replace"] = layers
    if _field(reader, f"{arch}.attention.temperature_scale") and arch != "mistral4":
        # Llama 4's query scale on DeepSeek's layers (Mistral Large 3 as llama.cpp writes Mistral's
        # own format): transformers serves it as a Mistral 4, which this file does not say it is
        raise GGUFConversionError(
            f"a {arch!r} file with Llama 4's query scaling (attention.temperature_scale) is not read yet"
        )
    if not v3 and arch != "mistral4":
        out.update(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if _field(reader, f"{arch}.rope.scaling.type") == "yarn":
        mscale = float(_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope = {
            "rope_type": "yarn",
            "rope_theta": config["rope_theta"],
            "factor": float(_required(reader, f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(
                _required(reader, f"{arch}.rope.scaling.original_context_length")
            ),
            "beta_fast": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            **({"mscale": mscale, "mscale_all_dim": mscale} if mscale else {}),
        }
    out["rope_parameters"] = rope
    if arch == "mistral4":
        out.pop("topk_method", None)  # (Mistral 4 has its own router, and no such key)
        out.update(_mistral4(reader, arch, config, names, rope, nope, rope_dim))
    return out


def _mistral4(
    reader: Reader,
    arch: str,
    config: dict[str, Any],
    names: set[str],
    rope: dict[str, Any],
    nope: int,
    rope_dim: int,
) -> dict[str, Any]:
    """A `mistral4` file's keys beyond DeepSeek's: llama.cpp's converter writes Mistral 4
    (`Mistral4ForCausalLM`) as it writes DeepSeek V2 / V3, under its own name. Its router is Mistral
    4's (softmax scores, the `expert_group_used_count` groups of the best two scores' sums, as
    llama.cpp groups every router): the file names no gating function and has no correction biases.
    Its rotary features are the rope part of a head (`partial_rotary_factor`, a fraction of the head).

    Llama 4's query scale, 1 + beta · ln(1 + floor(position / original_max_position_embeddings)):
    the converter writes no beta (`attention.temperature_scale`, which llama.cpp's runtime would
    read). Where the file has one, it is read; where not, the model is served exactly where the
    scale is 1 whatever beta is, the positions below YaRN's original context: `max_position_embeddings`
    is cut to it (`llama_4_scaling_beta` 0 says the scale is 1 there; `deepseek_config` logs the cut)."""
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's ExpertGatingFuncType: 1 softmax, 2 sigmoid
        raise GGUFConversionError(
            f"a {arch!r} file whose router's gating function is {gating}: Mistral 4's is softmax"
        )
    if any(n.endswith(".exp_probs_b.bias") for n in names):
        raise GGUFConversionError(
            f"a {arch!r} file with router correction biases: Mistral 4's router has none"
        )
    rope["partial_rotary_factor"] = rope_dim / (nope + rope_dim)
    orig = rope.get("original_max_position_embeddings")
    out: dict[str, Any] = {"architectures": ["Mistral4ForCausalLM"], "model_type": "mistral4"}
    if beta := _field(reader, f"{arch}.attention.temperature_scale"):
        context = int(_field(reader, f"{arch}.attention.temperature_length", orig or 0) or 0)
        if context <= 0 or (orig is not None and context != orig):
            raise GGUFConversionError(
                f"a {arch!r} file whose Llama 4 query scale's length ({context}) is not YaRN's original "
                f"context ({orig}): Mistral 4 scales by the one length"
            )
        rope.update(llama_4_scaling_beta=float(beta), original_max_position_embeddings=context)
        return out
    if orig is None:
        raise GGUFConversionError(
            f"a {arch!r} file with neither Llama 4's query scaling beta nor YaRN's original context: "
            "where its query scale departs from 1 is not known"
        )
    rope["llama_4_scaling_beta"] = 0.0
    out.update(
        max_position_embeddings=min(int(config["max_position_embeddings"]), int(orig)),
        pytgi_llama4_beta_unknown=True,
    )
    return out


def _per_layer(reader: Reader, key: str, layers: int) -> list[int]:
    """A key llama.cpp writes per layer for hybrids (or once for all): one int a layer."""
    value = _field(reader, key, 0)
    return [int(v) for v in value][:layers] if isinstance(value, list) else [int(value or 0)] * layers


def _mamba_hybrid(reader: Reader, arch: str, config: dict[str, Any], names: set[str]) -> None:
    """Nemotron-H's and Granite-4.0-H's config.json keys from what llama.cpp's converter writes: a
    layer attends where its head_count_kv is not 0; Nemotron-H's MLP (or experts) layers are those
    with a feed_forward_length, the others Mamba-2; the Mamba-2 sizes from the ssm keys (heads:
    time_step_rank; head_dim: inner_size / heads)."""
    layers = config["num_hidden_layers"]
    kv = _per_layer(reader, f"{arch}.attention.head_count_kv", layers)
    heads = int(_required(reader, f"{arch}.ssm.time_step_rank"))
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    used = int(_field(reader, f"{arch}.expert_used_count", 0) or 0)
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    mamba = {
        "state": int(_required(reader, f"{arch}.ssm.state_size")),
        "groups": int(_required(reader, f"{arch}.ssm.group_count")),
        "conv": int(_field(reader, f"{arch}.ssm.conv_kernel", 4)),
        "head_dim": int(_required(reader, f"{arch}.ssm.inner_size")) // heads,
        "conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in names),
        "proj_bias": any(n.endswith(".ssm_in.bias") for n in names),
    }
    config.update(num_key_value_heads=max(kv), attention_bias=False)
    if arch == "falcon-h1":  # every layer attends and has its Mamba-2 mixer; its multipliers are folded
        config.update(
            mamba_n_heads=heads,
            mamba_d_head=mamba["head_dim"],
            mamba_d_ssm=mamba["head_dim"] * heads,
            mamba_n_groups=mamba["groups"],
            mamba_d_state=mamba["state"],
            mamba_d_conv=mamba["conv"],
            mamba_conv_bias=mamba["conv_bias"],
            mamba_proj_bias=mamba["proj_bias"],
            projectors_bias=any(n.endswith(".ssm_out.bias") for n in names),
            # the gated norm where the file has one, as llama.cpp runs it: after the gate
            mamba_rms_norm=any(n.endswith(".ssm_norm.weight") for n in names),
            mamba_norm_before_gate=False,
        )
        return
    if arch.startswith("nemotron_h"):
        ffn = _per_layer(reader, f"{arch}.feed_forward_length", layers)
        mlp = "moe" if arch == "nemotron_h_moe" else "mlp"
        n_group = int(_field(reader, f"{arch}.expert_group_count", 1) or 1)
        topk_group = _field(reader, f"{arch}.expert_group_used_count")
        if topk_group is None and n_group > 1:
            raise GGUFConversionError("a Nemotron-H file with expert groups but no expert_group_used_count")
        config.update(
            layers_block_type=[
                "full_attention" if k else mlp if f else "linear_attention" for k, f in zip(kv, ffn)
            ],
            intermediate_size=max(ffn),
            layer_norm_epsilon=config["rms_norm_eps"],
            mlp_hidden_act="relu2",
            mamba_num_heads=heads,
            mamba_head_dim=mamba["head_dim"],
            n_groups=mamba["groups"],
            ssm_state_size=mamba["state"],
            conv_kernel=mamba["conv"],
            use_conv_bias=mamba["conv_bias"],
            use_bias=mamba["proj_bias"],
        )
        if experts:
            config.update(
                n_routed_experts=experts,
                num_experts_per_tok=used,
                moe_intermediate_size=int(_required(reader, f"{arch}.expert_feed_forward_length")),
                moe_shared_expert_intermediate_size=int(shared or 0),
                n_shared_experts=int(_field(reader, f"{arch}.expert_shared_count", 1) or 0),
                norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", True)),
                routed_scaling_factor=float(_field(reader, f"{arch}.expert_weights_scale", 1.0) or 1.0),
                n_group=n_group,
                topk_group=int(topk_group or 1),
            )
        return
    rope = bool(_field(reader, f"{arch}.rope.scaling.finetuned", False))
    if shared is None:  # a dense file's MLP: its rows
        up = next(t for t in reader.tensors if t.name.endswith(".ffn_up.weight"))
        shared = int(up.shape[1])
    config.update(
        layer_types=["attention" if k else "mamba" for k in kv],
        num_local_experts=experts,
        num_experts_per_tok=used,
        shared_intermediate_size=int(shared),
        position_embedding_type="rope" if rope else None,
        mamba_n_heads=heads,
        mamba_d_head=mamba["head_dim"],
        mamba_n_groups=mamba["groups"],
        mamba_d_state=mamba["state"],
        mamba_d_conv=mamba["conv"],
        mamba_conv_bias=mamba["conv_bias"],
        mamba_proj_bias=mamba["proj_bias"],
    )
    if rope and (dim := _field(reader, f"{arch}.rope.dimension_count")):  # Bamba's half-head RoPE
        config["partial_rotary_factor"] = int(dim) / config["head_dim"]


def _periodic(where: list[bool], what: str) -> tuple[int, int]:
    """(period, offset) of the layers marked in `where`, as Jamba's config gives them (none: an offset
    no layer reaches)."""
    marked = [i for i, m in enumerate(where) if m]
    if not marked:
        return len(where) + 1, len(where)
    period = marked[1] - marked[0] if len(marked) > 1 else len(where)
    offset = marked[0] % period
    if [i % period == offset for i in range(len(where))] != where:
        raise GGUFConversionError(f"Jamba's {what} layers are not every n-th layer: {marked}")
    return period, offset


def _mamba1(reader: Reader, arch: str, config: dict[str, Any], names: set[str]) -> None:
    """Mamba-1's sizes from the `ssm.*` keys (llama.cpp's converter writes FalconMamba as `mamba` with
    `ssm.dt_b_c_rms`); Jamba's attention layers are those whose per-layer head_count_kv is not 0, its
    expert layers those with a router (`ffn_gate_inp`)."""
    inner = int(_required(reader, f"{arch}.ssm.inner_size"))
    state = int(_required(reader, f"{arch}.ssm.state_size"))
    rank = int(_required(reader, f"{arch}.ssm.time_step_rank"))
    kernel = int(_field(reader, f"{arch}.ssm.conv_kernel", 4))
    conv_bias = any(n.endswith(".ssm_conv1d.bias") for n in names)
    proj_bias = any(n.endswith(".ssm_in.bias") for n in names)
    layers = config["num_hidden_layers"]
    if arch == "mamba":
        falcon = bool(_field(reader, f"{arch}.ssm.dt_b_c_rms", False))
        config.update(
            architectures=["FalconMambaForCausalLM" if falcon else "MambaForCausalLM"],
            model_type="falcon_mamba" if falcon else "mamba",
            intermediate_size=inner,
            state_size=state,
            time_step_rank=rank,
            conv_kernel=kernel,
            use_conv_bias=conv_bias,
            use_bias=proj_bias,
            layer_norm_epsilon=config["rms_norm_eps"],
        )
        return
    kv = _field(reader, f"{arch}.attention.head_count_kv")
    kv = list(kv) if isinstance(kv, (list, tuple)) else [int(kv or 0)] * layers
    attn_period, attn_offset = _periodic([bool(k) for k in kv[:layers]], "attention")
    routed = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers)]
    moe_period, moe_offset = _periodic(routed, "expert")
    config.update(
        num_key_value_heads=int(max(kv) or config["num_attention_heads"]),
        attn_layer_period=attn_period,
        attn_layer_offset=attn_offset,
        expert_layer_period=moe_period,
        expert_layer_offset=moe_offset,
        num_experts=int(_field(reader, f"{arch}.expert_count", 1) or 1),
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 2) or 2),
        mamba_expand=inner // config["hidden_size"],
        mamba_d_state=state,
        mamba_dt_rank=rank,
        mamba_d_conv=kernel,
        mamba_conv_bias=conv_bias,
        mamba_proj_bias=proj_bias,
    )


def mtp_tensor(name: str, config: dict[str, Any]) -> bool:
    """A tensor of a multi-token-prediction block llama.cpp wrote after the model's layers (skipped)."""
    parts, layers = name.split("."), config.get("num_hidden_layers")
    return layers is not None and len(parts) > 2 and parts[0] == "blk" and int(parts[1]) >= layers


def hf_tensor_name(name: str, model_type: str = "llama") -> str:
    if model_type in DELTANET_TYPES and name.endswith(".ssm_a"):  # a bare parameter: −exp(A_log)
        return f"model.layers.{name.split('.')[1]}.linear_attn.A_log"
    if model_type in DELTANET_TYPES and name.endswith(".ssm_dt.bias"):
        return f"model.layers.{name.split('.')[1]}.linear_attn.dt_bias"
    if model_type in MAMBA_TYPES:  # Mamba-2's bare parameters: blk.N.ssm_a, blk.N.ssm_d, blk.N.ssm_dt.bias
        parts = name.split(".")
        if len(parts) in (3, 4) and parts[0] == "blk" and parts[2] in MAMBA_BARE:
            return f"model.layers.{parts[1]}.linear_attn.{MAMBA_BARE[parts[2]]}"
        if len(parts) == 3 and parts[0] == "blk" and parts[2] == "ffn_norm":  # Falcon-H1's: no ".weight"
            return f"model.layers.{parts[1]}.post_attention_layernorm.weight"
    if model_type in MAMBA1_TYPES:  # Mamba-1's bare parameters: blk.N.ssm_a, blk.N.ssm_d
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in MAMBA1_BARE:
            return f"model.layers.{parts[1]}.linear_attn.{MAMBA1_BARE[parts[2]]}"
    stem, _, kind = name.rpartition(".")  # kind: weight | bias
    if stem == "rope_freqs":  # a llama3 scaling's divisors: read into the config (`_rope_freqs`)
        return "model.rotary_emb.rope_freqs"
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if model_type == "gemma3n_text":
        if stem in GEMMA3N_TENSORS:
            return f"{GEMMA3N_TENSORS[stem]}.{kind}"
        if len(parts) == 3 and parts[0] == "blk" and parts[2] == "altup_correct_scale":
            return f"model.layers.{parts[1]}.altup.correct_output_scale"  # a bare parameter
    bits = name.split(".", 2)  # a KDA layer's bare parameters: blk.N.<its GGUF name>
    if model_type in KDA_TYPES and len(bits) == 3 and bits[0] == "blk" and bits[2] in KDA_PARAMETERS:
        return f"model.layers.{bits[1]}.linear_attn.{KDA_PARAMETERS[bits[2]]}"
    if model_type in LFM2_TYPES:
        if stem == "token_embd_norm":  # LFM2's final norm (`embedding_norm`: after the last layer)
            return f"model.norm.{kind}"
        if len(parts) == 4 and parts[0] == "blk" and parts[2] == "shortconv":  # conv, in_proj, out_proj
            mixer = f"model.layers.{parts[1]}.linear_attn."
            if parts[3] == "conv":  # bare parameters (`short_conv.ShortConv`)
                return mixer + ("conv" if kind == "weight" else "conv_bias")
            return f"{mixer}{parts[3]}.{kind}"
    if model_type == "gemma4_text":
        if stem in GEMMA4_TENSORS:
            return f"{GEMMA4_TENSORS[stem]}.{kind}"
        if len(parts) == 3 and parts[0] == "blk" and parts[2] == "layer_output_scale":
            return f"model.layers.{parts[1]}.layer_scalar"  # a bare parameter
        if len(parts) == 3 and parts[0] == "blk" and kind == "scale" and parts[2] in GEMMA4_SCALES:
            return f"model.layers.{parts[1]}.{GEMMA4_SCALES[parts[2]]}"
    if model_type in DEEPSEEK_TYPES and len(parts) == 3 and parts[0] == "blk" and parts[2] == "exp_probs_b":
        return f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias"  # a bare parameter
    layer = (
        {**LAYER_TENSORS, **GEMMA_LAYER_TENSORS, **GEMMA4_LAYER_TENSORS}
        if model_type == "gemma4_text"
        else {**LAYER_TENSORS, **GEMMA_LAYER_TENSORS, **GEMMA3N_LAYER_TENSORS}
        if model_type == "gemma3n_text"
        else {**LAYER_TENSORS, **GEMMA_LAYER_TENSORS}
        if model_type.startswith("gemma")
        else {**LAYER_TENSORS, **PHI3_LAYER_TENSORS}
        if model_type == "phi3"
        else {**LAYER_TENSORS, **GPT_OSS_LAYER_TENSORS}
        if model_type == "gpt_oss"
        else {**LAYER_TENSORS, **HYBRID_LAYER_TENSORS}
        if model_type in DELTANET_TYPES
        else {**LAYER_TENSORS, **MAMBA_LAYER_TENSORS}
        if model_type in MAMBA_TYPES
        else {**LAYER_TENSORS, **MAMBA1_LAYER_TENSORS}
        if model_type in MAMBA1_TYPES
        else {**LAYER_TENSORS, **POST_NORM_LAYER_TENSORS}
        if model_type in POST_NORM_TYPES
        else {**LAYER_TENSORS, "post_attention_norm": "post_attention_layernorm"}
        if model_type == "seed_oss"  # its MLP's input norm under that name
        else {**LAYER_TENSORS, **DEEPSEEK_LAYER_TENSORS}
        if model_type in DEEPSEEK_TYPES
        else {**LAYER_TENSORS, **DEEPSEEK_LAYER_TENSORS, **KDA_LAYER_TENSORS}
        if model_type in KDA_TYPES
        else {**LAYER_TENSORS, **GLM4_MOE_LAYER_TENSORS}
        if model_type == "glm4_moe"
        else LAYER_TENSORS
    )
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        hf = f"model.layers.{parts[1]}.{layer[parts[2]]}"
        if model_type == "gpt_oss":  # experts keep .weight / .bias; the sinks are a bare parameter
            return hf if parts[2] == "attn_sinks" else f"{hf}.{kind}"
        if parts[2] == "exp_probs_b":
            return hf
        return (
            hf if parts[2].endswith("_exps") else f"{hf}.{kind}"
        )  # stacked experts: a parameter, no .weight
    raise GGUFConversionError(f"unexpected tensor {name!r} in GGUF file")


def _recovered_merges(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """A SentencePiece BPE file keeps no merges: every token that two others join into is one, and
    merges apply best-ranked first (then the longer left part first; ties in file order)."""
    index = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[float, int, int, str, str]] = []
    for tok, score in rank.items():
        pairs = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in index and tok[k:] in index]
        pairs.sort(key=lambda lr: (index[lr[0]], index[lr[1]]))
        merges += [(score, len(left), len(right), left, right) for left, right in pairs]
    merges.sort(key=lambda m: (-m[0], -m[1], -m[2]))  # stable: equal keys keep their order
    return [(left, right) for _, _, _, left, right in merges]


def _sentencepiece_tokenizer_json(reader: Reader, arch: str) -> str:
    """A SentencePiece BPE vocabulary (`tokenizer.ggml.model` = llama) as transformers reads it from
    the file, byte fallback to <0xNN> tokens, BOS added as the file says (by default, as llama.cpp):
    - the Llama family's (Llama 2, Mistral, TinyLlama...): words split on '▁' with one prepended to
      the first (`add_space_prefix`, by default on), merges recovered from the scores;
    - the Gemma family's: spaces become '▁' with no prefix, merges recovered in file order (Gemma's
      scores do not follow its merge order); Gemma 4's (`tokenizer.ggml.model` = gemma4) the same
      with the merges its file holds."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    gemma = arch.startswith("gemma")
    blank = lambda t: "\u2581" * len(t) if gemma and " " in t and not t.strip() else t
    # a blank token with a space in it is stored with real spaces; the normalized text has '▁'
    tokens = [blank(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type") or [])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if gemma:
        rank = {tok: -float(i) for i, tok in enumerate(tokens)}
    else:
        scores = _field(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise GGUFConversionError("the GGUF file's SentencePiece vocabulary has no tokenizer.ggml.scores")
        rank = dict(zip(tokens, map(float, scores)))
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk)] if gemma and unk is not None else None
    merges = _recovered_merges(tokens, rank)
    if (given := _field(reader, "tokenizer.ggml.merges")) and gemma:  # Gemma 4's, split as llama.cpp does
        merges = [(blank(m[: m.index(" ", 1)]), blank(m[m.index(" ", 1) + 1 :])) for m in given]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=unk_token,
        )
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
        if arch == "phi3" and prefix:  # as transformers reads Phi-3: the prefix from a normalizer
            tok.normalizer = normalizers.Sequence(
                [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
            )
        steps += [decoders.Strip(content=" ", left=1, right=0)] if prefix else []
    tok.decoder = decoders.Sequence(steps)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None and _field(reader, "tokenizer.ggml.add_bos_token", True):
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b}:1 $B:1", special_tokens=[(b, int(bos))]
        )
    _add_marked_tokens(tok, tokens, types, vocab)
    return tok.to_str()


def _add_marked_tokens(
    tok: Tokenizer, tokens: list[str], types: list[int], vocab: dict[str, int] | None
) -> None:
    """Control tokens (type 3) are added special tokens, user-defined ones (4) plain added tokens:
    both are matched whole in the text."""
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3]
    )
    tok.add_tokens(
        [
            AddedToken(tokens[i], normalized=False)
            for i, t in enumerate(types)
            if t == 4 and (vocab is None or tokens[i] in vocab)
        ]
    )


def gguf_tokenizer_json(reader: Reader) -> str:
    """Build a `tokenizers` tokenizer equal to the one the GGUF file describes: byte-level BPE
    ('gpt2'), or SentencePiece BPE ('llama': the Llama and Gemma families'; 'gemma4')."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind in ("llama", "gemma4"):
        return _sentencepiece_tokenizer_json(reader, _field(reader, "general.architecture"))
    if kind != "gpt2":
        raise GGUFConversionError(
            f"GGUF tokenizer type {kind!r} is not supported (byte-level BPE 'gpt2', or SentencePiece BPE "
            "'llama'); convert the model to a Hugging Face directory and pass that instead"
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [])
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        why = (
            "its vocabulary is not byte-level or llama.cpp splits it with custom code"
            if pre in _UNREPRODUCED_PRE
            else "pytgi does not know this name"
        )
        raise GGUFConversionError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported: {why}; convert the "
            "model to a Hugging Face directory and pass that instead"
        )
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in _IGNORE_MERGES,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    _add_marked_tokens(tok, tokens, types, None)
    return tok.to_str()


def _tokenizer_config(reader: Reader, config: dict[str, Any]) -> dict[str, Any]:
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def tok(key: str) -> str | None:
        i = _field(reader, key)
        return None if i is None else str(tokens[int(i)])

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        "add_bos_token": bool(
            _field(reader, "tokenizer.ggml.add_bos_token", _field(reader, "tokenizer.ggml.model") == "llama")
        ),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }


SPLIT = re.compile(
    r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE
)  # llama.cpp's gguf-split parts: model-00001-of-00003.gguf


def gguf_parts(path: str | os.PathLike) -> list[Path]:
    """A GGUF file's parts: itself, or, for the first part of a split file, every part in order."""
    path = Path(path)
    m = SPLIT.search(path.name)
    if m is None:
        return [path]
    if int(m[1]) != 1:
        raise GGUFConversionError(
            f"{path.name} is part {int(m[1])} of a split GGUF file: name its first part"
        )
    n = int(m[2])
    parts = [path.with_name(SPLIT.sub(f"-{i:05d}-of-{m[2]}.gguf", path.name)) for i in range(1, n + 1)]
    if missing := [p.name for p in parts if not p.is_file()]:
        raise GGUFConversionError(f"{path.name} is split in {n} parts and {', '.join(missing)} is missing")
    return parts


class _SplitReader:
    """The parts of a split GGUF file read as one: the first part's metadata, every part's tensors."""

    def __init__(self, readers: list[GGUFReader]) -> None:
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]


SOURCE_FILE = "gguf.json"  # in a converted directory: the GGUF file's parts, whose tensors it serves


def write_source(out_dir: Path, gguf_path: str | os.PathLike) -> None:
    """Name (again) the GGUF file a converted directory serves: the same file may have moved."""
    parts = [str(p.resolve()) for p in gguf_parts(gguf_path)]
    tmp = out_dir / f".{SOURCE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"parts": parts}, indent=2))
    os.replace(tmp, out_dir / SOURCE_FILE)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> Path:
    """Write `out_dir` as a Hugging Face model directory whose weights stay in the GGUF file; atomic (a
    half-written dir never appears). `gguf_path`: a GGUF file, or the first part of a split one."""
    from gguf import GGUFReader

    out_dir = Path(out_dir)
    readers = [GGUFReader(str(p)) for p in gguf_parts(gguf_path)]
    reader = readers[0] if len(readers) == 1 else _SplitReader(readers)
    config = gguf_config(reader)
    tokenizer_json = gguf_tokenizer_json(reader)
    tok_config = _tokenizer_config(reader, config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        types = {
            hf_tensor_name(t.name, config["model_type"]): t.tensor_type.name
            for t in reader.tensors
            if not mtp_tensor(t.name, config)
        }
        (tmp / "quantization.json").write_text(json.dumps({"source": "gguf", "tensors": types}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        write_source(tmp, gguf_path)
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
