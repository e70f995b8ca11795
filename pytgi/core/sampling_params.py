"""Sampling and stopping parameters of one request (plain data, no torch)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from pytgi.core.errors import InvalidRequest

# The rules a request keeps, each written once. SHARED_RULES hold wherever a request comes from (the
# API's validation checks them in TGI's words and order; SamplingParams checks them too); TGI's
# stricter rules for its own parameters (temperature > 0, top_p < 1...) live in its validation.
SHARED_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_new_tokens": (lambda v: isinstance(v, int) and v > 0, "must be strictly positive"),
    "repetition_penalty": (lambda v: v > 0, "must be strictly positive"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "must be >= -2.0 and <= 2.0"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "must be >= -2.0 and <= 2.0"),
    "stop": (lambda v: all(isinstance(s, str) and s for s in v), "must be a list of non-empty strings"),
    "inputs": (lambda v: len(v) > 0, "cannot be empty"),
}
# What the engine can run at all (0 and 1 disable a warper, 0 is greedy).
ENGINE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 disables it)"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "must be > 0.0 and <= 1.0"),
    "typical_p": (lambda v: 0.0 < v <= 1.0, "must be > 0.0 and <= 1.0"),
    "top_n_tokens": (lambda v: v >= 0, "must be >= 0"),
    "seed": (lambda v: 0 <= v < 2**64, "must be in [0, 2**64)"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "must be >= 0.0 and <= 1.0 (0 disables it)"),
    "logit_bias": (
        lambda v: all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0 for t, b in v.items()),
        "must map token ids (>= 0) to biases in [-100, 100]",
    ),
    "cache_pins": (
        lambda v: all(t >= 0 and d > 0 for t, d in v) and all(a[0] <= b[0] for a, b in pairwise(v)),
        "must be (prompt tokens >= 0, seconds > 0) pairs, by tokens ascending",
    ),
}


def check(name: str, value: object) -> None:
    """Refuse `value` for the field `name` if it breaks its shared rule (None: not given)."""
    ok, rule = SHARED_RULES[name]
    if value is not None and not ok(value):
        raise InvalidRequest(f"`{name}` {rule}", name)


def check_token_ids(ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"`inputs` token ids must be >= 0 and < {vocab_size}", "inputs")


def check_logit_bias(bias: dict[int, float] | None, vocab_size: int | None) -> None:
    if bias and vocab_size is not None and max(bias) >= vocab_size:
        raise InvalidRequest(f"`logit_bias` token ids must be >= 0 and < {vocab_size}", "logit_bias")


def check_prompt(
    ids: list[int],
    max_new_tokens: int,
    max_input_tokens: int,
    max_total_tokens: int,
    vocab_size: int | None,
    extra: int = 0,
) -> None:
    """The prompt's rules (TGI's words, in TGI's order), for the API's validation and the engine alike.
    `extra`: positions the engine adds (a vision model's image tokens, expanded)."""
    check("inputs", ids)
    check_token_ids(ids, vocab_size)
    n = len(ids) + extra
    if n + max_new_tokens > max_total_tokens:
        raise InvalidRequest(
            f"`inputs` tokens + `max_new_tokens` must be <= {max_total_tokens}. "
            f"Given: {n} `inputs` tokens and {max_new_tokens} `max_new_tokens`",
            "max_new_tokens",
            "context_length_exceeded",
        )
    if n > max_input_tokens:
        raise InvalidRequest(
            f"`inputs` must have less than {max_input_tokens} tokens. Given: {n}",
            "inputs",
            "context_length_exceeded",
        )


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 20
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    typical_p: float = 1.0  # 1 disables
    min_p: float = 0.0  # 0 disables: keep tokens with probability >= min_p * the top token's
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to those tokens' logits, greedy or not
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
    # Structured output (`pytgi.core.grammar`), at most one: the output must match it.
    json_schema: dict[str, Any] | str | None = None  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # Lark, or GBNF/EBNF
    # The answer's reasoning format (--reasoning-parser): a constraint applies after its <think> block
    reasoning: str | None = None
    adapter: str | None = None  # the LoRA adapter (--lora-adapters) that generates; None: the base model
    # (prompt tokens, seconds): keep the prefix cache's blocks of the prompt's first tokens that long
    # (Anthropic's cache_control; at most --prefix-cache-max-pin-seconds)
    cache_pins: list[tuple[int, float]] = field(default_factory=list)

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
        warped = self.top_k > 0 or self.top_p < 1.0 or self.typical_p < 1.0 or self.min_p > 0.0
        return self.temperature != 1.0 or warped

    def validate(self) -> None:
        for name in [n for n in SHARED_RULES if n != "inputs"]:
            check(name, getattr(self, name))
        for name, (ok, rule) in ENGINE_RULES.items():
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise InvalidRequest(f"`{name}` {rule}, got {value!r}", name)
