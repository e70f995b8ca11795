"""TGI router's `Infer`: limit → validate → submit → stream of events; `generate` collects it.

Everything here runs in the API process (no torch): tokens arrive from the engine as ids, and each
request's `OutputProcessor` (`pytgi.core.outputs`) turns them into text and `Delta`s that the TGI and OpenAI
routes render.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pytgi.api.frontend.engine_client import Engine
from pytgi.api.frontend.validation import ValidRequest
from pytgi.core import protocol as P
from pytgi.core.errors import EngineDead, GenerationError, IncompleteGeneration, Overloaded
from pytgi.core.outputs import Delta, OutputProcessor
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import Tokenizer


@dataclass(slots=True)
class Timings:
    validation: float = 0.0  # seconds spent validating
    queued: float = 0.0  # monotonic time the request entered the engine's queue
    start: float = 0.0  # first token out of the engine (its prefill is done)
    end: float = 0.0
    engine_queue: float = 0.0  # seconds it waited in the engine's queue (the engine says)


@dataclass(slots=True)
class Generation:
    """A collected stream (`generate`), with best_of's other sequences."""

    output: OutputProcessor  # text, tokens, top tokens, prefill, finish reason
    timings: Timings
    request: ValidRequest  # best_of's sequences each have their own seed
    best_of_sequences: list[Generation] = field(default_factory=list)


class Admission:
    """One client request's share of the `max_concurrent_requests` slots, and the engine streams
    opened under it.

    The server opens one per HTTP exchange and closes it when the exchange ends, however it ends
    (`pytgi.api.app.AdmissionMiddleware`): streams still running are aborted and the slots come
    back. Nothing else gives slots back, so no error path can keep one."""

    def __init__(self, infer: Infer) -> None:
        self.infer = infer
        self.slots = 0
        self.streams: list[RequestStream | PoolCall] = []
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
    def __init__(self, client: Engine, tokenizer: Tokenizer, max_concurrent_requests: int) -> None:
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
            queue = self.client.submit(rid, req.input_ids, req.sampling, req.images, req.cache_key)
        except EngineDead as exc:
            raise GenerationError(str(exc)) from None
        stream = RequestStream(self, rid, req, queue, timings)
        admission.streams.append(stream)
        return stream

    async def pool(
        self, inputs: list[list[int]], params: P.PoolParams | list[P.PoolParams], admission: Admission
    ) -> list[P.PoolOut]:
        """A pooling model's vectors for `inputs` (token ids), one `PoolOut` each, in order; `params`:
        for all, or one per input."""
        if admission.closed:
            raise RuntimeError("admission already closed")
        call = PoolCall(self)
        admission.streams.append(call)
        try:
            return await call.run(inputs, params)
        finally:
            call.close()

    async def generate(
        self, req: ValidRequest, admission: Admission, validation_time: float = 0.0
    ) -> Generation:
        """The collected stream; with best_of > 1 the best of several samples (mean token logprob)."""
        runs = [
            self._collect(self.stream(_with_seed(req, i), admission, validation_time))
            for i in range(req.best_of)
        ]
        results = await asyncio.gather(*runs, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        gens = [r for r in results if not isinstance(r, BaseException)]
        best = max(gens, key=mean_logprob)
        if len(gens) > 1:
            best.best_of_sequences = [r for r in gens if r is not best]
        return best

    async def _collect(self, stream: RequestStream) -> Generation:
        async for _ in stream:
            pass
        if not stream.output.finished:
            raise IncompleteGeneration()
        return Generation(stream.output, stream.timings, stream.req)


class PoolCall:
    """One HTTP request's pooling requests (an embedding model's), one engine request per input,
    submitted together so the engine batches them; `close()` aborts those still running."""

    def __init__(self, infer: Infer) -> None:
        self.infer = infer
        self.pending: dict[str, asyncio.Queue] = {}
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for rid in self.pending:
            self.infer.client.abort(rid)
        self.pending.clear()

    async def run(
        self, inputs: list[list[int]], params: P.PoolParams | list[P.PoolParams]
    ) -> list[P.PoolOut]:
        rids = []
        each = params if isinstance(params, list) else [params] * len(inputs)
        for ids, one in zip(inputs, each, strict=True):
            rid = f"req-{next(self.infer._ids)}"
            try:
                self.pending[rid] = self.infer.client.submit(rid, ids, _NO_SAMPLING, pool=one)
            except EngineDead as exc:
                raise GenerationError(str(exc)) from None
            rids.append(rid)
        out = []
        for rid in rids:
            got = await self.pending[rid].get()
            del self.pending[rid]
            self.infer.client.release(rid)
            if isinstance(got, EngineDead):
                raise GenerationError(str(got))
            if isinstance(got, P.TokenOut):  # the engine refused or failed it
                raise GenerationError(got.error or "the engine failed the request")
            out.append(got)
        return out


_NO_SAMPLING = SamplingParams(max_new_tokens=1)


class RequestStream:
    """One submitted request's `Delta`s: async-iterable once; `close()` ends it early. `output`
    holds what has been generated so far."""

    def __init__(
        self, infer: Infer, rid: str, req: ValidRequest, queue: asyncio.Queue, timings: Timings
    ) -> None:
        self.infer, self.rid, self.req, self.queue, self.timings = infer, rid, req, queue, timings
        self.output = OutputProcessor(infer.tokenizer, req.input_ids, req.sampling)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.output.finished and not self.output.stopped:
            self.infer.client.release(self.rid)
        else:
            self.infer.client.abort(self.rid)  # error, cancellation, disconnect, stop sequence

    async def __aiter__(self) -> AsyncIterator[Delta]:
        timings = self.timings
        try:
            while not self.output.finished:
                update = await self.queue.get()
                if isinstance(update, EngineDead):
                    raise GenerationError(str(update))
                if not timings.start:
                    timings.start = time.monotonic()
                    timings.engine_queue = update.queue_time
                try:
                    delta = self.output.process(update)
                except GenerationError:
                    self.infer.client.release(self.rid)  # the engine already dropped it
                    self.closed = True
                    raise
                if delta is None:
                    continue
                if delta.finish_reason is not None:
                    timings.end = time.monotonic()
                yield delta
        finally:
            self.close()


def _with_seed(req: ValidRequest, i: int) -> ValidRequest:
    if i == 0:
        return req
    other = copy.copy(req)
    other.sampling = copy.copy(req.sampling)
    other.sampling.seed = random.getrandbits(63)
    return other


def mean_logprob(g: Generation) -> float:
    lps = [t.logprob for t in g.output.tokens if t.logprob is not None]
    return sum(lps) / len(lps) if lps else float("-inf")
