"""OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`, under /v1/ only: the app's
exception handlers are wrapped so that TGI's routes keep TGI's shape."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pytgi.api.error_handlers import OVERLOADED
from pytgi.api.json_response import JSONObject, JSONResponse
from pytgi.core.errors import ClientGone, InferError, InvalidRequest, Overloaded, UnknownModel

PREFIX = "/v1/"


class OpenAIError(Exception):
    """An error answered as `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> JSONObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def from_infer_error(exc: InferError) -> OpenAIError:
    if isinstance(exc, Overloaded):
        return OpenAIError(429, OVERLOADED, "requests", None, "rate_limit_exceeded")
    return OpenAIError(500, exc.message, "server_error", None, exc.error_type)


def _describe(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        param = param or where or None
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "malformed request body", param


def as_openai_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        message, param = _describe(exc)
        return invalid(message, param)
    if isinstance(exc, InferError):
        return from_infer_error(exc)
    if isinstance(exc, UnknownModel):
        return OpenAIError(404, exc.message, "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, InvalidRequest):
        return invalid(exc.message, exc.param, exc.code)
    if isinstance(exc, StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind)
    return OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error")


def install_handlers(app: FastAPI) -> None:
    """Answer errors under /v1/ in OpenAI's shape (others keep their handlers). Call after the app's
    own handlers are installed: each is wrapped, not replaced."""
    for exc_class, handler in list(app.exception_handlers.items()):
        if isinstance(exc_class, type):
            app.add_exception_handler(exc_class, _dispatching(handler))
    for exc_class in (RequestValidationError, StarletteHTTPException, Exception):
        if exc_class not in app.exception_handlers:
            app.add_exception_handler(exc_class, _dispatching(None))
    app.add_exception_handler(OpenAIError, _dispatching(None))


def _dispatching(fallback: Callable | None) -> Callable:
    async def handler(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientGone):
            return Response(status_code=499)  # nobody reads it
        if fallback is None or request.url.path.startswith(PREFIX) or isinstance(exc, OpenAIError):
            err = as_openai_error(exc)
            return JSONResponse(err.body(), status_code=err.status)
        result = fallback(request, exc)
        return await result if asyncio.iscoroutine(result) else result

    return handler
