"""gpt-oss in pytgi's own model code (issue 46, point 1), through the engine: greedy tokens equal
transformers' `generate` in float32 (sinks, alternating windows, YaRN, biased router and experts, the
clamped SwiGLU), and in bf16 a request batched with others gives what it gives alone. The layer-level
logits under chunking and prefix hits are tests/model/test_tiny_models.py's ("gpt-oss"); N shards =
one is tests/model/test_sharding.py's."""

from __future__ import annotations

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.engine.engine import LLMEngine
from tests.model.test_sharding import run

PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64] * 3, [7, 9] * 10, list(range(30, 60))]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,  # the prompts reach past it
        swiglu_limit=1.0,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        eos_token_id=None,
        initializer_range=0.2,  # weights big enough for greedy tokens that vary
    )
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # biases and sinks large enough to matter
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name:
                p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp("gpt-oss")
    model.save_pretrained(path)
    return model, path


def test_greedy_equals_transformers_in_float32(gpt_oss):
    model, path = gpt_oss
    engine = LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, dtype="float32"))
    try:
        got = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    for prompt, (tokens, _) in zip(PROMPTS, got):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        ref = out[0, len(prompt) :].tolist()
        assert tokens == ref, (prompt, tokens, ref)


def test_batched_equals_alone_in_bf16(gpt_oss):
    _, path = gpt_oss
    engine = LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, dtype="bfloat16"))
    try:
        alone = [run(engine, [p])[0] for p in PROMPTS]
        batched = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert batched == alone  # tokens and every prompt and output logprob, to the bit
