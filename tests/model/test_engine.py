"""Engine behaviour on a tiny random model: failures stay inside their step, aborts free memory,
bad models are refused with a clear message."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.errors import ModelNotFound, UnsupportedModel
from pytgi.core.model_files import resolve_model
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine
from tests.model.tiny_llama import tiny_llama


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine(tiny_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_path), max_batch_total_tokens=512, block_size=4))


def run(engine: LLMEngine) -> dict[str, list]:
    seen: dict[str, list] = {}
    while engine.has_unfinished():
        for u in engine.step():
            seen.setdefault(u.request_id, []).append(u)
    return seen


def test_a_failing_step_fails_only_its_requests_and_the_engine_goes_on(engine, monkeypatch):
    params = SamplingParams(max_new_tokens=5, temperature=0)
    engine.add_request("ok-before", [1, 2, 3], params)
    assert run(engine)["ok-before"][-1].finish_reason == "length"

    real = engine.runner.execute

    def flaky(batch):
        if any(s.request.request_id == "doomed" for s in batch):
            raise RuntimeError("injected fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    engine.add_request("neighbour", [4, 5, 6], params)
    engine.step()  # neighbour is running
    engine.add_request("doomed", [7, 8, 9], params)
    updates = engine.step()  # neighbour's decode and doomed's prefill share this step
    assert {u.request_id for u in updates} == {"neighbour", "doomed"}
    assert all(u.error and "injected fault" in u.error and u.finish_reason == "error" for u in updates)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.info.num_blocks

    engine.add_request("ok-after", [1, 2, 3], params)
    out = run(engine)["ok-after"]
    assert len(out) == 5 and out[-1].finish_reason == "length" and out[-1].error is None
    assert engine.stats()["failed_steps"] == 1


def test_abort_frees_blocks_within_a_step(engine):
    engine.add_request("a", list(range(1, 20)), SamplingParams(max_new_tokens=50, temperature=0))
    engine.add_request("b", list(range(1, 9)), SamplingParams(max_new_tokens=50, temperature=0))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.info.num_blocks
    assert engine.abort_request("a") and engine.abort_request("b")
    assert not engine.abort_request("a")
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.info.num_blocks
    assert engine.step() == []


def test_kv_cache_too_small_for_one_request_is_refused_at_start(tiny_path):
    with pytest.raises(ValueError, match="max_batch_total_tokens"):
        LLMEngine(EngineConfig(model=str(tiny_path), max_batch_total_tokens=64, max_total_tokens=128))


def test_max_total_tokens_defaults_to_what_the_kv_cache_holds(tiny_path):
    """Unset, a request may take the model's positions as far as the KV cache holds them."""
    info = LLMEngine(EngineConfig(model=str(tiny_path), max_batch_total_tokens=64)).info
    assert (info.max_total_tokens, info.max_input_tokens, info.max_batch_total_tokens) == (64, 63, 64)


def test_missing_model_path_names_the_fix(tmp_path):
    with pytest.raises(ModelNotFound, match="model not found"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelNotFound, match="config.json"):
        resolve_model(tmp_path)


def test_unsupported_architecture_is_refused(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(tmp_path), model_impl="pytgi"))  # auto: transformers' code runs it
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]


def test_longrope_requests_get_their_table_and_their_own_cached_blocks(tmp_path):
    """LongRoPE (Phi-3): a prompt past the original context runs on the long factors from its first
    chunk, as transformers' one forward does, so it must not reuse blocks a short request computed on
    the short ones; greedy output equals transformers' either way."""
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(  # type: ignore[call-arg]  # the stubs lack rope_scaling (kwargs)
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=16,
        pad_token_id=0,
        eos_token_id=None,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.2 * i for i in range(4)],
            "long_factor": [1.0 + 2.0 * i for i in range(4)],
        },
    )
    hf = transformers.Phi3ForCausalLM(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="float32", max_batch_total_tokens=512, block_size=4)
    )
    short, long = list(range(3, 15)), list(range(3, 15)) + list(range(40, 70))  # 12 and 42 tokens

    def want(prompt: list[int]) -> list[int]:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
        return out[0, len(prompt) :].tolist()

    def greedy(rid: str, prompt: list[int]) -> tuple[list[int], int]:
        engine.add_request(rid, prompt, SamplingParams(max_new_tokens=5, temperature=0))
        ids, cached = [], 0
        while engine.has_unfinished():
            for u in engine.step():
                ids.append(u.token_id)
                cached = max(cached, u.num_cached_tokens)
        return ids, cached

    try:
        assert greedy("short", short) == (want(short), 0)
        got, cached = greedy("long", long)  # its first 12 tokens' blocks exist, on the short table
        assert got == want(long) and cached == 0
        assert greedy("again", long) == (want(long), 40)  # its own blocks, on the long table
    finally:
        engine.shutdown()


def test_dynamic_ntk_rope_follows_transformers_per_forward(tmp_path):
    """Dynamic NTK: transformers scales the base by the sequence's length at each forward once past
    the original context (the prompt's forward: its length; each decode: the length so far). Greedy
    output equals its `generate` for a prompt inside the original context that decodes past it and
    for prompts past it; a long prompt's cached blocks serve only prompts of its own length."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(  # type: ignore[call-arg]  # the stubs lack rope_scaling (kwargs)
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        eos_token_id=None,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0},
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="float32", max_batch_total_tokens=512, block_size=4)
    )
    assert engine.info.max_total_tokens == 64  # 4 × 16 positions
    short, long = list(range(3, 13)), list(range(3, 13)) + list(range(40, 70))  # 10 and 40 tokens

    def want(prompt: list[int]) -> list[int]:
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).float().eval()  # a fresh rope state
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        ids = out.sequences[0, len(prompt) :].tolist()
        logprobs[tuple(prompt)] = [float(s[0].log_softmax(-1)[t]) for s, t in zip(out.scores, ids)]
        return ids

    logprobs: dict[tuple[int, ...], list[float]] = {}

    def greedy(rid: str, prompt: list[int]) -> tuple[list[int], int]:
        engine.add_request(rid, prompt, SamplingParams(max_new_tokens=12, temperature=0))
        ids, lps, cached = [], [], 0
        while engine.has_unfinished():
            for u in engine.step():
                ids.append(u.token_id)
                lps.append(u.logprob)
                cached = max(cached, u.num_cached_tokens)
        want(prompt)  # each token's logprob too: greedy tokens alone can hide a wrong frequency
        torch.testing.assert_close(
            torch.tensor(lps), torch.tensor(logprobs[tuple(prompt)]), atol=1e-4, rtol=0
        )
        return ids, cached

    try:
        assert greedy("short", short) == (want(short), 0)  # decodes 11 .. 22: past 16 from the 7th
        assert greedy("long", long) == (want(long), 0)  # its first 8 tokens' blocks exist, for length 16
        assert greedy("again", long) == (want(long), 36)  # its own blocks, for its length
        longer = long + [5, 6, 7, 8]
        assert greedy("longer", longer) == (want(longer), 0)  # another length: its own blocks
    finally:
        engine.shutdown()
