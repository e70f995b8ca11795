"""OpenAI's routes: /v1/models, /v1/completions, /v1/chat/completions.

A request's trip: OpenAI's own rules (`schema`), then conversion into the router's `GenerateInput` and
the same validation, admission, engine streams and output processing as TGI's routes, then OpenAI's
shapes (`render`). No torch here.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Request, Response

from pytgi.errors import InferError, InvalidRequest
from pytgi.router.infer import Admission, Generation, RequestStream, Timings
from pytgi.router.request import ValidRequest
from pytgi.server.openai import render, schema, tools
from pytgi.server.openai.errors import OpenAIError, from_infer_error, invalid
from pytgi.server.responses import JSONResponse
from pytgi.server.state import State, admission, state_of
from pytgi.server.streaming import KEEP_ALIVE, record_success, sse_response, unless_gone, with_keep_alive

router = APIRouter()
_STARTED = int(time.time())


# -- admission and generation ----------------------------------------------------------------------
@contextmanager
def _refused(st: State, names: dict[str, str] | None = None) -> Iterator[None]:
    """Count a 4xx refusal as TGI's routes do (`tgi_request_failure{err="validation"}`), and answer a
    shared rule's refusal with OpenAI's field names."""
    try:
        yield
    except InvalidRequest as exc:
        st.metrics.request_failure.labels("validation").inc()
        raise schema.as_openai(exc, names or {}) from None
    except OpenAIError:
        st.metrics.request_failure.labels("validation").inc()
        raise


async def _admit(
    request: Request, count: int, names: dict[str, str], prepare: Callable[[], Awaitable[list[ValidRequest]]]
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
    with _refused(st, names):
        reqs = await prepare()
    elapsed = time.monotonic() - t0
    st.metrics.request_validation_duration.observe(elapsed)
    return reqs, adm, elapsed


def _combined(timings: list[Timings]) -> Timings:
    starts = [t.start for t in timings if t.start]
    return Timings(
        validation=timings[0].validation,
        queued=min(t.queued for t in timings),
        start=min(starts) if starts else 0.0,
        end=max(t.end for t in timings),
    )


async def _generate_all(
    request: Request, reqs: list[ValidRequest], adm: Admission, vtime: float, arrived: float
) -> list[Generation]:
    """Every engine request to completion; the client going away (or one failing) aborts them all."""
    st = state_of(request)
    assert st.infer is not None
    infer = st.infer

    async def run_all() -> list[Generation]:
        tasks = [asyncio.ensure_future(infer.generate(r, adm, vtime)) for r in reqs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    try:
        gens = await unless_gone(request, asyncio.ensure_future(run_all()))
    except InferError as exc:
        st.metrics.request_failure.labels(exc.error_type).inc()
        raise from_infer_error(exc) from None
    timings = _combined([g.timings for g in gens])
    st.metrics.time_to_first_token.observe(max(timings.start - arrived, 0.0))
    record_success(
        st, timings, arrived, sum(r.input_length for r in reqs), sum(len(g.output.tokens) for g in gens)
    )
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


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(choice, delta) from every stream as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for d in stream:
                queue.put_nowait((i, d))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    live = len(streams)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _sse_events(
    st: State,
    streams: list[RequestStream],
    renderer: render.StreamRenderer,
    arrived: float,
    reqs: list[ValidRequest],
) -> AsyncIterator[str]:
    """Merge the choices' deltas into OpenAI chunks; `:` keep-alives; an error as a last event (no
    [DONE] then). The finally awaits nothing: it may run inside a cancelled task (client gone)."""
    last = [arrived] * len(streams)
    first_token = True
    try:
        for chunk in renderer.start():
            yield _sse(chunk)
        async for item in with_keep_alive(_merged(streams)):
            if item is None:
                yield KEEP_ALIVE
                continue
            i, delta = item
            now = time.monotonic()
            if first_token:
                st.metrics.time_to_first_token.observe(now - arrived)
                first_token = False
            elif delta.index > 1:
                st.metrics.inter_token_latency.observe(now - last[i])
            last[i] = now
            for chunk in renderer.delta(i, delta):
                yield _sse(chunk)
        for chunk in renderer.end():
            yield _sse(chunk)
        record_success(
            st,
            _combined([s.timings for s in streams]),
            arrived,
            sum(r.input_length for r in reqs),
            renderer.completion_tokens,
        )
        yield "data: [DONE]\n\n"
    except InferError as exc:
        st.metrics.request_failure.labels(exc.error_type).inc()
        yield _sse(from_infer_error(exc).body())
    finally:
        for s in streams:
            s.close()


async def _in_thread(fn: Callable, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# -- routes ----------------------------------------------------------------------------------------
def _model_card(st: State) -> dict[str, Any]:
    return {"id": st.config.model_id, "object": "model", "created": _STARTED, "owned_by": "pytgi"}


@router.get("/v1/models", tags=["OpenAI"])
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(state_of(request))]})


@router.get("/v1/models/{model:path}", tags=["OpenAI"])
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    st = state_of(request)
    schema.check_model(model, st.config.model_id)  # the names the other routes accept
    return JSONResponse(_model_card(st))


def _begin(request: Request, body: schema.SamplingBody) -> tuple[State, int]:
    """What both routes check first; returns the state and n."""
    st = state_of(request)
    st.metrics.request_count.inc()
    with _refused(st):
        schema.check_model(body.model, st.config.model_id)
        return st, schema.check_sampling(body)


async def _answer(
    request: Request,
    body: schema.SamplingBody,
    reqs: list[ValidRequest],
    adm: Admission,
    vtime: float,
    arrived: float,
    head: dict[str, Any],
    prompt_tokens: int,
    renderer: Callable[[], render.StreamRenderer],
    choice: Callable[[int, ValidRequest, Generation], dict[str, Any]],
) -> Response:
    """Stream the choices, or run them to completion and answer them in one body."""
    st = state_of(request)
    if body.stream:
        return sse_response(_sse_events(st, _submit_all(st, reqs, adm, vtime), renderer(), arrived, reqs))
    gens = await _generate_all(request, reqs, adm, vtime, arrived)
    completion_tokens = sum(len(g.output.tokens) for g in gens)
    return JSONResponse(
        {
            **head,
            "choices": [choice(i, r, g) for i, (r, g) in enumerate(zip(reqs, gens))],
            "usage": render.usage(prompt_tokens, completion_tokens),
        }
    )


@router.post("/v1/completions", tags=["OpenAI"])
async def completions(request: Request, body: schema.CompletionRequest) -> Response:
    arrived, created = time.monotonic(), int(time.time())
    st, n = _begin(request, body)
    with _refused(st):
        prompts = schema.check_completion(body)
        grammar, grammar_field = schema.constraint(body)
    assert st.validation is not None
    validation = st.validation
    echo = bool(body.echo)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
    names = {
        "inputs": "prompt",
        "max_new_tokens": "max_tokens",
        "top_n_tokens": "logprobs",
        "grammar": grammar_field,
    }

    async def prepare() -> list[ValidRequest]:
        reqs = []
        for prompt in prompts:
            gi = schema.to_input(
                body,
                prompt,
                max_tokens,
                body.logprobs,
                schema.MAX_COMPLETION_LOGPROBS,
                prompt_logprobs=echo and body.logprobs is not None,
                grammar=grammar,
            )
            reqs += schema.choices(await validation.validate(gi), n, body.seed)
        return reqs

    reqs, adm, vtime = await _admit(request, len(prompts) * n, names, prepare)
    head = render.head("text_completion", f"cmpl-{uuid.uuid4().hex}", created, st.config.model_id)

    def renderer() -> render.StreamRenderer:
        return render.StreamRenderer(
            False,
            head,
            len(reqs),
            body.logprobs is not None,
            body.include_usage,
            prompt_tokens,
            st.tokenizer.id_to_piece,
            [r.inputs if echo else "" for r in reqs],
        )

    def choice(index: int, req: ValidRequest, g: Generation) -> dict[str, Any]:
        prefix = req.inputs if echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = render.completion_logprobs(g.output, prefix if echo else None)
        return {
            "index": index,
            "text": prefix + g.output.text,
            "logprobs": logprobs,
            "finish_reason": render.finish_reason(g.output.finish_reason),
        }

    prompt_tokens = sum(r.input_length for r in reqs[::n])
    return await _answer(request, body, reqs, adm, vtime, arrived, head, prompt_tokens, renderer, choice)


@router.post("/v1/chat/completions", tags=["OpenAI"])
async def chat_completions(request: Request, body: schema.ChatCompletionRequest) -> Response:
    arrived, created = time.monotonic(), int(time.time())
    st, n = _begin(request, body)
    template = st.tokenizer.chat_template
    with _refused(st):
        messages = schema.check_chat(body)
        grammar, grammar_field = schema.constraint(body)
        tool_plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, template)
        if tool_plan is not None and tool_plan.forced:
            if grammar is not None:
                raise invalid(
                    f'`tool_choice` "{body.tool_choice if isinstance(body.tool_choice, str) else "function"}"'
                    f" forces a tool call: it cannot be combined with `{grammar_field}`",
                    grammar_field,
                )
            grammar, grammar_field = tools.grammar(tool_plan), "tools"
    tool_style = tool_plan.style if tool_plan is not None else None
    assert st.validation is not None
    validation = st.validation
    max_tokens, max_tokens_name = body.max_new_tokens
    names = {
        "inputs": "messages",
        "max_new_tokens": max_tokens_name,
        "top_n_tokens": "top_logprobs",
        "grammar": grammar_field,
    }

    def render_template() -> str:
        msgs, tool_list = tools.template_messages(messages, tool_plan, tools.style_of(template))
        try:
            return st.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tools=tool_list)
        except ValueError as exc:
            raise invalid(f"cannot apply the chat template: {exc}", "messages") from None

    async def prepare() -> list[ValidRequest]:
        text = await _in_thread(render_template)
        gi = schema.to_input(
            body,
            text,
            max_tokens,
            body.top_logprobs if body.logprobs else None,
            schema.MAX_CHAT_TOP_LOGPROBS,
            add_special_tokens=False,
            grammar=grammar,
        )
        return schema.choices(await validation.validate(gi), n, body.seed)

    reqs, adm, vtime = await _admit(request, n, names, prepare)
    head = render.head("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", created, st.config.model_id)

    def renderer() -> render.StreamRenderer:
        return render.StreamRenderer(
            True,
            {**head, "object": "chat.completion.chunk"},
            len(reqs),
            bool(body.logprobs),
            body.include_usage,
            reqs[0].input_length,
            st.tokenizer.id_to_piece,
            tool_style=tool_style,
        )

    def choice(index: int, req: ValidRequest, g: Generation) -> dict[str, Any]:
        message, finish = render.chat_message(g.output.text, g.output.finish_reason, tool_style)
        return {
            "index": index,
            "message": message,
            "logprobs": render.chat_message_logprobs(g.output) if body.logprobs else None,
            "finish_reason": finish,
        }

    return await _answer(
        request, body, reqs, adm, vtime, arrived, head, reqs[0].input_length, renderer, choice
    )
