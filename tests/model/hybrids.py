"""What the tests of every recurrent family check the same way (gated DeltaNet, LFM2's convolutions,
Kimi's KDA, ...): an engine on a saved tiny model, transformers' greedy tokens, greedy equality alone
and batched under prefill chunks that cut the prompts, bf16 rows that do not depend on the batch, and
prefix-cache hits that give a cold prefill's bits."""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine
from tests.model.test_sharding import run

# alone and together: whole prompts, and prefill chunks of 24 and of 5 tokens that cut every long
# prompt (5: a chunk's tail shorter than a convolution's window is the next chunk's state)
CHUNKINGS: tuple[dict[str, Any], ...] = (
    {},
    {"max_batch_prefill_tokens": 24, "enable_chunked_prefill": True},
    {"max_batch_prefill_tokens": 5, "enable_chunked_prefill": True},
)


def engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, **kw))


def reference(model, prompt: list[int]) -> list[int]:
    """transformers' 12 greedy tokens after `prompt`."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def assert_greedy_equals_transformers(model, path, prompts, chunkings=CHUNKINGS) -> None:
    """float32: each prompt's tokens alone and in a batch are transformers', under each chunking."""
    refs = [reference(model, p) for p in prompts]
    assert len({tuple(r) for r in refs}) > 1  # the answers differ: the test can tell them apart
    for kw in chunkings:
        eng = engine(path, dtype="float32", **kw)
        try:
            together = run(eng, prompts)
            alone = [run(eng, [p])[0] for p in prompts]
        finally:
            eng.shutdown()
        for ref, (a, _), (b, _) in zip(refs, together, alone):
            assert a == ref and b == ref, (kw, ref, a, b)


def assert_batched_equals_alone_in_bf16(path, prompts) -> None:
    eng = engine(path, dtype="bfloat16")
    try:
        alone = [run(eng, [p])[0] for p in prompts]
        batched = run(eng, prompts)
    finally:
        eng.shutdown()
    assert batched == alone  # tokens and every prompt and output logprob, to the bit


# a conversation's two turns (tokens 1..100: every tiny config's vocabulary has 101): the first 210
# tokens, the second 60 more
_rng = random.Random(3)
TURN_1 = [_rng.randrange(1, 101) for _ in range(210)]
TURN_2 = TURN_1 + [_rng.randrange(1, 101) for _ in range(60)]


def answer(eng: LLMEngine, prompt: list[int], max_new_tokens: int = 8) -> tuple[list[int], list[float], int]:
    """A prompt's greedy tokens, their logprobs and its cached prompt tokens."""
    rid = f"p{_rng.random()}"
    eng.add_request(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))
    tokens, lps, cached = [], [], 0
    while eng.has_unfinished():
        for u in eng.step():
            if u.token_id >= 0:
                tokens.append(u.token_id)
                lps.append(u.logprob)
            cached = u.num_cached_tokens
    return tokens, lps, cached


def assert_a_hit_gives_the_bits_of_a_cold_prefill(path, dtype: str, grid: int, **kw) -> None:
    """The prefix cache on a model with recurrent layers (docs/prefix-cache.md, "checkpoints"): its
    grid is the lcm of its kinds' (`RecurrentMixer.state_grid`), the first turn keeps a checkpoint
    at its last boundary before its end (every lcm(16, grid) tokens), the second resumes there and
    the same prompt again at its own; each answer is a cold prefill's, tokens and logprobs, to the
    bit in bf16 (the engine's own row-invariant matmuls); in float32 the tokens, the logprobs within
    1e-5 (oneDNN's matmuls round a row by the step's size: 2e-6 measured, Jamba's and LFM2's).
    The kinds' own prefills split on the grid are exact in both (the layers alone: 16 rows or more
    give the same bits however split)."""
    stride = math.lcm(16, grid)
    eng = engine(path, dtype=dtype, **kw)
    try:
        assert eng.runner.state_grid == grid and eng.info.enable_prefix_caching
        assert eng.block_manager.checkpoint_stride == stride
        first = answer(eng, TURN_1)
        second = answer(eng, TURN_2)
        again = answer(eng, TURN_2)
    finally:
        eng.shutdown()
    assert first[2] == 0
    assert second[2] == (len(TURN_1) - 1) // stride * stride
    assert again[2] == (len(TURN_2) - 1) // stride * stride
    cold = engine(path, dtype=dtype, enable_prefix_caching=False, **kw)
    try:
        assert not cold.info.enable_prefix_caching
        cold_1, cold_2 = answer(cold, TURN_1), answer(cold, TURN_2)
    finally:
        cold.shutdown()
    assert cold_1[2] == cold_2[2] == 0 and len(set(cold_2[0])) > 1
    for got, want in ((first, cold_1), (second, cold_2), (again, cold_2)):
        if dtype == "bfloat16":
            assert got[:2] == want[:2]  # tokens and logprobs, to the bit
        else:  # float32's matmuls are oneDNN's, whose rows change with the step's rows
            # (docs/batch-invariance.md): the recurrent layers are exact, the projections close
            assert got[0] == want[0]
            assert max(abs(a - b) for a, b in zip(got[1], want[1])) < 1e-5
