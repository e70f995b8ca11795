"""Requests and a fake model loop for scheduler / block-manager tests (no model)."""

from __future__ import annotations

import itertools

from pytgi.core import protocol as P
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.scheduling.request import Request
from pytgi.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from pytgi.engine.scheduling.step import StepOutput

_unique = itertools.count(1)


def make_request(rid: str, prompt: list[int] | int, max_new_tokens: int = 16, **kw) -> Request:
    """A greedy request; an int prompt gets that many tokens shared with no other request."""
    ids = [next(_unique) for _ in range(prompt)] if isinstance(prompt, int) else prompt
    return Request(rid, ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **kw))


def run_step(sched: Scheduler, next_token: int = 7) -> SchedulerOutput:
    """One engine step with a fake runner that samples `next_token` for every request at its end."""
    out = sched.schedule()
    samples = {
        s.request.request_id: P.TokenOut(s.request.request_id, next_token) for s in out.scheduled if s.samples
    }
    sched.update_from_output(out, StepOutput(samples))
    return out
