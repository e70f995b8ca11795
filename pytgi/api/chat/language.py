"""The API side's own chat language: what a chat request asks for, whichever API it came through.

OpenAI's chat completions, OpenAI's Responses and Anthropic's Messages each translate their body into
a `ChatRequest` (each API's `to_chat`); `pytgi.api.chat.requests.chat_requests` turns that into the
router's requests, and each API renders what comes back (`pytgi.api.chat.answer`) in its own shapes.
Nothing here imports an API's module: the arrow runs from each API into this language, never back.

Refusals on the chat side are `pytgi.core.errors.InvalidRequest`s whose `param` is a field of the
`ChatRequest` (`messages`, `max_tokens`, `top_logprobs`, `tool_choice`, `tools`, `tools.<i>.name`,
`constraint`, or a sampling field's name); each API maps it to its own field's name (`renamed`) and
answers in its own error shape. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Literal

import msgspec

from pytgi.api.frontend.bodies import GenerateInput, GenerateParameters, GrammarType
from pytgi.api.frontend.media import ImageRef
from pytgi.api.json_response import JSONObject
from pytgi.core.errors import InvalidRequest

Role = Literal["system", "user", "assistant", "tool", "function"]  # "function": OpenAI's legacy results
ReasoningEffort = Literal["low", "medium", "high"]  # what gpt-oss's template and training know
MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's bound, and vLLM's)


# -- the conversation ------------------------------------------------------------------------------
class Text(msgspec.Struct, frozen=True, tag="text"):
    text: str


class Image(msgspec.Struct, frozen=True, tag="image"):
    """An image: its URL (data: or http(s):) and the request field that gave it (for refusals)."""

    url: str
    where: str

    @property
    def ref(self) -> ImageRef:
        return ImageRef(self.url, self.where)


Part = Text | Image


class Call(msgspec.Struct, frozen=True):
    """A tool call the assistant made earlier in the conversation."""

    name: str
    arguments: str = "{}"  # JSON text (a chat template gets it as data where it parses)
    id: str | None = None


class Message(msgspec.Struct):
    """One turn. `content`: text, or parts in order where the turn holds an image (text parts alone
    are joined with newlines for the template); `calls`: an assistant's tool calls; `call_id`: the
    call a tool result answers; `fields`: what else the client gave the turn that a chat template may
    read (OpenAI's `name`, `reasoning_content`, ...)."""

    role: Role
    content: str | list[Part] | None = None
    calls: list[Call] = []
    call_id: str | None = None
    fields: JSONObject = {}


# -- tools -----------------------------------------------------------------------------------------
class Function(msgspec.Struct, frozen=True):
    """A tool the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str | None
    parameters: JSONObject

    def as_tool(self) -> JSONObject:
        """The tool object as chat templates take it: a description always (empty when the request
        gave none), since templates such as gpt-oss's read it unconditionally."""
        fn: JSONObject = {
            "name": self.name,
            "description": self.description or "",
            "parameters": self.parameters,
        }
        return {"type": "function", "function": fn}


class Named(msgspec.Struct, frozen=True):
    """A tool choice that forces a call of this function."""

    name: str


# "none": no tools offered; "auto": text or calls, the model's choice; "required": at least one call
ToolChoice = Literal["auto", "none", "required"] | Named


# -- sampling --------------------------------------------------------------------------------------
class Sampling(msgspec.Struct):
    """What every API's sampling fields translate to; None: not given. Temperature 0 is greedy and
    None is 1 (the chat APIs' default); top_p 1 and top_k 0 or -1 turn them off."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: list[str] = []
    seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id → bias
    ignore_eos: bool = False

    def to_input(
        self,
        inputs: str | list[int],
        top_n: int | None,
        max_top_n: int,
        *,
        stream: bool = False,
        prompt_logprobs: bool = False,
        add_special_tokens: bool = True,
        grammar: GrammarType | None = None,
        adapter: str | None = None,
        cache_key: str | None = None,
    ) -> GenerateInput:
        """The router's request (as TGI's `try_into_generate` converts OpenAI's): the stop text is
        cut; `top_n`: alternatives per token (None: no logprobs), at most `max_top_n`."""
        temperature = 1.0 if self.temperature is None else self.temperature
        params = GenerateParameters.model_construct(
            temperature=temperature if temperature != 0 else None,
            do_sample=temperature != 0,
            top_p=None if self.top_p in (None, 1.0) else self.top_p,
            top_k=None if self.top_k in (None, 0, -1) else self.top_k,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            max_new_tokens=self.max_tokens,
            stop=list(self.stop),
            seed=None if self.seed is None else self.seed % 2**64,  # int64 seeds into the engine's u64
            top_n_tokens=top_n,
            decoder_input_details=prompt_logprobs,
            ignore_eos_token=self.ignore_eos,
            best_of=None,
            typical_p=None,
            return_full_text=None,
            truncate=None,
            watermark=False,
            details=True,
            grammar=grammar,
            adapter_id=adapter,
        )
        return GenerateInput(
            inputs,
            params,
            stream=stream,
            add_special_tokens=add_special_tokens,
            include_stop_str_in_output=False,
            max_top_n_tokens=max_top_n,
            min_p=self.min_p,
            logit_bias=self.logit_bias,
            cache_key=cache_key,
        )


# -- the request -----------------------------------------------------------------------------------
class ChatRequest(msgspec.Struct):
    """A chat request in the API side's own terms.

    `top_logprobs`: logprobs with this many alternatives per token (None: no logprobs). `tools`: the
    functions offered; `tool_choice` None: not given ("auto" where there are tools). `constraint`:
    what the answer must match (a JSON schema, a regex, ...). `thinking` (the template's
    `enable_thinking`, Qwen3's switch), `reasoning_effort` (gpt-oss's) and `chat_template_kwargs`
    (vLLM's: any variable) reach the chat template. `model`: the served model's name or a LoRA
    adapter's. `cache_key`: the replica router's affinity key. `cache_marks`: (messages, seconds)
    pins, each of the prompt up to the end of its first messages (Anthropic's `cache_control`)."""

    messages: list[Message]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    n: int = 1
    top_logprobs: int | None = None
    tools: list[Function] = []
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    constraint: GrammarType | None = None
    thinking: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: JSONObject = {}
    stream: bool = False
    model: str | None = None
    cache_key: str | None = None
    cache_marks: list[tuple[int, float]] = []

    @property
    def template_kwargs(self) -> JSONObject:
        """The chat template's variables besides messages and tools: `chat_template_kwargs`, then
        `enable_thinking` and `reasoning_effort` where given (gpt-oss's template writes it:
        `Reasoning: low`)."""
        kwargs = dict(self.chat_template_kwargs)
        if self.thinking is not None:
            kwargs["enable_thinking"] = self.thinking
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs


# -- refusals --------------------------------------------------------------------------------------
@contextmanager
def renamed(names: Mapping[str, str] | Callable[[str], str]) -> Iterator[None]:
    """An `InvalidRequest` raised inside, its `param` given in other words: from the router's names
    into the chat request's (`chat_requests`), or from the chat request's into an API's own."""
    rename = names if callable(names) else (lambda param: names.get(param, param))
    try:
        yield
    except InvalidRequest as exc:
        if exc.param is not None:
            exc.param = rename(exc.param)
        raise
