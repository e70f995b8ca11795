"""What every API's routes do around a generation, written once (`Exchange`): admission in TGI's
order (slots, then validation), the request metrics, running the engine requests to completion or
streaming them as server-sent events with keep-alive comments, and noticing a client that went away.
Each API keeps its JSON shapes and how its errors are answered (pytgi.api.error_handlers and
pytgi.api.openai.error_shape); the app's exception handlers answer what is raised here."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from pytgi.api import tracing
from pytgi.api.frontend.bodies import ValidRequest
from pytgi.api.frontend.infer import Admission, Generation, RequestStream, Timings
from pytgi.api.state import State, admission, state_of
from pytgi.core.errors import ClientGone, InferError, InvalidRequest
from pytgi.core.outputs import Delta

log = logging.getLogger("pytgi.api")
KEEP_ALIVE_SECONDS = 15.0
KEEP_ALIVE = ":\n\n"  # an SSE comment: keeps proxies and clients from timing out on a slow step

T = TypeVar("T")
# the route's span: TGI's names where TGI has the route
ROUTE_SPANS = {
    "/": "compat_generate",
    "/generate": "generate",
    "/generate_stream": "generate_stream",
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"x-accel-buffering": "no", "cache-control": "no-cache"},
    )


async def with_keep_alive(items: AsyncIterable[T]) -> AsyncIterator[T | None]:
    """`items`, with a None whenever KEEP_ALIVE_SECONDS pass without one. Closing this closes `items`'s
    pending read without awaiting anything (it may run in a cancelled task)."""
    it = items.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=KEEP_ALIVE_SECONDS)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()


def record_success(
    st: State,
    t: Timings,
    arrived: float,
    input_length: int,
    generated: int,
    cached: int = 0,
    disk: int = 0,
) -> None:
    """`cached`: the prompt tokens the prefix cache served; `disk`: of them, those read from disk."""
    m = st.metrics
    m.request_success.inc()
    m.request_duration.observe(time.monotonic() - arrived)
    m.request_queue_duration.observe(max(t.start - t.queued, 0.0))
    inference = max(t.end - t.start, 0.0)
    m.request_inference_duration.observe(inference)
    m.request_mean_time_per_token_duration.observe(inference / max(generated, 1))
    m.request_input_length.observe(input_length)
    m.request_generated_tokens.observe(generated)
    m.prompt_tokens.inc(input_length)
    m.prefix_cache_hit_tokens.labels(tier="ram").inc(cached - disk)
    m.prefix_cache_hit_tokens.labels(tier="disk").inc(disk)


async def wait_disconnect(request: Request, task: asyncio.Task) -> bool:
    """Cancel `task` if the client goes away before it completes (non-streaming routes): True if so."""
    while not task.done():
        if await request.is_disconnected():
            task.cancel()
            return True
        await asyncio.sleep(0.25)
    return False


async def unless_gone(request: Request, task: asyncio.Task[T]) -> T:
    """`task`'s result, or `ClientGone` (an INFO line, not an error) when the client left first."""
    watcher = asyncio.ensure_future(wait_disconnect(request, task))
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled() and watcher.result():
            log.info("%s: the client went away before the answer; its request was aborted", request.url.path)
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


def combined(timings: list[Timings]) -> Timings:
    """Several engine requests' timings as one answer's (n choices, several prompts)."""
    starts = [t.start for t in timings if t.start]
    return Timings(
        validation=timings[0].validation,
        queued=min(t.queued for t in timings),
        start=min(starts) if starts else 0.0,
        end=max(t.end for t in timings),
    )


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """(stream's index, delta) from every stream as they come."""
    if len(streams) == 1:  # the common case, without a task per stream
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for d in stream:
                queue.put_nowait((i, d))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    live = len(streams)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class Exchange:
    """One HTTP request's generations, from admission to the last byte. `refusals`: the API's own
    exceptions for a request at fault, counted as validation failures as InvalidRequest is."""

    def __init__(self, request: Request, refusals: tuple[type[Exception], ...] = ()) -> None:
        self.request = request
        self.st: State = state_of(request)
        self.arrived = time.monotonic()
        self.refusals: tuple[type[Exception], ...] = (InvalidRequest, *refusals)
        self.admission: Admission | None = None
        self.validation_time = 0.0
        self.st.metrics.request_count.inc()

    @contextmanager
    def refused(self) -> Iterator[None]:
        """Count a refused request as TGI does (`tgi_request_failure{err="validation"}`)."""
        try:
            yield
        except self.refusals:
            self.st.metrics.request_failure.labels("validation").inc()
            raise

    def failed(self, exc: InferError) -> None:
        """Count a request the router could not serve, by its kind (`tgi_request_failure`)."""
        self.st.metrics.request_failure.labels(exc.error_type).inc()

    def take(self, count: int) -> None:
        """`count` more concurrency slots, or `Overloaded` (429) at once. They are held until the
        HTTP exchange ends (`AdmissionMiddleware`), whatever happens in between."""
        if self.admission is None:
            self.admission = admission(self.request)
        try:
            self.admission.take(count)
        except InferError as exc:
            self.failed(exc)
            raise

    async def admit(
        self, count: int, prepare: Callable[[], Awaitable[list[ValidRequest]]]
    ) -> list[ValidRequest]:
        """TGI's order: take `count` slots (429 at once if short), then validate and tokenize
        (`prepare`: the API's requests as the router's)."""
        self.take(count)
        t0 = time.monotonic()
        with self.refused():
            refusal = self.st.validation.refusal if self.st.validation is not None else None
            if refusal is not None:  # a model that does not generate (an embedding model)
                raise InvalidRequest(refusal, "model", "model_not_supported")
            reqs = await prepare()
        self.validation_time = time.monotonic() - t0
        self.st.metrics.request_validation_duration.observe(self.validation_time)
        return reqs

    async def generate(self, reqs: list[ValidRequest]) -> list[Generation]:
        """Every request to completion; the client going away (or one failing) aborts them all."""
        assert self.st.infer is not None and self.admission is not None
        infer, adm = self.st.infer, self.admission

        async def run_all() -> list[Generation]:
            tasks = [asyncio.ensure_future(infer.generate(r, adm, self.validation_time)) for r in reqs]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:
                    t.cancel()

        try:
            gens = await unless_gone(self.request, asyncio.ensure_future(run_all()))
        except InferError as exc:
            self.failed(exc)
            self.trace(reqs, [], exc)
            raise
        timings = combined([g.timings for g in gens])
        self.st.metrics.time_to_first_token.observe(max(timings.start - self.arrived, 0.0))
        generated = sum(len(g.output.tokens) for g in gens)
        cached = sum(g.output.num_cached_tokens for g in gens)
        disk = sum(g.output.num_disk_tokens for g in gens)
        inputs = sum(r.input_length for r in reqs)
        record_success(self.st, timings, self.arrived, inputs, generated, cached, disk)
        self.trace(reqs, [(g.timings, len(g.output.tokens), g.request.sampling.seed) for g in gens])
        return gens

    def streams(self, reqs: list[ValidRequest]) -> list[RequestStream]:
        """Submit every request now; the streams opened are closed with the admission if one fails."""
        assert self.st.infer is not None and self.admission is not None
        try:
            return [self.st.infer.stream(r, self.admission, self.validation_time) for r in reqs]
        except InferError as exc:
            self.failed(exc)
            raise

    @staticmethod
    def _traced(streams: list[RequestStream], generated: list[int]) -> list[tuple[Timings, int, int | None]]:
        return [(s.timings, n, s.req.sampling.seed) for s, n in zip(streams, generated)]

    def trace(
        self,
        reqs: list[ValidRequest],
        runs: list[tuple[Timings, int, int | None]],
        error: InferError | None = None,
    ) -> None:
        """The request's trace, when tracing is on (`pytgi.api.tracing`)."""
        if not tracing.enabled():
            return
        path = self.request.url.path
        route = ROUTE_SPANS.get(path, path.strip("/").replace("/", "_"))
        attributes = {
            "http.route": path,
            "gen_ai.request.model": self.st.config.model_id,
            "input_length": sum(r.input_length for r in reqs),
            "generated_tokens": sum(n for _, n, _ in runs),
        }
        tracing.record(
            route,
            self.request.headers,
            self.arrived,
            self.validation_time,
            runs,
            attributes,
            None if error is None else error.message,
        )

    def sse(
        self,
        streams: list[RequestStream],
        on_delta: Callable[[int, Delta], Iterable[str]],
        on_error: Callable[[InferError], str],
        start: Iterable[str] = (),
        end: Callable[[], Iterable[str]] = tuple,
    ) -> StreamingResponse:
        """The streams' deltas as server-sent events (`on_delta`'s), after `start` and before `end()`;
        `:` keep-alive comments; an error as a last event (`on_error`'s), and nothing after it."""
        return sse_response(self._events(streams, on_delta, on_error, start, end))

    async def _events(
        self,
        streams: list[RequestStream],
        on_delta: Callable[[int, Delta], Iterable[str]],
        on_error: Callable[[InferError], str],
        start: Iterable[str],
        end: Callable[[], Iterable[str]],
    ) -> AsyncIterator[str]:
        # The finally awaits nothing: it may run inside a cancelled task (client gone).
        m = self.st.metrics
        last = [self.arrived] * len(streams)
        generated = [0] * len(streams)
        first_token = True
        try:
            for event in start:
                yield event
            async for item in with_keep_alive(merged(streams)):
                if item is None:
                    yield KEEP_ALIVE
                    continue
                i, delta = item
                now = time.monotonic()
                if first_token:
                    m.time_to_first_token.observe(now - self.arrived)
                    first_token = False
                elif delta.index > 1:
                    m.inter_token_latency.observe(now - last[i])
                last[i], generated[i] = now, delta.index
                for event in on_delta(i, delta):
                    yield event
            for event in end():
                yield event
            timings = combined([s.timings for s in streams])
            inputs = sum(s.req.input_length for s in streams)
            cached = sum(s.output.num_cached_tokens for s in streams)
            disk = sum(s.output.num_disk_tokens for s in streams)
            record_success(self.st, timings, self.arrived, inputs, sum(generated), cached, disk)
            self.trace([s.req for s in streams], self._traced(streams, generated))
        except InferError as exc:
            self.failed(exc)
            self.trace([s.req for s in streams], self._traced(streams, generated), exc)
            yield on_error(exc)
        finally:
            for s in streams:
                s.close()


def sse_event(data: Any, space: bool = True) -> str:
    """One server-sent event of JSON (TGI writes `data:{...}`, OpenAI `data: {...}`)."""
    return f"data:{' ' if space else ''}{json.dumps(data, ensure_ascii=False)}\n\n"


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the default thread pool, off the event loop (a chat template, a tokenization)."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
