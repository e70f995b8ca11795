"""gpt-oss end to end: a tiny random gpt-oss (pytgi's own model code: sinks, windows, the oai experts)
with a tokenizer that has harmony's special tokens and gpt-oss's published chat template, served with
`--reasoning-parser harmony`. A forced call comes back through the `openai` SDK (chat, streamed and
not; Responses) and the `anthropic` SDK as a tool call; no harmony marker reaches a client; a bad
`reasoning_effort` is a 400 and the server keeps serving."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import torch
import transformers

from tests.e2e.server import Server
from tests.e2e.test_tool_formats import WEATHER  # a schema a random model finishes in a few tokens
from tests.unit.test_harmony import harmony_dir  # noqa: F401  # the tokenizer's fixture

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(harmony_dir):  # noqa: F811
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(harmony_dir / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=4096,
        eos_token_id=json.loads((harmony_dir / "generation_config.json").read_text())["eos_token_id"],
    )
    transformers.GptOssForCausalLM(cfg).save_pretrained(harmony_dir)
    srv = Server(
        "--model-id", str(harmony_dir), "--reasoning-parser", "harmony", log=harmony_dir / "server.log"
    ).wait_ready()
    yield srv, str(harmony_dir)
    srv.stop()


def test_a_forced_call_comes_back_as_a_tool_call(served):
    srv, model = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    kw = dict(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
    )
    choice = client.chat.completions.create(**kw, reasoning_effort="low").choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert "<|" not in (choice.message.content or "")
    streamed = {"name": "", "arguments": ""}
    for chunk in client.chat.completions.create(**kw, reasoning_effort="low", stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed["name"] += tc.function.name or ""
            streamed["arguments"] += tc.function.arguments or ""
    assert streamed == {"name": "get_weather", "arguments": call.function.arguments}

    r = client.responses.create(
        model=model,
        input=ASK[0]["content"],
        tools=[{"type": "function", **WEATHER["function"]}],
        tool_choice="required",
        max_output_tokens=60,
        reasoning={"effort": "high"},
        temperature=0,
    )
    (item,) = [i for i in r.output if i.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) == json.loads(call.function.arguments)

    m = anthropic.Anthropic(base_url=srv.url, api_key="-", max_retries=0).messages.create(
        model=model,
        max_tokens=60,
        messages=ASK,
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == [
        ("get_weather", json.loads(call.function.arguments))
    ]


def test_free_text_shows_no_marker_and_bad_effort_is_refused(served):
    srv, model = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=40, seed=1, temperature=1.0)
    message = r.choices[0].message
    said = (message.content or "") + (getattr(message, "reasoning_content", None) or "")
    assert "<|" not in said
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, reasoning_effort="extreme")
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=2).choices[0]
