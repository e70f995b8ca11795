"""OpenAI's request bodies, the rules only OpenAI's API has, and their translation: a chat body into
the chat request every chat API speaks (`to_chat`, `pytgi.api.chat.language`), a completion body into
the router's `GenerateInput` (as TGI's `try_into_generate` does), so that every rule the APIs share is
checked once, by `pytgi.api.frontend.validation`. No torch here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pytgi.api.chat.constraints import StructuredFields, one
from pytgi.api.chat.language import (
    MAX_TOP_LOGPROBS,
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
)
from pytgi.api.frontend.bodies import F32, I32, I64, U32, Bool, GenerateInput, GrammarType
from pytgi.api.json_response import JSONObject
from pytgi.api.openai.error_shape import invalid

MAX_N = 8  # choices per prompt
MAX_COMPLETION_LOGPROBS = 20  # as chat's top_logprobs (OpenAI's legacy bound was 5; vLLM allows 20)
MAX_CHAT_TOP_LOGPROBS = MAX_TOP_LOGPROBS  # OpenAI's bound for `top_logprobs`
# each role a message may have, and the chat request's (`developer` is the system role)
ROLES: dict[str, Role] = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "function",
    "developer": "system",
}


# -- request bodies --------------------------------------------------------------------------------
class _Body(BaseModel):
    # Unknown fields are ignored: OpenAI clients send many (metadata, store, parallel_tool_calls, ...).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: JSONObject | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingBody(_Body, StructuredFields):
    model: str | None = None
    # OpenAI's: requests that share it (and their prompt's start) go to the same engine replica
    prompt_cache_key: str | None = None
    max_tokens: U32 | None = None
    temperature: F32 | None = None
    top_p: F32 | None = None
    n: U32 | None = None
    stop: str | list[str] | None = None
    seed: I64 | None = None
    presence_penalty: F32 | None = None
    frequency_penalty: F32 | None = None
    logit_bias: dict[str, F32] | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # extensions (vLLM / TGI)
    top_k: I32 | None = None
    min_p: F32 | None = None
    repetition_penalty: F32 | None = None
    ignore_eos: Bool | None = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: U32 | None = None
    echo: Bool | None = False
    best_of: U32 | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, ... reach the template
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: U32 | None = None
    logprobs: Bool | None = False
    top_logprobs: U32 | None = None
    tools: list[JSONObject] | None = None
    tool_choice: str | JSONObject | None = None
    parallel_tool_calls: Bool | None = None
    chat_template_kwargs: JSONObject | None = None  # vLLM's: e.g. {"enable_thinking": false}
    reasoning_effort: ReasoningEffort | None = None  # → the chat template's `reasoning_effort` (gpt-oss's)

    @property
    def max_new_tokens(self) -> tuple[int | None, str]:
        """The completion's length bound and the field it came from."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# -- OpenAI's own rules ----------------------------------------------------------------------------
def check_sampling(body: SamplingBody) -> int:
    """The rules TGI's parameters have no counterpart for; returns n."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise invalid(f"`n` must be >= 1 and <= {MAX_N}. Given: {n}", "n")
    if body.temperature is not None and body.temperature > 2.0:
        raise invalid(f"`temperature` must be >= 0 and <= 2. Given: {body.temperature}", "temperature")
    return n


def logit_bias(body: SamplingBody) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as strings) as the engine's; its range rule is the engine's."""
    if not body.logit_bias:
        return None
    out = {}
    for key, bias in body.logit_bias.items():
        if not key.strip().isdigit():
            raise invalid(f"`logit_bias` keys must be token ids. Given: {key!r}", "logit_bias")
        out[int(key)] = float(bias)
    return out


def check_completion(body: CompletionRequest) -> list[str | list[int]]:
    """The completion route's own rules; returns the prompts."""
    if body.best_of is not None and body.best_of not in (1, body.n or 1):
        raise invalid("`best_of` other than `n` is not supported", "best_of")
    if body.suffix:
        raise invalid("`suffix` is not supported", "suffix")
    if body.echo and body.logprobs is not None and body.stream:
        raise invalid("`echo` with `logprobs` is not supported when streaming", "echo")
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("`prompt` cannot be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def constraint(body: SamplingBody) -> tuple[GrammarType | None, str]:
    """What the output must match, as the router's grammar, and the field that asked for it: OpenAI's
    `response_format`, or vLLM's `structured_outputs` / `guided_*`."""
    given: list[tuple[GrammarType, str]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        given.append((GrammarType(type="json", value={"type": "object"}), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise invalid(
                "`response_format` of type `json_schema` needs `json_schema.schema`", "response_format"
            )
        given.append((GrammarType(type="json", value=rf.json_schema.schema_), "response_format"))
    return one(given + body.structured_constraints(), "response_format")


def sampling(body: SamplingBody, max_tokens: int | None) -> Sampling:
    """The body's sampling fields, in the chat request's terms."""
    return Sampling(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        seed=body.seed,
        logit_bias=logit_bias(body),
        ignore_eos=bool(body.ignore_eos),
    )


# -- a chat body into the chat request -------------------------------------------------------------
def _parts(content: list[ContentPart], i: int) -> list[Part]:
    parts: list[Part] = []
    for j, part in enumerate(content):
        where = f"messages.[{i}].content.[{j}]"
        if part.type == "text":
            parts.append(Text(part.text or ""))
        elif part.type == "image_url":
            image = (part.model_extra or {}).get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url:
                raise invalid("an `image_url` part needs `image_url.url`", f"{where}.image_url")
            parts.append(Image(url, f"{where}.image_url"))
        else:
            raise invalid(
                f"content parts of type `{part.type}` are not supported: only `text` and `image_url` "
                "parts are",
                f"{where}.type",
            )
    return parts


def _calls(given: object, i: int) -> list[Call]:
    """An assistant message's `tool_calls` (arguments as JSON text, as OpenAI sends them)."""
    if given is None:
        return []
    if not isinstance(given, list) or not all(isinstance(c, dict) for c in given):
        raise invalid(
            f"`messages[{i}].tool_calls` must be a list of tool calls", f"messages.[{i}].tool_calls"
        )
    calls = []
    for c in given:
        fn = c.get("function")
        fn = fn if isinstance(fn, dict) else {}
        name, args, call_id = fn.get("name"), fn.get("arguments"), c.get("id")
        if not isinstance(args, str):
            args = json.dumps({} if args is None else args, ensure_ascii=False)
        calls.append(
            Call(name if isinstance(name, str) else "", args, None if call_id is None else str(call_id))
        )
    return calls


def chat_messages(messages: list[ChatMessage]) -> list[Message]:
    """The messages in the chat request's terms: `developer` is the system role, and the fields the
    chat request does not name (`name`, ...) go to the template as they are."""
    out = []
    for i, m in enumerate(messages):
        role = ROLES.get(m.role)
        if role is None:
            raise invalid(
                f"`messages[{i}].role` must be one of {sorted(ROLES)}. Given: {m.role!r}",
                f"messages.[{i}].role",
            )
        fields = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
        calls = _calls(fields.pop("tool_calls", None), i)
        call_id = fields.pop("tool_call_id") if isinstance(fields.get("tool_call_id"), str) else None
        content = _parts(m.content, i) if isinstance(m.content, list) else m.content
        out.append(Message(role, content, calls, call_id, fields))
    return out


def _functions(tools: list[JSONObject]) -> list[Function]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise invalid(f'`tools[{i}]` must be {{"type": "function", "function": {{...}}}}', f"tools.[{i}]")
        name = fn.get("name")
        if not isinstance(name, str):
            raise invalid(
                f"`tools[{i}].function.name` must be a string. Given: {name!r}", f"tools.[{i}].function.name"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid(
                f"`tools[{i}].function.parameters` must be a JSON schema object",
                f"tools.[{i}].function.parameters",
            )
        desc = fn.get("description")
        out.append(Function(name, desc if isinstance(desc, str) else None, params))
    return out


def _tool_choice(tool_choice: str | JSONObject | None) -> ToolChoice | None:
    if tool_choice is None:
        return None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise invalid(
                f'`tool_choice` must be "none", "auto", "required" or a named function. '
                f"Given: {tool_choice!r}",
                "tool_choice",
            )
        return tool_choice  # type: ignore[return-value]
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid(
            'a named `tool_choice` must be {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    return Named(name)


_TOOL_FIELD = re.compile(r"tools\.(\d+)\.(\w+)")


def chat_param(names: Mapping[str, str]) -> Callable[[str], str]:
    """OpenAI's name for a chat request's field (`names`: those that depend on the body)."""

    def param(name: str) -> str:
        tool = _TOOL_FIELD.fullmatch(name)
        if tool is not None:
            return f"tools.[{tool[1]}].function.{tool[2]}"
        return names.get(name, name)

    return param


def to_chat(body: ChatCompletionRequest, n: int = 1) -> tuple[ChatRequest, Callable[[str], str]]:
    """The chat request an OpenAI chat body asks for (OpenAI's own rules checked on the way), and
    OpenAI's name for each of its fields (for `param`)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    messages = chat_messages(body.messages)
    grammar, grammar_field = constraint(body)
    max_tokens, max_tokens_field = body.max_new_tokens
    chat = ChatRequest(
        messages,
        sampling(body, max_tokens),
        n=n,
        top_logprobs=body.top_logprobs if body.logprobs else None,
        tools=_functions(body.tools or []),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        constraint=grammar,
        reasoning_effort=body.reasoning_effort,
        chat_template_kwargs=dict(body.chat_template_kwargs or {}),
        stream=bool(body.stream),
        model=body.model,
        cache_key=body.prompt_cache_key,
    )
    return chat, chat_param({"max_tokens": max_tokens_field, "constraint": grammar_field})


# -- a completion body into the router's request ---------------------------------------------------
def to_input(
    body: SamplingBody,
    inputs: str | list[int],
    max_new_tokens: int | None,
    top_n: int | None,
    max_top_n: int,
    prompt_logprobs: bool = False,
    add_special_tokens: bool = True,
    grammar: GrammarType | None = None,
    adapter: str | None = None,
) -> GenerateInput:
    """TGI's parameters for an OpenAI body: temperature 0 is greedy, any other samples (OpenAI's default
    temperature is 1); top_p 1 and top_k 0 / -1 disable them; the stop text is cut."""
    return sampling(body, max_new_tokens).to_input(
        inputs,
        top_n,
        max_top_n,
        stream=bool(body.stream),
        prompt_logprobs=prompt_logprobs,
        add_special_tokens=add_special_tokens,
        grammar=grammar,
        adapter=adapter,
        cache_key=body.prompt_cache_key,
    )
