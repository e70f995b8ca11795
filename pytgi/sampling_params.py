"""Sampling and stopping parameters of one request (plain data, no torch)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the parameter and the fix."""


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 20
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    typical_p: float = 1.0  # 1 disables
    repetition_penalty: float = 1.0  # HF / TGI style, on prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI style, on output tokens
    presence_penalty: float = 0.0  # OpenAI style, on output tokens
    do_sample: bool | None = None  # None: sample when any warper is set and temperature > 0
    seed: int | None = None  # None: a random seed is drawn (and reported) when sampling
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's default; TGI's routes keep it
    ignore_eos: bool = False
    top_n_tokens: int = 0  # alternatives reported per generated token
    logprobs: bool = True  # report the chosen token's logprob
    prompt_logprobs: bool = False  # logprobs of the prompt tokens (TGI's decoder_input_details)
    skip_special_tokens: bool = True
    watermark: bool = False  # green-list watermark (Kirchenbauer et al. 2023), as TGI's `watermark`
    # Structured output (`pytgi.structured`), at most one: the output must match it.
    json_schema: dict[str, Any] | str | None = None  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # Lark, or GBNF/EBNF

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()
        if self.seed is None and self.sampling:
            self.seed = random.getrandbits(63)

    @property
    def sampling(self) -> bool:
        """Whether tokens are drawn at random (otherwise greedy)."""
        if self.temperature == 0:
            return False
        if self.do_sample is not None:
            return self.do_sample
        return self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0 or self.typical_p < 1.0

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(msg)

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise bad(f"`max_new_tokens` must be strictly positive, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise bad(f"`temperature` must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise bad(f"`top_k` must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"`top_p` must be > 0.0 and <= 1.0, got {self.top_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise bad(f"`typical_p` must be > 0.0 and <= 1.0, got {self.typical_p}")
        if self.repetition_penalty <= 0:
            raise bad(f"`repetition_penalty` must be strictly positive, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"`frequency_penalty` must be >= -2.0 and <= 2.0, got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"`presence_penalty` must be >= -2.0 and <= 2.0, got {self.presence_penalty}")
        if self.top_n_tokens < 0:
            raise bad(f"`top_n_tokens` must be >= 0, got {self.top_n_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise bad(f"`seed` must be in [0, 2**64), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("`stop` must be a list of non-empty strings")
