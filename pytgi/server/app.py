"""The API process: FastAPI app factory, its shared state, and the middlewares around the routes."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pytgi
from pytgi.config import EngineConfig
from pytgi.metrics import Metrics
from pytgi.router.engine_client import EngineClient
from pytgi.router.infer import Admission, Infer
from pytgi.router.validation import Validation, ValidLimits
from pytgi.server.errors import error_body, install_handlers, path_error_response
from pytgi.tokenizer import Tokenizer

log = logging.getLogger("pytgi.server")


@dataclass(slots=True)
class ServerConfig:
    engine: EngineConfig
    model_path: Path
    model_id: str
    hostname: str = "0.0.0.0"
    port: int = 3000
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    validation_workers: int = 2
    api_key: str | None = None
    payload_limit: int = 2_000_000
    cors_allow_origin: list[str] = field(default_factory=list)
    json_output: bool = False
    graceful_termination_timeout: int = 90
    revision: str | None = None
    engine_module: str = "pytgi.engine.process"  # the engine process's entry point


@dataclass(slots=True)
class State:
    config: ServerConfig
    client: EngineClient
    tokenizer: Tokenizer
    metrics: Metrics
    infer: Infer | None = None
    validation: Validation | None = None
    on_engine_death: list = field(default_factory=list)  # callbacks(reason)


def state_of(request: Request) -> State:
    return request.app.state.pytgi


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    st: State = app.state.pytgi
    info = await st.client.start()
    cfg = st.config
    st.validation = Validation(
        st.tokenizer,
        ValidLimits(info.max_input_tokens, info.max_total_tokens, cfg.max_best_of, cfg.max_stop_sequences,
                    cfg.max_top_n_tokens),
        workers=cfg.validation_workers,
    )
    st.infer = Infer(st.client, st.tokenizer, cfg.max_concurrent_requests)
    st.client.on_step = st.metrics.engine_step
    st.client.on_stats = st.metrics.engine_stats
    st.client.on_death = lambda reason: [cb(reason) for cb in st.on_engine_death]
    log.info("serving %s on http://%s:%d", info.model_id, cfg.hostname, cfg.port)
    try:
        yield
    finally:
        await st.client.stop()
        st.validation.close()


_ADMISSIONS = "pytgi.admissions"


def admission(request: Request) -> Admission:
    """A new claim on the concurrency slots for this HTTP exchange; `AdmissionMiddleware` closes it
    when the exchange ends (response sent, error raised, client gone, stream never started)."""
    st = state_of(request)
    assert st.infer is not None
    adm = st.infer.admission()
    request.scope[_ADMISSIONS].append(adm)
    return adm


class AdmissionMiddleware:
    """Gives every concurrency slot back when its HTTP exchange ends, whatever path it took."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admissions: list[Admission] = []
        scope[_ADMISSIONS] = admissions
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


def create_app(config: ServerConfig) -> FastAPI:
    from pytgi.server import openai, tgi

    app = FastAPI(title="pytgi", version=pytgi.__version__, lifespan=lifespan,
                  description="Text Generation Inference, in Python")
    client = EngineClient(config.engine, config.engine_module)
    app.state.pytgi = State(config, client, Tokenizer.from_dir(config.model_path), Metrics())
    install_handlers(app)
    app.include_router(tgi.router)
    openai.install(app)  # OpenAI's routes, and OpenAI's error shape under /v1/
    # The last added runs first: CORS outermost, so that refusals (401, 413) carry its headers too.
    app.add_middleware(AdmissionMiddleware)
    app.add_middleware(PayloadLimitMiddleware, limit=config.payload_limit)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, key=config.api_key)
    if config.cors_allow_origin:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_allow_origin, allow_methods=["*"],
                           allow_headers=["*"])
    return app


async def wait_disconnect(request: Request, task: asyncio.Task) -> None:
    """Cancel `task` if the client goes away before it completes (non-streaming routes)."""
    while not task.done():
        if await request.is_disconnected():
            task.cancel()
            return
        await asyncio.sleep(0.25)


__all__ = ["ServerConfig", "State", "admission", "create_app", "state_of", "error_body", "wait_disconnect"]
