"""OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models.

The same engine path as TGI's routes (`Infer`, admissions, metrics, disconnects), with OpenAI's request
fields, response shapes, stop semantics (the stop text is cut) and error shape
`{"error": {"message", "type", "param", "code"}}`. Runs in the API process: no torch here.

`install(app)` includes the router and wraps the app's exception handlers so that anything raised under
`/v1/` (malformed bodies, unknown routes, unexpected errors) answers in OpenAI's shape while every other
route keeps TGI's.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

import pytgi
from pytgi.router.infer import (
    Admission,
    Generation,
    InferError,
    Overloaded,
    RequestStream,
    StreamEvent,
    Timings,
    Token,
)
from pytgi.router.validation import ValidRequest
from pytgi.sampling_params import InvalidRequest, SamplingParams
from pytgi.server.app import State, admission, state_of, wait_disconnect
from pytgi.server.tgi import KEEP_ALIVE_SECONDS, record_success
from pytgi.tokenizer import partial_stop_len

router = APIRouter()

PREFIX = "/v1/"
MAX_N = 8  # choices per prompt
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for the legacy `logprobs`
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's bound for `top_logprobs`
MIN_LOGPROB = -9999.0  # -inf is not JSON
SYSTEM_FINGERPRINT = f"pytgi-{pytgi.__version__}"
MODEL_ALIASES = ("", "tgi")  # also served: what TGI's OpenAI routes accept
_STARTED = int(time.time())


# -- errors --------------------------------------------------------------------------------------
class OpenAIError(Exception):
    """An error answered as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def from_infer_error(exc: InferError) -> OpenAIError:
    if isinstance(exc, Overloaded):
        return OpenAIError(429, "Model is overloaded: too many concurrent requests, retry later", "requests",
                           None, "rate_limit_exceeded")
    return OpenAIError(500, exc.message, "server_error", None, exc.error_type)


def _describe(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        param = param or where or None
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "malformed request body", param


def _as_openai(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        message, param = _describe(exc)
        return invalid(message, param)
    if isinstance(exc, InferError):
        return from_infer_error(exc)
    if isinstance(exc, StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind)
    return OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error")


def install(app: FastAPI) -> None:
    """Include the router; answer errors under /v1/ in OpenAI's shape (others keep their handlers).

    Call after the app's own handlers are installed: each is wrapped, not replaced."""
    app.include_router(router)
    for exc_class, handler in list(app.exception_handlers.items()):
        if isinstance(exc_class, type):
            app.add_exception_handler(exc_class, _dispatching(handler))
    for exc_class in (RequestValidationError, StarletteHTTPException, Exception):
        if exc_class not in app.exception_handlers:
            app.add_exception_handler(exc_class, _dispatching(None))
    app.add_exception_handler(OpenAIError, _dispatching(None))


def _dispatching(fallback: Callable | None) -> Callable:
    async def handler(request: Request, exc: Exception) -> Response:
        if fallback is None or request.url.path.startswith(PREFIX) or isinstance(exc, OpenAIError):
            return _as_openai(exc).response()
        result = fallback(request, exc)
        return await result if asyncio.iscoroutine(result) else result

    return handler


# -- request bodies --------------------------------------------------------------------------------
class _Body(BaseModel):
    # Unknown fields are ignored: OpenAI clients send many (metadata, store, parallel_tool_calls, ...).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM / TGI)
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, ... reach the template
    role: str
    content: str | list[ContentPart] | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


# -- checks and the engine's parameters ------------------------------------------------------------
def _model_not_found(st: State, model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist: this server serves `{st.config.model_id}`",
                       "invalid_request_error", "model", "model_not_found")


def _check_model(st: State, model: str | None) -> None:
    if not (model is None or model in MODEL_ALIASES or model == st.config.model_id):
        raise _model_not_found(st, model)


def _stops(stop: str | list[str] | None, max_stops: int) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > max_stops:
        raise invalid(f"`stop` supports up to {max_stops} sequences. Given: {len(stops)}", "stop")
    if any(not s for s in stops):
        raise invalid("`stop` sequences must be non-empty strings", "stop")
    return stops


def _check_sampling(body: _SamplingBody) -> int:
    """The parameter rules common to both routes; returns n."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise invalid(f"`n` must be >= 1 and <= {MAX_N}. Given: {n}", "n")
    if body.temperature is not None and not 0.0 <= body.temperature <= 2.0:
        raise invalid(f"`temperature` must be >= 0 and <= 2. Given: {body.temperature}", "temperature")
    if body.top_p is not None and not 0.0 < body.top_p <= 1.0:
        raise invalid(f"`top_p` must be > 0 and <= 1. Given: {body.top_p}", "top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise invalid(f"`{name}` must be >= -2 and <= 2. Given: {value}", name)
    if body.repetition_penalty is not None and not body.repetition_penalty > 0:
        raise invalid(f"`repetition_penalty` must be strictly positive. Given: {body.repetition_penalty}",
                      "repetition_penalty")
    if body.top_k is not None and body.top_k < -1:
        raise invalid(f"`top_k` must be >= 1, or 0 / -1 to disable it. Given: {body.top_k}", "top_k")
    if body.logit_bias:
        raise invalid("`logit_bias` is not supported yet", "logit_bias")
    return n


def _sampling(body: _SamplingBody, max_new_tokens: int, stops: list[str], choice: int, top_n: int,
              prompt_logprobs: bool = False) -> SamplingParams:
    """One choice's engine parameters: temperature 0 is greedy, anything else samples (OpenAI's default
    temperature is 1); a given seed becomes seed + choice, so every choice is reproducible."""
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = None if body.seed is None else (body.seed + choice) % 2**64
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=max(body.top_k or 0, 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            do_sample=temperature > 0,
            seed=seed,
            stop=list(stops),
            include_stop_str_in_output=False,  # OpenAI: the stop text is not returned
            ignore_eos=bool(body.ignore_eos),
            top_n_tokens=top_n,
            prompt_logprobs=prompt_logprobs,
        )
    except InvalidRequest as exc:
        raise invalid(str(exc)) from None


def _limits(st: State) -> tuple[int, int]:
    assert st.validation is not None
    return st.validation.limits.max_input_tokens, st.validation.limits.max_total_tokens


def _check_lengths(st: State, n_input: int, max_tokens: int | None, param: str) -> int:
    """OpenAI's context checks; returns max_new_tokens (`None`: up to max_total_tokens)."""
    max_input, max_total = _limits(st)
    if n_input == 0:
        raise invalid(f"`{param}` cannot be empty", param)
    if n_input > max_input:
        raise invalid(f"This model's maximum input length is {max_input} tokens. However, your {param} has "
                      f"{n_input} tokens. Please reduce its length.", param, "context_length_exceeded")
    new = max_total - n_input if max_tokens is None else max_tokens
    if n_input + new > max_total:
        raise invalid(f"This model's maximum context length is {max_total} tokens. However, you requested "
                      f"{n_input + new} tokens ({n_input} in the {param}, {new} in the completion). Please "
                      f"reduce the length of the {param} or completion.", "max_tokens",
                      "context_length_exceeded")
    return new


def _check_max_tokens(value: int | None, param: str = "max_tokens") -> None:
    if value is not None and value < 1:
        raise invalid(f"`{param}` must be strictly positive. Given: {value}", param)


def _valid_request(ids: list[int], text: str, sampling: SamplingParams, stream: bool) -> ValidRequest:
    return ValidRequest(input_ids=ids, input_length=len(ids), sampling=sampling, best_of=1, details=True,
                        decoder_input_details=sampling.prompt_logprobs, return_full_text=False,
                        watermark=False, stream=stream, inputs=text, truncate=None)


async def _in_thread(fn: Callable, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# -- admission and generation ----------------------------------------------------------------------
@contextmanager
def _refused(st: State) -> Iterator[None]:
    """Count a 4xx refusal as TGI's routes do (`tgi_request_failure{err="validation"}`)."""
    try:
        yield
    except OpenAIError:
        st.metrics.request_failure.labels("validation").inc()
        raise


async def _admit(request: Request, count: int, prepare: Callable[[], Awaitable[list[ValidRequest]]]
                 ) -> tuple[list[ValidRequest], Admission, float]:
    """TGI's order: take one slot per engine request (429 at once if short), then validate/tokenize.
    The slots are held until the HTTP exchange ends (`AdmissionMiddleware`)."""
    st = state_of(request)
    adm = admission(request)
    try:
        adm.take(count)
    except InferError as exc:
        st.metrics.request_failure.labels("overloaded").inc()
        raise from_infer_error(exc) from None
    t0 = time.monotonic()
    with _refused(st):
        reqs = await prepare()
    elapsed = time.monotonic() - t0
    st.metrics.request_validation_duration.observe(elapsed)
    return reqs, adm, elapsed


def _combined(timings: list[Timings]) -> Timings:
    starts = [t.start for t in timings if t.start]
    return Timings(validation=timings[0].validation, queued=min(t.queued for t in timings),
                   start=min(starts) if starts else 0.0, end=max(t.end for t in timings))


async def _generate_all(request: Request, st: State, reqs: list[ValidRequest], adm: Admission,
                        vtime: float, arrived: float) -> list[Generation]:
    """Every engine request to completion; the client going away (or one failing) aborts them all."""
    assert st.infer is not None
    infer = st.infer

    async def run_all() -> list[Generation]:
        tasks = [asyncio.ensure_future(infer.generate(r, adm, vtime)) for r in reqs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    task = asyncio.ensure_future(run_all())
    watcher = asyncio.ensure_future(wait_disconnect(request, task))
    try:
        gens = await task
    except InferError as exc:
        st.metrics.request_failure.labels(exc.error_type).inc()
        raise from_infer_error(exc) from None
    finally:
        watcher.cancel()
    timings = _combined([g.timings for g in gens])
    st.metrics.time_to_first_token.observe(max(timings.start - arrived, 0.0))
    record_success(st, timings, arrived, sum(r.input_length for r in reqs), sum(len(g.tokens) for g in gens))
    return gens


def _submit_all(st: State, reqs: list[ValidRequest], adm: Admission, vtime: float) -> list[RequestStream]:
    assert st.infer is not None
    try:
        return [st.infer.stream(r, adm, vtime) for r in reqs]
    except InferError as exc:  # the streams already opened are closed with the admission
        st.metrics.request_failure.labels(exc.error_type).inc()
        raise from_infer_error(exc) from None


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse_events(st: State, streams: list[RequestStream], renderer: _StreamRenderer, arrived: float,
                      reqs: list[ValidRequest]) -> AsyncIterator[str]:
    """Merge the choices' event streams into OpenAI chunks; `:` keep-alives; an error as a last event
    (no [DONE] then). The finally awaits nothing: it may run inside a cancelled task (client gone)."""
    iters = [s.__aiter__() for s in streams]
    pending: dict[asyncio.Future, int] = {}
    live = set(range(len(iters)))
    last = [arrived] * len(iters)
    first_token = True
    try:
        for chunk in renderer.start():
            yield _sse(chunk)
        while live:
            waiting = set(pending.values())
            for i in sorted(live - waiting):
                pending[asyncio.ensure_future(iters[i].__anext__())] = i
            done, _ = await asyncio.wait(set(pending), timeout=KEEP_ALIVE_SECONDS,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield ":\n\n"
                continue
            for fut in sorted(done, key=lambda f: pending[f]):
                i = pending.pop(fut)
                try:
                    ev = fut.result()
                except StopAsyncIteration:
                    live.discard(i)
                    continue
                now = time.monotonic()
                if first_token:
                    st.metrics.time_to_first_token.observe(now - arrived)
                    first_token = False
                elif ev.index > 1:
                    st.metrics.inter_token_latency.observe(now - last[i])
                last[i] = now
                for chunk in renderer.event(i, ev):
                    yield _sse(chunk)
        for chunk in renderer.end():
            yield _sse(chunk)
        record_success(st, _combined([s.timings for s in streams]), arrived,
                       sum(r.input_length for r in reqs), renderer.completion_tokens)
        yield "data: [DONE]\n\n"
    except InferError as exc:
        st.metrics.request_failure.labels(exc.error_type).inc()
        yield _sse(from_infer_error(exc).body())
    finally:
        for fut in pending:
            fut.cancel()
        for s in streams:
            s.close()


def _streaming_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"x-accel-buffering": "no", "cache-control": "no-cache"})


# -- response shapes -------------------------------------------------------------------------------
def _finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"  # eos_token, stop_sequence


def _lp(value: float | None) -> float | None:
    return None if value is None else max(float(value), MIN_LOGPROB)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chat_logprob(piece: str, t: Token, tops: list[Token]) -> dict[str, Any]:
    return {"token": piece, "logprob": _lp(t.logprob), "bytes": list(piece.encode("utf-8")),
            "top_logprobs": [{"token": a.text, "logprob": _lp(a.logprob),
                              "bytes": list(a.text.encode("utf-8"))} for a in tops]}


def _text_logprobs(pieces: list[str], tokens: list[Token], tops: list[list[Token]], offsets: list[int]
                   ) -> dict[str, Any]:
    """The legacy completions shape; `top_logprobs` holds the alternatives and always the chosen token."""
    top: list[dict[str, float] | None] = []
    for piece, t, alts in zip(pieces, tokens, tops):
        d: dict[str, float] = {}
        for a in alts:
            d.setdefault(a.text, _lp(a.logprob))  # type: ignore[arg-type]
        d.setdefault(piece, _lp(t.logprob))  # type: ignore[arg-type]
        top.append(d)
    return {"tokens": pieces, "token_logprobs": [_lp(t.logprob) for t in tokens], "top_logprobs": top,
            "text_offset": offsets}


def _offsets(tokens: list[Token], base: int) -> list[int]:
    """Where each token's text starts: its streamed delta (a special token adds no text)."""
    out, at = [], base
    for t in tokens:
        out.append(at)
        at += 0 if t.special else len(t.text)
    return out


def _prompt_logprobs(st: State, req: ValidRequest, prefill: list[Token]) -> dict[str, Any]:
    pieces = [st.tokenizer.id_to_piece(i) for i in req.input_ids]
    lps = [_lp(t.logprob) for t in prefill] if prefill else [None] * len(pieces)
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": pieces, "token_logprobs": lps,
            "top_logprobs": [None if lp is None else {p: lp} for p, lp in zip(pieces, lps)],
            "text_offset": offsets}


def _head(kind: str, rid: str, created: int, st: State) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": created, "model": st.config.model_id,
            "system_fingerprint": SYSTEM_FINGERPRINT}


class _Choice:
    __slots__ = ("cum", "offsets", "sent", "tokens", "tops")

    def __init__(self) -> None:
        self.sent = ""  # text sent so far
        self.cum = ""  # every delta so far (may end in a possible stop's start, held back)
        self.tokens: list[Token] = []  # tokens whose logprobs are not sent yet
        self.tops: list[list[Token]] = []
        self.offsets: list[int] = []


class _StreamRenderer:
    """OpenAI chunks from engine events, per choice: text that might start a stop string is held back
    until the next tokens rule it out (the engine cuts the stop itself on the final event)."""

    def __init__(self, st: State, chat: bool, rid: str, created: int, count: int, stops: list[str],
                 logprobs: bool, include_usage: bool, prompt_tokens: int,
                 echo: list[str] | None = None) -> None:
        self.st, self.chat, self.stops, self.logprobs = st, chat, stops, logprobs
        self.head = _head("chat.completion.chunk" if chat else "text_completion", rid, created, st)
        if include_usage:
            self.head["usage"] = None
        self.include_usage, self.prompt_tokens = include_usage, prompt_tokens
        self.echo = echo  # completions: the prompt text per choice, sent first
        self.choices = [_Choice() for _ in range(count)]
        self.completion_tokens = 0

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [choice]}

    def start(self) -> list[dict[str, Any]]:
        """Chat: the assistant role first, per choice; completions with `echo`: the prompt first."""
        out = []
        for i in range(len(self.choices)):
            if self.chat:
                out.append(self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}))
            elif self.echo and self.echo[i]:
                out.append(self._chunk({"index": i, "text": self.echo[i], "logprobs": None,
                                        "finish_reason": None}))
        return out

    def _take_logprobs(self, c: _Choice) -> dict[str, Any] | None:
        if not self.logprobs or not c.tokens:
            return None
        pieces = [self.st.tokenizer.id_to_piece(t.id) for t in c.tokens]
        if self.chat:
            content = [_chat_logprob(p, t, a) for p, t, a in zip(pieces, c.tokens, c.tops)]
            out: dict[str, Any] = {"content": content, "refusal": None}
        else:
            out = _text_logprobs(pieces, c.tokens, c.tops, c.offsets)
        c.tokens, c.tops, c.offsets = [], [], []
        return out

    def _content(self, i: int, text: str, c: _Choice) -> dict[str, Any]:
        lps = self._take_logprobs(c)
        if self.chat:
            return self._chunk({"index": i, "delta": {"content": text}, "logprobs": lps,
                                "finish_reason": None})
        return self._chunk({"index": i, "text": text, "logprobs": lps, "finish_reason": None})

    def event(self, i: int, ev: StreamEvent) -> list[dict[str, Any]]:
        c = self.choices[i]
        base = len(self.echo[i]) if (self.echo and not self.chat) else 0
        c.tokens.append(ev.token)
        c.tops.append(ev.top_tokens)
        c.offsets.append(base + len(c.cum))
        if not ev.token.special:
            c.cum += ev.token.text
        if ev.generated_text is not None:  # the last event: the full text, stop already cut
            full = ev.generated_text
            new = full[len(c.sent):] if full.startswith(c.sent) else ""
        else:
            hold = partial_stop_len(c.cum, self.stops) if self.stops else 0
            new = c.cum[len(c.sent): len(c.cum) - hold]
        c.sent += new
        out = [self._content(i, new, c)] if new else []
        if ev.finish_reason is not None:
            self.completion_tokens += ev.generated_tokens
            lps = self._take_logprobs(c)
            finish = _finish_reason(ev.finish_reason)
            if self.chat:
                out.append(self._chunk({"index": i, "delta": {}, "logprobs": lps, "finish_reason": finish}))
            else:
                out.append(self._chunk({"index": i, "text": "", "logprobs": lps, "finish_reason": finish}))
        return out

    def end(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [{**self.head, "choices": [], "usage": _usage(self.prompt_tokens, self.completion_tokens)}]


# -- routes ----------------------------------------------------------------------------------------
def _model_card(st: State) -> dict[str, Any]:
    return {"id": st.config.model_id, "object": "model", "created": _STARTED, "owned_by": "pytgi"}


@router.get("/v1/models", tags=["OpenAI"])
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(state_of(request))]})


@router.get("/v1/models/{model:path}", tags=["OpenAI"])
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    st = state_of(request)
    if model != st.config.model_id:
        raise _model_not_found(st, model)
    return JSONResponse(_model_card(st))


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("`prompt` cannot be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


@router.post("/v1/completions", tags=["OpenAI"])
async def completions(request: Request, body: CompletionRequest) -> Response:
    st = state_of(request)
    arrived, created = time.monotonic(), int(time.time())
    st.metrics.request_count.inc()
    assert st.validation is not None
    with _refused(st):
        _check_model(st, body.model)
        n = _check_sampling(body)
        _check_max_tokens(body.max_tokens)
        stops = _stops(body.stop, st.validation.limits.max_stop_sequences)
        top_n = 0
        if body.logprobs is not None:
            bound = min(MAX_COMPLETION_LOGPROBS, st.validation.limits.max_top_n_tokens)
            if not 0 <= body.logprobs <= bound:
                raise invalid(f"`logprobs` must be >= 0 and <= {bound}. Given: {body.logprobs}", "logprobs")
            top_n = body.logprobs
        if body.best_of is not None and body.best_of not in (1, n):
            raise invalid("`best_of` other than `n` is not supported", "best_of")
        if body.suffix:
            raise invalid("`suffix` is not supported", "suffix")
        echo = bool(body.echo)
        if echo and body.logprobs is not None and body.stream:
            raise invalid("`echo` with `logprobs` is not supported when streaming", "echo")
        prompts = _prompts(body.prompt)
    stream = bool(body.stream)
    vocab = st.client.info.vocab_size if st.client.info else st.tokenizer.vocab_size
    max_tokens = 16 if body.max_tokens is None else body.max_tokens

    def encode_all() -> list[tuple[list[int], str]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise invalid("`prompt` cannot be empty", "prompt")
                out.append((st.tokenizer.encode(p, add_special_tokens=True), p))
            else:
                if any(not 0 <= t < vocab for t in p):
                    raise invalid(f"`prompt` token ids must be >= 0 and < {vocab}", "prompt")
                out.append((list(p), st.tokenizer.decode(list(p), skip_special_tokens=False)))
        return out

    async def prepare() -> list[ValidRequest]:
        encoded = await _in_thread(encode_all)
        reqs = []
        for ids, text in encoded:
            new = _check_lengths(st, len(ids), max_tokens, "prompt")
            for i in range(n):
                sp = _sampling(body, new, stops, i, top_n, prompt_logprobs=echo and body.logprobs is not None)
                reqs.append(_valid_request(ids, text, sp, stream))
        return reqs

    reqs, adm, vtime = await _admit(request, len(prompts) * n, prepare)
    prompt_tokens = sum(r.input_length for r in reqs[::n])
    rid = f"cmpl-{uuid.uuid4().hex}"
    if stream:
        streams = _submit_all(st, reqs, adm, vtime)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        renderer = _StreamRenderer(st, False, rid, created, len(reqs), stops, body.logprobs is not None,
                                   include_usage, prompt_tokens, [r.inputs if echo else "" for r in reqs])
        return _streaming_response(_sse_events(st, streams, renderer, arrived, reqs))
    gens = await _generate_all(request, st, reqs, adm, vtime, arrived)
    choices = []
    for index, (req, g) in enumerate(zip(reqs, gens)):
        prefix = req.inputs if echo else ""
        logprobs = None
        if body.logprobs is not None:
            pieces = [st.tokenizer.id_to_piece(t.id) for t in g.tokens]
            logprobs = _text_logprobs(pieces, g.tokens, g.top_tokens, _offsets(g.tokens, len(prefix)))
            if echo:
                head = _prompt_logprobs(st, req, g.prefill)
                logprobs = {k: head[k] + logprobs[k] for k in logprobs}
        choices.append({"index": index, "text": prefix + g.generated_text, "logprobs": logprobs,
                        "finish_reason": _finish_reason(g.finish_reason)})
    out = {**_head("text_completion", rid, created, st), "choices": choices,
           "usage": _usage(prompt_tokens, sum(len(g.tokens) for g in gens))}
    return JSONResponse(out)


_ROLES = {"system", "user", "assistant", "tool", "function", "developer"}


def _messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template: text parts joined; `developer` is the system role."""
    if not messages:
        raise invalid("`messages` cannot be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise invalid(f"`messages[{i}].role` must be one of {sorted(_ROLES)}. Given: {m.role!r}",
                          f"messages.[{i}].role")
        d = m.model_dump(exclude_none=True)
        if m.role == "developer":
            d["role"] = "system"
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise invalid(f"content parts of type `{part.type}` are not supported: only `text` parts "
                                  "are", f"messages.[{i}].content.[{j}].type")
                texts.append(part.text or "")
            d["content"] = "\n".join(texts)
        out.append(d)
    return out


@router.post("/v1/chat/completions", tags=["OpenAI"])
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    st = state_of(request)
    arrived, created = time.monotonic(), int(time.time())
    st.metrics.request_count.inc()
    assert st.validation is not None
    with _refused(st):
        _check_model(st, body.model)
        n = _check_sampling(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        _check_max_tokens(max_tokens, "max_completion_tokens" if body.max_completion_tokens is not None
                          else "max_tokens")
        stops = _stops(body.stop, st.validation.limits.max_stop_sequences)
        top_n = 0
        if body.top_logprobs is not None:
            bound = min(MAX_CHAT_TOP_LOGPROBS, st.validation.limits.max_top_n_tokens)
            if not 0 <= body.top_logprobs <= bound:
                raise invalid(f"`top_logprobs` must be >= 0 and <= {bound}. Given: {body.top_logprobs}",
                              "top_logprobs")
            if not body.logprobs:
                raise invalid("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
            top_n = body.top_logprobs
        if body.response_format is not None and body.response_format.type != "text":
            raise invalid(f"`response_format` of type `{body.response_format.type}` is not supported yet: "
                          "this server has no constrained decoding", "response_format")
        if body.tools and body.tool_choice != "none":
            raise invalid("tool calling is not supported yet: send no `tools`, or `tool_choice: \"none\"`",
                          "tools")
        if body.tool_choice not in (None, "none", "auto"):
            raise invalid("tool calling is not supported yet: `tool_choice` must be \"none\" or \"auto\"",
                          "tool_choice")
        messages = _messages(body.messages)
    stream = bool(body.stream)

    def render() -> tuple[list[int], str]:
        try:
            text = st.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as exc:
            raise invalid(f"cannot apply the chat template: {exc}", "messages") from None
        return st.tokenizer.encode(text, add_special_tokens=False), text

    async def prepare() -> list[ValidRequest]:
        ids, text = await _in_thread(render)
        new = _check_lengths(st, len(ids), max_tokens, "messages")
        return [_valid_request(ids, text, _sampling(body, new, stops, i, top_n), stream) for i in range(n)]

    reqs, adm, vtime = await _admit(request, n, prepare)
    prompt_tokens = reqs[0].input_length
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if stream:
        streams = _submit_all(st, reqs, adm, vtime)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        renderer = _StreamRenderer(st, True, rid, created, len(reqs), stops, bool(body.logprobs),
                                   include_usage, prompt_tokens)
        return _streaming_response(_sse_events(st, streams, renderer, arrived, reqs))
    gens = await _generate_all(request, st, reqs, adm, vtime, arrived)
    choices = []
    for index, g in enumerate(gens):
        logprobs = None
        if body.logprobs:
            content = [_chat_logprob(st.tokenizer.id_to_piece(t.id), t, tops)
                       for t, tops in zip(g.tokens, g.top_tokens)]
            logprobs = {"content": content, "refusal": None}
        message = {"role": "assistant", "content": g.generated_text, "refusal": None}
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": _finish_reason(g.finish_reason)})
    out = {**_head("chat.completion", rid, created, st), "choices": choices,
           "usage": _usage(prompt_tokens, sum(len(g.tokens) for g in gens))}
    return JSONResponse(out)


__all__ = ["ChatCompletionRequest", "CompletionRequest", "OpenAIError", "install", "router"]
