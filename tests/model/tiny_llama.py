"""The tiny random Llama the engine tests run (vocabulary 128, 2 layers, no EOS), saved in float32."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def tiny_llama(path: Path, seed: int = 0, max_positions: int = 128) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=None,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path
