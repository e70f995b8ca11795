"""The chat language every chat API translates into (pytgi.api.chat.language): one conversation asked
through OpenAI's chat completions, the Responses API and Anthropic's Messages is one chat request;
each API names the chat request's fields its own way in refusals; a stored conversation reads back
as it was; and the chat request's own rules (tools, the prompt) refuse naming its fields."""

from __future__ import annotations

import json

import msgspec
import pytest

from pytgi.api import anthropic
from pytgi.api.chat import tools
from pytgi.api.chat.language import Call, ChatRequest, Image, Message, Text, renamed
from pytgi.api.chat.requests import ROUTER_NAMES
from pytgi.api.openai import responses, schema
from pytgi.core.errors import InvalidRequest

ARGS = json.dumps({"city": "Paris"})
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def openai_chat() -> ChatRequest:
    body = schema.ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": ARGS}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18C"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "then?"}],
                },
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "w", "description": "Weather", "parameters": SCHEMA},
                }
            ],
            "tool_choice": "required",
            "max_completion_tokens": 8,
            "temperature": 0.5,
            "stop": "x",
        }
    )
    return schema.to_chat(body)[0]


def responses_chat() -> ChatRequest:
    body = responses.ResponseRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather?"},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": ARGS},
                {"type": "function_call_output", "call_id": "c1", "output": "18C"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "And"},
                        {"type": "input_text", "text": "then?"},
                    ],
                },
            ],
            "tools": [{"type": "function", "name": "w", "description": "Weather", "parameters": SCHEMA}],
            "tool_choice": "required",
            "max_output_tokens": 8,
            "temperature": 0.5,
        }
    )
    return responses.to_chat(body, responses.input_messages(body.input))


def anthropic_chat() -> ChatRequest:
    body = anthropic.MessagesRequest.model_validate(
        {
            "model": "m",
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "c1", "name": "w", "input": {"city": "Paris"}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "c1", "content": "18C"},
                        {"type": "text", "text": "And"},
                        {"type": "text", "text": "then?"},
                    ],
                },
            ],
            "tools": [{"name": "w", "description": "Weather", "input_schema": SCHEMA}],
            "tool_choice": {"type": "any"},
            "max_tokens": 8,
            "temperature": 0.5,
            "stop_sequences": ["x"],
        }
    )
    return anthropic.to_chat(body)


def test_one_conversation_through_each_api_is_one_chat_request() -> None:
    o, r, a = openai_chat(), responses_chat(), anthropic_chat()
    template = [tools.template_messages(c.messages, None, "hermes")[0] for c in (o, r, a)]
    assert template[0] == template[1] == template[2]
    assert template[0][-1] == {"role": "user", "content": "And\nthen?"}  # text parts joined
    assert o.messages[2].calls == [Call("w", ARGS, "c1")] and o.messages[3].call_id == "c1"
    assert o.tools == r.tools == a.tools and o.tools[0].parameters == SCHEMA
    assert o.tool_choice == r.tool_choice == a.tool_choice == "required"
    assert o.parallel_tool_calls and r.parallel_tool_calls and a.parallel_tool_calls
    assert o.sampling.max_tokens == r.sampling.max_tokens == a.sampling.max_tokens == 8
    assert o.sampling.temperature == r.sampling.temperature == a.sampling.temperature == 0.5
    assert o.sampling.stop == a.sampling.stop == ["x"]


def test_each_api_names_the_chat_requests_fields_its_own() -> None:
    """A refusal names the chat request's field; each API's routes name it as their body does."""
    body = schema.ChatCompletionRequest.model_validate(
        {"messages": [], "max_completion_tokens": 5, "guided_regex": "a+"}
    )
    _, openai_param = schema.to_chat(body)
    fields = ["max_tokens", "constraint", "tools.2.name", "messages", "top_logprobs", "temperature"]
    assert [openai_param(f) for f in fields] == [
        "max_completion_tokens",
        "guided_regex",
        "tools.[2].function.name",
        "messages",
        "top_logprobs",
        "temperature",
    ]
    # the router's name, into the chat request's, into OpenAI's and the Responses API's
    for names, want in [(openai_param, "max_completion_tokens"), (responses.PARAMS, "max_output_tokens")]:
        with pytest.raises(InvalidRequest) as e, renamed(names), renamed(ROUTER_NAMES):
            raise InvalidRequest("`max_new_tokens` must be > 0", "max_new_tokens")
        assert e.value.param == want


def test_a_stored_conversation_reads_back_as_it_was() -> None:
    """The Responses API keeps conversations as JSON (bounded by their bytes) and reads them back."""
    messages = [
        Message("system", "Be brief."),
        Message(
            "user",
            [Text("What is this?"), Image("data:image/png;base64,AAAA", "input.0.content.1.image_url")],
        ),
        Message("assistant", None, [Call("w", ARGS, "c1")]),
        Message("tool", "18C", call_id="c1"),
        Message("user", "hi", fields={"name": "u"}),
    ]
    stored = msgspec.to_builtins(messages)
    json.dumps(stored)  # plain JSON
    assert msgspec.convert(stored, list[Message]) == messages


def test_the_chat_requests_rules_name_its_fields() -> None:
    with pytest.raises(InvalidRequest) as e:
        tools.plan([], "required", True, None)
    assert e.value.param == "tool_choice"
    body = anthropic.MessagesRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "output_format": {"type": "json_schema", "schema": SCHEMA},
            "guided_regex": "a+",
        }
    )
    with pytest.raises(InvalidRequest) as e:
        anthropic.to_chat(body)  # two constraints: the second named
    assert e.value.param == "guided_regex"
