"""What TGI's and OpenAI's routes both do around a generation: SSE with keep-alive comments, the
success metrics, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from pytgi.errors import ClientGone
from pytgi.router.infer import Timings
from pytgi.server.state import State

log = logging.getLogger("pytgi.server")
KEEP_ALIVE_SECONDS = 15.0
KEEP_ALIVE = ":\n\n"  # an SSE comment: keeps proxies and clients from timing out on a slow step

T = TypeVar("T")


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


def record_success(st: State, t: Timings, arrived: float, input_length: int, generated: int) -> None:
    m = st.metrics
    m.request_success.inc()
    m.request_duration.observe(time.monotonic() - arrived)
    m.request_queue_duration.observe(max(t.start - t.queued, 0.0))
    inference = max(t.end - t.start, 0.0)
    m.request_inference_duration.observe(inference)
    m.request_mean_time_per_token_duration.observe(inference / max(generated, 1))
    m.request_input_length.observe(input_length)
    m.request_generated_tokens.observe(generated)


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
