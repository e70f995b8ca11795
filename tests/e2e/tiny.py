"""Tiny random-weight models served in e2e tests: the tiny tokenizer (tests/unit/tiny_tokenizer.py)
plus random Llama weights, built in a second or two."""

from __future__ import annotations

import json

import torch
import transformers
from tokenizers import Tokenizer

from tests.unit import tiny_tokenizer


def tiny_model(path, template: str | None = None):
    """The tiny tokenizer plus Mistral's two control tokens (`[TOOL_CALLS]`, `[ARGS]`), the template
    (else ChatML), random Llama weights."""
    tiny_tokenizer.build(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["[TOOL_CALLS]", "[ARGS]"])
    tok.save(str(path / "tokenizer.json"))
    if template is not None:
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(tok.get_vocab_size())).save_pretrained(path)
    return path


def llama_config(vocab_size: int) -> transformers.LlamaConfig:
    """The tiny random Llama's config (the tiny tokenizer's ids: bos 1, eos 2)."""
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
