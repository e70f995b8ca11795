"""Tensor parallelism: N shards give what one gives (tiny random model and the default model),
uneven head splits included; impossible shard counts are refused at start."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

from pytgi import LLM, SamplingParams
from pytgi.core.config import EngineConfig
from pytgi.core.net import free_port
from pytgi.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    torch.manual_seed(0)
    # 6 query heads in 3 key/value groups: N=2 splits them 2+1 groups, N=3 one each
    cfg = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=256,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny-tp")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def run(
    engine: LLMEngine, prompts: list[list[int]], ignore_eos: bool = False
) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_new_tokens=12, temperature=0, prompt_logprobs=True, ignore_eos=ignore_eos)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for u in engine.step():
            if u.prompt_logprobs:
                logprobs[u.request_id] += u.prompt_logprobs[1:]
            if u.token_id >= 0:
                tokens[u.request_id].append(u.token_id)
                logprobs[u.request_id].append(u.logprob)
    return [(tokens[str(i)], logprobs[str(i)]) for i in range(len(prompts))]


def run_sharded(
    path, prompts: list[list[int]], num_shard: int, dtype: str
) -> list[tuple[list[int], list[float]]]:
    """`run` on a fresh engine over `num_shard` shards, shut down after."""
    engine = LLMEngine(
        EngineConfig(model=str(path), max_batch_total_tokens=1024, num_shard=num_shard, dtype=dtype)
    )
    try:
        return run(engine, prompts)
    finally:
        engine.shutdown()


def assert_two_shards_equal_one(model: transformers.PreTrainedModel, path) -> None:
    """`model` saved to `path`, served in float32 on 1 and on 2 shards: the same greedy tokens and
    logprobs (within 1e-5) for a short prompt and a 20-token one."""
    model.save_pretrained(path)
    prompts = [[5, 17, 3, 99, 42, 8, 1, 64], [7] * 20]
    outs = [run_sharded(path, prompts, n, "float32") for n in (1, 2)]
    for (tokens, lps), (ref_tokens, ref_lps) in zip(*outs):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_reference(tiny_path):
    prompts = [[5, 17, 3, 99, 42, 8, 1, 64], [7] * 20, list(range(30, 60))]
    engine = LLMEngine(EngineConfig(model=str(tiny_path), max_batch_total_tokens=1024, dtype="float32"))
    try:
        return prompts, run(engine, prompts)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("n", [2, 3])
def test_tiny_model_logits_match_one_shard(tiny_path, tiny_reference, n):
    prompts, ref = tiny_reference
    engine = LLMEngine(
        EngineConfig(model=str(tiny_path), max_batch_total_tokens=1024, num_shard=n, dtype="float32")
    )
    try:
        got = run(engine, prompts)
    finally:
        engine.shutdown()
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, ref):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5, rtol=1e-5)


def test_tiny_gpt_oss_matches_one_shard(tmp_path):
    """gpt-oss over 2 shards (3 key/value groups split 2+1): each rank's sinks are its query heads',
    each expert's intermediate features split, the experts' down bias added once."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        swiglu_limit=0.5,
        max_position_embeddings=256,
        eos_token_id=None,
    )
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # biases and sinks that matter
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name:
                p.add_(torch.randn_like(p))
    assert_two_shards_equal_one(model, tmp_path)


SHAPE = dict(
    vocab_size=101,
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=None,
)


@pytest.mark.parametrize(
    "family",
    [
        # q/k norms over every head: each rank's sum of squares all-reduced, its slice of the weights
        (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
        # q/k rows reordered per head before they are split; attention and MLP added in parallel
        (transformers.Cohere2Config, transformers.Cohere2ForCausalLM),
    ],
    ids=["olmo3", "cohere2"],
)
def test_tiny_dense_families_match_one_shard(tmp_path, family):
    """OLMo 3 and Cohere 2 over 2 shards (3 key/value groups split 2+1) give one shard's tokens."""
    cfg_cls, model_cls = family
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**SHAPE))
    with torch.no_grad():  # norms that differ per feature, so a wrong slice shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    assert_two_shards_equal_one(model, tmp_path)


def test_a_rank_started_by_pytgi_shard_joins_rank_0(tiny_path, tiny_reference, monkeypatch):
    """Ranks on other machines: with WORLD_SIZE set, rank 0 starts no worker; `pytgi shard` is rank 1."""
    prompts, ref = tiny_reference
    port = free_port()
    monkeypatch.setenv("WORLD_SIZE", "2")
    shard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytgi.cli",
            "shard",
            "--model-id",
            str(tiny_path),
            "--dtype",
            "float32",
            "--rank",
            "1",
            "--master-port",
            str(port),
        ]
    )
    try:
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_path),
                max_batch_total_tokens=1024,
                num_shard=2,
                dtype="float32",
                master_port=port,
            )
        )
        try:
            assert engine.shards.procs == []
            got = run(engine, prompts)
        finally:
            engine.shutdown()
        assert shard.wait(30) == 0
    finally:
        shard.kill()
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, ref):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5, rtol=1e-5)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def default_reference():
    llm = LLM(dtype="float32", max_batch_total_tokens=4096, max_total_tokens=1024)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=48, temperature=0))]
    finally:
        llm.engine.shutdown()


SIGMOID_MOE = {
    # partial rotary, q/k/v biases, per-head q/k norms, a dense first layer, grouped sigmoid routing
    # with a correction bias, an ungated shared expert
    "glm4-moe": lambda kw: transformers.Glm4MoeForCausalLM(
        transformers.Glm4MoeConfig(
            **kw,
            intermediate_size=40,
            num_hidden_layers=3,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        )
    ),
    # q/k norms over the whole projection: each rank's heads' squares summed over the ranks
    "minimax-m2": lambda kw: transformers.MiniMaxM2ForCausalLM(
        transformers.MiniMaxM2Config(
            **kw,
            intermediate_size=40,
            num_hidden_layers=2,
            rotary_dim=8,  # type: ignore[call-arg]  # (released checkpoints' legacy key)
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    ),
}


def test_tiny_deepseek_v3_matches_one_shard(tmp_path):
    """MLA over 2 shards: 5 query heads split 3 + 2, the latent row computed and cached on each rank;
    V3's grouped sigmoid router, a shared expert, a dense first layer."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            vocab_size=101,
            hidden_size=48,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=5,
            num_key_value_heads=5,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            n_shared_experts=1,
            max_position_embeddings=256,
            eos_token_id=None,
            bos_token_id=None,
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.04)
    assert_two_shards_equal_one(model, tmp_path)


@pytest.mark.parametrize("family", list(SIGMOID_MOE))
def test_tiny_sigmoid_routed_moe_matches_one_shard(tmp_path, family):
    """GLM-4.5 MoE and MiniMax-M2 over 2 shards (3 key/value groups split 2+1)."""
    torch.manual_seed(0)
    kw = dict(
        vocab_size=101,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = SIGMOID_MOE[family](kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.04)
    assert_two_shards_equal_one(model, tmp_path)


@pytest.mark.parametrize("n", [2, 3])
def test_default_model_greedy_equals_one_shard(default_reference, n):
    llm = LLM(dtype="float32", max_batch_total_tokens=4096, max_total_tokens=1024, num_shard=n)
    try:
        assert [
            o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=48, temperature=0))
        ] == default_reference
        assert llm.engine.runner.model.layers[0].self_attn.n_kv == (
            2 if n == 2 else 1
        )  # 3 KV heads: 2+1, 1+1+1
    finally:
        llm.engine.shutdown()


def test_fast_default_path_shards(default_reference):
    """bf16 + the GGUF's int4 on each rank's slices (row-parallel slices regroup the int4 grid, and the
    partial sums add in another order): not bit-equal to one rank, but as faithful. Both score
    float32's greedy continuations (prompt logprobs) within a few hundredths of a nat a token."""
    llm = LLM(max_batch_total_tokens=4096, max_total_tokens=1024, num_shard=2)
    one = LLM(max_batch_total_tokens=4096, max_total_tokens=1024)
    try:
        assert llm.engine.runner.dtype == torch.bfloat16
        assert llm.engine.runner.model.layers[0].mlp.down_proj.quant is not None
        params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True)
        for p, ref in zip(PROMPTS, default_reference):
            ids = one.encode(p)
            sharded = llm.generate(ids + ref, params)[0].prompt_logprobs[len(ids) :]
            alone = one.generate(ids + ref, params)[0].prompt_logprobs[len(ids) :]
            gap = sum(abs(a - b) for a, b in zip(sharded, alone)) / len(ref)
            assert gap < 0.05, (p, gap)
        got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))]
        assert sum(g == ref[:8] for g, ref in zip(got, default_reference)) >= 1
    finally:
        llm.engine.shutdown()
        one.engine.shutdown()


def test_bad_shard_counts_are_refused(tiny_path):
    with pytest.raises(ValueError, match="num_shard must be >= 1"):
        LLMEngine(EngineConfig(model=str(tiny_path), num_shard=0))
    with pytest.raises(ValueError, match="3 key/value heads over 4 ranks"):
        LLMEngine(EngineConfig(model=str(tiny_path), num_shard=4))


@pytest.mark.parametrize("name", ["gemma4", "gemma4-moe"])
def test_tiny_gemma4_matches_one_shard(tmp_path, name):
    """Gemma 4 over 2 shards: each layer split by its own kv heads (the full layers' keys are their
    values, with a head size of their own), the per-layer inputs whole on each rank, the shared layers
    reading their source's shard of the cache, the experts beside the MLP split by features. A model
    whose full layers have fewer kv heads than shards is refused by those heads."""
    from tests.model.test_tiny_models import CONFIGS, randomize_gemma4_router

    cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    kw = dict(kw, vocab_size=128, eos_token_id=None, pad_token_id=0)
    model = transformers.Gemma4ForCausalLM(cls(**dict(kw, num_global_key_value_heads=2))).float().eval()
    randomize_gemma4_router(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "layer_scalar" in n:
                p.add_(torch.randn_like(p) * 0.3)
    assert_two_shards_equal_one(model, tmp_path / "two")
    if name == "gemma4":
        transformers.Gemma4ForCausalLM(cls(**kw)).save_pretrained(
            tmp_path / "one"
        )  # 1 kv head in full layers
        with pytest.raises(ValueError, match="1 key/value heads over 2 ranks"):
            LLMEngine(EngineConfig(model=str(tmp_path / "one"), num_shard=2, dtype="float32"))
