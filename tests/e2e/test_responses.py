"""OpenAI's Responses API with the official `openai` SDK against a real server: text equal to the chat
route's (one request path), streamed with the SDK's own event accumulator, previous_response_id and
GET from the store, function calls streamed and not and their outputs sent back, structured output."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 20}},
    },
}


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_text_equals_chat_and_streams_as_the_sdk_expects(client):
    want = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        max_tokens=200,
        temperature=0,
    )
    r = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Say hi.", max_output_tokens=200, temperature=0
    )
    assert r.status == "completed" and r.output_text == want.choices[0].message.content
    assert (
        r.usage.input_tokens == want.usage.prompt_tokens
        and r.usage.output_tokens == want.usage.completion_tokens
    )
    with client.responses.stream(
        model=MODEL, instructions="Be brief.", input="Say hi.", max_output_tokens=200, temperature=0
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and final.output_text == r.output_text
    cut = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_and_retrieve(client):
    first = client.responses.create(
        model=MODEL, input="What is the capital of France?", max_output_tokens=16, temperature=0
    )
    second = client.responses.create(
        model=MODEL, input="And of Italy?", previous_response_id=first.id, max_output_tokens=16, temperature=0
    )
    history = client.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        temperature=0,
        messages=[
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Italy?"},
        ],
    )
    assert second.output_text == history.choices[0].message.content
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=2)


def test_function_calls_streamed_and_not_and_outputs_sent_back(client):
    kw = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    r = client.responses.create(**kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert deltas and json.loads("".join(deltas)) == json.loads(call.arguments)
    assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments) == json.loads(
        call.arguments
    )
    answer = client.responses.create(
        model=MODEL,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=20,
        temperature=0,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"},
        ],
    )
    assert answer.output_text and answer.output[0].type == "message"


def test_structured_output(client):
    person = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age"],
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
    }
    r = client.responses.create(
        model=MODEL,
        input="Describe a person.",
        max_output_tokens=80,
        temperature=0.7,
        text={"format": {"type": "json_schema", "name": "person", "schema": person}},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), person)


@pytest.mark.parametrize(
    "kw",
    [
        dict(input=[{"role": "wizard", "content": "hi"}]),
        dict(input=[{"type": "input_image", "image_url": "x"}]),
        dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
        dict(input="hi", tools=[{"type": "web_search"}]),
        dict(input="hi", max_output_tokens=100_000),
        dict(input="hi", text={"format": {"type": "yaml"}}),
    ],
)
def test_bad_requests(client, kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **kw)
    assert e.value.body["type"] == "invalid_request_error"


def test_usage_says_what_the_prefix_cache_served(client):
    """Responses' usage.input_tokens_details.cached_tokens: the prompt tokens the prefix cache served,
    streamed or not (it was always 0)."""
    instructions = "You answer questions about the weather. " * 12  # several full KV blocks
    ask = dict(
        model=MODEL, instructions=instructions, input="Rain in Paris?", max_output_tokens=2, temperature=0
    )
    client.responses.create(**ask)
    again = client.responses.create(
        **ask, prompt_cache_key="conversation-1"
    )  # taken (one engine: no routing)
    cached = again.usage.input_tokens_details.cached_tokens
    assert 64 <= cached < again.usage.input_tokens
    with client.responses.stream(**ask) as stream:
        last = [e for e in stream][-1]  # cut by max_output_tokens: response.incomplete
    assert last.type == "response.incomplete"
    assert last.response.usage.input_tokens_details.cached_tokens == cached
