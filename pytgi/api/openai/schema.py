"""OpenAI's request bodies, the rules only OpenAI's API has, and the conversion of a body into the
router's `GenerateInput` (as TGI's `try_into_generate` does), so that every rule the two APIs share is
checked once, by `pytgi.api.frontend.validation`. No torch here.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pytgi.api.frontend.bodies import (
    F32,
    I32,
    I64,
    U32,
    Bool,
    GenerateInput,
    GenerateParameters,
    GrammarType,
    ValidRequest,
)
from pytgi.api.frontend.media import ImageRef
from pytgi.api.openai.error_shape import OpenAIError, invalid
from pytgi.core.errors import InvalidRequest

MAX_N = 8  # choices per prompt
MAX_COMPLETION_LOGPROBS = 20  # as chat's top_logprobs (OpenAI's legacy bound was 5; vLLM allows 20)
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's bound for `top_logprobs`
MODEL_ALIASES = ("", "tgi")  # also served: what TGI's OpenAI routes accept
ROLES = {"system", "user", "assistant", "tool", "function", "developer"}
ReasoningEffort = Literal["low", "medium", "high"]  # what gpt-oss's template and training know


# -- request bodies --------------------------------------------------------------------------------
class _Body(BaseModel):
    # Unknown fields are ignored: OpenAI clients send many (metadata, store, parallel_tool_calls, ...).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (one of them)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingBody(_Body):
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
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false}
    reasoning_effort: ReasoningEffort | None = None  # → the chat template's `reasoning_effort` (gpt-oss's)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables besides messages and tools: `chat_template_kwargs`, and
        `reasoning_effort` when given (gpt-oss's template writes it: `Reasoning: low`)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    @property
    def max_new_tokens(self) -> tuple[int | None, str]:
        """The completion's length bound and the field it came from."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# -- OpenAI's own rules ----------------------------------------------------------------------------
def check_model(model: str | None, served: str, adapters: Collection[str] = ()) -> None:
    """`model` names the served model (or an alias of it) or one of its LoRA adapters."""
    if not (model is None or model in MODEL_ALIASES or model == served or model in adapters):
        also = "".join(f", `{a}`" for a in sorted(adapters))
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist: this server serves `{served}`{also}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


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


def check_chat(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The chat route's own rules; returns the messages for the chat template."""
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    return messages_for_template(body.messages)


def messages_for_template(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template: text parts joined; `developer` is the system role."""
    if not messages:
        raise invalid("`messages` cannot be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise invalid(
                f"`messages[{i}].role` must be one of {sorted(ROLES)}. Given: {m.role!r}",
                f"messages.[{i}].role",
            )
        d = m.model_dump(exclude_none=True)
        if m.role == "developer":
            d["role"] = "system"
        if isinstance(m.content, list):
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(m.content):
                where = f"messages.[{i}].content.[{j}]"
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text or ""})
                elif part.type == "image_url":
                    image = getattr(part, "image_url", None)
                    url = image.get("url") if isinstance(image, dict) else image
                    if not isinstance(url, str) or not url:
                        raise invalid("an `image_url` part needs `image_url.url`", f"{where}.image_url")
                    parts.append({"type": "image", IMAGE_REF: ImageRef(url, f"{where}.image_url")})
                else:
                    raise invalid(
                        f"content parts of type `{part.type}` are not supported: only `text` and "
                        "`image_url` parts are",
                        f"{where}.type",
                    )
            has_image = any(p["type"] == "image" for p in parts)
            # text alone is joined, as every template takes; with images the template gets the parts
            d["content"] = parts if has_image else "\n".join(p["text"] for p in parts)
        out.append(d)
    return out


IMAGE_REF = "_pytgi_image"  # an image part's reference, taken out (`take_images`) before the template


def take_images(messages: list[dict[str, Any]]) -> list[ImageRef]:
    """The image parts' references in prompt order, removed from the parts (the template sees
    `{"type": "image"}`)."""
    refs: list[ImageRef] = []
    for m in messages:
        if isinstance(m.get("content"), list):
            for part in m["content"]:
                if IMAGE_REF in part:
                    refs.append(part.pop(IMAGE_REF))
    return refs


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
    so = body.structured_outputs
    for kind, value, field in [
        ("json", so and so.json_, "structured_outputs"),
        ("regex", so and so.regex, "structured_outputs"),
        ("choice", so and so.choice, "structured_outputs"),
        ("grammar", so and so.grammar, "structured_outputs"),
        ("json", body.guided_json, "guided_json"),
        ("regex", body.guided_regex, "guided_regex"),
        ("choice", body.guided_choice, "guided_choice"),
        ("grammar", body.guided_grammar, "guided_grammar"),
    ]:
        if value is not None:
            given.append((GrammarType(type=kind, value=value), field))  # type: ignore[arg-type]
    if len(given) > 1:
        raise invalid(
            "give one structured-output constraint, not several: " + ", ".join(field for _, field in given),
            given[1][1],
        )
    return given[0] if given else (None, "response_format")


# -- into the router's request ---------------------------------------------------------------------
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
    temperature = 1.0 if body.temperature is None else body.temperature
    top_k = None if body.top_k in (None, 0, -1) else body.top_k
    params = GenerateParameters.model_construct(
        temperature=temperature if temperature != 0 else None,
        do_sample=temperature != 0,
        top_p=None if body.top_p in (None, 1.0) else body.top_p,
        top_k=top_k,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        max_new_tokens=max_new_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        seed=None if body.seed is None else body.seed % 2**64,  # OpenAI's int64 seeds into the engine's u64
        top_n_tokens=top_n,
        decoder_input_details=prompt_logprobs,
        ignore_eos_token=bool(body.ignore_eos),
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
        stream=bool(body.stream),
        add_special_tokens=add_special_tokens,
        include_stop_str_in_output=False,
        max_top_n_tokens=max_top_n,
        min_p=body.min_p,
        logit_bias=logit_bias(body),
        cache_key=body.prompt_cache_key,
    )


def as_openai(exc: InvalidRequest, names: dict[str, str]) -> OpenAIError:
    """A shared rule's refusal, naming OpenAI's field (`names`: TGI's name → the body's)."""
    param = names.get(exc.param or "", exc.param)
    return invalid(exc.message, param, exc.code)


def choices(req: ValidRequest, n: int, seed: int | None) -> list[ValidRequest]:
    """n engine requests for n choices: a given seed becomes seed + choice, so each is reproducible;
    without one each sampled choice draws its own."""
    out = [req]
    for i in range(1, n):
        other = copy.copy(req)
        other.sampling = copy.copy(req.sampling)
        if req.sampling.sampling:
            other.sampling.seed = random.getrandbits(63) if seed is None else (seed + i) % 2**64
        out.append(other)
    return out
