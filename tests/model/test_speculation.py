"""Speculative decoding (`speculate=N`) on the default model's fast path: the output is the one
without speculation, token for token (greedy and seeded), with its logprobs, stops and limits, alone,
batched, after a preemption and on a prefix-cache hit; drafts are accepted where the output repeats
its input."""

from __future__ import annotations

import pytest

from pytgi import LLM, SamplingParams
from tests.kernel_paths import batch_invariant

pytestmark = [pytest.mark.slow, batch_invariant]  # every test compares with the output without drafts

CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    return width * height


def perimeter(width, height):
    """Return the perimeter of a rectangle."""
    return 2 * (width + height)
'''
ASKS = [
    "Rewrite this Python code with type hints:\n\n" + CODE,
    "Repeat this sentence three times: The old lighthouse keeper climbed the stairs every night.",
    "Write a short poem about the sea.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def llms():
    plain = LLM(max_batch_total_tokens=16384)
    spec = LLM(max_batch_total_tokens=16384, speculate=4)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


@pytest.fixture(scope="module")
def prompts(llms):
    tok = llms[0].tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}]), False) for a in ASKS]


def run(llm, prompts, params):
    return [
        (o.token_ids, o.text, o.finish_reason, o.logprobs, o.top_logprobs)
        for o in llm.generate(prompts, params)
    ]


def test_greedy_output_is_the_same_with_drafts_alone_and_batched(llms, prompts):
    plain, spec = llms
    params = SamplingParams(max_new_tokens=96, temperature=0, top_n_tokens=3)
    want = [run(plain, p, params)[0] for p in prompts]
    before = spec.engine.stats()
    assert [run(spec, p, params)[0] for p in prompts] == want
    assert run(spec, prompts, params) == want
    stats = spec.engine.stats()
    drafted, accepted = (
        stats["spec_drafted"] - before["spec_drafted"],
        stats["spec_accepted"] - before["spec_accepted"],
    )
    assert accepted > 0.5 * sum(len(w[0]) for w in want[:2]) / 2  # the copying prompts took many drafts
    assert 0 < accepted <= drafted


def test_seeded_sampling_is_the_same_with_drafts(llms, prompts):
    """Each output position has its own seeded draw, so the sample does not depend on how many
    positions a step verified: the same tokens, not only the same distribution."""
    plain, spec = llms
    for seed in range(6):
        params = SamplingParams(
            max_new_tokens=48, temperature=0.7, top_p=0.95, seed=seed, repetition_penalty=1.1
        )
        assert run(spec, prompts[:2], params) == run(plain, prompts[:2], params), seed


def test_stops_and_limits_cut_inside_a_verified_draft(llms, prompts):
    plain, spec = llms
    full = plain.generate(prompts[0], SamplingParams(max_new_tokens=60, temperature=0))[0]
    assert len(full.token_ids) > 40
    stop = full.text.split()[8]  # a word from the middle of the copied code
    for params in (
        SamplingParams(max_new_tokens=60, temperature=0, stop=[stop]),
        SamplingParams(max_new_tokens=23, temperature=0),
        SamplingParams(max_new_tokens=60, temperature=0, stop_token_ids=[full.token_ids[17]]),
    ):
        assert run(spec, prompts[0], params) == run(plain, prompts[0], params)


def test_streaming_gives_every_token_its_own_event(llms, prompts):
    plain, spec = llms
    params = SamplingParams(max_new_tokens=64, temperature=0)
    pieces = list(spec.stream(prompts[0], params))
    assert "".join(pieces) == plain.generate(prompts[0], params)[0].text
    assert len(pieces) > 40  # not one piece per step: the steps verified drafts of several tokens


def test_drafts_with_preemption_and_prefix_cache():
    small = LLM(max_batch_total_tokens=256, max_total_tokens=256, speculate=4)  # preempts and recomputes
    plain = LLM(max_batch_total_tokens=16384)
    try:
        tok = small.tokenizer
        ps = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": f"{a} ({i})"}]), False)
            for i, a in enumerate(ASKS[:2] * 2)
        ]
        params = SamplingParams(max_new_tokens=80, temperature=0)
        want = run(plain, ps, params)
        assert run(small, ps, params) == want
        assert small.engine.stats()["preemptions"] > 0
        assert run(small, ps[:1], params) == want[:1]  # now a prefix-cache hit
    finally:
        small.shutdown()
        plain.shutdown()
