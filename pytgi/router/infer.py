"""The seed's `Infer`: limit → validate → submit → stream of events; `generate` collects it.

Everything here runs in the API process (no torch): tokens arrive from the engine as ids and are
turned into TGI's events here — incremental detokenization, stop sequences, prefill details.
"""

from __future__ import annotations

import asyncio
import copy
import random
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pytgi import protocol as P
from pytgi.router.engine_client import EngineClient, EngineDead
from pytgi.router.validation import ValidRequest
from pytgi.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop


class InferError(Exception):
    error_type = "generation"
    status = 424
    prefix = ""

    @property
    def message(self) -> str:
        return f"{self.prefix}{self}"


class Overloaded(InferError):
    error_type, status = "overloaded", 429

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


class GenerationError(InferError):
    error_type, status, prefix = "generation", 424, "Request failed during generation: "


class IncompleteGeneration(InferError):
    error_type, status = "incomplete_generation", 500

    def __init__(self) -> None:
        super().__init__("Incomplete generation")


@dataclass(slots=True)
class Token:
    id: int
    text: str
    logprob: float | None
    special: bool = False


@dataclass(slots=True)
class Timings:
    validation: float = 0.0  # seconds spent validating
    queued: float = 0.0  # monotonic time the request entered the engine's queue
    start: float = 0.0  # first token out of the engine (its prefill is done)
    end: float = 0.0


@dataclass(slots=True)
class StreamEvent:
    index: int
    token: Token
    top_tokens: list[Token] = field(default_factory=list)
    # set on the last event only
    generated_text: str | None = None
    finish_reason: str | None = None
    generated_tokens: int = 0
    seed: int | None = None
    prefill: list[Token] = field(default_factory=list)
    input_length: int = 0
    timings: Timings | None = None


@dataclass(slots=True)
class Generation:
    """A collected stream (`generate`), with best_of's other sequences."""

    generated_text: str
    finish_reason: str
    tokens: list[Token]
    top_tokens: list[list[Token]]
    prefill: list[Token]
    seed: int | None
    input_length: int
    timings: Timings
    best_of_sequences: list[Generation] = field(default_factory=list)


class Admission:
    """One client request's share of the `max_concurrent_requests` slots, and the engine streams
    opened under it.

    The server opens one per HTTP exchange and closes it when the exchange ends, however it ends
    (`pytgi.server.app.AdmissionMiddleware`): streams still running are aborted and the slots come
    back. Nothing else gives slots back, so no error path can keep one."""

    def __init__(self, infer: Infer) -> None:
        self.infer = infer
        self.slots = 0
        self.streams: list[RequestStream] = []
        self.closed = False

    def take(self, n: int = 1) -> None:
        """Non-blocking: over the limit the answer is 429 at once, never a wait."""
        if self.closed:
            raise RuntimeError("admission already closed")
        if self.infer.in_flight + n > self.infer.max_concurrent_requests:
            raise Overloaded()
        self.infer.in_flight += n
        self.slots += n

    def close(self) -> None:
        """Idempotent and synchronous: it may run where nothing can be awaited (a cancelled task)."""
        if self.closed:
            return
        self.closed = True
        for stream in self.streams:
            stream.close()
        self.infer.in_flight -= self.slots
        self.slots = 0


class Infer:
    def __init__(self, client: EngineClient, tokenizer: Tokenizer, max_concurrent_requests: int) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0
        self._ids = itertools.count()

    def admission(self) -> Admission:
        return Admission(self)

    def stream(self, req: ValidRequest, admission: Admission, validation_time: float = 0.0) -> RequestStream:
        """Submit now under `admission`; iterate the result for the request's events. `close()` (sync,
        idempotent) aborts it, so cleanup works even inside a cancelled task where nothing can be awaited."""
        if admission.closed:
            raise RuntimeError("admission already closed")
        rid = f"req-{next(self._ids)}"
        timings = Timings(validation=validation_time, queued=time.monotonic())
        try:
            queue = self.client.submit(rid, req.input_ids, req.sampling)
        except EngineDead as exc:
            raise GenerationError(str(exc)) from None
        stream = RequestStream(self, rid, req, queue, timings)
        admission.streams.append(stream)
        return stream

    async def generate(self, req: ValidRequest, admission: Admission, validation_time: float = 0.0) -> Generation:
        """The collected stream; with best_of > 1 the best of several samples (mean token logprob)."""
        runs = [self._collect(self.stream(_with_seed(req, i), admission, validation_time))
                for i in range(req.best_of)]
        results = await asyncio.gather(*runs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        best = max(results, key=_mean_logprob)  # type: ignore[arg-type]
        if len(results) > 1:
            best.best_of_sequences = [r for r in results if r is not best]  # type: ignore[misc]
        return best  # type: ignore[return-value]

    async def _collect(self, events: RequestStream) -> Generation:
        tokens: list[Token] = []
        tops: list[list[Token]] = []
        async for ev in events:
            tokens.append(ev.token)
            tops.append(ev.top_tokens)
            if ev.generated_text is not None and ev.timings is not None:
                return Generation(ev.generated_text, ev.finish_reason or "length", tokens, tops, ev.prefill,
                                  ev.seed, ev.input_length, ev.timings)
        raise IncompleteGeneration()


class RequestStream:
    """One submitted request's events: async-iterable once; `close()` ends it early."""

    def __init__(self, infer: Infer, rid: str, req: ValidRequest, queue: asyncio.Queue, timings: Timings) -> None:
        self.infer, self.rid, self.req, self.queue, self.timings = infer, rid, req, queue, timings
        self.finished = False  # the engine finished it (a stop sequence still needs an abort)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.finished:
            self.infer.client.release(self.rid)
        else:
            self.infer.client.abort(self.rid)  # error, cancellation, disconnect, stop sequence

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        state = _Decoder(self.infer.tokenizer, self.req)
        timings = self.timings
        try:
            while True:
                update = await self.queue.get()
                if isinstance(update, EngineDead):
                    raise GenerationError(str(update))
                if update.error is not None:
                    self.finished = True
                    raise GenerationError(update.error)
                if not timings.start:
                    timings.start = time.monotonic()
                state.prefill_from(update)
                if update.token_id < 0:
                    continue
                event = state.token(update)
                if event.finish_reason is not None:
                    self.finished = not state.stopped_early
                    timings.end = time.monotonic()
                    event.timings = timings
                    yield event
                    return
                yield event
        finally:
            self.close()


def _with_seed(req: ValidRequest, i: int) -> ValidRequest:
    if i == 0:
        return req
    other = copy.copy(req)
    other.sampling = copy.copy(req.sampling)
    other.sampling.seed = random.getrandbits(63)
    return other


def _mean_logprob(g: Generation) -> float:
    lps = [t.logprob for t in g.tokens if t.logprob is not None]
    return sum(lps) / len(lps) if lps else float("-inf")


class _Decoder:
    """Turns one request's engine updates into TGI events."""

    def __init__(self, tokenizer: Tokenizer, req: ValidRequest) -> None:
        self.tok = tokenizer
        self.req = req
        self.detok = IncrementalDetokenizer(tokenizer, req.input_ids[-8:], skip_special_tokens=True)
        self.text = ""
        self.index = 0
        self.prefill: list[Token] = []
        self.stopped_early = False

    def piece(self, token_id: int, logprob: float | None) -> Token:
        return Token(token_id, self.tok.id_to_piece(token_id), logprob, token_id in self.tok.special_ids)

    def prefill_from(self, update: P.TokenOut) -> None:
        if update.prompt_logprobs is not None:
            ids = self.req.input_ids
            self.prefill = [self.piece(i, lp) for i, lp in zip(ids, update.prompt_logprobs)]

    def token(self, update: P.TokenOut) -> StreamEvent:
        self.index += 1
        special = update.token_id in self.tok.special_ids
        before = len(self.text)
        delta = self.detok.add(update.token_id)
        self.text += delta
        finish = update.finish_reason
        stops = self.req.sampling.stop
        match = find_stop(self.text, stops, before) if stops else None
        if match is not None:
            # TGI keeps the stop text (validation sets include_stop_str_in_output); OpenAI's routes cut it
            self.text = self.text[: match[1] if self.req.sampling.include_stop_str_in_output else match[0]]
            delta = self.text[before:]
            finish, self.stopped_early = "stop_sequence", True
        elif finish is not None:
            tail = self.detok.flush()
            self.text += tail
            delta += tail
        text = self.tok.id_to_piece(update.token_id) if special else delta
        event = StreamEvent(
            index=self.index,
            token=Token(update.token_id, text, update.logprob, special),
            top_tokens=[self.piece(i, lp) for i, lp in update.top],
        )
        if finish is not None:
            event.finish_reason = finish
            event.generated_text = (self.req.inputs + self.text) if self.req.return_full_text else self.text
            event.generated_tokens = self.index
            event.seed = self.req.sampling.seed if self.req.sampling.sampling else None
            event.prefill = self.prefill
            event.input_length = self.req.input_length
        return event
