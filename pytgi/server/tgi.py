"""TGI's routes: /generate, /generate_stream, /, /invocations, /health, /info, /metrics, /tokenize."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

import pytgi
from pytgi.router.infer import Admission, Generation, InferError, RequestStream, StreamEvent, Timings, Token
from pytgi.router.validation import CompatGenerateRequest, GenerateRequest, ValidationError, ValidRequest
from pytgi.server.app import State, admission, state_of, wait_disconnect
from pytgi.server.errors import error_body, error_response, infer_error_response, validation_response

router = APIRouter()
KEEP_ALIVE_SECONDS = 15.0


# -- JSON shapes ---------------------------------------------------------------------------------
def token_json(t: Token) -> dict[str, Any]:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def sequence_details(g: Generation, req: ValidRequest) -> dict[str, Any]:
    d: dict[str, Any] = {
        "finish_reason": g.finish_reason,
        "generated_tokens": len(g.tokens),
        "seed": g.seed,
        "prefill": [token_json(t) for t in g.prefill] if req.decoder_input_details else [],
        "tokens": [token_json(t) for t in g.tokens],
    }
    if req.sampling.top_n_tokens:
        d["top_tokens"] = [[token_json(t) for t in top] for top in g.top_tokens]
    return d


def generate_json(g: Generation, req: ValidRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"generated_text": g.generated_text}
    if req.details:
        details = sequence_details(g, req)
        if req.best_of > 1:
            details["best_of_sequences"] = [
                {"generated_text": o.generated_text, **sequence_details(o, req)} for o in g.best_of_sequences
            ]
        out["details"] = details
    return out


def stream_json(ev: StreamEvent, req: ValidRequest) -> dict[str, Any]:
    details = None
    if ev.generated_text is not None and req.details:
        details = {"finish_reason": ev.finish_reason, "generated_tokens": ev.generated_tokens, "seed": ev.seed,
                   "input_length": ev.input_length}
    out: dict[str, Any] = {"index": ev.index, "token": token_json(ev.token), "generated_text": ev.generated_text,
                           "details": details}
    if req.sampling.top_n_tokens:
        out["top_tokens"] = [token_json(t) for t in ev.top_tokens]
    return out


def timing_headers(st: State, t: Timings, arrived: float, prompt_tokens: int, generated: int) -> dict[str, str]:
    total = time.monotonic() - arrived
    inference = max(t.end - t.start, 0.0) if t.end else 0.0
    info = st.client.info
    return {
        "x-compute-type": f"{info.num_shard}-{info.model_device_type}" if info else "unknown",
        "x-compute-time": f"{total:.6f}",
        "x-total-time": str(int(total * 1000)),
        "x-validation-time": str(int(t.validation * 1000)),
        "x-queue-time": str(int(max(t.start - t.queued, 0.0) * 1000)),
        "x-inference-time": str(int(inference * 1000)),
        "x-time-per-token": str(int(inference * 1000 / max(generated, 1))),
        "x-prompt-tokens": str(prompt_tokens),
        "x-generated-tokens": str(generated),
    }


# -- shared request path ---------------------------------------------------------------------------
async def admit(request: Request, body: GenerateRequest, stream: bool) -> tuple[ValidRequest, Admission, float]:
    """The seed's order: take a slot (429 at once if none), then validate (422). The slots are held
    until the HTTP exchange ends (`AdmissionMiddleware`), whatever happens in between."""
    st = state_of(request)
    st.metrics.request_count.inc()
    assert st.validation is not None
    adm = admission(request)
    try:
        adm.take(1)
    except InferError:
        st.metrics.request_failure.labels("overloaded").inc()
        raise
    t0 = time.monotonic()
    try:
        req = await st.validation.validate(body, stream)
    except ValidationError:
        st.metrics.request_failure.labels("validation").inc()
        raise
    if req.best_of > 1:
        try:
            adm.take(req.best_of - 1)
        except InferError:
            st.metrics.request_failure.labels("overloaded").inc()
            raise
    elapsed = time.monotonic() - t0
    st.metrics.request_validation_duration.observe(elapsed)
    return req, adm, elapsed


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


async def generate_response(request: Request, body: GenerateRequest) -> tuple[dict[str, Any], dict[str, str]]:
    st = state_of(request)
    arrived = time.monotonic()
    req, adm, vtime = await admit(request, body, stream=False)
    assert st.infer is not None
    task = asyncio.ensure_future(st.infer.generate(req, adm, vtime))
    watcher = asyncio.ensure_future(wait_disconnect(request, task))
    try:
        g = await task
    except InferError as exc:
        st.metrics.request_failure.labels(exc.error_type).inc()
        raise
    finally:
        watcher.cancel()
    st.metrics.time_to_first_token.observe(max(g.timings.start - arrived, 0.0))
    record_success(st, g.timings, arrived, req.input_length, len(g.tokens))
    return generate_json(g, req), timing_headers(st, g.timings, arrived, req.input_length, len(g.tokens))


async def stream_response(request: Request, body: GenerateRequest) -> Response:
    st = state_of(request)
    arrived = time.monotonic()
    req, adm, vtime = await admit(request, body, stream=True)
    assert st.infer is not None
    events = st.infer.stream(req, adm, vtime)
    return StreamingResponse(sse(st, req, events, arrived), media_type="text/event-stream",
                             headers={"x-accel-buffering": "no", "cache-control": "no-cache"})


async def sse(st: State, req: ValidRequest, events: RequestStream, arrived: float) -> AsyncIterator[str]:
    """`data:{json}` per token, `:` keep-alive comments, errors as a last event."""
    last = arrived
    it = events.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=KEEP_ALIVE_SECONDS)
            if not done:
                yield ":\n\n"
                continue
            try:
                ev = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            now = time.monotonic()
            (st.metrics.time_to_first_token if ev.index == 1 else st.metrics.inter_token_latency).observe(now - last)
            last = now
            yield f"data:{json.dumps(stream_json(ev, req), ensure_ascii=False)}\n\n"
            if ev.timings is not None:
                record_success(st, ev.timings, arrived, req.input_length, ev.generated_tokens)
    except InferError as exc:
        st.metrics.request_failure.labels(exc.error_type).inc()
        yield f"data:{json.dumps(error_body(exc.message, exc.error_type))}\n\n"
    finally:  # nothing awaited here: this may run inside a cancelled task (client gone)
        if pending is not None:
            pending.cancel()
        events.close()


# -- routes ----------------------------------------------------------------------------------------
@router.post("/generate", tags=["Text Generation Inference"])
async def generate(request: Request, body: GenerateRequest) -> JSONResponse:
    out, headers = await generate_response(request, body)
    return JSONResponse(out, headers=headers)


@router.post("/generate_stream", tags=["Text Generation Inference"])
async def generate_stream(request: Request, body: GenerateRequest) -> Response:
    return await stream_response(request, body)


@router.post("/", tags=["Text Generation Inference"])
async def compat_generate(request: Request, body: CompatGenerateRequest) -> Response:
    if body.stream:
        return await stream_response(request, body.to_generate_request())
    out, headers = await generate_response(request, body.to_generate_request())
    return JSONResponse([out], headers=headers)


@router.post("/invocations", tags=["Text Generation Inference"])
async def invocations(request: Request, body: CompatGenerateRequest) -> Response:
    return await compat_generate(request, body)


@router.get("/health", tags=["Text Generation Inference"])
async def health(request: Request) -> Response:
    if state_of(request).client.healthy:
        return Response(status_code=200)
    return error_response(503, "unhealthy", "healthcheck")


@router.get("/info", tags=["Text Generation Inference"])
async def info(request: Request) -> JSONResponse:
    st = state_of(request)
    cfg, eng = st.config, st.client.info
    assert eng is not None
    return JSONResponse({
        "model_id": cfg.model_id,
        "model_sha": cfg.revision,
        "model_dtype": eng.model_dtype,
        "model_device_type": eng.model_device_type,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": cfg.max_concurrent_requests,
        "max_best_of": cfg.max_best_of,
        "max_stop_sequences": cfg.max_stop_sequences,
        "max_input_tokens": eng.max_input_tokens,
        "max_total_tokens": eng.max_total_tokens,
        "max_input_length": eng.max_input_tokens,
        "waiting_served_ratio": eng.waiting_served_ratio,
        "max_batch_total_tokens": eng.max_batch_total_tokens,
        "max_waiting_tokens": eng.max_waiting_tokens,
        "max_batch_size": eng.max_batch_size,
        "max_batch_prefill_tokens": eng.max_batch_prefill_tokens,
        "validation_workers": cfg.validation_workers,
        "max_client_batch_size": 4,
        "num_shard": eng.num_shard,
        "router": "pytgi",
        "version": pytgi.__version__,
        "sha": None,
        "docker_label": None,
    })


@router.get("/metrics", tags=["Text Generation Inference"])
async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/tokenize", tags=["Text Generation Inference"])
async def tokenize(request: Request, body: GenerateRequest) -> JSONResponse:
    st = state_of(request)
    assert st.validation is not None
    if not body.inputs:
        return validation_response("`inputs` cannot be empty")
    return JSONResponse(await st.validation.validate_tokenize(body.inputs, body.add_special_tokens))


__all__ = ["router", "infer_error_response"]
