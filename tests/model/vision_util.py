"""What the vision model tests share: random PNGs, a float32 engine, and greedy runs of image prompts."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine


def png(seed: int, size=(70, 45)) -> bytes:
    """A PNG of random pixels, `size` = (width, height)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def engine_for(path, **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(**{"model": str(path), "dtype": "float32", "max_batch_total_tokens": 4096, **kw})
    )


def greedy(engine: LLMEngine, jobs, new: int) -> tuple[list[list[int]], list[int]]:
    """jobs: (prompt ids, images) submitted together; each one's `new` greedy tokens (fewer at EOS),
    and the prompt tokens the prefix cache gave it."""
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for i, (prompt, images) in enumerate(jobs):
        engine.add_request(str(i), prompt, SamplingParams(max_new_tokens=new, temperature=0), images=images)
        got[str(i)] = []
    while engine.has_unfinished():
        for u in engine.step():
            cached.setdefault(u.request_id, u.num_cached_tokens)
            if u.token_id >= 0:
                got[u.request_id].append(u.token_id)
    return [got[str(i)] for i in range(len(jobs))], [cached[str(i)] for i in range(len(jobs))]
