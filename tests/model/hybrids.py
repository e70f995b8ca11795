"""What the tests of every recurrent family check the same way (gated DeltaNet, LFM2's convolutions,
Kimi's KDA, ...): an engine on a saved tiny model, transformers' greedy tokens, greedy equality alone
and batched under prefill chunks that cut the prompts, bf16 rows that do not depend on the batch."""

from __future__ import annotations

from typing import Any

import torch

from pytgi.core.config import EngineConfig
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
