"""Tool-call formats beyond hermes, end to end: a tiny random Llama whose tokenizer has Mistral's
`[TOOL_CALLS]` and `[ARGS]` special tokens, served with a Mistral-shaped template of its own and with a
pythonic one given by `--chat-template`.
A forced call (tool_choice "required") comes back through the `openai` and `anthropic` SDKs as tool
calls, streamed and not; a Mistral answer keeps its special marker in the text the parser reads; an
OpenAI-style call id in the history reaches a template that demands 9-character ids."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from tests.e2e.server import Server
from tests.e2e.tiny import tiny_model
from tests.unit.test_tools import MISTRAL_TEMPLATE, PYTHONIC_TEMPLATE

pytestmark = pytest.mark.slow

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module", params=["mistral", "pythonic"])
def served(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    if request.param == "mistral":
        tiny_model(path, MISTRAL_TEMPLATE)
        flags: list[str] = []
    else:
        tiny_model(path, None)
        (path / "pythonic.jinja").write_text(PYTHONIC_TEMPLATE)
        flags = ["--chat-template", str(path / "pythonic.jinja")]
    srv = Server("--model-id", str(path), *flags, log=path / "server.log").wait_ready()
    yield request.param, srv, str(path)
    srv.stop()


def test_forced_calls_come_back_as_tool_calls_streamed_and_not(served):
    style, srv, model = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-")
    kw = {
        "model": model,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 0,
    }
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    if style == "mistral":
        assert len(call.id) == 9 and call.id.isalnum()
    streamed: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            got["name"] += tc.function.name or ""
            got["arguments"] += tc.function.arguments or ""
    assert streamed == {0: {"name": "get_weather", "arguments": call.function.arguments}}


def test_the_anthropic_sdk_gets_tool_use_blocks(served):
    _, srv, model = served
    client = anthropic.Anthropic(base_url=srv.url, api_key="-")
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    m = client.messages.create(
        model=model,
        max_tokens=200,
        messages=ASK,
        tool_choice={"type": "any"},
        tools=[tool],
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    assert m.content[0].name == "get_weather" and m.content[0].input["city"] in ("Paris", "Oslo")


def test_an_openai_call_id_in_the_history_reaches_the_template(served):
    _, srv, model = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-")
    call_id = "call_0f3a9c1e27b84d6a95e2c7d1"  # what OpenAI's own ids look like: 29 characters
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 C and sunny"},
    ]
    r = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
