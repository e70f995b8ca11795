"""Structured output's token masks with no model: llguidance matchers over the tiny tokenizer, driven
by random logits through the real sampler, and the scheduler's handling of their outcomes."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pytgi.core import grammar as structured
from pytgi.core import protocol as P
from pytgi.core.errors import GrammarError
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import Tokenizer
from pytgi.engine.sampling.grammars import GrammarMatchers
from pytgi.engine.sampling.sampler import Sampler, SamplingMetadata
from pytgi.engine.scheduling.request import Status
from pytgi.engine.scheduling.step import StepOutput
from tests.unit.helpers import make_request
from tests.unit.test_scheduler import make_scheduler
from tests.unit.tiny_tokenizer import VOCAB_SIZE

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture()
def grammars(tokenizer_dir):
    g = GrammarMatchers(tokenizer_dir / "tokenizer.json", VOCAB_SIZE, frozenset({EOS}))
    yield g
    g.shutdown()


def grammar(**constraint) -> str:
    g = structured.check(SamplingParams(**constraint))
    assert g is not None
    return g


def allowed(grammars: GrammarMatchers, ids: list[str]) -> torch.Tensor:
    masks = grammars.start_masks(ids)
    assert masks is not None
    return masks.result() == 0


def generate(
    grammars: GrammarMatchers,
    tok: Tokenizer,
    rids: list[str],
    params: list[SamplingParams],
    steps: int = 120,
    seed: int = 0,
) -> dict[str, tuple[list[int], str]]:
    """Drive requests with random logits through the sampler and their masks until each grammar is
    complete (or EOS); returns (token ids, how it ended) per request."""
    logits_gen = torch.Generator().manual_seed(seed)
    gens = {
        rid: torch.Generator().manual_seed(p.seed or 0) if p.sampling else None
        for rid, p in zip(rids, params)
    }
    out: dict[str, tuple[list[int], str]] = {rid: ([], "") for rid in rids}
    live = list(zip(rids, params))
    for _ in range(steps):
        if not live:
            break
        masks = grammars.start_masks([rid for rid, _ in live])
        logits = torch.randn(len(live), VOCAB_SIZE, generator=logits_gen) * 3
        meta = SamplingMetadata.build(
            [p for _, p in live],
            [[]] * len(live),
            [out[r][0] for r, _ in live],
            [gens[r] for r, _ in live],
            VOCAB_SIZE,
            torch.device("cpu"),
        )
        tokens = Sampler()(logits, meta, masks.result() if masks else None).token_ids.tolist()
        still = []
        for (rid, p), t in zip(live, tokens):
            out[rid][0].append(t)
            if rid in grammars and grammars.accept(rid, t):
                out[rid] = (out[rid][0], "complete")
            elif t == EOS:
                out[rid] = (out[rid][0], "eos")
            else:
                still.append((rid, p))
        live = still
    return out


def text(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode([i for i in ids if i != EOS])


def test_unconstrained_rows_need_no_mask(grammars):
    assert grammars.start_masks(["a", "b"]) is None


def test_masks_allow_only_what_the_grammar_can_continue_with(grammars, tok):
    grammars.add("r", grammar(regex=r"\d+"))
    grammars.add("free", grammar(choice=["hello", "world"]))
    mask = allowed(grammars, ["x", "r", "free"])
    assert mask.shape == (3, VOCAB_SIZE) and mask[0].all()  # an unconstrained row allows everything
    digits = [t for t in mask[1].nonzero().flatten().tolist()]
    assert digits and all(re.fullmatch(r"[0-9]+", tok.decode([t])) for t in digits)
    assert not mask[1, EOS]  # EOS only where the grammar accepts: not before a digit
    assert grammars.accept("r", tok.encode("7")[0]) is False
    assert allowed(grammars, ["r"])[0, EOS]  # one digit matches: now the request may end
    firsts = {tok.decode([t]) for t in mask[2].nonzero().flatten().tolist()}
    assert firsts and all("hello".startswith(f) or "world".startswith(f) for f in firsts)


def test_ignore_eos_masks_eos_until_the_grammar_admits_nothing_else(grammars, tok):
    grammars.add("keep", grammar(regex=r"\d+"), ignore_eos=True)
    grammars.add("plain", grammar(regex=r"\d+"))
    grammars.add("done", grammar(choice=["ok"]), ignore_eos=True)
    for rid, text in (("keep", "7"), ("plain", "7"), ("done", "ok")):
        for t in tok.encode(text):
            grammars.accept(rid, t)
    mask = allowed(grammars, ["keep", "plain", "done"])
    assert not mask[0, EOS] and mask[0].any()  # more digits may follow: no end yet
    assert mask[1, EOS]  # without ignore_eos the request may end here
    assert mask[2, EOS] and mask[2].sum() == 1  # complete: the end is all that is left


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_is_valid_for_greedy_and_sampling(grammars, tok, temperature):
    rids = [f"r{i}" for i in range(4)]
    params = [
        SamplingParams(temperature=temperature, seed=i, do_sample=temperature > 0, json_schema=SCHEMA)
        for i in range(4)
    ]
    for rid in rids:
        grammars.add(rid, grammar(json_schema=SCHEMA))
    for rid, (ids, end) in generate(grammars, tok, rids, params).items():
        assert end in ("complete", "eos"), (rid, text(tok, ids))
        jsonschema.validate(json.loads(text(tok, ids)), SCHEMA)


def test_choice_and_regex_outputs_match(grammars, tok):
    grammars.add("c", grammar(choice=["yes", "no", "hello world"]))
    grammars.add("r", grammar(regex=r"[a-z]{2,4}-\d{2}"))
    p = SamplingParams(temperature=1.0, seed=5, do_sample=True)
    out = generate(grammars, tok, ["c", "r"], [p, p])
    assert text(tok, out["c"][0]) in ("yes", "no", "hello world")
    assert re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", text(tok, out["r"][0]))


def test_a_constrained_row_is_the_same_alone_and_batched(grammars, tok):
    """A row's mask depends on its own matcher only (the sampler's draw is per row too: its tests;
    whole generations alone and batched: tests/model/test_structured.py)."""
    a = GrammarMatchers(grammars._tokenizer_json, VOCAB_SIZE, frozenset({EOS}))
    b = GrammarMatchers(grammars._tokenizer_json, VOCAB_SIZE, frozenset({EOS}))
    try:
        a.add("me", grammar(json_schema=SCHEMA))
        for rid in ("me", "x", "y"):
            b.add(rid, grammar(json_schema=SCHEMA) if rid != "y" else grammar(regex="[0-9]+"))
        for t in tok.encode('{"name": "ab", "age": 1'):
            alone = allowed(a, ["me"])[0]
            batched = allowed(b, ["y", "plain", "me", "x"])[2]
            assert torch.equal(alone, batched)
            a.accept("me", t)
            b.accept("me", t)
    finally:
        a.shutdown()
        b.shutdown()


def test_same_grammar_twice_starts_fresh(grammars, tok):
    """The second request with a schema starts from a copy of the cached matcher, not from the first
    request's state."""
    grammars.add("a", grammar(json_schema=SCHEMA))
    first = allowed(grammars, ["a"])[0]
    for t in tok.encode('{"name"'):
        grammars.accept("a", t)
    grammars.add("b", grammar(json_schema=SCHEMA))
    assert torch.equal(allowed(grammars, ["b"])[0], first)
    assert not torch.equal(allowed(grammars, ["a"])[0], first)


def test_a_refused_token_is_an_error_for_that_request_only(grammars, tok):
    grammars.add("r", grammar(regex="[0-9]+"))
    grammars.add("s", grammar(regex="[0-9]+"))
    with pytest.raises(GrammarError):
        grammars.accept("r", tok.encode("hello")[0])
    assert grammars.accept("s", tok.encode("5")[0]) is False


def test_a_grammar_that_fails_to_build_fails_its_request_only(grammars, tok):
    grammars.add("bad", "this is not a grammar %%%")
    grammars.add("good", grammar(regex="[0-9]+"))
    mask = allowed(grammars, ["bad", "good"])
    assert mask[0].all()  # its row is left open ...
    with pytest.raises(GrammarError):
        grammars.accept("bad", 5)  # ... and its request ends at its first token
    assert grammars.accept("good", tok.encode("5")[0]) is False


def test_removed_requests_are_forgotten(grammars):
    grammars.add("a", grammar(regex="x"))
    grammars.remove("a")
    assert "a" not in grammars and grammars.start_masks(["a"]) is None


# -- the scheduler's side --------------------------------------------------------------------------------
def test_a_complete_grammar_ends_the_request_and_an_error_fails_only_its_own():
    sched = make_scheduler()
    done, bad, other = (make_request(r, 4, max_new_tokens=50) for r in ("done", "bad", "other"))
    for r in (done, bad, other):
        sched.add(r)
    out = sched.schedule()
    samples = {s.request.request_id: P.TokenOut(s.request.request_id, 7) for s in out.scheduled}
    updates = {
        u.request_id: u
        for u in sched.update_from_output(
            out, StepOutput(samples, complete={"done"}, errors={"bad": "structured output: no"})
        )
    }
    assert updates["done"].finish_reason == "eos_token" and done.status is Status.FINISHED
    assert updates["bad"].finish_reason == "error" and updates["bad"].error == "structured output: no"
    assert updates["other"].finish_reason is None and other.status is Status.RUNNING
    assert bad.status is Status.FINISHED and list(sched.requests) == ["other"]
