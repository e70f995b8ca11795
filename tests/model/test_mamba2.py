"""The Mamba-2 hybrids in pytgi's own code (issue 64): Nemotron-H (dense MLP and experts, one mixer a
layer), Granite-4.0-H (experts beside a shared MLP, Granite's multipliers, attention with and without
RoPE) and Bamba, tiny random configs, through the engine. Greedy tokens equal transformers' `generate`
in float32, alone and batched, with prefill chunks that cut through the prompts (and through the
scan's 64-token chunks); in bf16 a request batched with others gives what it gives alone; a preempted
request recomputes its state, an aborted one gives its slot back clean; the chunked scan equals the
token-by-token recurrence."""

from __future__ import annotations

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.models.mamba2 import ssd_chunked, ssd_step
from tests.model.test_sharding import run

PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64] * 10, [7, 9] * 10, list(range(30, 60)), [11]]

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    initializer_range=0.2,  # weights big enough for greedy tokens that vary
)
MAMBA = dict(mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=16)


def _save(model, path):
    with torch.no_grad():  # norms off 1, decays, steps and skips that matter, selection biases that steer
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name or name.endswith(".D"):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.5)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    """Every kind of layer: Mamba-2, experts, attention, a dense MLP, Mamba-2 again."""
    torch.manual_seed(0)
    cfg = transformers.NemotronHConfig(
        **COMMON,
        head_dim=16,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention"],
        intermediate_size=64,
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        n_group=2,
        topk_group=1,
        chunk_size=16,
    )
    return _save(transformers.NemotronHForCausalLM(cfg).eval(), tmp_path_factory.mktemp("nemotron-h"))


@pytest.fixture(scope="module")
def granite_h(tmp_path_factory):
    """Granite-4.0-H's own shape: experts beside the shared MLP, no RoPE, the four multipliers."""
    torch.manual_seed(1)
    cfg = transformers.GraniteMoeHybridConfig(
        **COMMON,
        **MAMBA,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        intermediate_size=32,
        shared_intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        logits_scaling=2.0,
        attention_multiplier=0.2,
    )
    return _save(transformers.GraniteMoeHybridForCausalLM(cfg).eval(), tmp_path_factory.mktemp("granite-h"))


@pytest.fixture(scope="module")
def granite_h_dense_rope(tmp_path_factory):
    """Without experts (the shared MLP alone) and with RoPE on the attention layer."""
    torch.manual_seed(2)
    cfg = transformers.GraniteMoeHybridConfig(
        **COMMON,
        **MAMBA,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        shared_intermediate_size=48,
        num_local_experts=0,
        position_embedding_type="rope",
    )
    return _save(transformers.GraniteMoeHybridForCausalLM(cfg).eval(), tmp_path_factory.mktemp("granite-hd"))


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    torch.manual_seed(3)
    cfg = transformers.BambaConfig(
        **COMMON, **MAMBA, intermediate_size=64, num_hidden_layers=3, attn_layer_indices=[1]
    )
    return _save(transformers.BambaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("bamba"))


@pytest.fixture(params=["nemotron_h", "granite_h", "granite_h_dense_rope", "bamba"])
def hybrid(request):
    return request.getfixturevalue(request.param)


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, **kw))


def _reference(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_transformers_in_float32(hybrid):
    model, path = hybrid
    refs = [_reference(model, p) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) > 1  # the answers differ: the test can tell them apart
    # alone and together; prefill chunks of 24 tokens cut every long prompt, and decodes join them
    for kw in ({}, {"max_batch_prefill_tokens": 24, "enable_chunked_prefill": True}):
        engine = _engine(path, dtype="float32", **kw)
        try:
            together = run(engine, PROMPTS)
            alone = [run(engine, [p])[0] for p in PROMPTS]
        finally:
            engine.shutdown()
        for ref, (a, _), (b, _) in zip(refs, together, alone):
            assert a == ref and b == ref, (kw, ref, a, b)


def test_batched_equals_alone_in_bf16(nemotron_h):
    _, path = nemotron_h
    engine = _engine(path, dtype="bfloat16")
    try:
        alone = [run(engine, [p])[0] for p in PROMPTS]
        batched = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert batched == alone  # tokens and every prompt and output logprob, to the bit


def test_a_preempted_request_recomputes_its_state(nemotron_h):
    """A KV cache too small for every request at once: the last admitted is preempted, its state
    slot freed and its state recomputed from its tokens when it runs again; the answers are those of
    a cache big enough."""
    _, path = nemotron_h
    prompts = [list(range(1 + i, 41 + i)) for i in range(4)]
    engine = _engine(path, dtype="float32")
    try:
        ref = run(engine, prompts)
    finally:
        engine.shutdown()
    engine = LLMEngine(
        EngineConfig(
            model=str(path), max_batch_total_tokens=112, block_size=16, max_batch_size=4, dtype="float32"
        )
    )
    try:
        got = run(engine, prompts)
        assert engine.scheduler.num_preemptions > 0
        assert sorted(engine.block_manager.free_states) == list(range(engine.info.max_batch_size))
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [t for t, _ in ref]


def test_an_aborted_request_gives_its_slot_back_clean(nemotron_h):
    """A request aborted halfway through its prompt (its state slot holds a partial state): the others
    finish as they would, and a new request in that slot starts from zero."""
    model, path = nemotron_h
    engine = _engine(path, dtype="float32", max_batch_size=2, max_batch_prefill_tokens=24)
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0)
        engine.add_request("cut", PROMPTS[0], params)
        engine.add_request("kept", PROMPTS[2], params)
        engine.step()
        assert engine.abort_request("cut")
        kept: list[int] = []
        while engine.has_unfinished():
            kept += [u.token_id for u in engine.step() if u.token_id >= 0]
        assert sorted(engine.block_manager.free_states) == [0, 1]
        again = run(engine, [PROMPTS[1]])[0][0]
    finally:
        engine.shutdown()
    assert kept == _reference(model, PROMPTS[2])
    assert again == _reference(model, PROMPTS[1])


def test_the_engine_keeps_a_state_per_request_and_none_for_mlp_layers(nemotron_h):
    _, path = nemotron_h
    engine = _engine(path, dtype="float32", max_batch_size=3)
    try:
        caches = engine.runner.paged.kv_caches
        assert not engine.info.enable_prefix_caching
        assert caches[0][0].shape == (3, 8 * 8 + 2 * 2 * 8, 3)  # the convolution's last 3 inputs
        assert caches[0][1].shape == (3, 8, 8, 8) and caches[0][1].dtype == torch.float32
        assert caches[1] == () and caches[3] == ()  # the experts' and the MLP's layers keep nothing
        assert len(caches[2]) == 2  # the attention layer's keys and values
        per_layer = (96 * 3) * 4 + 8 * 8 * 8 * 4
        assert engine.runner.paged.state_bytes_per_request() == 2 * per_layer
    finally:
        engine.shutdown()


@pytest.mark.parametrize("length", [1, 5, 16, 50])
def test_the_chunked_scan_equals_the_recurrence(length):
    g = torch.Generator().manual_seed(length)
    H, P, N = 3, 8, 4
    x = torch.randn(length, H, P, generator=g)
    dt = torch.rand(length, H, generator=g)
    A = -torch.rand(H, generator=g) * 2
    B, C = (torch.randn(length, H, N, generator=g) for _ in range(2))
    s0 = torch.randn(H, P, N, generator=g)
    out, state = ssd_chunked(x, dt, A, B, C, s0.clone(), chunk=16)
    ref_state = s0.clone().unsqueeze(0)
    ref = torch.stack(
        [
            ssd_step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], ref_state)[0]
            for t in range(length)
        ]
    )
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state[0], rtol=1e-4, atol=1e-4)
