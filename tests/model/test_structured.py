"""Structured output on the default model (float32): outputs match their constraint for greedy and
seeded sampling; a constrained request gives the same output alone and batched, under chunked
prefill, preemption and the prefix cache, and over two shards."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pytgi.core.errors import InvalidRequest
from pytgi.core.sampling_params import SamplingParams
from pytgi.llm import LLM

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "hobbies"],
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def cases(llm: LLM) -> list[tuple[str, SamplingParams]]:
    """Constrained requests of every kind, greedy and seeded, plus unconstrained neighbours."""
    person = chat(llm, "Describe a person as JSON with name, age and hobbies.")
    return [
        (person, SamplingParams(max_new_tokens=80, temperature=0, json_schema=PERSON)),
        (person, SamplingParams(max_new_tokens=80, temperature=0.9, seed=7, json_schema=PERSON)),
        (
            chat(llm, "What is the phone number of the office?"),
            SamplingParams(max_new_tokens=30, temperature=0, regex=PHONE),
        ),
        (
            chat(llm, "Is the sky blue? Answer yes or no."),
            SamplingParams(max_new_tokens=10, temperature=0.7, seed=3, choice=["yes", "no"]),
        ),
        (
            chat(llm, "Write a word list."),
            SamplingParams(
                max_new_tokens=30,
                temperature=0,
                grammar='root ::= item item? item?\nitem ::= "- " [a-z]+ "\\n"',
            ),
        ),
        (person, SamplingParams(max_new_tokens=40, temperature=0)),  # unconstrained, same prompt
        ("The capital of France is", SamplingParams(max_new_tokens=40, temperature=0.8, seed=1)),
    ]


def check(outputs) -> None:
    for o in outputs[:2]:
        jsonschema.validate(json.loads(o.text), PERSON)
        assert o.finish_reason == "eos_token"  # the object closed: the grammar ended the request
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", outputs[2].text)
    assert outputs[3].text in ("yes", "no")
    assert re.fullmatch(r"(- [a-z]+\n){1,3}", outputs[4].text)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="float32", max_batch_total_tokens=4096, max_total_tokens=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def alone(llm) -> list[str]:
    """Each case generated on its own."""
    outs = [llm.generate([p], [s])[0] for p, s in cases(llm)]
    check(outs)
    return [o.text for o in outs]


def test_outputs_match_their_constraints_and_batched_equals_alone(llm, alone):
    prompts, params = zip(*cases(llm))
    outs = llm.generate(list(prompts), list(params))
    check(outs)
    assert [o.text for o in outs] == alone


def test_a_seed_reproduces_a_constrained_sample(llm, alone):
    p, s = cases(llm)[1]
    assert llm.generate([p], [s])[0].text == alone[1]
    other = llm.generate(
        [p], [SamplingParams(max_new_tokens=80, temperature=0.9, seed=8, json_schema=PERSON)]
    )[0]
    jsonschema.validate(json.loads(other.text), PERSON)


def test_chunked_prefill_preemption_and_prefix_cache_keep_outputs(alone):
    """Prompts cut into 32-token chunks and a KV cache too small for the batch (requests are preempted
    and recomputed, matchers keep their state), twice so the second round hits the prefix cache."""
    small = LLM(
        dtype="float32",
        max_batch_total_tokens=192,
        max_total_tokens=192,
        max_batch_prefill_tokens=32,
        block_size=16,
    )
    try:
        prompts, params = zip(*cases(small))
        for _ in range(2):
            assert [o.text for o in small.generate(list(prompts), list(params))] == alone
        assert small.engine.scheduler.num_preemptions > 0
        assert small.engine.block_manager.hit_rate > 0
    finally:
        small.shutdown()


def test_two_shards_give_the_same_outputs(alone):
    sharded = LLM(dtype="float32", max_batch_total_tokens=4096, max_total_tokens=1024, num_shard=2)
    try:
        prompts, params = zip(*cases(sharded))
        assert [o.text for o in sharded.generate(list(prompts), list(params))] == alone
    finally:
        sharded.shutdown()


def test_ignore_eos_still_ends_when_the_grammar_is_complete(llm):
    out = llm.generate(
        [chat(llm, "Yes or no?")],
        [SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, choice=["yes", "no"])],
    )[0]
    assert out.text in ("yes", "no") and out.finish_reason == "eos_token"


def test_invalid_constraints_are_refused_before_anything_runs(llm):
    for bad in (  # type: ignore[var-annotated]
        {"regex": "("},
        {"json_schema": {"type": "nonsense"}},
        {"grammar": "root ::= ("},
        {"choice": []},
        {"regex": "a", "choice": ["a"]},
    ):
        with pytest.raises(InvalidRequest):
            llm.generate(["x"], [SamplingParams(max_new_tokens=4, **bad)])
    assert not llm.engine.has_unfinished()
