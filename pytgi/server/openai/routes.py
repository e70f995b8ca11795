"""OpenAI's routes: /v1/models, /v1/completions, /v1/chat/completions.

A request's trip: OpenAI's own rules (`schema`), then conversion into the router's `GenerateInput` and
the same validation, admission, engine streams and output processing as TGI's routes, then OpenAI's
shapes (`render`). No torch here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Request, Response

from pytgi.errors import InvalidRequest
from pytgi.router.infer import Generation
from pytgi.router.request import ValidRequest
from pytgi.server.exchange import Exchange, in_thread, sse_event
from pytgi.server.openai import render, schema, tools
from pytgi.server.openai.errors import OpenAIError, from_infer_error, invalid
from pytgi.server.responses import JSONResponse
from pytgi.server.state import State, state_of

router = APIRouter()
_STARTED = int(time.time())


# -- admission and generation (pytgi.server.exchange) ---------------------------------------------
@contextmanager
def _named(names: dict[str, str]) -> Iterator[None]:
    """A shared rule's refusal, answered with OpenAI's field names (`max_tokens`, not `max_new_tokens`)."""
    try:
        yield
    except InvalidRequest as exc:
        raise schema.as_openai(exc, names) from None


# -- routes ----------------------------------------------------------------------------------------
def _model_card(st: State, adapter: str | None = None) -> dict[str, Any]:
    """The served model's card, or an adapter's (vLLM's shape: its directory and its parent)."""
    card = {"object": "model", "created": _STARTED, "owned_by": "pytgi"}
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
    schema.check_model(model, st.config.model_id, st.adapters)  # the names the other routes accept
    return JSONResponse(_model_card(st, st.adapter_of(model)))


def _begin(request: Request, body: schema.SamplingBody) -> tuple[Exchange, int]:
    """What both routes check first; returns the exchange and n."""
    ex = Exchange(request, refusals=(OpenAIError,))
    with ex.refused():
        schema.check_model(body.model, ex.st.config.model_id, ex.st.adapters)
        return ex, schema.check_sampling(body)


async def _answer(
    ex: Exchange,
    body: schema.SamplingBody,
    reqs: list[ValidRequest],
    head: dict[str, Any],
    prompt_tokens: int,
    renderer: Callable[[], render.StreamRenderer],
    choice: Callable[[int, ValidRequest, Generation], dict[str, Any]],
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
        with _named(names):
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
                reqs += schema.choices(await validation.validate(gi), n, body.seed)
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
    return await _answer(ex, body, reqs, head, prompt_tokens, renderer, choice)


async def chat_requests(
    ex: Exchange, body: schema.ChatCompletionRequest, n: int
) -> tuple[list[ValidRequest], tools.Style | None]:
    """A chat body's engine requests, admitted: OpenAI's chat rules, tools and constraints, the
    chat template, validation. Anthropic's Messages route converts its body and comes here too."""
    st = ex.st
    template = st.tokenizer.chat_template
    with ex.refused():
        messages = schema.check_chat(body)
        image_refs = schema.take_images(messages)
        grammar, grammar_field = schema.constraint(body)
        tool_plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, template)
        if tool_plan is not None and tool_plan.forced:
            if grammar is not None:
                raise invalid(
                    f'`tool_choice` "{body.tool_choice if isinstance(body.tool_choice, str) else "function"}"'
                    f" forces a tool call: it cannot be combined with `{grammar_field}`",
                    grammar_field,
                )
            grammar, grammar_field = tools.grammar(tool_plan, st.tokenizer.special_id), "tools"
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
            return st.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tools=tool_list, **(body.chat_template_kwargs or {})
            )
        except ValueError as exc:
            raise invalid(f"cannot apply the chat template: {exc}", "messages") from None

    async def prepare() -> list[ValidRequest]:
        with _named(names):
            return await prepare_named()

    async def prepare_named() -> list[ValidRequest]:
        images = await st.load_images(image_refs)
        text = await in_thread(render_template)
        gi = schema.to_input(
            body,
            text,
            max_tokens,
            body.top_logprobs if body.logprobs else None,
            schema.MAX_CHAT_TOP_LOGPROBS,
            add_special_tokens=False,
            grammar=grammar,
            adapter=st.adapter_of(body.model),
        )
        gi.reasoning = st.config.reasoning_parser
        gi.images = images
        # Mistral's calls open with a special token: the answer's text keeps special tokens (as vLLM's)
        gi.skip_special_tokens = tool_style not in tools.MISTRAL_STYLES
        return schema.choices(await validation.validate(gi), n, body.seed)

    return await ex.admit(n, prepare), tool_style


@router.post("/v1/chat/completions", tags=["OpenAI"])
async def chat_completions(request: Request, body: schema.ChatCompletionRequest) -> Response:
    created = int(time.time())
    ex, n = _begin(request, body)
    st = ex.st
    reqs, tool_style = await chat_requests(ex, body, n)
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

    def choice(index: int, req: ValidRequest, g: Generation) -> dict[str, Any]:
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
