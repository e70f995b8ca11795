"""The Mamba-1 families in pytgi's own code (issue 64): Jamba (Mamba-1 layers, attention without RoPE
every other layer, experts every other layer), Mamba and FalconMamba (Mamba-1 layers only, no
attention at all), tiny random configs, through the engine. Greedy tokens equal transformers' in
float32, alone and batched, with prefill chunks that cut through the prompts; Jamba's logits equal
transformers' full forward position by position; the token-by-token scan equals the step; the state
pool alone sizes a model without attention layers."""

from __future__ import annotations

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.models.mamba1 import selective_scan
from tests.model.test_sharding import assert_two_shards_equal_one, run

PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64] * 5, [7, 9] * 10, list(range(30, 60)), [11]]
NEW = 12


def _save(model, path):
    with torch.no_grad():  # norms off 1, decays, steps and skips that matter
        for name, p in model.named_parameters():
            if "norm" in name or "dt_proj.bias" in name or "A_log" in name or name.endswith(".D"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    """Mamba-1 with experts, attention with a dense MLP, Mamba-1 with experts, attention."""
    torch.manual_seed(0)
    cfg = transformers.JambaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_dt_rank=8,
        eos_token_id=None,
        initializer_range=0.2,
    )
    return _save(transformers.JambaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("jamba"))


def _mamba_cfg(cls):
    return cls(
        vocab_size=101,
        hidden_size=64,
        num_hidden_layers=3,
        state_size=8,
        time_step_rank=8,
        eos_token_id=None,
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    torch.manual_seed(1)
    cfg = _mamba_cfg(transformers.MambaConfig)
    return _save(transformers.MambaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("mamba"))


@pytest.fixture(scope="module")
def falcon_mamba(tmp_path_factory):
    torch.manual_seed(2)
    cfg = _mamba_cfg(transformers.FalconMambaConfig)
    return _save(transformers.FalconMambaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("falcon-mamba"))


@pytest.fixture(params=["jamba", "mamba", "falcon_mamba"])
def family(request):
    return request.getfixturevalue(request.param)


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, **kw))


def _reference(model, prompt):
    """Greedy tokens from full forwards over the growing sequence (no cache: what every model runs,
    transformers' `generate` included where it can)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_greedy_equals_transformers_in_float32(family):
    model, path = family
    refs = [_reference(model, p) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) > 1  # the answers differ: the test can tell them apart
    # alone and together; prefill chunks of 12 tokens cut every long prompt, and decodes join them
    for kw in ({}, {"max_batch_prefill_tokens": 12, "enable_chunked_prefill": True}):
        engine = _engine(path, dtype="float32", **kw)
        try:
            together = run(engine, PROMPTS)
            alone = [run(engine, [p])[0] for p in PROMPTS]
        finally:
            engine.shutdown()
        for ref, (a, _), (b, _) in zip(refs, together, alone):
            assert a == ref and b == ref, (kw, ref, a, b)


@pytest.mark.parametrize("name", ["jamba", "falcon_mamba"])
def test_batched_equals_alone_in_bf16(name, request):
    _, path = request.getfixturevalue(name)
    engine = _engine(path, dtype="bfloat16")
    try:
        alone = [run(engine, [p])[0] for p in PROMPTS]
        batched = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert batched == alone  # tokens and every prompt and output logprob, to the bit


@pytest.mark.parametrize("name", ["mamba", "falcon_mamba"])
def test_generate_equals_the_forwards(name, request):
    """Where transformers' `generate` runs greedily (its cached path), it gives the full forwards'
    tokens: the reference above is transformers' own answer."""
    model, _ = request.getfixturevalue(name)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert out[0, len(PROMPTS[0]) :].tolist() == _reference(model, PROMPTS[0])


def test_jamba_prompt_logprobs_equal_the_full_forward(jamba):
    """Every prompt position's log-probability of the next prompt token, as transformers' one forward
    over the whole prompt gives it, with chunks of 12 cutting the prompt."""
    model, path = jamba
    prompt = PROMPTS[0]
    with torch.no_grad():
        logp = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    want = [logp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    engine = _engine(path, dtype="float32", max_batch_prefill_tokens=12, enable_chunked_prefill=True)
    try:
        _, got = run(engine, [prompt])[0]
    finally:
        engine.shutdown()
    torch.testing.assert_close(torch.tensor(got[: len(want)]), torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_a_model_without_attention_sizes_the_state_pool_alone(mamba):
    """No attention layer: the KV cache has no bytes, each layer keeps a state, and the default
    batch comes from the memory the states take (no --max-batch-size, no --max-batch-total-tokens),
    halved for the prefix cache's checkpoints (one a running state), which `--prefix-cache-state-bytes`
    sizes instead, or turns off with 0."""
    _, path = mamba
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_cpu_bytes=1 << 22))
    try:
        paged = engine.runner.paged
        assert paged.kv_bytes_per_token() == 0
        caches = paged.kv_caches
        slots = engine.info.max_batch_size
        assert caches[0][0].shape == (2 * slots, 128, 3) and caches[0][1].shape == (2 * slots, 128, 8)
        per_request = 3 * (128 * 3 * 4 + 128 * 8 * 4)
        assert paged.state_bytes_per_request() == per_request
        assert slots == min(256, (1 << 22) // (2 * per_request))
        assert engine.info.enable_prefix_caching and len(engine.block_manager.free_checkpoints) == slots
        assert run(engine, [PROMPTS[1]])[0][0]
    finally:
        engine.shutdown()
    for cached, slots in ((per_request * 10, (1 << 22) // per_request - 10), (0, (1 << 22) // per_request)):
        config = EngineConfig(
            model=str(path), dtype="float32", kv_cache_cpu_bytes=1 << 22, prefix_cache_state_bytes=cached
        )
        engine = LLMEngine(config)
        try:
            assert engine.info.max_batch_size == min(256, slots)
            assert len(engine.block_manager.free_checkpoints) == cached // per_request
            assert engine.info.enable_prefix_caching == (cached > 0)
        finally:
            engine.shutdown()


@pytest.mark.parametrize("name", ["jamba", "mamba"])
def test_a_preempted_request_recomputes_its_state(name, request):
    """Too few KV blocks for every request at once (a model without attention layers counts positions
    in blocks all the same): the last admitted is preempted, its state slot freed and its state
    recomputed from its tokens; the answers are those of a cache big enough."""
    _, path = request.getfixturevalue(name)
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


@pytest.mark.parametrize("name", ["jamba", "mamba", "falcon_mamba"])
def test_two_shards_equal_one(name, request, tmp_path):
    """Each rank keeps half of every Mamba-1 layer's channels; x_proj and out_proj are all-reduced."""
    model, _ = request.getfixturevalue(name)
    assert_two_shards_equal_one(model, tmp_path / name)


@pytest.mark.parametrize("length", [1, 7, 33])
def test_the_scan_equals_the_step(length):
    g = torch.Generator().manual_seed(length)
    D, N = 6, 4
    x, dt = torch.randn(length, D, generator=g), torch.rand(length, D, generator=g)
    A = -torch.rand(D, N, generator=g) * 2
    B, C = (torch.randn(length, N, generator=g) for _ in range(2))
    s0 = torch.randn(D, N, generator=g)
    out, state = selective_scan(x, dt, A, B, C, s0)
    ref_state, ref = s0.clone(), []
    for t in range(length):
        ref_state = ref_state * (dt[t, :, None] * A).exp() + (dt[t] * x[t])[:, None] * B[t]
        ref.append(ref_state @ C[t])
    torch.testing.assert_close(out, torch.stack(ref))
    torch.testing.assert_close(state, ref_state)


# transformers' module names → llama.cpp's
GGUF_NAMES = {
    "norm": "attn_norm",
    "input_layernorm": "attn_norm",
    "pre_ff_layernorm": "ffn_norm",
    "in_proj": "ssm_in",
    "x_proj": "ssm_x",
    "dt_proj": "ssm_dt",
    "out_proj": "ssm_out",
    "conv1d": "ssm_conv1d",
    "dt_layernorm": "ssm_dt_norm",
    "b_layernorm": "ssm_b_norm",
    "c_layernorm": "ssm_c_norm",
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
    "router": "ffn_gate_inp",
}


def write_mamba1_gguf(hf, arch: str, path) -> None:
    """`hf` as llama.cpp's converter writes it (`mamba` for Mamba and FalconMamba, with
    `ssm.dt_b_c_rms` for the latter; `jamba`, its attention layers in the per-layer head_count_kv):
    A as −exp(A_log) [d_inner, d_state], the convolution squeezed, experts stacked, no output tensor
    where the head is tied, no q/k interleave (Jamba's attention has no RoPE)."""
    import gguf
    import numpy as np

    from tests.model.test_gguf_families import byte_vocabulary

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_ssm_conv_kernel(c.conv_kernel if arch == "mamba" else c.mamba_d_conv)
    w.add_ssm_state_size(c.state_size if arch == "mamba" else c.mamba_d_state)
    if arch == "mamba":
        w.add_context_length(2**20)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_inner_size(c.intermediate_size)
        w.add_ssm_time_step_rank(c.time_step_rank)
        w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
        w.add_ssm_dt_b_c_rms(c.model_type == "falcon_mamba")
    else:
        w.add_context_length(c.max_position_embeddings)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        kinds = c.layers_block_type
        w.add_head_count_kv([c.num_key_value_heads if k == "attention" else 0 for k in kinds])
        w.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
        w.add_ssm_time_step_rank(c.mamba_dt_rank)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    byte_vocabulary(w, c.vocab_size)
    glob = {"embeddings": "token_embd", "embed_tokens": "token_embd", "norm_f": "output_norm"}
    glob["final_layernorm"] = "output_norm"
    tied = c.tie_word_embeddings
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name == "lm_head.weight":
            if not tied:
                w.add_tensor("output.weight", a)
            continue
        _, part, rest = name.split(".", 2)
        if part != "layers":
            w.add_tensor(f"{glob[part]}.weight", a)
            continue
        i, rest = rest.split(".", 1)
        blk = f"blk.{i}."
        for prefix in ("mixer.", "mamba.", "self_attn.", "feed_forward."):
            rest = rest.removeprefix(prefix)
        stem, _, kind = rest.rpartition(".")
        if rest == "A_log":
            w.add_tensor(blk + "ssm_a", -np.exp(a))
        elif rest == "D":
            w.add_tensor(blk + "ssm_d", a)
        elif rest == "conv1d.weight":
            w.add_tensor(blk + "ssm_conv1d.weight", np.ascontiguousarray(a.reshape(a.shape[0], -1)))
        elif rest == "experts.gate_up_proj":  # transformers' experts, gate | up stacked [E, 2I, H]
            gate, up = np.split(a, 2, axis=1)
            w.add_tensor(blk + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(blk + "ffn_up_exps.weight", np.ascontiguousarray(up))
        elif rest == "experts.down_proj":
            w.add_tensor(blk + "ffn_down_exps.weight", a)
        else:
            w.add_tensor(f"{blk}{GGUF_NAMES[stem]}.{kind}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["jamba", "mamba", "falcon_mamba"])
def test_a_gguf_file_serves_transformers_tokens(name, request, tmp_path, monkeypatch):
    """Files as llama.cpp's converter writes them (checked here against its own converter's output of
    a tiny Jamba, Mamba and FalconMamba by hand: the same keys, names and shapes)."""
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    model, _ = request.getfixturevalue(name)
    arch = "jamba" if name == "jamba" else "mamba"
    write_mamba1_gguf(model, arch, tmp_path / f"{name}.gguf")
    engine = _engine(tmp_path / f"{name}.gguf", dtype="float32")
    try:
        got = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [_reference(model, p) for p in PROMPTS]
