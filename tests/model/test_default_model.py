"""The embedded default model (SmolLM2-135M-Instruct) in fp32: fidelity to transformers and
invariance of the output under batching, chunking, prefix caching and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytgi import LLM, SamplingParams
from pytgi.core.errors import InvalidRequest
from tests.kernel_paths import batch_invariant, decoder_loop
from tests.model.loop_check import assert_loop_equals_python_path
from tests.reference import hf_copy

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is to a child.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea, there lived",
]
NEW_TOKENS = 48
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_batch_total_tokens=16384)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), False) for c in CHATS]
    return chats + [tok.encode(r) for r in RAW]


@pytest.fixture(scope="module")
def hf_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_copy(llm.engine.model_path), dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(seq[0, len(ids) :].tolist())
    return out


def greedy_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_greedy_equals_transformers_alone(llm, prompts, hf_greedy):
    for ids, ref in zip(prompts, hf_greedy):
        assert greedy_ids(llm, [ids])[0] == ref


def test_batched_equals_alone(llm, prompts, hf_greedy):
    assert greedy_ids(llm, prompts) == hf_greedy


def test_chat_output_is_sensible(llm):
    out = llm.chat([{"role": "user", "content": CHATS[0]}], GREEDY)
    assert "Paris" in out.text and out.finish_reason == "eos_token"


def test_chunked_prefill_equals_unchunked(prompts, hf_greedy):
    chunky = LLM(dtype="float32", max_batch_total_tokens=16384, max_batch_prefill_tokens=16)
    assert greedy_ids(chunky, prompts) == hf_greedy


def test_prefix_cache_hit_equals_miss(llm, prompts):
    system = [{"role": "system", "content": "You are a terse assistant. " * 8}]
    tok = llm.tokenizer
    convo = [
        tok.encode(tok.apply_chat_template(system + [{"role": "user", "content": q}]), False)
        for q in ("Name a color.", "Name a fruit.")
    ]
    first = llm.generate(convo[0], GREEDY)[0]
    second = llm.generate(convo[1], GREEDY)[0]
    assert second.num_cached_tokens >= 64  # the shared system prompt came from the cache
    cold = LLM(dtype="float32", max_batch_total_tokens=16384, enable_prefix_caching=False)
    assert [o.token_ids for o in cold.generate(convo, GREEDY)] == [first.token_ids, second.token_ids]
    assert all(o.num_cached_tokens == 0 for o in cold.generate(convo, GREEDY))


def test_preemption_gives_the_same_output(prompts, hf_greedy):
    # 6 requests need ~6 x 100 tokens; 256 KV slots force preemptions and recomputation.
    small = LLM(dtype="float32", max_batch_total_tokens=256, max_total_tokens=256)
    assert greedy_ids(small, prompts) == hf_greedy
    assert small.engine.stats()["preemptions"] > 0
    assert small.engine.block_manager.num_free_blocks == small.engine.info.num_blocks


def test_seed_reproduces_a_sample_alone_or_batched(llm, prompts):
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=seed)

    alone = llm.generate(prompts[0], params(7))[0].token_ids
    batched = llm.generate(prompts[:3], [params(7), params(8), params(9)])
    assert batched[0].token_ids == alone
    assert batched[1].token_ids != alone
    assert llm.generate(prompts[1], params(8))[0].token_ids == batched[1].token_ids


def test_stop_strings_and_stop_token_ids(llm, prompts, hf_greedy):
    ref = llm.tokenizer.decode(hf_greedy[0])  # "The capital of France is Paris..."
    out = llm.generate(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, stop=["Paris"]))[
        0
    ]
    assert out.finish_reason == "stop_sequence" and out.text == ref[: ref.index("Paris")]
    kept = llm.generate(
        prompts[0],
        SamplingParams(
            max_new_tokens=NEW_TOKENS, temperature=0, stop=["Paris"], include_stop_str_in_output=True
        ),
    )[0]
    assert kept.text.endswith("Paris")
    by_id = llm.generate(
        prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[hf_greedy[0][2]])
    )[0]
    assert by_id.token_ids == hf_greedy[0][:3] and by_id.finish_reason == "stop_sequence"


def test_max_new_tokens_and_ignore_eos(llm, prompts):
    out = llm.generate(prompts[0], SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"
    assert 2 in out.token_ids  # it went past <|im_end|>


def test_logprobs_match_transformers(llm, prompts):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_new_tokens=8, temperature=0, top_n_tokens=3, prompt_logprobs=True)
    out = llm.generate(prompts[3], params)[0]
    model = AutoModelForCausalLM.from_pretrained(hf_copy(llm.engine.model_path), dtype=torch.float32).eval()
    full = out.prompt_token_ids + out.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    ref_prompt = [lp[i - 1, full[i]].item() for i in range(1, n)]
    assert out.prompt_logprobs[0] is None
    torch.testing.assert_close(
        torch.tensor(out.prompt_logprobs[1:]), torch.tensor(ref_prompt), atol=1e-4, rtol=0
    )
    ref_gen = [lp[n - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref_gen), atol=1e-4, rtol=0)
    top = lp[n - 1].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()


def test_bad_input_is_refused_clearly(llm):
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate("", GREEDY)
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate([[]], GREEDY)
    too_long = [100] * (llm.engine.info.max_input_tokens + 1)
    with pytest.raises(InvalidRequest, match="`inputs` tokens \\+ `max_new_tokens` must be <="):
        llm.generate(too_long, GREEDY)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        llm.generate([100] * 10, SamplingParams(max_new_tokens=llm.engine.info.max_total_tokens))
    with pytest.raises(InvalidRequest, match="token ids"):
        llm.generate([10**9], GREEDY)
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    # the engine keeps serving afterwards
    assert llm.generate("Hello", SamplingParams(max_new_tokens=3, temperature=0))[0].token_ids


def test_fast_default_is_faithful_to_float32(llm, prompts, hf_greedy):
    """The default CPU path (bfloat16 activations, the GGUF's Q4_1 tensors as int4, its Q8_0 head as
    int8) scores transformers' float32 greedy continuations almost as float32 does, on the
    int4 kernels one token at a time (alone) and in a prefill of the same tokens."""
    fast = LLM(max_batch_total_tokens=16384)
    try:
        runner = fast.engine.runner
        assert runner.dtype == torch.bfloat16
        assert sum(getattr(m, "quant", None) is not None for m in runner.model.modules()) == 30 * 4 + 1
        params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True)
        for p, ref in zip(prompts, hf_greedy):
            exact = llm.generate(p + ref, params)[0].prompt_logprobs[len(p) :]
            scored = fast.generate(p + ref, params)[0].prompt_logprobs[len(p) :]  # one prefill: bf16 path
            gap = sum(abs(a - b) for a, b in zip(exact, scored)) / len(exact)
            assert gap < 0.1, gap
        # Decoding alone (one token per step, the int4 path) mostly follows float32's greedy choices.
        agree = [
            fast.generate(p, SamplingParams(max_new_tokens=8, temperature=0))[0].token_ids == ref[:8]
            for p, ref in zip(prompts, hf_greedy)
        ]
        assert sum(agree) >= len(agree) - 2, agree
    finally:
        fast.shutdown()


TOPICS = [
    "the ocean",
    "a red bicycle",
    "quantum computers",
    "baking bread",
    "the moon landing",
    "a lost cat",
    "winter in Norway",
    "learning Python",
    "a jazz concert",
    "volcanoes",
    "the Roman empire",
    "coffee",
    "a robot gardener",
    "chess openings",
    "rain forests",
    "the stock market",
    "a haunted house",
    "electric cars",
    "honey bees",
    "the Eiffel tower",
    "a marathon",
    "origami",
    "black holes",
    "tea ceremonies",
    "a pirate ship",
]


@batch_invariant
def test_fast_default_is_batch_invariant():
    """A request's greedy output does not depend on who else is on the server (issue 14): 50 chat
    prompts sent together give the texts they give one at a time, and a long prompt gives the same
    tokens prefilled in one step or in chunks of 64 next to others."""
    fast = LLM(max_batch_total_tokens=16384)
    chunked = LLM(max_batch_total_tokens=16384, max_batch_prefill_tokens=64)
    try:
        tok = fast.tokenizer
        chats = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": k.format(t)}]), False)
            for k in ("Write a short story about {}.", "Explain {} in three sentences.")
            for t in TOPICS
        ]
        params = SamplingParams(max_new_tokens=32, temperature=0)
        alone = [fast.generate(p, params)[0].token_ids for p in chats]
        together = [o.token_ids for o in fast.generate(chats, params)]
        assert sum(a == b for a, b in zip(alone, together)) == len(chats)
        long = tok.encode(
            "Summarize: " + " ".join(f"{t.capitalize()} is a topic worth a paragraph." for t in TOPICS * 2)
        )
        assert len(long) > 300
        one_step = fast.generate(long, params)[0].token_ids
        assert next(o.token_ids for o in chunked.generate([long] + chats[:3], params)) == one_step
    finally:
        fast.shutdown()
        chunked.shutdown()


@decoder_loop
def test_c_decoder_loop_equals_the_python_path(prompts):
    """The fast path's one-call decoder loop (`pytgi/engine/kernels/decoder.c`) runs the kernels the
    Python path runs, with the same arguments: the same tokens and prompt logprobs, bit for bit,
    for batched decodes and for prefills small enough for it (both of which it must have run)."""
    fast = LLM(max_batch_total_tokens=16384)
    try:
        assert_loop_equals_python_path(fast, prompts, 11)  # at least the decode steps of the first run
    finally:
        fast.shutdown()


@decoder_loop
def test_c_decoder_loop_equals_the_python_path_with_an_int8_cache(prompts):
    """The same with `--kv-cache-dtype int8`: the loop writes and reads the int8 rows as the layer
    loop's kernels do."""
    fast = LLM(max_batch_total_tokens=16384, kv_cache_dtype="int8")
    try:
        assert_loop_equals_python_path(fast, prompts, 11)
    finally:
        fast.shutdown()


def test_an_int8_cache_costs_under_a_hundredth_of_a_nat_a_token():
    """The default model's mean log-likelihood of a held-out text (this repository's architecture
    notes) with its keys and values in int8, against the bf16 cache: issue 45's bound, 0.01."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()[:3000]
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=True, temperature=0)
    nll = {}
    for kv in ("auto", "int8"):
        llm = LLM(max_batch_total_tokens=4096, kv_cache_dtype=kv, enable_prefix_caching=False)
        try:
            lps = [
                x
                for x in llm.generate([llm.tokenizer.encode(text)], params)[0].prompt_logprobs
                if x is not None
            ]
        finally:
            llm.shutdown()
        nll[kv] = -sum(lps) / len(lps)
    assert len(lps) > 500 and abs(nll["int8"] - nll["auto"]) <= 0.01, nll
