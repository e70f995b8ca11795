"""The offline API, as vLLM users know it: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

from pytgi.core.config import EngineConfig
from pytgi.core.errors import GenerationError, InvalidRequest
from pytgi.core.outputs import Delta, OutputProcessor, Token
from pytgi.core.protocol import TokenOut
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import Tokenizer
from pytgi.engine.engine import LLMEngine


class ImagePrompt(TypedDict):
    """A vision model's prompt: its text (or ids) with one image token per image, and the images'
    encoded bytes (PNG, JPEG, ...) in order."""

    prompt: str | list[int]
    images: list[bytes]


Prompt = str | list[int] | ImagePrompt


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each generated token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when top_n_tokens > 0
    prompt_logprobs: list[float | None] | None = None  # when asked; the first is None
    finish_reason: str | None = None  # length | eos_token | stop_sequence
    num_cached_tokens: int = 0
    num_disk_tokens: int = 0  # of them, read back from --prefix-cache-dir's files
    seed: int | None = None

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM's shape: `out.outputs[0].text`."""
        return [self]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _logprob(token: Token) -> float:
    assert token.logprob is not None, "a generated token has its logprob"
    return token.logprob


class _Tracker:
    """One request's `OutputProcessor` and the `RequestOutput` it fills."""

    def __init__(self, out: RequestOutput, params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.out, self.params = out, params
        self.proc = OutputProcessor(tokenizer, out.prompt_token_ids, params)

    def apply(self, u: TokenOut) -> Delta | None:
        out, proc = self.out, self.proc
        try:
            delta = proc.process(u)
        except GenerationError as exc:
            raise GenerationError(f"request {out.request_id}: {exc}") from None
        out.prompt_logprobs = proc.prompt_logprobs
        if delta is None:
            return None
        out.num_cached_tokens, out.num_disk_tokens = proc.num_cached_tokens, proc.num_disk_tokens
        out.token_ids.append(delta.token.id)
        out.logprobs.append(_logprob(delta.token))
        if self.params.top_n_tokens:
            out.top_logprobs.append([(t.id, _logprob(t)) for t in delta.top_tokens])
        out.text, out.finish_reason = proc.text, proc.finish_reason
        return delta


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **engine_args))
        self.tokenizer = Tokenizer.from_dir(self.engine.model_path)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (also done at exit when they lose rank 0)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise InvalidRequest("a prompt is a string or a list of token ids (ints)")
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion, continuously batched; outputs in the prompts' order."""
        if isinstance(prompts, (str, dict)):
            batch: list[Prompt] = [prompts]
        elif prompts and isinstance(cast(Sequence[Any], prompts)[0], int):
            batch = [cast(Prompt, prompts)]
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(plist) != len(batch):
            raise InvalidRequest("give one SamplingParams, or one per prompt")
        trackers: list[_Tracker] = []
        try:
            for prompt, sp in zip(batch, plist):
                trackers.append(self._submit(prompt, sp))
        except Exception:  # all or nothing: a bad prompt must not leave the others running
            for t in trackers:
                self.engine.abort_request(t.out.request_id)
            raise
        for _ in self._run({t.out.request_id: t for t in trackers}):
            pass
        return [t.out for t in trackers]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion's text as it is generated."""
        tracker = self._submit(prompt, sampling_params or SamplingParams())
        for _, text in self._run({tracker.out.request_id: tracker}):
            if text:
                yield text

    def chat(
        self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(self.tokenizer.encode(prompt, add_special_tokens=False), sampling_params)[0]

    def _submit(self, prompt: Prompt, params: SamplingParams) -> _Tracker:
        images: list[bytes] = []
        text: str | list[int]
        if isinstance(prompt, dict):
            text, images = prompt["prompt"], list(prompt["images"])
        else:
            text = prompt
        ids = self.encode(text)
        rid = f"llm-{next(self._ids)}"
        out = RequestOutput(rid, text if isinstance(text, str) else None, ids, seed=params.seed)
        self.engine.add_request(rid, ids, params, images)
        return _Tracker(out, params, self.tokenizer)

    def _run(self, trackers: dict[str, _Tracker]) -> Iterator[tuple[str, str]]:
        """Step the engine; yield (request id, text that can be shown now) per update of `trackers`."""
        pending = set(trackers)
        try:
            while pending and self.engine.has_unfinished():
                for u in self.engine.step():
                    tracker = trackers.get(u.request_id)
                    if tracker is None or tracker.proc.finished or not isinstance(u, TokenOut):
                        continue  # tokens of a step after a stop string
                    delta = tracker.apply(u)
                    if tracker.proc.stopped:  # a stop string: the engine only knows token ids
                        self.engine.abort_request(u.request_id)
                    if tracker.proc.finished:
                        pending.discard(u.request_id)
                    yield u.request_id, delta.text if delta else ""
        finally:
            for rid in pending:  # an exception or an abandoned stream must not leave work behind
                self.engine.abort_request(rid)
