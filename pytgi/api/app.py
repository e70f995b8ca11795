"""The API process: the FastAPI app, its lifespan (the engine process starts and stops with it) and
the middlewares around the routes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pytgi.api import anthropic, embeddings, scores, tgi, tracing
from pytgi.api.error_handlers import install_handlers
from pytgi.api.frontend.engine_client import Engine, EngineClient
from pytgi.api.frontend.infer import Infer
from pytgi.api.frontend.validation import Validation, ValidLimits
from pytgi.api.json_response import JSONResponse
from pytgi.api.metrics import Metrics
from pytgi.api.middleware import (
    AdmissionMiddleware,
    ApiKeyMiddleware,
    OverloadMiddleware,
    PayloadLimitMiddleware,
    ReplicaHeaderMiddleware,
)
from pytgi.api.openai import routes as openai
from pytgi.api.replicas.client import ReplicaClient, ReplicaOptions
from pytgi.api.state import State
from pytgi.core.config import ServerConfig, read_chat_template
from pytgi.core.errors import EngineDead
from pytgi.core.tokenizer import Tokenizer
from pytgi.core.version import __version__

log = logging.getLogger("pytgi.api")
STARTUP_FAILED = "engine failed to start:"  # an `EngineDead` whose reason the engine process logged


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    st: State = app.state.pytgi
    cfg = st.config
    if cfg.otlp_endpoint:
        tracing.setup(cfg.otlp_endpoint, cfg.otlp_service_name)
    try:
        info = await st.client.start()
    except EngineDead as exc:  # one line, no traceback: the launcher exits non-zero (issue 63)
        st.start_failed = str(exc)
        if not st.start_failed.startswith(STARTUP_FAILED):  # the engine logged its own reason
            log.error("%s", exc)
        raise
    st.validation = Validation(
        st.tokenizer,
        ValidLimits(
            info.max_input_tokens,
            info.max_total_tokens,
            cfg.max_best_of,
            cfg.max_stop_sequences,
            cfg.max_top_n_tokens,
        ),
        workers=cfg.validation_workers,
        vocab_size=info.vocab_size,
        adapters=lambda: st.adapters,
        image_layout=info.image_layout,
        refusal=None if info.task == "generate" else embeddings.refusal(info),
    )
    st.infer = Infer(st.client, st.tokenizer, cfg.max_concurrent_requests)
    st.metrics.model_info(info, lambda: st.adapters)
    st.client.on_step = st.metrics.engine_step
    st.client.on_stats = st.metrics.engine_stats

    def engine_died(reason: str) -> None:
        for cb in st.on_engine_death:
            cb(reason)

    st.client.on_death = engine_died
    log.info(
        "serving %s on %s://%s:%d", info.model_id, "https" if cfg.tls else "http", cfg.hostname, cfg.port
    )
    try:
        yield
    finally:
        await st.client.stop()
        st.validation.close()
        tracing.shutdown()


def create_app(config: ServerConfig) -> FastAPI:
    app = FastAPI(
        title="pytgi",
        version=__version__,
        lifespan=lifespan,
        description="Text Generation Inference, in Python",
        default_response_class=JSONResponse,
    )
    client: Engine
    if config.replicas > 0:  # engine replicas on Ray Serve (pytgi.api.replicas)
        options = ReplicaOptions(
            config.replicas,
            config.min_replicas,
            config.max_replicas,
            config.ray_address,
            config.replica_routing,
        )
        client = ReplicaClient(config.engine, options, config.engine_module)
    else:
        client = EngineClient(config.engine, config.engine_module)
    tokenizer = Tokenizer.from_dir(config.model_path)
    if config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    app.state.pytgi = State(config, client, tokenizer, Metrics())
    install_handlers(app)
    app.include_router(embeddings.router)
    app.include_router(scores.router)
    app.include_router(tgi.router)
    openai.install(app, config)  # OpenAI's routes, and OpenAI's error shape under /v1/
    anthropic.install(app)  # Anthropic's Messages routes, and its error shape under /v1/messages
    # The last added runs first: CORS outermost, so that refusals (401, 413) carry its headers too.
    app.add_middleware(AdmissionMiddleware)
    app.add_middleware(
        PayloadLimitMiddleware, limit=config.payload_limit, body_timeout=config.request_body_timeout
    )
    app.add_middleware(OverloadMiddleware)  # before the body is read
    if config.replicas > 0:
        app.add_middleware(ReplicaHeaderMiddleware)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, key=config.api_key, exempt=config.api_key_exempt)
    if config.cors_allow_origin:
        app.add_middleware(
            CORSMiddleware, allow_origins=config.cors_allow_origin, allow_methods=["*"], allow_headers=["*"]
        )
    return app


__all__ = ["ServerConfig", "State", "create_app"]
