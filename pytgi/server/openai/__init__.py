"""OpenAI's API over the same request path as TGI's: `schema` (bodies, OpenAI's own rules, conversion
into the router's request), `render` (response shapes), `routes`, `errors` (OpenAI's error shape under
/v1/)."""

from __future__ import annotations

from fastapi import FastAPI

from pytgi.config import ServerConfig
from pytgi.server.openai import adapters, responses
from pytgi.server.openai.errors import OpenAIError, install_handlers
from pytgi.server.openai.routes import router
from pytgi.server.openai.schema import ChatCompletionRequest, CompletionRequest


def install(app: FastAPI, config: ServerConfig) -> None:
    """OpenAI's routes, and OpenAI's error shape under /v1/ (call after the app's own handlers); the
    runtime adapter routes where the operator turned them on."""
    app.include_router(router)
    responses.install(app, config)
    adapters.install(app, config)
    install_handlers(app)


__all__ = ["ChatCompletionRequest", "CompletionRequest", "OpenAIError", "install", "router"]
