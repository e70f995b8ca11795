"""Hybrid linear-attention models in pytgi's own code (issue 46, point 2): Qwen3-Next and Qwen3.5,
tiny random configs, through the engine. Greedy tokens equal transformers' `generate` in float32,
alone and batched, with prefill chunks that cut through the requests (and through the delta rule's
64-token chunks); in bf16 a request batched with others gives what it gives alone; a preempted
request recomputes its state; the chunked delta rule equals the token-by-token recurrence."""

from __future__ import annotations

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.errors import ConfigError
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.models.linear_attention import chunked_rule, l2norm, recurrent_step
from tests.model import hybrids
from tests.model.test_gguf_families import LAYER, byte_vocabulary, common_metadata
from tests.model.test_sharding import run

PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64] * 10, [7, 9] * 10, list(range(30, 60)), [11]]

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    num_hidden_layers=4,  # three linear layers, then one attention layer
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    max_position_embeddings=512,
    eos_token_id=None,
    initializer_range=0.2,  # weights big enough for greedy tokens that vary
)


def _save(model, path):
    with torch.no_grad():  # offsets from 1 (the norms), decays and gates that matter
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        **COMMON,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],  # one dense MLP among the experts
    )
    return _save(transformers.Qwen3NextForCausalLM(cfg).eval(), tmp_path_factory.mktemp("qwen3-next"))


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.Qwen3_5TextConfig(**COMMON, intermediate_size=64)
    return _save(transformers.Qwen3_5ForCausalLM(cfg).eval(), tmp_path_factory.mktemp("qwen3.5"))


MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    """Qwen3.5-MoE's text model: experts in every layer (its config has no dense intermediate_size),
    the router always renormalizing, a gated shared expert."""
    torch.manual_seed(4)
    cfg = transformers.Qwen3_5MoeTextConfig(**COMMON, **MOE)
    return _save(transformers.Qwen3_5MoeForCausalLM(cfg).eval(), tmp_path_factory.mktemp("qwen3.5-moe"))


@pytest.fixture(params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def hybrid(request):
    return request.getfixturevalue(request.param)


_engine, _reference = hybrids.engine, hybrids.reference


def test_greedy_equals_transformers_in_float32(hybrid):
    model, path = hybrid
    hybrids.assert_greedy_equals_transformers(model, path, PROMPTS, hybrids.CHUNKINGS[:2])


def test_batched_equals_alone_in_bf16(hybrid):
    _, path = hybrid
    hybrids.assert_batched_equals_alone_in_bf16(path, PROMPTS)


def test_a_preempted_request_recomputes_its_state(qwen3_next):
    """A KV cache too small for every request at once: the last admitted is preempted, its state
    slot freed and its state recomputed from its tokens when it runs again; the answers are those of
    a cache big enough."""
    _, path = qwen3_next
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


def test_the_engine_says_what_it_turns_off(qwen3_next, tmp_path):
    _, path = qwen3_next
    engine = _engine(path, dtype="float32", max_batch_size=3)
    try:
        # the prefix cache's checkpoints: an eighth of the 1024-token KV cache's memory
        state, per_token = engine.runner.state_bytes, engine.runner.paged.kv_bytes_per_token()
        checkpoints = 1024 * per_token // 8 // state
        assert engine.info.enable_prefix_caching and checkpoints > 0
        assert engine.info.max_batch_size == 3
        # a state per running request, then the checkpoints
        assert engine.runner.paged.kv_caches[0][1].shape == (3 + checkpoints, 4, 16, 8)
    finally:
        engine.shutdown()
    engine = _engine(path, dtype="float32", max_batch_size=3, enable_prefix_caching=False)
    try:
        assert not engine.info.enable_prefix_caching
        assert engine.runner.paged.kv_caches[0][1].shape == (3, 4, 16, 8)
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError, match="--speculate.*no positions to drop the rejected ones from"):
        _engine(path, dtype="float32", speculate=2)
    engine = _engine(path, dtype="float32", prefix_cache_dir=str(tmp_path / "kv"))
    try:  # the disk tier keeps the checkpoints' states too (tests/model/test_hybrid_prefix_disk.py)
        assert engine.disk is not None and engine.disk.state_pool is not None
        assert engine.disk.state_pool.nbytes == engine.runner.state_bytes
    finally:
        engine.shutdown()


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_the_chunked_rule_equals_the_recurrence(length):
    g = torch.Generator().manual_seed(length)
    H, K, V = 3, 16, 8
    q, k = (l2norm(torch.randn(length, H, K, generator=g)) for _ in range(2))
    v = torch.randn(length, H, V, generator=g)
    decay = -torch.rand(length, H, generator=g) * 0.5
    beta = torch.rand(length, H, generator=g)
    s0 = torch.randn(H, K, V, generator=g)
    out, state = chunked_rule(q, k, v, decay, beta, s0.clone(), chunk=16)
    ref_state = s0.clone().unsqueeze(0)
    ref = torch.stack(
        [
            recurrent_step(
                q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], ref_state
            )[0]
            for t in range(length)
        ]
    )
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state[0], rtol=1e-4, atol=1e-4)


def test_pytorch_ops_alone_give_the_same_tokens(qwen3_next, monkeypatch):
    """Without the C kernels (no compiler, or CUDA): PyTorch's ops for attention, norms and rope."""
    from pytgi.engine import kernels

    for name in ("supports", "vnni_supported", "bf16gemm_supported"):
        monkeypatch.setattr(kernels, name, lambda *_: False)
    model, path = qwen3_next
    engine = _engine(path, dtype="float32")
    try:
        assert not engine.runner.model.kernels.fused  # type: ignore[attr-defined]
        got = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [_reference(model, p) for p in PROMPTS]


def test_two_shards_equal_one(hybrid):
    """Each rank keeps whole key-head groups of the linear layers (their convolution channels, decays
    and states) and its attention heads with their gates; the output projections are all-reduced."""
    _, path = hybrid
    outs = []
    for n in (1, 2):
        engine = _engine(path, dtype="float32", num_shard=n)
        try:
            outs.append(run(engine, PROMPTS))
        finally:
            engine.shutdown()
    for (tokens, lps), (ref_tokens, ref_lps) in zip(*outs):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5, rtol=1e-5)


# -- GGUF files as llama.cpp's converter writes them (point 4) -----------------------------------------
# Checked against files made by llama.cpp's own convert_hf_to_gguf.py from such models: a Qwen3-Next's
# in_proj_qkvz is split into Qwen3.5's q|k|v and z, Qwen3.5's value heads are reordered from grouped
# by key head to tiled, A_log is stored as −exp(A_log), the offset norms as 1 + w (the gated norm as is).
GGUF_NAMES = {
    **LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}


def _tiled(a, nk: int, r: int, dim: int):
    """Value heads grouped by key head ([nk, r, ...] along `dim`) reordered to tiled ([r, nk, ...])."""
    import numpy as np

    a = np.moveaxis(a, dim, 0)
    a = a.reshape(nk, r, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, dim))


def write_hybrid_gguf(hf, arch: str, path, mtp: bool = False) -> None:
    """`mtp`: with a multi-token-prediction block after the model's layers, as llama.cpp's converter
    writes a published checkpoint's (`nextn_predict_layers`; pytgi does not read it)."""
    import gguf
    import numpy as np

    c = hf.config
    nk, nv, dk, dv = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    )
    r, tiled = nv // nk, arch in ("qwen35", "qwen35moe") and nk != nv
    w = gguf.GGUFWriter(str(path), arch)
    common_metadata(w, c, mtp_blocks=int(mtp))
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(c.head_dim // 4)
    byte_vocabulary(w, c.vocab_size)
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name.endswith("norm.weight") and "linear_attn" not in name:
            a = a + 1
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
            continue
        if name == "lm_head.weight":
            w.add_tensor("output.weight", a)
            continue
        if name == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
            continue
        _, _, i, rest = name.split(".", 3)
        stem, _, kind = rest.rpartition(".")
        blk = f"blk.{i}."
        if rest == "linear_attn.in_proj_qkvz.weight":  # [q, k, v, z] per key head → q|k|v, z
            q, k, v, z = np.split(a.reshape(nk, -1, a.shape[-1]), np.cumsum([dk, dk, r * dv])[:3], axis=1)
            qkv = np.concatenate([x.reshape(-1, a.shape[-1]) for x in (q, k, v)])
            w.add_tensor(blk + "attn_qkv.weight", np.ascontiguousarray(qkv))
            w.add_tensor(blk + "attn_gate.weight", np.ascontiguousarray(z.reshape(-1, a.shape[-1])))
            continue
        if tiled and rest.startswith("linear_attn."):
            if stem == "linear_attn.in_proj_qkv" or stem == "linear_attn.conv1d":
                a = np.concatenate([a[: 2 * nk * dk], _tiled(a[2 * nk * dk :], nk, r, 0)])
            elif stem in (
                "linear_attn.in_proj_z",
                "linear_attn.in_proj_a",
                "linear_attn.in_proj_b",
            ) or rest in ("linear_attn.A_log", "linear_attn.dt_bias"):
                a = _tiled(a, nk, r, 0)
            elif stem == "linear_attn.out_proj":
                a = _tiled(a, nk, r, 1)
        if rest == "linear_attn.A_log":
            w.add_tensor(blk + "ssm_a", -np.exp(a))
        elif rest == "linear_attn.dt_bias":
            w.add_tensor(blk + "ssm_dt.bias", a)
        elif rest == "linear_attn.conv1d.weight":
            w.add_tensor(blk + "ssm_conv1d.weight", np.ascontiguousarray(a.reshape(a.shape[0], -1)))
        elif rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]
            gate, up = np.split(a, 2, axis=1)
            w.add_tensor(blk + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(blk + "ffn_up_exps.weight", np.ascontiguousarray(up))
        elif rest == "mlp.experts.down_proj":
            w.add_tensor(blk + "ffn_down_exps.weight", a)
        else:
            w.add_tensor(f"{blk}{GGUF_NAMES[stem]}.{kind}", np.ascontiguousarray(a))
    if mtp:  # its own tensors, and an attention layer's
        L, H = c.num_hidden_layers, c.hidden_size
        w.add_tensor(f"blk.{L}.nextn.eh_proj.weight", np.ones((H, 2 * H), np.float32))
        w.add_tensor(f"blk.{L}.nextn.enorm.weight", np.ones(H, np.float32))
        w.add_tensor(
            f"blk.{L}.attn_q.weight", np.ones((2 * c.num_attention_heads * c.head_dim, H), np.float32)
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35", "qwen35moe"])
def test_a_gguf_file_serves_transformers_tokens(arch, tmp_path, monkeypatch):
    """qwen35moe: no dense feed_forward_length, and an MTP block after the layers (left unread)."""
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    kw = dict(COMMON, intermediate_size=64)
    torch.manual_seed(2)
    if arch == "qwen35moe":
        moe_cfg = transformers.Qwen3_5MoeTextConfig(**COMMON, **MOE)
        model, _ = _save(transformers.Qwen3_5MoeForCausalLM(moe_cfg).eval(), tmp_path / "hf")
    elif arch == "qwen3next":  # llama.cpp's converter takes experts in every layer
        cfg = transformers.Qwen3NextConfig(
            **kw,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        )
        model, _ = _save(transformers.Qwen3NextForCausalLM(cfg).eval(), tmp_path / "hf")
    else:
        model, _ = _save(
            transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw)).eval(), tmp_path / "hf"
        )
    write_hybrid_gguf(model, arch, tmp_path / f"{arch}.gguf", mtp=arch == "qwen35moe")
    engine = _engine(tmp_path / f"{arch}.gguf", dtype="float32")
    try:
        got = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [_reference(model, p) for p in PROMPTS]


@pytest.mark.parametrize("moe", [False, True])
def test_a_qwen3_5_vision_checkpoint_serves_its_language_model(moe, tmp_path):
    """Qwen3.5 is published as vision-language checkpoints (`Qwen3_5ForConditionalGeneration`,
    `Qwen3_5MoeForConditionalGeneration`): pytgi serves their language model (`model.language_model.*`,
    a MoE's experts one tensor each) as text, its vision tower and an MTP layer's tensors left unread,
    with the greedy tokens of transformers' model on text."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(3)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    model: torch.nn.Module
    if moe:
        moe_cfg = transformers.Qwen3_5MoeConfig(text_config=dict(COMMON, **MOE), vision_config=vision)
        model = transformers.Qwen3_5MoeForConditionalGeneration(moe_cfg).eval()
    else:
        cfg = transformers.Qwen3_5Config(text_config=dict(COMMON, intermediate_size=64), vision_config=vision)
        model = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    _save(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert any(n.startswith("model.visual.") for n in tensors)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)  # a published checkpoint's MTP layer: not read
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    engine = _engine(tmp_path, dtype="float32")
    try:
        got = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [_reference(model, p) for p in PROMPTS]
