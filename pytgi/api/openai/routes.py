"""OpenAI's routes: /v1/models, /v1/completions, /v1/chat/completions.

A request's trip: OpenAI's own rules (`schema`), then translation into the chat request every chat API
speaks (`pytgi.api.chat`) or, for completions, into the router's `GenerateInput`; the same validation,
admission, engine streams and output processing as TGI's routes; then OpenAI's shapes (`render`). No
torch here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Request, Response

from pytgi.api.chat.language import renamed
from pytgi.api.chat.requests import chat_requests, choices
from pytgi.api.exchange import Exchange, sse_event
from pytgi.api.frontend.bodies import ValidRequest
from pytgi.api.frontend.infer import Generation
from pytgi.api.json_response import JSONObject, JSONResponse
from pytgi.api.openai import lora_routes, render, responses, schema
from pytgi.api.openai.error_shape import OpenAIError, from_infer_error, install_handlers
from pytgi.api.state import State, state_of
from pytgi.core.config import ServerConfig

router = APIRouter()
_STARTED = int(time.time())


# -- routes ----------------------------------------------------------------------------------------
def _model_card(st: State, adapter: str | None = None) -> JSONObject:
    """The served model's card, or an adapter's (vLLM's shape: its directory and its parent)."""
    card: JSONObject = {"object": "model", "created": _STARTED, "owned_by": "pytgi"}
    if adapter is None:
        return {"id": st.config.model_id, **card}
    return {"id": adapter, **card, "root": st.adapters[adapter], "parent": st.config.model_id}


@router.get("/v1/models", tags=["OpenAI"])
async def list_models(request: Request) -> JSONResponse:
    st = state_of(request)
    cards = [_model_card(st), *(_model_card(st, a) for a in st.adapters)]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}", tags=["OpenAI"])
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    st = state_of(request)
    st.check_model(model)  # the names the other routes accept
    return JSONResponse(_model_card(st, st.adapter_of(model)))


def _begin(request: Request, body: schema.SamplingBody) -> tuple[Exchange, int]:
    """What both routes check first; returns the exchange and n."""
    ex = Exchange(request, refusals=(OpenAIError,))
    with ex.refused():
        ex.st.check_model(body.model)
        return ex, schema.check_sampling(body)


async def _answer(
    ex: Exchange,
    body: schema.SamplingBody,
    reqs: list[ValidRequest],
    head: JSONObject,
    prompt_tokens: int,
    renderer: Callable[[], render.StreamRenderer],
    choice: Callable[[int, ValidRequest, Generation], JSONObject],
) -> Response:
    """Stream the choices, or run them to completion and answer them in one body."""
    if body.stream:
        r = renderer()
        streams = ex.streams(reqs)

        def end() -> list[str]:
            r.cached_tokens = sum(s.output.num_cached_tokens for s in streams)
            return [*(sse_event(chunk) for chunk in r.end()), "data: [DONE]\n\n"]

        return ex.sse(
            streams,
            lambda i, delta: [sse_event(chunk) for chunk in r.delta(i, delta)],
            lambda exc: sse_event(from_infer_error(exc).body()),  # no [DONE] after an error
            start=[sse_event(chunk) for chunk in r.start()],
            end=end,
        )
    gens = await ex.generate(reqs)
    completion_tokens = sum(len(g.output.tokens) for g in gens)
    cached = sum(g.output.num_cached_tokens for g in gens)
    return JSONResponse(
        {
            **head,
            "choices": [choice(i, r, g) for i, (r, g) in enumerate(zip(reqs, gens))],
            "usage": render.usage(prompt_tokens, completion_tokens, cached),
        }
    )


@router.post("/v1/completions", tags=["OpenAI"])
async def completions(request: Request, body: schema.CompletionRequest) -> Response:
    created = int(time.time())
    ex, n = _begin(request, body)
    st = ex.st
    with ex.refused():
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
        with renamed(names):
            for prompt in prompts:
                gi = schema.to_input(
                    body,
                    prompt,
                    max_tokens,
                    body.logprobs,
                    schema.MAX_COMPLETION_LOGPROBS,
                    prompt_logprobs=echo and body.logprobs is not None,
                    grammar=grammar,
                    adapter=ex.st.adapter_of(body.model),
                )
                reqs += choices(await validation.validate(gi), n, body.seed)
        return reqs

    reqs = await ex.admit(len(prompts) * n, prepare)
    model = st.adapter_of(body.model) or st.config.model_id
    head = render.head("text_completion", f"cmpl-{uuid.uuid4().hex}", created, model)

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

    def choice(index: int, req: ValidRequest, g: Generation) -> JSONObject:
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
    return await _answer(ex, body, reqs, head, prompt_tokens, renderer, choice)


@router.post("/v1/chat/completions", tags=["OpenAI"])
async def chat_completions(request: Request, body: schema.ChatCompletionRequest) -> Response:
    created = int(time.time())
    ex, n = _begin(request, body)
    st = ex.st
    with ex.refused():
        chat, param = schema.to_chat(body, n)
    with renamed(param):
        reqs, tool_style = await chat_requests(ex, chat)
    model = st.adapter_of(body.model) or st.config.model_id
    head = render.head("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", created, model)

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
            reasoning_style=st.config.reasoning_parser,
        )

    def choice(index: int, req: ValidRequest, g: Generation) -> JSONObject:
        message, finish = render.chat_message(
            g.output.text, g.output.finish_reason, tool_style, st.config.reasoning_parser
        )
        return {
            "index": index,
            "message": message,
            "logprobs": render.chat_message_logprobs(g.output) if body.logprobs else None,
            "finish_reason": finish,
        }

    return await _answer(ex, body, reqs, head, reqs[0].input_length, renderer, choice)


def install(app: FastAPI, config: ServerConfig) -> None:
    """OpenAI's routes, and OpenAI's error shape under /v1/ (call after the app's own handlers); the
    runtime adapter routes where the operator turned them on."""
    app.include_router(router)
    responses.install(app, config)
    lora_routes.install(app, config)
    install_handlers(app)
