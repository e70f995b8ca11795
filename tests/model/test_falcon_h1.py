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
from tests.model.test_sharding import assert_two_shards_equal_one, run

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


def test_two_shards_equal_one(falcon_h1, tmp_path):
    """Each rank keeps half the attention's kv heads and half the Mamba-2 heads (a group each), both
    outputs all-reduced; the multipliers are folded before the weights are split."""
    model, _ = falcon_h1
    assert_two_shards_equal_one(model, tmp_path / "falcon-h1")


def test_every_layer_keeps_keys_values_and_a_state(falcon_h1):
    _, path = falcon_h1
    engine = LLMEngine(
        EngineConfig(model=str(path), max_batch_total_tokens=1024, dtype="float32", max_batch_size=3)
    )
    try:
        # 3 running states, then the prefix cache's checkpoints (every 64 tokens: Mamba-2's grid)
        rows = 3 + len(engine.block_manager.free_checkpoints)
        assert engine.info.enable_prefix_caching and engine.runner.state_grid == 64
        for k, v, conv, ssm in engine.runner.paged.kv_caches:
            assert k.shape[1:] == (2, 16) and v.shape == k.shape
            assert conv.shape == (rows, 64 + 2 * 2 * 8, 3)
            assert ssm.shape == (rows, 4, 16, 8) and ssm.dtype == torch.float32
    finally:
        engine.shutdown()


def write_falcon_h1_gguf(hf, path) -> None:
    """`hf` as llama.cpp's converter writes it (`falcon-h1`): every multiplier folded into the weights
    (the embeddings and the head too), A as −exp(A_log) [H, 1], D [H, 1], the gated norm [groups,
    inner / groups], the convolution squeezed, q/k rows as they are, and the MLP's input norm named
    `blk.N.ffn_norm` without ".weight"."""
    import gguf
    import numpy as np

    from tests.model.test_gguf_families import byte_vocabulary

    c = hf.config
    inner, gn = c.mamba_d_ssm, c.mamba_n_groups * c.mamba_d_state
    w = gguf.GGUFWriter(str(path), "falcon-h1")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.hidden_size // c.num_attention_heads)
    w.add_value_length(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_time_step_rank(c.mamba_n_heads)
    w.add_ssm_group_count(c.mamba_n_groups)
    w.add_vocab_size(c.vocab_size)
    byte_vocabulary(w, c.vocab_size)
    z, x, b, cc, dt = c.ssm_multipliers
    names = {
        "input_layernorm": "attn_norm",
        "mamba.in_proj": "ssm_in",
        "mamba.out_proj": "ssm_out",
        "mamba.conv1d": "ssm_conv1d",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "feed_forward.gate_proj": "ffn_gate",
        "feed_forward.up_proj": "ffn_up",
        "feed_forward.down_proj": "ffn_down",
    }
    scale = {
        "feed_forward.gate_proj": c.mlp_multipliers[0],
        "feed_forward.down_proj": c.mlp_multipliers[1],
        "self_attn.q_proj": c.attention_in_multiplier,
        "self_attn.k_proj": c.attention_in_multiplier * c.key_multiplier,
        "self_attn.v_proj": c.attention_in_multiplier,
        "self_attn.o_proj": c.attention_out_multiplier,
        "mamba.out_proj": c.ssm_out_multiplier,
    }
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name == "lm_head.weight":
            w.add_tensor("output.weight", a * c.lm_head_multiplier)
            continue
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a * c.embedding_multiplier)
            continue
        if name == "model.final_layernorm.weight":
            w.add_tensor("output_norm.weight", a)
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        blk = f"blk.{i}."
        stem, _, kind = rest.rpartition(".")
        if rest == "mamba.A_log":
            w.add_tensor(blk + "ssm_a", -np.exp(a).reshape(-1, 1))
        elif rest == "mamba.D":
            w.add_tensor(blk + "ssm_d", a.reshape(-1, 1))
        elif rest == "mamba.dt_bias":
            w.add_tensor(blk + "ssm_dt.bias", a)
        elif rest == "mamba.norm.weight":
            w.add_tensor(blk + "ssm_norm.weight", a.reshape(c.mamba_n_groups, -1))
        elif rest == "pre_ff_layernorm.weight":
            w.add_tensor(blk + "ffn_norm", a)
        elif rest == "mamba.conv1d.weight":
            w.add_tensor(blk + "ssm_conv1d.weight", np.ascontiguousarray(a.reshape(a.shape[0], -1)))
        elif rest == "mamba.in_proj.weight":
            rows = np.concatenate(
                [np.full(n, m) for n, m in ((inner, z), (inner, x), (gn, b), (gn, cc), (c.mamba_n_heads, dt))]
            )
            w.add_tensor(blk + "ssm_in.weight", a * c.ssm_in_multiplier * rows[:, None].astype(np.float32))
        else:
            w.add_tensor(f"{blk}{names[stem]}.{kind}", (a * scale.get(stem, 1.0)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_serves_transformers_tokens(falcon_h1, tmp_path, monkeypatch):
    """A file as llama.cpp's converter writes it (checked here against its own converter's output of
    the two tiny configs by hand: the same keys, names and shapes)."""
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    model, _ = falcon_h1
    write_falcon_h1_gguf(model, tmp_path / "falcon-h1.gguf")
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path / "falcon-h1.gguf"), max_batch_total_tokens=1024, dtype="float32")
    )
    try:
        got = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [_reference(model, p) for p in PROMPTS]
