"""Falcon-H1 in pytgi's own code (issue 64): attention and a Mamba-2 mixer side by side in every layer,
its µP multipliers (all set off 1 here) folded into the weights at load; tiny random configs through
the engine. Greedy tokens equal transformers' `generate` in float32, alone and batched, with prefill
chunks that cut through the prompts; with and without the Mamba mixer's gated norm; each layer keeps
its keys and values and its Mamba-2 state."""

from __future__ import annotations

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.engine.llm_engine import LLMEngine
from tests.model.test_sharding import run

PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64] * 5, [7, 9] * 10, list(range(30, 60)), [11]]

MULTIPLIERS = dict(
    embedding_multiplier=1.5,
    lm_head_multiplier=0.7,
    key_multiplier=0.8,
    attention_in_multiplier=1.2,
    attention_out_multiplier=0.9,
    ssm_in_multiplier=1.1,
    ssm_out_multiplier=0.6,
    ssm_multipliers=[0.9, 1.3, 0.7, 1.2, 1.4],
    mlp_multipliers=[1.25, 0.8],
)


def _model(tmp_path_factory, seed: int, **kw):
    torch.manual_seed(seed)
    cfg = transformers.FalconH1Config(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_chunk_size=16,
        eos_token_id=None,
        initializer_range=0.2,
        **MULTIPLIERS,
        **kw,
    )
    model = transformers.FalconH1ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms off 1, decays, steps and skips that matter
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name or name.endswith(".D"):
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp("falcon-h1")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=["plain", "gated_norm"])
def falcon_h1(request, tmp_path_factory):
    if request.param == "plain":
        return _model(tmp_path_factory, 0)
    return _model(tmp_path_factory, 1, mamba_rms_norm=True, mamba_norm_before_gate=False)


def _reference(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_transformers_in_float32(falcon_h1):
    model, path = falcon_h1
    refs = [_reference(model, p) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) > 1  # the answers differ: the test can tell them apart
    for kw in ({}, {"max_batch_prefill_tokens": 12, "enable_chunked_prefill": True}):
        engine = LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, dtype="float32", **kw))
        try:
            together = run(engine, PROMPTS)
            alone = [run(engine, [p])[0] for p in PROMPTS]
        finally:
            engine.shutdown()
        for ref, (a, _), (b, _) in zip(refs, together, alone):
            assert a == ref and b == ref, (kw, ref, a, b)


def test_every_layer_keeps_keys_values_and_a_state(falcon_h1):
    _, path = falcon_h1
    engine = LLMEngine(
        EngineConfig(model=str(path), max_batch_total_tokens=1024, dtype="float32", max_batch_size=3)
    )
    try:
        for k, v, conv, ssm in engine.runner.paged.kv_caches:
            assert k.shape[1:] == (2, 16) and v.shape == k.shape
            assert conv.shape == (3, 64 + 2 * 2 * 8, 3)
            assert ssm.shape == (3, 4, 16, 8) and ssm.dtype == torch.float32
    finally:
        engine.shutdown()
