"""The engine's thread count changes how work is split, not the bits (issue 65): the thread governor
may change it between steps (pytgi/engine/execution/threads.py), so a greedy output, its logprobs and
its prompt's must not depend on it."""

from __future__ import annotations

import pytest

from pytgi.core.config import EngineConfig
from pytgi.core.model_files import default_gguf_path
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def _run(threads: int, dtype: str) -> dict[str, list[float]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(default_gguf_path()), threads=threads, dtype=dtype, max_batch_total_tokens=4096
        )
    )
    prompts = [list(range(100, 100 + n)) for n in (5, 40, 300)]
    out: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    try:
        for i, p in enumerate(prompts):
            engine.add_request(
                str(i), p, SamplingParams(max_new_tokens=24, temperature=0, prompt_logprobs=True)
            )
        while engine.has_unfinished():
            for u in engine.step():
                out[u.request_id] += u.prompt_logprobs[1:] if u.prompt_logprobs else []
                if u.token_id >= 0:
                    out[u.request_id] += [u.token_id, u.logprob]
    finally:
        engine.shutdown()
    return out


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_one_thread_and_two_give_the_same_bits(dtype):
    """The default model as served (bf16 and the GGUF's 4-bit weights) and in float32."""
    assert _run(1, dtype) == _run(2, dtype)
