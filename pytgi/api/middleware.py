"""ASGI middlewares around the routes: slots given back, API key, early 429, body limit and timeout."""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pytgi.api.error_handlers import infer_error_response, path_error_response
from pytgi.api.frontend.infer import Admission
from pytgi.api.json_response import JSONResponse
from pytgi.api.openai.error_shape import from_infer_error
from pytgi.api.replicas.client import NOTE, ReplicaNote
from pytgi.api.state import ADMISSIONS
from pytgi.core.config import API_KEY_EXEMPTIONS
from pytgi.core.errors import Overloaded


class AdmissionMiddleware:
    """Gives every concurrency slot back when its HTTP exchange ends, whatever path it took."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admissions: list[Admission] = []
        scope[ADMISSIONS] = admissions
        try:
            await self.app(scope, receive, send)
        finally:
            for adm in admissions:
                adm.close()


async def _receive_within(receive: Receive, seconds: float) -> Message:
    """The next ASGI message, or asyncio.TimeoutError after `seconds`."""
    if hasattr(asyncio, "timeout"):  # Python 3.11+: no task per message, unlike wait_for
        async with asyncio.timeout(seconds):
            return await receive()
    return await asyncio.wait_for(receive(), seconds)


# Routes an API key may leave open (`--api-key-exempt`), by name: the paths each covers.
EXEMPTIONS: dict[str, tuple[str, ...]] = {
    "health": ("GET /health", "GET /"),  # load balancers' probes (POST / generates, and stays guarded)
    "metrics": ("GET /metrics",),
    "info": ("GET /info",),
    "docs": (
        "GET /docs",
        "GET /docs/oauth2-redirect",
        "GET /redoc",
        "GET /openapi.json",
    ),  # the page loads it
    "openapi": ("GET /openapi.json",),
    "models": ("GET /v1/models", "GET /v1/models/*"),
}
assert tuple(EXEMPTIONS) == API_KEY_EXEMPTIONS  # the names ServerConfig checks --api-key-exempt against
GENERATION_ROUTES = {
    "/generate",
    "/generate_stream",
    "/",
    "/invocations",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
}


class ApiKeyMiddleware:
    """Every route needs `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) when the
    server has an API key, but those named in `exempt` (see EXEMPTIONS) and CORS preflights; the key
    is compared in constant time."""

    def __init__(self, app: ASGIApp, key: str, exempt: tuple[str, ...] = ("health",)) -> None:
        self.app, self.expected, self.key = app, f"Bearer {key}".encode(), key.encode()
        self.open = {route for name in exempt if name != "none" for route in EXEMPTIONS[name]}

    def _exempt(self, method: str, path: str) -> bool:
        if method == "OPTIONS" or f"{method} {path}" in self.open:
            return True
        return method == "GET" and path.startswith("/v1/models/") and "GET /v1/models/*" in self.open

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._exempt(scope["method"], scope["path"]):
            headers = dict(scope["headers"])
            auth, x_key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
            if not (hmac.compare_digest(auth, self.expected) or hmac.compare_digest(x_key, self.key)):
                refusal = path_error_response(
                    scope["path"],
                    401,
                    "Unauthorized: send `Authorization: Bearer <key>`",
                    "authentication",
                    "authentication_error",
                    "invalid_api_key",
                )
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OverloadMiddleware:
    """Over `--max-concurrent-requests`, a generation request is answered 429 before its body is read,
    parsed or validated: under a burst the refusals cost next to nothing and come at once. (The
    admission itself is still taken after validation; this only spares doomed requests the work.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_ROUTES:
            st = scope["app"].state.pytgi
            infer = st.infer
            if infer is not None and infer.in_flight >= infer.max_concurrent_requests:
                st.metrics.request_count.inc()  # counted as the routes count their 429s
                st.metrics.request_failure.labels("overloaded").inc()
                if scope["path"].startswith("/v1/messages"):
                    refusal = path_error_response(scope["path"], 429, "Model is overloaded", "", "")
                elif scope["path"].startswith("/v1/"):
                    err = from_infer_error(Overloaded())
                    refusal = JSONResponse(err.body(), status_code=err.status)
                else:
                    refusal = infer_error_response(Overloaded())
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class PayloadLimitMiddleware:
    """Reads the whole request body before the route runs: over `--payload-limit` bytes it is refused
    with 413 (declared by Content-Length or streamed in chunks), and a body that stops arriving for
    `body_timeout` seconds gets 408 (a short body under a long Content-Length holds nothing)."""

    def __init__(self, app: ASGIApp, limit: int, body_timeout: float = 30.0) -> None:
        self.app, self.limit, self.body_timeout = app, limit, body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(
                scope,
                receive,
                send,
                413,
                f"Payload too large: the limit is {self.limit} bytes",
                "payload_too_large",
            )
            return
        chunks, seen, more = [], 0, True
        while more:
            try:
                message = await _receive_within(receive, self.body_timeout)
            except asyncio.TimeoutError:
                await self._refuse(
                    scope,
                    receive,
                    send,
                    408,
                    f"Request timeout: no body data for {self.body_timeout:g} s",
                    "request_timeout",
                )
                return
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            more = message.get("more_body", False)
            if seen > self.limit:
                await self._refuse(
                    scope,
                    receive,
                    send,
                    413,
                    f"Payload too large: the limit is {self.limit} bytes",
                    "payload_too_large",
                )
                return
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the client's disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, msg: str, kind: str
    ) -> None:
        refusal = path_error_response(scope["path"], status, msg, kind, "invalid_request_error")
        await refusal(scope, receive, send)


class ReplicaHeaderMiddleware:
    """With engine replicas (`--replicas`): each answer names the replica(s) that served it in an
    `x-pytgi-replica` header. The replica is known once the router sent the request there, so the
    headers wait for it (or for the request to fail) before they go out; answers that sent no
    request (health, validation refusals) go out at once, without the header."""

    HEADER = b"x-pytgi-replica"

    def __init__(self, app: ASGIApp, wait: float = 600.0) -> None:
        self.app, self.wait = app, wait

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        note = ReplicaNote()
        token = NOTE.set(note)
        held: list[Message] = []

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                held.append(message)
                return
            if held:
                start = held.pop()
                if note.pending:
                    try:
                        await asyncio.wait_for(note.known.wait(), self.wait)
                    except asyncio.TimeoutError:
                        pass
                if note.replicas:
                    headers = [*start.get("headers", []), (self.HEADER, ",".join(note.replicas).encode())]
                    start = {**start, "headers": headers}
                await send(start)
            await send(message)

        try:
            await self.app(scope, receive, send_named)
        finally:
            NOTE.reset(token)
