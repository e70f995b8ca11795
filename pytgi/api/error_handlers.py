"""TGI's error JSON `{"error", "error_type"}` and the exception handlers that produce it."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pytgi.api.json_response import JSONObject, JSONResponse
from pytgi.core.errors import ClientGone, InferError, InvalidRequest


def error_body(message: str, error_type: str) -> dict[str, str]:
    return {"error": message, "error_type": error_type}


def error_response(status: int, message: str, error_type: str) -> JSONResponse:
    return JSONResponse(error_body(message, error_type), status_code=status)


def path_error_response(
    path: str, status: int, message: str, error_type: str, openai_type: str, code: str | None = None
) -> JSONResponse:
    """For middlewares, which answer before routing: Anthropic's shape under /v1/messages, OpenAI's
    under the rest of /v1/, TGI's elsewhere."""
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error_body(status, message), status_code=status)
    if path.startswith("/v1/"):
        body = {"error": {"message": message, "type": openai_type, "param": None, "code": code}}
        return JSONResponse(body, status_code=status)
    return error_response(status, message, error_type)


# Anthropic's error type for each status (its API's errors page)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> JSONObject:
    """Anthropic's `{"type": "error", "error": {"type", "message"}}`."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# what OpenAI's and Anthropic's routes say when the concurrency slots are all taken
OVERLOADED = "Model is overloaded: too many concurrent requests, retry later"


def validation_response(message: str) -> JSONResponse:
    return error_response(422, f"Input validation error: {message}", "validation")


# TGI's status for each kind of InferError (pytgi.core.errors)
INFER_STATUS = {"overloaded": 429, "generation": 424, "incomplete_generation": 500}


def infer_error_response(exc: InferError) -> JSONResponse:
    return error_response(INFER_STATUS[exc.error_type], exc.message, exc.error_type)


def describe(exc: RequestValidationError) -> str:
    """A malformed body's faults, each as `where: what`."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "malformed request body"


def install_handlers(app: FastAPI, openai_paths: tuple[str, ...] = ("/v1/",)) -> None:
    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(describe(exc))

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> JSONResponse:
        return validation_response(exc.message)  # the API's validation's, or the engine's

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(InferError)
    async def _infer(request: Request, exc: InferError) -> JSONResponse:
        return infer_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "http")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}", "internal")
