"""Requests and a fake model loop for scheduler / block-manager tests (no model)."""

from __future__ import annotations

import itertools

from pytgi.engine.request import Request
from pytgi.engine.scheduler import Scheduler, SchedulerOutput
from pytgi.sampling_params import SamplingParams


_unique = itertools.count(1)


def make_request(rid: str, prompt: list[int] | int, max_new_tokens: int = 16, **kw) -> Request:
    """A greedy request; an int prompt gets that many tokens shared with no other request."""
    ids = [next(_unique) for _ in range(prompt)] if isinstance(prompt, int) else prompt
    return Request(rid, ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **kw))


def run_step(sched: Scheduler, next_token: int = 7) -> SchedulerOutput:
    """What the engine does after a successful forward: advance, cache blocks, sample, finish."""
    out = sched.schedule()
    for s in out.scheduled:
        req = s.request
        samples = s.samples
        req.num_computed_tokens += s.num_new_tokens
        sched.block_manager.cache_full_blocks(req)
        if samples:
            req.append_token(next_token)
            if req.check_stop() is not None:
                sched.finish(req)
    return out
