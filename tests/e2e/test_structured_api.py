"""Structured output and tool calling against a real server, through the clients users have:
`text-generation` and `huggingface_hub` with TGI's grammar, `openai` with response_format, vLLM's
extensions and tools (streamed and not); outputs are checked with `jsonschema`; bad schemas are 4xx
and the server keeps serving."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI
from text_generation import Client
from text_generation.errors import ValidationError as TGIValidationError
from text_generation.types import Grammar, GrammarType

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
}
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "required": ["zone"],
            "properties": {"zone": {"type": "string", "maxLength": 24}},
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


# -- TGI's grammar ---------------------------------------------------------------------------------
def test_text_generation_client_json_grammar(server):
    c = Client(server.url, timeout=120)
    out = c.generate(PROMPT, max_new_tokens=60, grammar=Grammar(type=GrammarType.Json, value=PERSON))
    jsonschema.validate(json.loads(out.generated_text), PERSON)
    assert out.details.finish_reason == "eos_token"  # the object closed, the request ended
    streamed = "".join(
        r.token.text
        for r in c.generate_stream(
            PROMPT, max_new_tokens=60, grammar=Grammar(type=GrammarType.Json, value=PERSON)
        )
        if not r.token.special
    )
    assert streamed == out.generated_text  # greedy: the same through the stream


def test_text_generation_client_regex_grammar(server):
    out = Client(server.url, timeout=120).generate(
        "The phone number is",
        max_new_tokens=20,
        grammar=Grammar(type=GrammarType.Regex, value=r"\(\d{3}\) \d{3}-\d{4}"),
    )
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", out.generated_text)


def test_inference_client_and_the_root_route(server):
    text = InferenceClient(server.url).text_generation(
        PROMPT, max_new_tokens=60, grammar={"type": "json", "value": PERSON}
    )
    jsonschema.validate(json.loads(text), PERSON)
    r = httpx.post(
        server.url + "/",
        json={
            "inputs": "Yes or no?",
            "parameters": {"max_new_tokens": 5, "grammar": {"type": "regex", "value": "(yes|no)"}},
        },
        timeout=120,
    )
    assert r.status_code == 200 and r.json()[0]["generated_text"] in ("yes", "no")


@pytest.mark.parametrize(
    "grammar, says",
    [
        ({"type": "json", "value": {"type": "nonsense"}}, "grammar is not valid"),
        ({"type": "regex", "value": "(unclosed"}, "grammar is not valid"),
        ({"type": "json", "value": "{not json"}, "grammar is not valid"),
        ({"type": "sql", "value": "x"}, ""),
    ],
)
def test_bad_grammars_are_422_and_the_server_keeps_serving(server, grammar, says):
    r = httpx.post(
        server.url + "/generate",
        json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, "grammar": grammar}},
    )
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and says in r.json()["error"]
    with pytest.raises(TGIValidationError):
        Client(server.url).generate(
            "Hi", max_new_tokens=2, grammar=Grammar(type=GrammarType.Regex, value="(")
        )
    assert httpx.get(server.url + "/health").status_code == 200


# -- OpenAI's response_format and vLLM's structured_outputs ----------------------------------------
def test_response_format_json_schema_and_json_object(client):
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=80,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=80,
        temperature=0.8,
        seed=3,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_n_choices_and_best_of_each_keep_the_grammar(client, server):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A person as JSON."}],
        n=3,
        max_tokens=80,
        temperature=1.0,
        seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    assert len(r.choices) == 3
    for c in r.choices:  # the schema is short: every object closes well inside the budget
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)
    out = httpx.post(
        server.url + "/generate",
        json={
            "inputs": PROMPT,
            "parameters": {
                "max_new_tokens": 60,
                "best_of": 2,
                "do_sample": True,
                "details": True,
                "grammar": {"type": "json", "value": PERSON},
            },
        },
        timeout=120,
    ).json()
    for text in [out["generated_text"], *(s["generated_text"] for s in out["details"]["best_of_sequences"])]:
        jsonschema.validate(json.loads(text), PERSON)


def test_vllm_structured_outputs_and_guided_names(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(
        model=MODEL,
        prompt="Today's date:",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": r"20\d\d-\d\d-\d\d"},
    )
    assert re.fullmatch(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}", r.choices[0].text)
    r = client.completions.create(
        model=MODEL,
        prompt="A list:\n",
        max_tokens=30,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= ("- " [a-z]+ "\\n"){2}'},
    )
    assert re.fullmatch(r"(- [a-z]+\n){2}", r.choices[0].text)


# -- tools -----------------------------------------------------------------------------------------
def check_call(call, tool=WEATHER) -> dict:
    assert (
        call.type == "function"
        and call.id.startswith("call_")
        and call.function.name == tool["function"]["name"]
    )
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_required_tool_call(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.content is None
    check_call(choice.message.tool_calls[0])
    # parallel calls allowed: this small model keeps calling until the token budget ends; every
    # call it finished is complete and follows its schema
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=100,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length") and len(choice.message.tool_calls) >= 2
    for call in choice.message.tool_calls:
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)


@pytest.mark.parametrize("max_tokens", [50, 100])
def test_an_answer_cut_by_the_token_limit_keeps_its_complete_calls(client, server, max_tokens):
    """Issue 46.5: with parallel calls this model repeats calls until max_tokens. The cut answer carries
    every call the stream completed, on OpenAI chat, Responses and Anthropic, and the cut call's text
    as content (not a call whose arguments are no JSON, and not nothing at all)."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0)
    streamed: dict[int, dict[str, str]] = {}
    text = ""
    for chunk in client.chat.completions.create(**kw, max_tokens=max_tokens, stream=True):
        text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            got["name"] += tc.function.name or ""
            got["arguments"] += tc.function.arguments or ""

    def whole(args: str) -> bool:
        try:
            return isinstance(json.loads(args), dict)
        except json.JSONDecodeError:
            return False

    done = [(c["name"], json.loads(c["arguments"])) for c in streamed.values() if whole(c["arguments"])]
    # the limit falls inside a call (before its name: the stream held it, then sent it as text; after:
    # a call it started): the case this test is for
    assert done and (text.strip() or len(done) < len(streamed)), (text, streamed)
    r = client.chat.completions.create(**kw, max_tokens=max_tokens).choices[0]
    assert r.finish_reason == "length"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls] == done
    assert r.message.content and r.message.content.lstrip().startswith("<tool_call>")

    responses = client.responses.create(
        model=MODEL,
        input=ASK[0]["content"],
        tools=[{"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}],
        tool_choice="required",
        max_output_tokens=max_tokens,
        temperature=0,
    )
    items = [(i.name, json.loads(i.arguments)) for i in responses.output if i.type == "function_call"]
    assert responses.status == "incomplete" and items == done
    assert any(i.type == "message" for i in responses.output)  # the cut call's text

    import anthropic

    m = anthropic.Anthropic(base_url=server.url, api_key="-", max_retries=0).messages.create(
        model=MODEL,
        max_tokens=max_tokens,
        messages=ASK,
        tools=[
            {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
            for t in (WEATHER, TIME)
        ],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "max_tokens"
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == done
    assert any(b.type == "text" and b.text.strip() for b in m.content)


def test_named_tool_call_streamed_as_openai_streams_it(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            max_tokens=100,
            temperature=0,
            stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert (
        pieces[0].index == 0 and pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    )
    assert len(pieces) > 2 and all(
        p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:]
    )
    args = "".join(p.function.arguments or "" for p in pieces)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=100,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == json.loads(args)


def test_auto_lets_the_model_choose_and_tool_results_go_back(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=100, temperature=0
    )
    choice = r.choices[0]
    if choice.message.tool_calls:  # a call the model wrote itself: parsed, with its own finish reason
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "get_weather"
        json.loads(choice.message.tool_calls[0].function.arguments)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=30, temperature=0, tool_choice="none"
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[WEATHER, WEATHER]), "tools.[1].function.name"),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                tool_choice="required",
            ),
            "tools",
        ),
        (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ],
)
def test_bad_tools_are_400_and_the_server_keeps_serving(client, server, kw, param):
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 4, "tools": [WEATHER], **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert e.value.body["param"] == param and e.value.body["message"]
    assert httpx.get(server.url + "/health").status_code == 200
