"""LFM2 and LFM2-MoE in pytgi's own code (issue 64): short-convolution layers (a recurrent kind on the
state pool) between attention layers with q/k norms; LFM2-MoE's dense first layers and sigmoid router
with an expert bias. Tiny random configs through the engine: greedy tokens equal transformers'
`generate` in float32, alone and batched, with prefill chunks that cut through the prompts (some
shorter than the convolution's window); in bf16 a request batched with others gives what it gives
alone; GGUF files as llama.cpp's converter writes `lfm2` and `lfm2moe` give transformers' logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.models.short_conv import ShortConv, ShortConvConfig
from tests.model import hybrids
from tests.model.test_gguf_families import byte_vocabulary
from tests.model.test_sharding import run

PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64] * 10, [7, 9] * 10, list(range(30, 60)), [11]]
# conv first (a GGUF file's first kv-head count is then 0), an attention layer, two more conv layers
TYPES = ["conv", "full_attention", "conv", "conv"]

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    layer_types=TYPES,
    eos_token_id=None,
    initializer_range=0.2,  # weights big enough for greedy tokens that vary
)


def _save(model, path):
    with torch.no_grad():  # norms away from 1 and expert biases that change the choice
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.rand_like(b) * 0.5)
    model.save_pretrained(path)
    return model, path


def _lfm2_model():
    # block_ff_dim 96 → two thirds, 64, rounded up to a multiple of 32: the MLP's width
    cfg = transformers.Lfm2Config(**COMMON, intermediate_size=96, block_multiple_of=32)
    return transformers.Lfm2ForCausalLM(cfg).eval()


def _lfm2_moe_model():
    cfg = transformers.Lfm2MoeConfig(
        **COMMON,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_dense_layers=1,
        conv_bias=True,  # (the published models have none: the biases' names and shards checked here)
    )
    return transformers.Lfm2MoeForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    torch.manual_seed(0)
    return _save(_lfm2_model(), tmp_path_factory.mktemp("lfm2"))


@pytest.fixture(scope="module")
def lfm2_moe(tmp_path_factory):
    torch.manual_seed(1)
    return _save(_lfm2_moe_model(), tmp_path_factory.mktemp("lfm2-moe"))


@pytest.fixture(params=["lfm2", "lfm2_moe"])
def hybrid(request):
    return request.getfixturevalue(request.param)


_engine, _reference = hybrids.engine, hybrids.reference


def test_greedy_equals_transformers_in_float32(hybrid):
    model, path = hybrid
    hybrids.assert_greedy_equals_transformers(model, path, PROMPTS)


def test_batched_equals_alone_in_bf16(hybrid):
    _, path = hybrid
    hybrids.assert_batched_equals_alone_in_bf16(path, PROMPTS)


def test_a_conv_layer_keeps_its_window_per_request(lfm2):
    """The state pool: a conv layer's entry is one [slots, hidden, L_cache − 1] tensor, the attention
    layer's its keys and values; the prefix cache keeps checkpoints at every block's end (the
    convolution is exact however a prefill is cut: grid 1)."""
    _, path = lfm2
    engine = _engine(path, dtype="float32", max_batch_size=3)
    try:
        paged = engine.runner.paged
        assert isinstance(paged.model.layers[0].linear_attn, ShortConv)
        assert [tuple(t.shape[1:]) for t in paged.kv_caches[0]] == [(64, 2)]
        assert len(paged.kv_caches[1]) == 2  # keys and values
        assert paged.state_bytes_per_request() == 3 * 64 * 2 * 4
        assert engine.info.enable_prefix_caching and engine.runner.state_grid == 1
        assert engine.block_manager.checkpoint_stride == 16
    finally:
        engine.shutdown()


def test_pytorch_ops_alone_give_the_same_tokens(lfm2_moe, monkeypatch):
    """Without the C kernels (no compiler, or CUDA): PyTorch's ops for attention, norms and rope."""
    from pytgi.engine import kernels

    for name in ("supports", "vnni_supported", "bf16gemm_supported"):
        monkeypatch.setattr(kernels, name, lambda *_: False)
    model, path = lfm2_moe
    engine = _engine(path, dtype="float32")
    try:
        got = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [_reference(model, p) for p in PROMPTS]


def test_two_shards_equal_one(lfm2_moe):
    """Each rank keeps a share of the conv layers' channels (their gates, taps, biases and states)
    and of the attention heads; the output projections are all-reduced."""
    _, path = lfm2_moe
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


# -- GGUF files as llama.cpp's converter writes them ----------------------------------------------------
# LFM2's names (llama.cpp's tensor map): the final `embedding_norm` is `token_embd_norm`, a conv layer's
# tensors `shortconv.*` (the convolution squeezed to [hidden, L_cache]), the expert bias `exp_probs_b`;
# kv heads per layer (0 for a conv layer), the MLP's width as adjusted, the taps in `shortconv.l_cache`.
GGUF_NAMES = {
    "operator_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm",
    "conv.in_proj": "shortconv.in_proj",
    "conv.conv": "shortconv.conv",
    "conv.out_proj": "shortconv.out_proj",
    "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down",
    "feed_forward.gate": "ffn_gate_inp",
}


def write_lfm2_gguf(hf, arch: str, path) -> None:
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(hf.model.layers[0].feed_forward.w1.out_features)  # (dense in both here)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t == "full_attention" else 0 for t in c.layer_types])
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    if arch == "lfm2moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_leading_dense_block_count(c.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    byte_vocabulary(w, c.vocab_size)
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
            continue
        if name == "model.embedding_norm.weight":
            w.add_tensor("token_embd_norm.weight", a)
            continue
        if name == "lm_head.weight":
            if not c.tie_word_embeddings:
                w.add_tensor("output.weight", a)
            continue
        _, _, i, rest = name.split(".", 3)
        stem, _, kind = rest.rpartition(".")
        blk = f"blk.{i}."
        if rest == "feed_forward.expert_bias":
            w.add_tensor(blk + "exp_probs_b.bias", a)
        elif rest == "feed_forward.experts.gate_up_proj":  # [E, 2I, H]
            gate, up = np.split(a, 2, axis=1)
            w.add_tensor(blk + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(blk + "ffn_up_exps.weight", np.ascontiguousarray(up))
        elif rest == "feed_forward.experts.down_proj":
            w.add_tensor(blk + "ffn_down_exps.weight", a)
        elif rest == "conv.conv.weight":  # [H, 1, L] → [H, L]
            w.add_tensor(blk + "shortconv.conv.weight", np.ascontiguousarray(a[:, 0]))
        else:
            w.add_tensor(f"{blk}{GGUF_NAMES[stem]}.{kind}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["lfm2", "lfm2moe"])
def test_a_gguf_file_gives_transformers_logits(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(2)
    model, _ = _save(_lfm2_model() if arch == "lfm2" else _lfm2_moe_model(), tmp_path / "hf")
    write_lfm2_gguf(model, arch, tmp_path / f"{arch}.gguf")
    engine = _engine(tmp_path / f"{arch}.gguf", dtype="float32")
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
    """LiquidAI/LFM2-1.2B's config.json: `block_ff_dim` adjusted to the MLP's width, `tie_embedding`,
    `norm_eps`, the layer types; the width is the one transformers' model builds."""
    from pytgi.engine.models.lfm2 import lfm2_config

    published = dict(
        architectures=["Lfm2ForCausalLM"],
        block_auto_adjust_ff_dim=True,
        block_ff_dim=12288,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=256,
        conv_L_cache=3,
        conv_bias=False,
        hidden_size=2048,
        intermediate_size=12288,
        full_attn_idxs=[2, 5, 8, 10, 12, 14],
        norm_eps=1e-5,
        num_attention_heads=32,
        num_hidden_layers=16,
        num_key_value_heads=8,
        rope_theta=1000000.0,
        tie_embedding=True,
        vocab_size=65536,
    )
    theirs = transformers.Lfm2Config(**published)
    with torch.device("meta"):
        mlp = transformers.models.lfm2.modeling_lfm2.Lfm2MLP(theirs)
    ours = lfm2_config(published)
    assert ours.intermediate_size == mlp.w1.out_features == 8192
    assert ours.layer_types == theirs.layer_types
    assert ours.tie_word_embeddings and ours.rms_norm_eps == 1e-5 and ours.qk_norm
    assert isinstance(ours.linear, ShortConvConfig) and ours.linear.kernel == 3 and not ours.linear.bias


def test_a_preempted_request_recomputes_its_state(lfm2):
    """A KV cache too small for every request at once: the last admitted is preempted, its state slot
    freed and its convolutions' windows recomputed from its tokens when it runs again; the answers are
    those of a cache big enough."""
    _, path = lfm2
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


def test_a_q8_0_file_serves_its_own_values(tmp_path, monkeypatch):
    """A file whose matrices are Q8_0 (the conv layers' in_proj and out_proj, the experts too): the
    tokens transformers gives with the same values rounded as the file holds them."""
    import gguf

    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    q8 = gguf.GGMLQuantizationType.Q8_0
    torch.manual_seed(3)
    model, _ = _save(_lfm2_moe_model(), tmp_path / "hf")
    with torch.no_grad():  # transformers' weights rounded as the file will hold them
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embed_tokens" not in name and "conv.conv" not in name:
                a = p.numpy().reshape(-1, p.shape[-1])
                back = gguf.quants.dequantize(gguf.quants.quantize(a, q8), q8)
                p.copy_(torch.from_numpy(back.reshape(p.shape)))
    plain = gguf.GGUFWriter.add_tensor

    def add(self, name, a, *args, **kw):  # every matrix but the embedding and the taps as Q8_0
        if a.ndim >= 2 and "token_embd" not in name and "shortconv.conv" not in name:
            return plain(self, name, gguf.quants.quantize(np.ascontiguousarray(a), q8), raw_dtype=q8)
        return plain(self, name, a, *args, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add)
    write_lfm2_gguf(model, "lfm2moe", tmp_path / "q8.gguf")
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", plain)
    engine = _engine(tmp_path / "q8.gguf", dtype="float32")
    try:
        got = run(engine, PROMPTS, ignore_eos=True)
    finally:
        engine.shutdown()
    assert [t for t, _ in got] == [_reference(model, p) for p in PROMPTS]
