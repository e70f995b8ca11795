"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed), `GET /v1/responses/{id}`.

A Responses body translates into the chat request every chat API speaks (`to_chat`,
`pytgi.api.chat.language`: `instructions` → a system message; `input` as a string or items: messages,
`function_call` and `function_call_output`; flat function tools; `text.format` → the constraint) and
takes the chat path (`chat_requests`). Only the shapes are the Responses API's: output items
(`reasoning`, `message`, `function_call`), the stream's events, the fields refusals name, and a
bounded in-memory store for `previous_response_id` and `GET`. No torch here.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
from fastapi import APIRouter, FastAPI, Request, Response

from pytgi.api.chat import answer, tools
from pytgi.api.chat.language import (
    Call,
    ChatRequest,
    Function,
    Image,
    Message,
    Named,
    Part,
    ReasoningEffort,
    Role,
    Sampling,
    Text,
    ToolChoice,
    renamed,
)
from pytgi.api.chat.requests import chat_requests
from pytgi.api.exchange import Exchange
from pytgi.api.frontend.bodies import F32, U32, Bool, GrammarType
from pytgi.api.json_response import JSON, JSONObject, JSONResponse
from pytgi.api.openai import schema
from pytgi.api.openai.error_shape import OpenAIError, as_openai_error, invalid
from pytgi.core.config import ServerConfig
from pytgi.core.errors import InferError
from pytgi.core.outputs import Delta, OutputProcessor

router = APIRouter()
STORE_SIZE, STORE_BYTES = 1000, 256 << 20  # defaults of --responses-store-size, --responses-store-bytes


class Reasoning(schema._Body):
    effort: ReasoningEffort | None = None  # → the chat request's `reasoning_effort`
    summary: str | None = None  # accepted, ignored


class ResponseRequest(schema._Body):
    model: str | None = None
    input: str | list[JSONObject]
    instructions: str | None = None
    max_output_tokens: U32 | None = None
    temperature: F32 | None = None
    top_p: F32 | None = None
    tools: list[JSONObject] | None = None
    tool_choice: str | JSONObject | None = None
    parallel_tool_calls: Bool | None = None
    text: JSONObject | None = None
    stream: Bool | None = False
    store: Bool | None = True
    previous_response_id: str | None = None
    metadata: JSONObject | None = None
    seed: int | None = None  # extensions, as on the chat route
    top_k: int | None = None
    chat_template_kwargs: JSONObject | None = None
    prompt_cache_key: str | None = None
    reasoning: Reasoning | None = None


class Store:
    """The newest responses and the conversation each ends (the chat messages as JSON, instructions
    left out), by id: at most `size` of them and `max_bytes` of their JSON, the oldest dropped first
    (`--responses-store-size`, `--responses-store-bytes`). One that alone is over the byte bound is
    not kept."""

    def __init__(self, size: int = STORE_SIZE, max_bytes: int = STORE_BYTES) -> None:
        self.size, self.max_bytes, self.bytes = size, max_bytes, 0
        self.items: OrderedDict[str, tuple[JSONObject, list[JSONObject], int]] = OrderedDict()

    def put(self, response: JSONObject, conversation: list[JSONObject]) -> None:
        rid, size = (
            str(response["id"]),
            len(json.dumps([response, conversation], ensure_ascii=False).encode()),
        )
        old = self.items.pop(rid, None)
        if old is not None:
            self.bytes -= old[2]
        if size <= self.max_bytes:
            self.items[rid] = (response, conversation, size)
            self.bytes += size
        while self.items and (len(self.items) > self.size or self.bytes > self.max_bytes):
            self.bytes -= self.items.popitem(last=False)[1][2]

    def get(self, rid: str) -> tuple[JSONObject, list[JSONObject]] | None:
        item = self.items.get(rid)
        return None if item is None else (item[0], item[1])


def store_of(request: Request) -> Store:
    """The app's store (`install`)."""
    return request.app.state.responses_store


def install(app: FastAPI, config: ServerConfig) -> None:
    app.include_router(router)
    app.state.responses_store = Store(config.responses_store_size, config.responses_store_bytes)


# -- the body → the chat request ---------------------------------------------------------------------
# the Responses API's names for the chat request's fields, where they differ (a tool's are the same)
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "constraint": "text.format"}


def _content(content: object, where: str) -> str | list[Part]:
    """A message's content: a string, or its text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"`{where}` must be a string or a list of content parts", where)
    parts: list[Part] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if isinstance(part, dict) and kind in ("input_text", "output_text", "text"):
            parts.append(Text(str(part.get("text", ""))))
        elif isinstance(part, dict) and kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append(Image(part["image_url"], f"{where}.{j}.image_url"))
        else:
            raise invalid(
                f"content parts of type `{kind}` are not supported: only text parts and `input_image` "
                "parts with an `image_url` are",
                f"{where}.{j}",
            )
    return parts


ROLES: dict[str, Role] = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_messages(items: str | list[JSONObject]) -> list[Message]:
    """The chat messages `input` stands for."""
    if isinstance(items, str):
        return [Message("user", items)]
    out: list[Message] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            given = item.get("role")
            role = ROLES.get(given) if isinstance(given, str) else None
            if role is None:
                raise invalid(
                    f"`input.{i}.role` must be user, system, developer or assistant", f"input.{i}.role"
                )
            out.append(Message(role, _content(item.get("content", ""), f"input.{i}.content")))
        elif kind == "function_call":
            call = Call(
                str(item.get("name", "")), str(item.get("arguments", "{}")), str(item.get("call_id", ""))
            )
            if out and out[-1].role == "assistant" and out[-1].calls:
                out[-1].calls.append(call)
            else:
                out.append(Message("assistant", None, [call]))
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = output if isinstance(output, str) else json.dumps(output)
            out.append(Message("tool", content, call_id=str(item.get("call_id", ""))))
        elif kind == "reasoning":
            continue  # earlier reasoning is not sent back to the model
        else:
            raise invalid(f"input items of type `{kind}` are not supported", f"input.{i}.type")
    return out


def _functions(body: ResponseRequest) -> list[Function]:
    out = []
    for i, t in enumerate(body.tools or []):
        if t.get("type") != "function":
            raise invalid(
                f"tools of type `{t.get('type')}` are not supported: only function tools are",
                f"tools.{i}.type",
            )
        name, params = t.get("name"), t.get("parameters") or {"type": "object"}
        if not isinstance(name, str):
            raise invalid(f"`tools.{i}.name` must be a string. Given: {name!r}", f"tools.{i}.name")
        if not isinstance(params, dict):
            raise invalid(f"`tools.{i}.parameters` must be a JSON schema object", f"tools.{i}.parameters")
        description = t.get("description")
        out.append(Function(name, description if isinstance(description, str) else "", params))
    return out


def _tool_choice(choice: str | JSONObject | None) -> ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(
                f'`tool_choice` must be "none", "auto", "required" or a named function. Given: {choice!r}',
                "tool_choice",
            )
        return choice  # type: ignore[return-value]
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise invalid('a named `tool_choice` must be {"type": "function", "name": ...}', "tool_choice")
    return Named(name)


def _format(body: ResponseRequest) -> GrammarType | None:
    fmt = (body.text or {}).get("format")
    if not fmt:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarType(type="json", value={"type": "object"})
    if kind == "json_schema" and isinstance(fmt, dict):
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise invalid("`text.format` of type `json_schema` needs `schema`", "text.format")
        return GrammarType(type="json", value=schema)
    raise invalid(f"`text.format` of type `{kind}` is not supported", "text.format")


def conversation(body: ResponseRequest, store: Store) -> list[Message]:
    """The messages before this turn's answer: a previous response's conversation (its instructions do
    not carry over), then `input`."""
    before: list[Message] = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise OpenAIError(
                404,
                f"Previous response with id '{body.previous_response_id}' not found",
                "invalid_request_error",
                "previous_response_id",
                "previous_response_not_found",
            )
        before = msgspec.convert(stored[1], list[Message])
    return before + input_messages(body.input)


def to_chat(body: ResponseRequest, messages: list[Message]) -> ChatRequest:
    """The chat request: `instructions` as a system message, then `messages`."""
    system = [Message("system", body.instructions)] if body.instructions else []
    return ChatRequest(
        system + messages,
        Sampling(
            max_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
        ),
        tools=_functions(body),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        constraint=_format(body),
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        chat_template_kwargs=dict(body.chat_template_kwargs or {}),
        stream=bool(body.stream),
        model=body.model,
        cache_key=body.prompt_cache_key,
    )


# -- results → the Responses API's shapes ------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", iid: str | None = None) -> JSONObject:
    return {
        "type": "message",
        "id": iid or _id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def reasoning_item(text: str, iid: str | None = None) -> JSONObject:
    return {
        "type": "reasoning",
        "id": iid or _id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call_id: str, name: str, arguments: str, status: str, iid: str | None = None) -> JSONObject:
    return {
        "type": "function_call",
        "id": iid or _id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def call_item(call: tools.ToolCall) -> JSONObject:
    return _call_item(call.id, call.name, call.arguments, "completed")


def response_json(
    body: ResponseRequest,
    rid: str,
    created: int,
    model: str,
    status: str,
    output: list[JSONObject],
    usage: tuple[int, int, int] | None,
) -> JSONObject:
    """`usage`: (input tokens, output tokens, input tokens the prefix cache served)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": [*output],
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tools": [*(body.tools or [])],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": body.text or {"format": {"type": "text"}},
        "previous_response_id": body.previous_response_id,
        "store": body.store is not False,
        "metadata": body.metadata or {},
        "reasoning": body.reasoning.model_dump() if body.reasoning else None,
        "usage": None
        if usage is None
        else {
            "input_tokens": usage[0],
            "output_tokens": usage[1],
            "total_tokens": usage[0] + usage[1],
            "input_tokens_details": {"cached_tokens": usage[2]},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def output_items(
    out: OutputProcessor, tool_style: tools.Style | None, reasoning_style: str | None
) -> list[JSONObject]:
    a = answer.read(out.text, tool_style, reasoning_style)
    items = [reasoning_item(a.reasoning)] if a.reasoning else []
    items += [message_item(a.content)] if a.content else []
    return items + [call_item(c) for c in a.calls]


def _text_of(value: JSON) -> str:
    return value if isinstance(value, str) else ""


def _assistant_turn(items: list[JSONObject]) -> Message:
    """The answer as a chat message, for the next turn of a stored conversation."""
    text, calls = "", []
    for item in items:
        content = item.get("content")
        if item.get("type") == "message" and isinstance(content, list):
            text += "".join(_text_of(part.get("text")) for part in content if isinstance(part, dict))
        elif item.get("type") == "function_call":
            name, arguments = _text_of(item.get("name")), _text_of(item.get("arguments"))
            calls.append(Call(name, arguments, _text_of(item.get("call_id"))))
    return Message("assistant", text or None, calls)


@dataclass
class _Writing:
    """The output item being streamed: its text (a call's: its arguments) grows as it comes."""

    type: Literal["message", "reasoning", "function_call"]
    id: str
    call_id: str = ""
    name: str = ""
    text: str = ""
    status: str = "in_progress"

    def item(self) -> JSONObject:
        if self.type == "message":
            return message_item(self.text, self.status, self.id)
        if self.type == "reasoning":
            return reasoning_item(self.text, self.id)
        return _call_item(self.call_id, self.name, self.text, self.status, self.id)

    def part(self) -> JSONObject:
        """A message's or reasoning's (only) content part."""
        if self.type == "message":
            return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": self.text}


Final = Callable[[str, list[JSONObject], int], JSONObject]  # (status, items, output tokens) → response


class ResponseStream:
    """The stream's events from one answer's deltas, each with its `sequence_number`."""

    def __init__(self, final: Final, tool_style: tools.Style | None, reasoning_style: str | None) -> None:
        self.final = final  # (status, output items, output tokens) → the completed response
        self.answer = answer.AnswerStream(tool_style, reasoning_style)
        self.seq = 0
        self.items: list[JSONObject] = []
        self.open: _Writing | None = None  # the item being written

    def event(self, kind: str, **data: JSON) -> str:
        self.seq += 1
        return (
            f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **data})}\n\n"
        )

    def start(self, response: JSONObject) -> list[str]:
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def _begin(self, w: _Writing) -> list[str]:
        events = self._end()
        self.open = w
        index = len(self.items)
        events.append(self.event("response.output_item.added", output_index=index, item=w.item()))
        if w.type != "function_call":
            events.append(self._part_event("content_part.added", w, index, part=w.part()))
        return events

    def _part_event(self, kind: str, w: _Writing, index: int, **data: JSON) -> str:
        """An event about the (only) content part of a message or reasoning item."""
        return self.event(f"response.{kind}", item_id=w.id, output_index=index, content_index=0, **data)

    def _end(self) -> list[str]:
        w, self.open = self.open, None
        if w is None:
            return []
        index, events, item = len(self.items), [], w.item()
        self.items.append(item)
        if w.type != "function_call":
            kind = "output_text" if w.type == "message" else "reasoning_text"
            events.append(self._part_event(f"{kind}.done", w, index, text=w.text))
            events.append(self._part_event("content_part.done", w, index, part=w.part()))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=w.id,
                    output_index=index,
                    arguments=w.text,
                    name=w.name,
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _text(self, kind: Literal["message", "reasoning"], text: str) -> list[str]:
        events = []
        if self.open is None or self.open.type != kind:
            events += self._begin(_Writing(kind, _id("msg" if kind == "message" else "rs")))
        assert self.open is not None
        self.open.text += text
        name = "output_text" if kind == "message" else "reasoning_text"
        extra: JSONObject = {"logprobs": []} if kind == "message" else {}
        events.append(
            self.event(
                f"response.{name}.delta",
                item_id=self.open.id,
                output_index=len(self.items),
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def delta(self, d: Delta) -> list[str]:
        events: list[str] = []
        for e in self.answer.feed(d):
            if isinstance(e, answer.Reasoning):
                events += self._text("reasoning", e.text)
            elif isinstance(e, tools.Content):
                events += self._text("message", e.text) if e.text else []
            elif isinstance(e, tools.CallStart):
                events += self._begin(_Writing("function_call", _id("fc"), e.id, e.name))
            elif self.open is not None:
                self.open.text += e.text
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self.open.id,
                        output_index=len(self.items),
                        delta=e.text,
                    )
                )
        if d.finish_reason is not None:
            if self.open is not None:
                self.open.status = "completed"
            events += self._end()
            status = "incomplete" if d.finish_reason == "length" else "completed"
            response = self.final(status, self.items, d.index)
            events.append(
                self.event(
                    f"response.{'incomplete' if status == 'incomplete' else 'completed'}", response=response
                )
            )
        return events


# -- routes ------------------------------------------------------------------------------------------
@router.post("/v1/responses", tags=["OpenAI"])
async def create_response(request: Request, body: ResponseRequest) -> Response:
    created, rid = int(time.time()), _id("resp")
    ex = Exchange(request, refusals=(OpenAIError,))
    st = ex.st
    with ex.refused():
        st.check_model(body.model)
        messages = conversation(body, store_of(request))
        chat = to_chat(body, messages)
    with renamed(PARAMS):
        reqs, tool_style = await chat_requests(ex, chat)
    model = st.adapter_of(body.model) or st.config.model_id
    style, prompt = st.config.reasoning_parser, reqs[0].input_length

    def final(status: str, items: list[JSONObject], generated: int, cached: int) -> JSONObject:
        """`cached`: the prompt tokens the prefix cache served."""
        response = response_json(body, rid, created, model, status, items, (prompt, generated, cached))
        if body.store is not False:
            store_of(request).put(response, msgspec.to_builtins([*messages, _assistant_turn(items)]))
        return response

    if not body.stream:
        [g] = await ex.generate(reqs)
        status = "incomplete" if g.output.finish_reason == "length" else "completed"
        items = output_items(g.output, tool_style, style)
        return JSONResponse(final(status, items, len(g.output.tokens), g.output.num_cached_tokens))
    [stream] = ex.streams(reqs)
    events = ResponseStream(
        lambda status, items, n: final(status, items, n, stream.output.num_cached_tokens), tool_style, style
    )
    start = events.start(response_json(body, rid, created, model, "in_progress", [], None))
    return ex.sse([stream], lambda _, d: events.delta(d), lambda exc: _error_event(events, exc), start=start)


def _error_event(events: ResponseStream, exc: InferError) -> str:
    err = as_openai_error(exc)
    return events.event("error", code=err.code, message=err.message, param=None)


@router.get("/v1/responses/{rid}", tags=["OpenAI"])
async def get_response(request: Request, rid: str) -> JSONResponse:
    stored = store_of(request).get(rid)
    if stored is None:
        raise OpenAIError(
            404, f"Response with id '{rid}' not found", "invalid_request_error", "response_id", "not_found"
        )
    return JSONResponse(stored[0])
