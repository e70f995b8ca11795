"""One engine step's types: what the scheduler asks the runner to compute, and what comes back.

Both sides import this module; neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pytgi.core import protocol as P
from pytgi.engine.scheduling.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """A request's part of a step: `num_new_tokens` of its tokens computed, from
    `request.all_ids[num_computed_tokens:]`, then its draft (verified this step)."""

    request: Request
    num_new_tokens: int  # the draft's tokens included
    draft: list[int] = field(default_factory=list)  # guessed tokens after the request's last

    @property
    def samples(self) -> bool:
        """Whether the step reaches the end of the request's tokens, so samples its next one."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens - len(self.draft) == req.num_tokens

    @property
    def tokens(self) -> list[int]:
        """The token ids this step computes for the request."""
        start = self.request.num_computed_tokens
        ids = self.request.all_ids[start : start + self.num_new_tokens - len(self.draft)]
        return ids + self.draft if self.draft else ids


@dataclass(slots=True)
class StepOutput:
    """What the runner computed for a step's scheduled requests."""

    samples: dict[str, P.TokenOut] = field(default_factory=dict)  # request_id → this step's token
    # request_id → the tokens after it (a draft's accepted tokens, each sampled again)
    more: dict[str, list[P.TokenOut]] = field(default_factory=dict)
    # request_id → logprobs of the prompt tokens this step's chunk predicted (first prompt token: None)
    prompt_logprobs: dict[str, list[float | None]] = field(default_factory=dict)
    complete: set[str] = field(default_factory=set)  # structured output whose grammar is complete
    errors: dict[str, str] = field(default_factory=dict)  # requests that cannot go on (and why)
    pooled: dict[str, P.PoolOut] = field(default_factory=dict)  # a pooling model's finished requests
