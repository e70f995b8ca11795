"""The Mamba-2 hybrids in pytgi's own code (issue 64): Nemotron-H (dense MLP and experts, one mixer a
layer), Granite-4.0-H (experts beside a shared MLP, Granite's multipliers, attention with and without
RoPE) and Bamba, tiny random configs, through the engine. Greedy tokens equal transformers' `generate`
in float32, alone and batched, with prefill chunks that cut through the prompts (and through the
scan's 64-token chunks); in bf16 a request batched with others gives what it gives alone; a preempted
request recomputes its state, an aborted one gives its slot back clean; the chunked scan equals the
token-by-token recurrence; GGUF files written as llama.cpp's converter writes them (`nemotron_h`,
`nemotron_h_moe`, `granitehybrid`) serve transformers' tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.model_files import resolve_model
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.execution.runner import ModelRunner
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.models.mamba2 import ssd_chunked, ssd_step
from tests.model.test_sharding import assert_two_shards_equal_one, run

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
    """Without experts (the shared MLP alone), with RoPE on the attention layer, and one group of B, C
    for all the Mamba-2 heads (Granite-4.0-H's)."""
    torch.manual_seed(2)
    cfg = transformers.GraniteMoeHybridConfig(
        **COMMON,
        **{**MAMBA, "mamba_n_groups": 1},
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


@pytest.mark.parametrize("name", ["nemotron_h", "granite_h_dense_rope"])
def test_two_shards_equal_one(name, request, tmp_path):
    """Each rank keeps half the Mamba-2 heads: Nemotron-H's whole groups, or (Granite-4.0-H's one group)
    half of a group, its B and C on both ranks and its norm's squares all-reduced; the experts, MLPs
    and attention split as for any model."""
    model, _ = request.getfixturevalue(name)
    assert_two_shards_equal_one(model, tmp_path / name)


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
        assert engine.info.enable_prefix_caching  # checkpoints every 64 tokens (`ssd_chunked`'s chunks)
        assert engine.runner.state_grid == 64
        # 3 running rows, then the checkpoints' (`PagedModel.allocate`)
        assert caches[0][0].shape[0] == 3 + len(engine.block_manager.free_checkpoints)
        assert caches[0][0].shape[1:] == (8 * 8 + 2 * 2 * 8, 3)  # the convolution's last 3 inputs
        assert caches[0][1].shape[1:] == (8, 8, 8) and caches[0][1].dtype == torch.float32
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


# transformers' module names → llama.cpp's (the layer's norm is attn_norm whatever its mixer)
GGUF_NAMES = {
    "norm": "attn_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "in_proj": "ssm_in",
    "out_proj": "ssm_out",
    "conv1d": "ssm_conv1d",
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "pre_ff_layernorm": "ffn_norm",  # Bamba's
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
    "gate": "ffn_gate_inp",
    "router": "ffn_gate_inp",
    "shared_experts.up_proj": "ffn_up_shexp",
    "shared_experts.down_proj": "ffn_down_shexp",
}


def write_mamba_gguf(hf, arch: str, path, experts: str | None = None) -> None:
    """`hf` as llama.cpp's converter writes it (`nemotron_h`, `nemotron_h_moe`, `granitehybrid`: Granite-4.0-H
    and Bamba): the layer kinds in per-layer head_count_kv and feed_forward_length, A as −exp(A_log)
    [H, 1], D [H, 1], the gated norm [groups, inner / groups], the convolution squeezed, q/k rows
    interleaved (llama's order), experts stacked, Granite's merged MLPs split in gate and up; Bamba's
    RoPE as `rope.scaling.finetuned` and its rotary features as `rope.dimension_count` (what the
    converter writes from a Hub checkpoint's `attn_rotary_emb`). `experts`: the GGUF type the stacked
    experts are stored as (None: as they are)."""
    import gguf
    import numpy as np

    from tests.model.test_gguf_families import _permute, byte_vocabulary

    c = hf.config
    L, nemotron, bamba = c.num_hidden_layers, arch.startswith("nemotron_h"), c.model_type == "bamba"
    kinds = list(c.layers_block_type)
    attn = [k in ("full_attention", "attention") for k in kinds]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if a else 0 for a in attn])
    if nemotron:
        heads, head_dim, groups, state = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size
        w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        moe = arch == "nemotron_h_moe"
        size = c.moe_intermediate_size if moe else c.intermediate_size
        w.add_feed_forward_length([size if k == ("moe" if moe else "mlp") else 0 for k in kinds])
        if moe:
            w.add_expert_used_count(c.num_experts_per_tok)
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
            w.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
            w.add_expert_count(c.n_routed_experts)
            w.add_expert_shared_count(c.n_shared_experts)
            w.add_expert_weights_norm(c.norm_topk_prob)
            w.add_expert_weights_scale(c.routed_scaling_factor)
            w.add_expert_group_count(c.n_group)
    elif bamba:  # a dense MLP in every layer, RoPE over part of each head
        heads, head_dim, groups, state = c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
        rotary = c.hidden_size // c.num_attention_heads * c.rope_parameters["partial_rotary_factor"]
        w.add_rope_dimension_count(int(rotary))
        w.add_rope_scaling_finetuned(True)
    else:
        heads, head_dim, groups, state = c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
        w.add_rope_scaling_finetuned(False)
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
        w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
        if c.num_local_experts:
            w.add_expert_count(c.num_local_experts)
            w.add_expert_used_count(c.num_experts_per_tok)
    w.add_ssm_conv_kernel(c.conv_kernel if nemotron else c.mamba_d_conv)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(heads * head_dim)
    w.add_ssm_time_step_rank(heads)
    byte_vocabulary(w, c.vocab_size)
    glob = {
        "embeddings": "token_embd",
        "embed_tokens": "token_embd",
        "norm_f": "output_norm",
        "norm": "output_norm",
        "final_layernorm": "output_norm",
    }
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name == "lm_head.weight":
            w.add_tensor("output.weight", a)
            continue
        _, part, rest = name.split(".", 2)
        if part != "layers":
            w.add_tensor(f"{glob[part]}.weight", a)
            continue
        i, rest = rest.split(".", 1)
        blk = f"blk.{i}."
        for prefix in ("mixer.", "mamba.", "self_attn.", "block_sparse_moe.", "shared_mlp.", "feed_forward."):
            if rest.startswith(prefix):
                module, rest = prefix, rest.removeprefix(prefix)
                break
        else:
            module = ""
        stem, _, kind = rest.rpartition(".")
        if rest == "A_log":
            w.add_tensor(blk + "ssm_a", -np.exp(a).reshape(-1, 1))
        elif rest == "D":
            w.add_tensor(blk + "ssm_d", a.reshape(-1, 1))
        elif rest == "dt_bias":
            w.add_tensor(blk + "ssm_dt.bias", a)
        elif rest == "conv1d.weight":
            w.add_tensor(blk + "ssm_conv1d.weight", np.ascontiguousarray(a.reshape(a.shape[0], -1)))
        elif (
            rest == "norm.weight"
            and module in ("mixer.", "mamba.")
            and kinds[int(i)] in ("linear_attention", "mamba")
        ):
            w.add_tensor(blk + "ssm_norm.weight", np.ascontiguousarray(a.reshape(groups, -1)))
        elif stem in ("q_proj", "k_proj"):
            n = c.num_attention_heads if stem == "q_proj" else c.num_key_value_heads
            w.add_tensor(f"{blk}{GGUF_NAMES[stem]}.weight", np.ascontiguousarray(_permute(a, n)))
        elif rest == "gate.e_score_correction_bias":
            w.add_tensor(blk + "exp_probs_b.bias", a)
        elif rest in ("experts.up_proj", "experts.down_proj"):  # Nemotron-H's, stacked [E, ., .]
            stacked = f"{blk}ffn_{rest.split('.')[1].split('_')[0]}_exps.weight"
            if experts is None:
                w.add_tensor(stacked, a)
            else:
                t = gguf.GGMLQuantizationType[experts]
                w.add_tensor(stacked, gguf.quants.quantize(np.ascontiguousarray(a), t), raw_dtype=t)
        elif rest == "experts.gate_up_proj":  # Granite's experts, gate | up stacked [E, 2I, H]
            gate, up = np.split(a, 2, axis=1)
            w.add_tensor(blk + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(blk + "ffn_up_exps.weight", np.ascontiguousarray(up))
        elif module == "shared_mlp.":
            sh = "_shexp" if c.num_local_experts else ""
            if rest == "output_linear.weight":
                w.add_tensor(f"{blk}ffn_down{sh}.weight", a)
            else:
                gate, up = np.split(a, 2, axis=0)
                w.add_tensor(f"{blk}ffn_gate{sh}.weight", np.ascontiguousarray(gate))
                w.add_tensor(f"{blk}ffn_up{sh}.weight", np.ascontiguousarray(up))
        else:
            w.add_tensor(f"{blk}{GGUF_NAMES[stem]}.{kind}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _nemotron_for_gguf(moe: bool):
    """llama.cpp's converter writes no topk_group: one expert group, as Nemotron 3 Nano has."""
    torch.manual_seed(5)
    cfg = transformers.NemotronHConfig(
        **{**COMMON, "vocab_size": 104},
        head_dim=16,
        layers_block_type=["linear_attention", "moe" if moe else "mlp", "full_attention", "linear_attention"],
        intermediate_size=64,
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        n_group=1,
        topk_group=1,
    )
    return transformers.NemotronHForCausalLM(cfg).eval()


@pytest.mark.parametrize("arch", ["nemotron_h", "nemotron_h_moe", "granitehybrid", "bamba"])
def test_a_gguf_file_serves_transformers_tokens(arch, tmp_path, monkeypatch):
    """Bamba's file is `granitehybrid` too (llama.cpp's converter takes both classes), with RoPE on
    half of each head; checked once against a file the converter itself made from a Bamba config with a
    Hub checkpoint's `attn_rotary_emb`."""
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    if arch == "bamba":
        torch.manual_seed(3)
        bamba = transformers.BambaConfig(
            **{**COMMON, "vocab_size": 104},
            **MAMBA,
            intermediate_size=64,
            num_hidden_layers=3,
            attn_layer_indices=[1],
        )
        hf = transformers.BambaForCausalLM(bamba).eval()
    elif arch == "granitehybrid":
        torch.manual_seed(6)
        cfg = transformers.GraniteMoeHybridConfig(
            **{**COMMON, "vocab_size": 104},
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
        hf = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    else:
        hf = _nemotron_for_gguf(arch == "nemotron_h_moe")
    model, _ = _save(hf, tmp_path / "hf")
    write_mamba_gguf(model, "granitehybrid" if arch == "bamba" else arch, tmp_path / f"{arch}.gguf")
    engine = _engine(tmp_path / f"{arch}.gguf", dtype="float32")
    try:
        got = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [_reference(model, p) for p in PROMPTS]


def test_a_gguf_files_relu2_experts_stay_packed(tmp_path, monkeypatch):
    """Nemotron-H's experts have no gate (relu(up)², then down): a file's Q8_0 experts are kept packed
    for the low-bit kernels, up alone, as the gated families' are (not expanded to the model's dtype:
    at Nemotron 3 Nano's size that is gigabytes), and the block's output is the one the float32 path
    computes from the same blocks, within bf16's error."""
    from pytgi.engine.models.moe import SparseMoE

    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    model, _ = _save(_nemotron_for_gguf(True), tmp_path / "hf")
    path = tmp_path / "q8.gguf"
    write_mamba_gguf(model, "nemotron_h_moe", path, experts="Q8_0")
    model_dir = resolve_model(str(path), progress=False).path
    blocks = {}
    for dtype in ("float32", "auto"):
        runner = ModelRunner(EngineConfig(model=str(model_dir), dtype=dtype, device="cpu"))
        moe = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
        assert len(moe) == 1 and (len(moe[0].packed) == 4 and moe[0].gate_up.numel() == 0) == (
            dtype == "auto"
        )
        blocks[dtype] = moe[0]
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = blocks["float32"](x)
        got = blocks["auto"](x.bfloat16()).float()
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())
