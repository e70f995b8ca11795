"""Anthropic's Messages API with the official `anthropic` SDK against a real server: text equal to the
OpenAI chat route's (one request path), streamed and not, stop sequences, tools (forced and streamed
as `input_json_delta`s, results sent back), count_tokens, errors in Anthropic's shape, x-api-key."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.server import Server

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments now; the API still takes them
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "unit"],
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
    },
}


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_text_equals_the_chat_route_streamed_and_not(client, oai):
    want = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, *ASK],
        max_tokens=12,
        extra_body=GREEDY,
    )
    r = client.messages.create(
        model=MODEL, system="Be brief.", messages=ASK, max_tokens=12, extra_body=GREEDY
    )
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want.choices[0].message.content
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 12
    # Anthropic's input_tokens leave out what the prefix cache served (the chat request's prompt)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert r.usage.cache_creation_input_tokens == 0
    with client.messages.stream(
        model=MODEL,
        system=[{"type": "text", "text": "Be brief."}],
        messages=ASK,
        max_tokens=12,
        extra_body=GREEDY,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == r.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12


def test_stop_sequences_and_end_turn(client):
    r = client.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from 1 to 10."}],
        max_tokens=60,
        extra_body=GREEDY,
        stop_sequences=["4"],
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "4" and "4" not in r.content[0].text
    r = client.messages.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=200, extra_body=GREEDY
    )
    assert r.stop_reason == "end_turn"


def test_forced_tool_use_streamed_and_not(client):
    r = client.messages.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=100,
        extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=100,
        extra_body=GREEDY,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert json.loads("".join(d.partial_json for d in deltas)) == call.input
    assert final.stop_reason == "tool_use" and final.content[-1].input == call.input


def test_tool_results_go_back(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": '{"temperature": 18, "sky": "clear"}',
                }
            ],
        },
    ]
    r = client.messages.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        max_tokens=30,
        extra_body=GREEDY,
        tool_choice={"type": "none"},
    )
    assert r.content and r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens")


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
    r = client.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=80,
        output_config={"format": {"type": "json_schema", "schema": person}},
    )
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), person)


def test_count_tokens_is_the_prompt_messages_would_take(client):
    r = client.messages.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=GREEDY)
    n = client.messages.count_tokens(model=MODEL, messages=ASK)
    assert n.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])
    assert with_tools.input_tokens > n.input_tokens


@pytest.mark.parametrize(
    "kw, error",
    [
        (dict(extra_body={"temperature": 1.5}), anthropic.BadRequestError),  # Anthropic's range is 0..1
        (dict(max_tokens=0), anthropic.BadRequestError),
        (dict(messages=[]), anthropic.BadRequestError),
        (
            dict(
                messages=[
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
                ]
            ),
            anthropic.BadRequestError,
        ),
        (dict(max_tokens=100_000), anthropic.BadRequestError),
        (dict(model="claude-nope"), anthropic.NotFoundError),
        (dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), anthropic.BadRequestError),
    ],
)
def test_errors_are_anthropics(client, kw, error):
    with pytest.raises(error) as e:
        client.messages.create(**{"model": MODEL, "messages": ASK, "max_tokens": 4, **kw})
    body = e.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]


def test_x_api_key(tmp_path):
    srv = Server("--api-key", "sekret", log=tmp_path / "server.log").wait_ready()
    try:
        ok = anthropic.Anthropic(base_url=srv.url, api_key="sekret", max_retries=0, timeout=120)
        assert ok.messages.create(model=MODEL, messages=ASK, max_tokens=2).usage.output_tokens == 2
        bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0, timeout=120)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model=MODEL, messages=ASK, max_tokens=2)
        assert e.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(
            f"{srv.url}/generate",
            headers={"x-api-key": "sekret"},
            json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
            timeout=60,
        )
        assert r.status_code == 200  # the same key, either header, on every route
    finally:
        srv.stop()


def test_usage_says_what_the_prefix_cache_served(client, oai):
    """The same long prompt twice: the second time its full blocks come from the prefix cache, and
    Anthropic's usage (cache_read_input_tokens, streamed or not) and OpenAI's (cached_tokens) say so."""
    system = "You answer questions about the weather. " * 12  # several full KV blocks
    first = client.messages.create(model=MODEL, system=system, messages=ASK, max_tokens=2, extra_body=GREEDY)
    again = client.messages.create(model=MODEL, system=system, messages=ASK, max_tokens=2, extra_body=GREEDY)
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt
    assert again.usage.cache_read_input_tokens >= 64 and again.usage.input_tokens < prompt
    with client.messages.stream(
        model=MODEL, system=system, messages=ASK, max_tokens=2, extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == again.usage.cache_read_input_tokens
    assert final.usage.input_tokens == again.usage.input_tokens
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, *ASK],
        max_tokens=2,
        extra_body=GREEDY,
        prompt_cache_key="conversation-1",  # OpenAI's; taken (it routes among --replicas)
    )
    assert chat.usage.prompt_tokens == prompt
    assert chat.usage.prompt_tokens_details.cached_tokens == again.usage.cache_read_input_tokens


def test_cache_control_pins_the_prefix_and_usage_counts_what_it_wrote(client, server):
    """A `cache_control` mark on the system prompt: the first request computes it (its tokens are
    `cache_creation_input_tokens`, and pinned), the next reads it; a mark on a message pins up to it."""
    system = [
        {
            "type": "text",
            "text": "You plan trips for a travel agency in Lisbon and answer in one line. " * 8,
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        }
    ]
    ask = [{"role": "user", "content": "Where is Porto?"}]
    count = client.messages.count_tokens(model=MODEL, system=system, messages=ask).input_tokens
    first = client.messages.create(model=MODEL, system=system, messages=ask, max_tokens=2, extra_body=GREEDY)
    u = first.usage
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens >= 100
    assert u.input_tokens + u.cache_creation_input_tokens == count
    assert 0 < u.input_tokens < 30  # the user turn and the answer's start, after the mark
    assert server.metric("pytgi_prefix_cache_pinned_blocks") >= u.cache_creation_input_tokens // 16

    ask2 = [{"role": "user", "content": "And where is Faro?"}]
    second = client.messages.create(
        model=MODEL, system=system, messages=ask2, max_tokens=2, extra_body=GREEDY
    )
    v = second.usage
    # read: the pinned full blocks (and any the cache kept past them); written: at most the mark's
    # last, partial block
    assert v.cache_read_input_tokens > 0 and v.cache_creation_input_tokens < 16
    assert v.cache_read_input_tokens + v.cache_creation_input_tokens >= u.cache_creation_input_tokens

    turns = [
        *ask,
        {"role": "assistant", "content": "In the north of Portugal."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And Faro?", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    with client.messages.stream(
        model=MODEL, system=system, messages=turns, max_tokens=2, extra_body=GREEDY
    ) as stream:
        w = stream.get_final_message().usage
    assert w.cache_read_input_tokens >= v.cache_read_input_tokens
    assert w.input_tokens < 10  # the mark is on the last message: only the answer's start is after it
    total = client.messages.count_tokens(model=MODEL, system=system, messages=turns).input_tokens
    assert w.input_tokens + w.cache_read_input_tokens + w.cache_creation_input_tokens == total


@pytest.mark.parametrize(
    ("block", "says"),
    [
        ({"type": "persistent"}, "ephemeral"),
        ({"type": "ephemeral", "ttl": "2h"}, "'5m' or '1h'"),
    ],
)
def test_a_bad_cache_control_is_refused(client, block, says):
    content = [{"type": "text", "text": "Hi", "cache_control": block}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert (
        e.value.body["error"]["type"] == "invalid_request_error" and says in e.value.body["error"]["message"]
    )


def test_more_than_four_cache_marks_are_refused(client):
    mark = {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, messages=[{"role": "user", "content": [mark] * 5}], max_tokens=2)
    assert "A maximum of 4 blocks with cache_control" in e.value.body["error"]["message"]
