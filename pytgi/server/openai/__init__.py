"""OpenAI's API over the same request path as TGI's: `schema` (bodies, OpenAI's own rules, conversion
into the router's request), `render` (response shapes), `routes`, `errors` (OpenAI's error shape under
/v1/)."""

from __future__ import annotations

from fastapi import FastAPI

from pytgi.server.openai import responses
from pytgi.server.openai.errors import OpenAIError, install_handlers
from pytgi.server.openai.routes import router
from pytgi.server.openai.schema import ChatCompletionRequest, CompletionRequest


def install(app: FastAPI) -> None:
    """OpenAI's routes, and OpenAI's error shape under /v1/ (call after the app's own handlers)."""
    app.include_router(router)
    app.include_router(responses.router)
    install_handlers(app)


__all__ = ["ChatCompletionRequest", "CompletionRequest", "OpenAIError", "install", "router"]
