"""ASGI middlewares around the routes: slots given back, API key, payload limit."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pytgi.router.infer import Admission
from pytgi.server.errors import path_error_response
from pytgi.server.state import ADMISSIONS


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


class ApiKeyMiddleware:
    """POST routes need `Authorization: Bearer <key>` when the server has an API key."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if auth != self.expected:
                refusal = path_error_response(scope["path"], 401, "Unauthorized: send `Authorization: Bearer <key>`",
                                              "authentication", "authentication_error", "invalid_api_key")
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class PayloadLimitMiddleware:
    """Bodies over `--payload-limit` bytes are refused with 413, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        msg = f"Payload too large: the limit is {self.limit} bytes"
        refusal = path_error_response(scope["path"], 413, msg, "payload_too_large", "invalid_request_error")
        await refusal(scope, receive, send)


class _TooLarge(Exception):
    pass
