"""Kimi Linear in pytgi's own code (issue 64): Kimi Delta Attention layers (a gated delta rule with a
decay per key channel, on the state pool) between multi-head latent attention layers without RoPE, and
DeepSeek V3's experts. Tiny random configs through the engine: greedy tokens equal transformers'
`generate` in float32, alone and batched, with prefill chunks that cut through the prompts (and
through the chunked rule's chunks); in bf16 a request batched with others gives what it gives alone;
the chunked rule equals the token-by-token recurrence."""

from __future__ import annotations

import pytest
import torch
import transformers

from pytgi.engine.models.kda import KimiDeltaAttention, chunked_rule, l2norm, recurrent_step
from tests.model import hybrids
from tests.model.test_sharding import run

PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64] * 10, [7, 9] * 10, list(range(30, 60)), [11]]

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=4,  # (MLA reads none; the shards' early check of the config does)
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    linear_head_dim=16,
    linear_num_heads=4,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,
    initializer_range=0.2,  # weights big enough for greedy tokens that vary
)


def _save(model, path):
    with torch.no_grad():  # norms away from 1, routing biases that change the choice
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.5)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=[None, 24], ids=["q_proj", "q_lora"])
def kimi(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.KimiLinearConfig(**COMMON, q_lora_rank=request.param)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    return _save(model, tmp_path_factory.mktemp("kimi-linear"))


_engine, _reference = hybrids.engine, hybrids.reference


def test_greedy_equals_transformers_in_float32(kimi):
    model, path = kimi
    # (the rule's 32-token chunks cut too)
    hybrids.assert_greedy_equals_transformers(model, path, PROMPTS)


def test_batched_equals_alone_in_bf16(kimi):
    _, path = kimi
    hybrids.assert_batched_equals_alone_in_bf16(path, PROMPTS)


def test_a_kda_layer_keeps_its_state_per_request(kimi):
    _, path = kimi
    engine = _engine(path, dtype="float32", max_batch_size=3)
    try:
        paged = engine.runner.paged
        assert isinstance(paged.model.layers[0].linear_attn, KimiDeltaAttention)
        # the convolution's window of q|k|v, then the rule's state per head
        assert [tuple(t.shape[1:]) for t in paged.kv_caches[0]] == [(3 * 4 * 16, 3), (4, 16, 16)]
        assert len(paged.kv_caches[1]) == 2  # the latent attention layer's cache
        assert engine.info.enable_prefix_caching and engine.runner.state_grid == 32  # its chunks
    finally:
        engine.shutdown()


@pytest.mark.parametrize("length", [1, 5, 32, 77])
def test_the_chunked_rule_equals_the_recurrence(length):
    g = torch.Generator().manual_seed(length)
    H, K, V = 3, 16, 8
    q, k = (l2norm(torch.randn(length, H, K, generator=g)) for _ in range(2))
    v = torch.randn(length, H, V, generator=g)
    decay = -torch.rand(length, H, K, generator=g) * 2  # per channel
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
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state[0], rtol=1e-5, atol=1e-5)


def test_two_shards_equal_one(kimi):
    """Each rank keeps whole KDA heads (their projections' rows, convolution channels, decays and
    states) and its share of the latent attention's query heads; the outputs are all-reduced."""
    _, path = kimi
    outs = []
    for n in (1, 2):
        engine = _engine(path, dtype="float32", num_shard=n)
        try:
            outs.append(run(engine, PROMPTS[:2]))
        finally:
            engine.shutdown()
    for (tokens, lps), (ref_tokens, ref_lps) in zip(*outs):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5, rtol=1e-5)


# -- GGUF files as llama.cpp's converter writes them (`kimi-linear`) ------------------------------------
# A KDA layer's tensors as `ssm_*` (the convolutions [1, H·K, 1, kernel] apart, A_log as −exp(A_log),
# dt_bias as `ssm_dt.bias`, o_norm as `ssm_norm`), its q, k, v and output under the attention's names;
# MLA's kv_b_proj split per head (attn_k_b transposed, attn_v_b); kv heads per layer (1 MLA, 0 KDA).
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.forget_gate.f_a_proj": "ssm_f_a",
    "self_attn.forget_gate.f_b_proj": "ssm_f_b",
    "self_attn.b_proj": "ssm_beta",
    "self_attn.g_a_proj": "ssm_g_a",
    "self_attn.g_b_proj": "ssm_g_b",
    "self_attn.o_norm": "ssm_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def write_kimi_linear_gguf(hf, path) -> None:
    import gguf
    import numpy as np

    from tests.model.test_gguf_families import byte_vocabulary

    c = hf.config
    w = gguf.GGUFWriter(str(path), "kimi-linear")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(512)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([1 if t == "full_attention" else 0 for t in c.layer_types])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_kda_head_dim(c.linear_head_dim)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_leading_dense_block_count(c.mlp_layer_types.count("dense"))
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    byte_vocabulary(w, c.vocab_size)
    K, H = c.linear_head_dim, c.linear_num_heads
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            glob = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}
            w.add_tensor(glob.get(name, "output") + ".weight", a)
            continue
        _, _, i, rest = name.split(".", 3)
        stem, _, kind = rest.rpartition(".")
        blk = f"blk.{i}."
        if rest == "self_attn.conv1d.weight":  # q|k|v stacked [3·H·K, 1, kernel] → three [1, H·K, 1, kernel]
            for part, x in zip("qkv", np.split(a, 3)):
                w.add_tensor(
                    f"{blk}ssm_conv1d_{part}.weight", np.ascontiguousarray(x.reshape(1, H * K, 1, -1))
                )
        elif rest == "self_attn.forget_gate.A_log":
            w.add_tensor(blk + "ssm_a", -np.exp(a))
        elif rest == "self_attn.forget_gate.dt_bias":
            w.add_tensor(blk + "ssm_dt.bias", a)
        elif rest == "self_attn.kv_b_proj.weight":
            kv_b = a.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            k_b, v_b = kv_b[:, : c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim :]
            w.add_tensor(blk + "attn_k_b.weight", np.ascontiguousarray(k_b.swapaxes(1, 2)))
            w.add_tensor(blk + "attn_v_b.weight", np.ascontiguousarray(v_b))
        elif rest == "mlp.gate.e_score_correction_bias":
            w.add_tensor(blk + "exp_probs_b.bias", a)
        elif rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]
            gate, up = np.split(a, 2, axis=1)
            w.add_tensor(blk + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(blk + "ffn_up_exps.weight", np.ascontiguousarray(up))
        elif rest == "mlp.experts.down_proj":
            w.add_tensor(blk + "ffn_down_exps.weight", a)
        else:
            w.add_tensor(f"{blk}{GGUF_NAMES[stem]}.{kind}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_gives_transformers_logits(kimi, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    model, _ = kimi
    write_kimi_linear_gguf(model, tmp_path / "kimi.gguf")
    engine = _engine(tmp_path / "kimi.gguf", dtype="float32")
    try:  # (the file's vocabulary has an end-of-sequence token; transformers' config none)
        got = run(engine, PROMPTS, ignore_eos=True)
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [_reference(model, p) for p in PROMPTS]
    for prompt, (_, lps) in zip(PROMPTS, got):  # each prompt token's logprob, as transformers gives it
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        want = logits.log_softmax(-1)[
            torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)
        ]
        torch.testing.assert_close(torch.tensor(lps[: len(prompt) - 1]), want, atol=1e-4, rtol=1e-4)


def test_the_published_config_reads_as_transformers_reads_it():
    """moonshotai/Kimi-Linear-48B-A3B's config.json names its keys its own way and gives the layers in
    `linear_attn_config` (1-indexed): read as transformers' config reads them."""
    from pytgi.engine.models.kimi_linear import kimi_linear_config

    published = dict(
        architectures=["KimiLinearForCausalLM"],
        first_k_dense_replace=1,
        hidden_act="silu",
        hidden_size=2304,
        intermediate_size=9216,
        kv_lora_rank=512,
        linear_attn_config=dict(
            full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
            kda_layers=[i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
            head_dim=128,
            num_heads=32,
            short_conv_kernel_size=4,
        ),
        mla_use_nope=True,
        model_max_length=1048576,
        moe_intermediate_size=1024,
        moe_renormalize=True,
        moe_router_activation_func="sigmoid",
        num_attention_heads=32,
        num_expert_group=1,
        num_experts=256,
        num_experts_per_token=8,
        num_hidden_layers=27,
        num_key_value_heads=32,
        num_shared_experts=1,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        rms_norm_eps=1e-5,
        routed_scaling_factor=2.446,
        topk_group=1,
        v_head_dim=128,
        vocab_size=163840,
        pad_token_id=163839,
    )
    theirs = transformers.KimiLinearConfig(**published)
    ours = kimi_linear_config(published)
    assert ours.layer_types == theirs.layer_types
    assert ours.linear.num_heads == 32 and ours.linear.head_dim == 128 and ours.linear.conv_kernel == 4
    assert ours.moe.sparse_layers == [t == "sparse" for t in theirs.mlp_layer_types]
    assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.shared_intermediate_size) == (256, 8, 1024)
    assert ours.moe.routing.scale == 2.446 and ours.moe.norm_topk
    assert ours.max_position_embeddings == 1048576
    assert ours.attn_scale == (128 + 64) ** -0.5 and ours.rope_layers == [False] * 27
