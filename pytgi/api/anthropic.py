"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and `POST /v1/messages/count_tokens`.

A Messages body translates into the chat request every chat API speaks (`to_chat`,
`pytgi.api.chat.language`: `system` → a system message; text, image, `tool_use` and `tool_result`
blocks → content, assistant tool calls and tool messages; `tools` and `tool_choice` as functions;
`output_config.format` → the constraint; `thinking` → the template's `enable_thinking`) and takes the
chat path (`chat_requests`: the same rules, chat template, tools, admission, validation and output
processing). Only the shapes are Anthropic's: content blocks, stop reasons, the stream's events and
the error body. No torch here.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Literal

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from pytgi.api.chat import answer, tools
from pytgi.api.chat.constraints import StructuredFields, one
from pytgi.api.chat.language import (
    Call,
    ChatRequest,
    Function,
    Image,
    Message,
    Named,
    Part,
    Sampling,
    Text,
    ToolChoice,
)
from pytgi.api.chat.requests import chat_requests, prompt_tokens
from pytgi.api.error_handlers import OVERLOADED, anthropic_error_body, describe
from pytgi.api.exchange import Exchange
from pytgi.api.frontend.bodies import F32, I32, U32, Bool, GrammarType, ValidRequest
from pytgi.api.json_response import JSON, JSONObject, JSONResponse
from pytgi.api.state import state_of
from pytgi.core.errors import ClientGone, InferError, InvalidRequest, Overloaded, UnknownModel
from pytgi.core.outputs import Delta, OutputProcessor

PREFIX = "/v1/messages"
router = APIRouter()


# -- bodies ----------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as Anthropic's SDKs expect


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: JSONObject
    cache_control: JSONObject | None = None


class ToolChoiceBody(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Bool | None = None


class MessageBody(_Body):
    role: Literal["user", "assistant"]
    content: str | list[JSONObject]


class CountTokensRequest(_Body):
    model: str
    messages: list[MessageBody]
    system: str | list[JSONObject] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceBody | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: JSONObject = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None  # `effort` is accepted and ignored


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]


class MessagesRequest(CountTokensRequest, StructuredFields):
    max_tokens: U32
    thinking: Thinking | None = None  # → the template's enable_thinking (Qwen3's switch)
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's name
    temperature: F32 | None = None
    top_p: F32 | None = None
    top_k: I32 | None = None
    stop_sequences: list[str] | None = None
    stream: Bool | None = False


# -- Anthropic's body → the chat request -----------------------------------------------------------
def _text(blocks: JSON | list[JSONObject], where: str) -> str:
    """A string, or text blocks joined (what `system` and a tool result hold)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise InvalidRequest(f"`{where}` must be a string or a list of text blocks", where)
    texts = []
    for j, b in enumerate(blocks):
        text = b.get("text") if isinstance(b, dict) and b.get("type") == "text" else None
        if not isinstance(text, str):
            raise InvalidRequest(f"`{where}.{j}` must be a text block", f"{where}.{j}")
        texts.append(text)
    return "\n".join(texts)


def _image_url(source: object, where: str) -> str:
    """An image block's source as a URL: base64 data as a data: URL, or its URL."""
    kind = source.get("type") if isinstance(source, dict) else None
    if isinstance(source, dict) and kind == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if isinstance(source, dict) and kind == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise InvalidRequest(
        "an image block's `source` is {type: base64, media_type, data} or {type: url, url}", where
    )


def _messages(body: CountTokensRequest) -> list[Message]:
    out: list[Message] = []
    if body.system:
        out.append(Message("system", _text(body.system, "system")))
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append(Message(m.role, m.content))
            continue
        texts: list[str] = []
        calls: list[Call] = []
        results: list[Message] = []
        parts: list[Part] = []  # text and image parts in order, where the message has an image
        for j, b in enumerate(m.content):
            where, kind, text = f"messages.{i}.content.{j}", b.get("type"), b.get("text")
            if kind == "text" and isinstance(text, str):
                texts.append(text)
                parts.append(Text(text))
            elif kind == "image" and m.role == "user":
                parts.append(Image(_image_url(b.get("source"), where), f"{where}.source"))
            elif kind == "tool_use" and m.role == "assistant":
                arguments = json.dumps(b.get("input") or {}, ensure_ascii=False)
                calls.append(Call(str(b.get("name", "")), arguments, str(b.get("id", ""))))
            elif kind == "tool_result" and m.role == "user":
                content = _text(b.get("content") or "", f"{where}.content")
                results.append(Message("tool", content, call_id=str(b.get("tool_use_id", ""))))
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning is not sent back to the model
            else:
                raise InvalidRequest(
                    f"content blocks of type `{kind}` are not supported in {m.role} messages", where
                )
        out += results  # a user turn's tool results answer the assistant's calls before its text
        if any(isinstance(p, Image) for p in parts):
            out.append(Message(m.role, parts))
        elif texts or calls:
            out.append(Message(m.role, "\n".join(texts) if texts else None, calls))
    return out


def _tool_choice(choice: ToolChoiceBody) -> ToolChoice:
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("`tool_choice` of type `tool` needs `name`", "tool_choice")
        return Named(choice.name)
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]  # type: ignore[return-value]


def _constraint(body: MessagesRequest) -> GrammarType | None:
    """`output_config.format` (or the beta's `output_format`), or vLLM's fields: one of them."""
    fmt = (body.output_config.format if body.output_config else None) or body.output_format
    own = [(GrammarType(type="json", value=fmt.schema_), "output_config.format")] if fmt else []
    return one(own + body.structured_constraints(), "output_config.format")[0]


CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_CACHE_MARKS = 4  # Anthropic's limit


def _ttl(mark: JSON, where: str) -> float:
    """A `cache_control`'s seconds: `{"type": "ephemeral", "ttl": "5m" (the default) | "1h"}`."""
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise InvalidRequest('`cache_control` must be {"type": "ephemeral", "ttl": "5m" | "1h"}', where)
    ttl = mark.get("ttl", "5m")
    if not isinstance(ttl, str) or ttl not in CACHE_TTLS:
        raise InvalidRequest(f"`cache_control.ttl` must be '5m' or '1h', got {ttl!r}", f"{where}.ttl")
    return CACHE_TTLS[ttl]


def cache_marks(body: CountTokensRequest) -> list[tuple[int, float]]:
    """The body's `cache_control` marks as (chat messages, seconds): each pins the prompt up to the
    end of the chat messages its block's message became (a mark on a tool or on `system`: the
    system message, where templates put the tools)."""
    found: list[tuple[int, float]] = []
    system = 1 if body.system else 0
    for j, tool in enumerate(body.tools or []):
        if tool.cache_control is not None:
            found.append((system, _ttl(tool.cache_control, f"tools.{j}.cache_control")))
    for j, block in enumerate(body.system if isinstance(body.system, list) else []):
        if isinstance(block, dict) and block.get("cache_control") is not None:
            found.append((system, _ttl(block["cache_control"], f"system.{j}.cache_control")))
    for i, m in enumerate(body.messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else []):
            if isinstance(block, dict) and block.get("cache_control") is not None:
                ttl = _ttl(block["cache_control"], f"messages.{i}.content.{j}.cache_control")
                upto = body.model_copy(update={"messages": body.messages[: i + 1]})
                found.append((len(_messages(upto)), ttl))
    if len(found) > MAX_CACHE_MARKS:
        raise InvalidRequest(
            f"A maximum of {MAX_CACHE_MARKS} blocks with cache_control may be provided. Found {len(found)}."
        )
    return found


def _tools(body: CountTokensRequest) -> tuple[list[Function], ToolChoice | None, bool]:
    """The functions, the tool choice and whether calls may be parallel (a choice only with tools)."""
    if not body.tools:
        return [], None, True
    functions = [Function(t.name, t.description or "", t.input_schema) for t in body.tools]
    choice = body.tool_choice
    if choice is None:
        return functions, None, True
    return functions, _tool_choice(choice), not choice.disable_parallel_tool_use


def to_chat(body: CountTokensRequest) -> ChatRequest:
    """The chat request a Messages body (or a count_tokens body) asks for (Anthropic's temperature
    is 0..1)."""
    functions, choice, parallel = _tools(body)
    if not isinstance(body, MessagesRequest):
        return ChatRequest(_messages(body), tools=functions, tool_choice=choice, model=body.model)
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise InvalidRequest(f"`temperature` must be >= 0 and <= 1. Given: {body.temperature}", "temperature")
    return ChatRequest(
        _messages(body),
        Sampling(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=list(body.stop_sequences or []),
        ),
        tools=functions,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        constraint=_constraint(body),
        thinking=None if body.thinking is None else body.thinking.type != "disabled",
        stream=bool(body.stream),
        model=body.model,
    )


# -- the answer → Anthropic's shapes ---------------------------------------------------------
def stop_reason(out: OutputProcessor, tool_calls: bool) -> str:
    """Anthropic's stop reason; an answer the token limit cut is `max_tokens` even when it holds
    complete calls (as OpenAI's `length`): the client learns that more was coming."""
    if tool_calls and out.finish_reason != "length":
        return "tool_use"
    return {"length": "max_tokens", "stop_sequence": "stop_sequence"}.get(out.finish_reason or "", "end_turn")


def usage(prompt: int, output: int, cached: int, pinned: int = 0) -> JSONObject:
    """Anthropic's usage. The prompt is `cache_read_input_tokens` (what pytgi's prefix cache served)
    `+ cache_creation_input_tokens` (the rest of the prompt up to its last `cache_control` mark, the
    `pinned` tokens: computed now and pinned) `+ input_tokens` (the rest)."""
    created = max(0, min(pinned, prompt) - cached)
    return {
        "input_tokens": prompt - cached - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def pinned(req: ValidRequest) -> int:
    """The prompt tokens the request's last `cache_control` mark pins (0: none, or pins are off)."""
    return req.sampling.cache_pins[-1][0] if req.sampling.cache_pins else 0


def _input(arguments: str) -> JSON:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def message_json(
    mid: str,
    model: str,
    out: OutputProcessor,
    tool_style: tools.Style | None,
    reasoning_style: str | None,
    prompt: int,
    pinned: int = 0,
) -> JSONObject:
    a = answer.read(out.text, tool_style, reasoning_style)
    content: list[JSON] = (
        [{"type": "thinking", "thinking": a.reasoning, "signature": ""}] if a.reasoning else []
    )
    content += [{"type": "text", "text": a.content}] if a.content else []
    content += [
        {"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)} for c in a.calls
    ]
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(out, bool(a.calls)),
        "stop_sequence": out.stop_sequence,
        "usage": usage(prompt, len(out.tokens), out.num_cached_tokens, pinned),
    }


def event(name: str, data: JSONObject) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class MessageStream:
    """Anthropic's events from one answer's deltas: message_start, then per content block (text, or a
    tool call whose arguments arrive as `input_json_delta`s) its start, deltas and stop, then
    message_delta (stop reason, output tokens) and message_stop."""

    def __init__(
        self,
        head: JSONObject,
        out: Callable[[], OutputProcessor],
        tool_style: tools.Style | None,
        reasoning_style: str | None = None,
        pinned: int = 0,
    ):
        self.head, self.out, self.pinned = head, out, pinned
        given = head.get("usage")
        prompt = given.get("input_tokens") if isinstance(given, dict) else None
        self.prompt = prompt if isinstance(prompt, int) else 0  # message_start's: the whole prompt
        self.answer = answer.AnswerStream(tool_style, reasoning_style)
        self.index, self.kind = -1, ""  # the open block, and its kind ("" when none is open)

    def start(self) -> list[str]:
        message = {**self.head, "content": [], "stop_reason": None, "stop_sequence": None}
        return [event("message_start", {"message": message})]

    def _open(self, block: JSONObject) -> list[str]:
        events = self._close()
        self.index, self.kind = self.index + 1, str(block["type"])
        return [*events, event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if not self.kind:
            return []
        self.kind = ""
        return [event("content_block_stop", {"index": self.index})]

    def delta(self, d: Delta) -> list[str]:
        events: list[str] = []
        delta: JSONObject
        for e in self.answer.feed(d):
            if isinstance(e, answer.Reasoning):
                if self.kind != "thinking":
                    events += self._open({"type": "thinking", "thinking": "", "signature": ""})
                delta = {"type": "thinking_delta", "thinking": e.text}
            elif isinstance(e, tools.Content):
                if not e.text:
                    continue
                if self.kind != "text":
                    events += self._open({"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": e.text}
            elif isinstance(e, tools.CallStart):
                events += self._open({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
                continue
            else:
                delta = {"type": "input_json_delta", "partial_json": e.text}
            events.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        if d.finish_reason is not None:
            out = self.out()
            reason = stop_reason(out, bool(self.answer.calls))
            events += self._close()
            events.append(
                event(
                    "message_delta",
                    {
                        "delta": {"stop_reason": reason, "stop_sequence": out.stop_sequence},
                        # the whole usage: the cached prompt tokens are known once the prompt ran
                        "usage": usage(self.prompt, d.index, out.num_cached_tokens, self.pinned),
                    },
                )
            )
            events.append(event("message_stop", {}))
        return events


# -- routes ----------------------------------------------------------------------------------------
@router.post(PREFIX, tags=["Anthropic"])
async def messages(request: Request, body: MessagesRequest) -> Response:
    ex = Exchange(request)
    with ex.refused():
        ex.st.check_model(body.model)
        chat = to_chat(body)
        chat.cache_marks = cache_marks(body)
    reqs, tool_style = await chat_requests(ex, chat)
    mid = f"msg_{uuid.uuid4().hex}"
    if not body.stream:
        [g] = await ex.generate(reqs)
        style = ex.st.config.reasoning_parser
        output = message_json(
            mid, body.model, g.output, tool_style, style, reqs[0].input_length, pinned(reqs[0])
        )
        return JSONResponse(output)
    [stream] = ex.streams(reqs)
    head: JSONObject = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "usage": usage(reqs[0].input_length, 0, 0),  # before the prompt runs: its whole length
    }
    renderer = MessageStream(
        head, lambda: stream.output, tool_style, ex.st.config.reasoning_parser, pinned(reqs[0])
    )
    return ex.sse([stream], lambda _, d: renderer.delta(d), error_event, start=renderer.start())


@router.post(f"{PREFIX}/count_tokens", tags=["Anthropic"])
async def count_tokens(request: Request, body: CountTokensRequest) -> JSONResponse:
    """The prompt's tokens as `messages` would count them (the chat template with the tools)."""
    st = state_of(request)
    st.check_model(body.model)
    return JSONResponse({"input_tokens": await prompt_tokens(st, to_chat(body))})


# -- errors ----------------------------------------------------------------------------------------
def _status(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, UnknownModel):
        return 404, exc.message
    if isinstance(exc, InvalidRequest):
        return 400, exc.message
    if isinstance(exc, RequestValidationError):
        return 400, describe(exc)
    if isinstance(exc, Overloaded):
        return 429, OVERLOADED
    if isinstance(exc, InferError):
        return 500, exc.message
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code, str(exc.detail)
    return 500, f"internal error: {type(exc).__name__}"


def as_anthropic(exc: Exception) -> tuple[int, JSONObject]:
    """(status, `{"type": "error", "error": {"type", "message"}}`) for what a route raised: a
    refusal 400 (404 for a model not served), a malformed body 400, too many requests 429."""
    status, message = _status(exc)
    return status, anthropic_error_body(status, message)


def error_event(exc: InferError) -> str:
    return event("error", {"error": as_anthropic(exc)[1]["error"]})


def install(app: FastAPI) -> None:
    """The routes, and Anthropic's error shape under /v1/messages (call after OpenAI's install: the
    handlers are wrapped once more, and answer for this prefix only)."""
    app.include_router(router)
    for exc_class, handler in list(app.exception_handlers.items()):
        if isinstance(exc_class, type):
            app.add_exception_handler(exc_class, _dispatching(handler))


def _dispatching(fallback: Callable) -> Callable:
    async def handler(request: Request, exc: Exception) -> Response:
        if not request.url.path.startswith(PREFIX):
            result = fallback(request, exc)
            return await result if asyncio.iscoroutine(result) else result
        if isinstance(exc, ClientGone):
            return Response(status_code=499)
        status, body = as_anthropic(exc)
        return JSONResponse(body, status_code=status)

    return handler


__all__ = ["MessagesRequest", "install", "router"]
