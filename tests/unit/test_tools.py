"""OpenAI tool calling without a model: the request's tools and tool_choice, the template's messages,
the grammar of a forced call (checked with llguidance over the tiny tokenizer), and the parser that
finds calls in whole answers and in streams cut anywhere."""

from __future__ import annotations

import json

import llguidance
import pytest

from pytgi import structured
from pytgi.sampling_params import SamplingParams
from pytgi.server.openai import tools
from pytgi.server.openai.errors import OpenAIError
from tests.unit.tiny_tokenizer import VOCAB_SIZE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"


def plan(choice=None, parallel=None, style_template=HERMES_TEMPLATE, fns=(WEATHER, TIME)):
    return tools.plan(list(fns), choice, parallel, style_template)


# -- tools and tool_choice ---------------------------------------------------------------------------
def test_styles_follow_the_chat_template():
    assert tools.style_of(HERMES_TEMPLATE) == "hermes"
    assert tools.style_of("{% if tools %}{{ tools | tojson }}{% endif %}") == "json"
    assert tools.style_of("{% for m in messages %}{{ m.content }}{% endfor %}") == "prompted"
    assert tools.style_of(None) == "prompted"


def test_plans():
    p = plan()
    assert p is not None and p.choice == "auto" and not p.forced and p.parallel and p.style == "hermes"
    assert [f.name for f in p.functions] == ["get_weather", "get_time"]
    assert plan("none") is None and tools.plan(None, None, None, None) is None
    assert plan("required").forced
    named = plan({"type": "function", "function": {"name": "get_time"}}, parallel=False)
    assert named is not None and named.choice == "get_time" and not named.parallel


@pytest.mark.parametrize("fns, choice, param", [
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools.[0].function.name"),
    ([WEATHER, WEATHER], None, "tools.[1].function.name"),
    ([{"type": "retrieval"}], None, "tools.[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools.[0].function.parameters"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([], "required", "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(fns, choice, param):
    with pytest.raises(OpenAIError) as e:
        tools.plan(fns, choice, None, HERMES_TEMPLATE)
    assert e.value.status == 400 and e.value.param == param


# -- the template's messages -------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_a_template_with_tools_gets_them_and_the_history_as_data():
    msgs, listed = tools.template_messages(HISTORY, plan(), "hermes")
    assert listed == [WEATHER, TIME]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and msgs[1]["content"] == ""
    assert msgs[2] == HISTORY[2]


def test_a_template_without_tools_gets_them_as_text():
    msgs, listed = tools.template_messages(HISTORY, plan(style_template=None), "prompted")
    assert listed is None
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and tools.OPEN in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant",
                       "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    # tool_choice none: no tools offered, the history still readable
    msgs, listed = tools.template_messages([{"role": "system", "content": "Be brief."}, *HISTORY], None, "prompted")
    assert listed is None and msgs[0] == {"role": "system", "content": "Be brief."} and msgs[3]["role"] == "user"


# -- forced calls' grammars --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lltok(tokenizer_dir):
    return llguidance.LLTokenizer((tokenizer_dir / "tokenizer.json").read_text(), n_vocab=VOCAB_SIZE, eos_token=[2])


def accepts(lltok, tok, g, text: str) -> bool:
    kind = {"grammar": "grammar", "json": "json_schema"}[g.type]
    matcher = llguidance.LLMatcher(lltok, structured.check(SamplingParams(**{kind: g.value})))
    return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


def call(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_auto_needs_no_grammar():
    assert tools.grammar(plan()) is None  # type: ignore[arg-type]


def test_required_admits_only_well_formed_calls(lltok, tok):
    g = tools.grammar(plan("required"))  # type: ignore[arg-type]
    assert g is not None
    assert accepts(lltok, tok, g, call("get_weather", {"city": "Paris"}))
    assert accepts(lltok, tok, g, call("get_weather", {"city": "Oslo"}) + "\n" + call("get_time", {"zone": "UTC"}))
    assert not accepts(lltok, tok, g, call("get_weather", {"town": "Paris"}))  # not its schema
    assert not accepts(lltok, tok, g, call("get_news", {}))
    assert not accepts(lltok, tok, g, "It is sunny.")
    single = tools.grammar(plan("required", parallel=False))  # type: ignore[arg-type]
    assert not accepts(lltok, tok, single, call("get_weather", {"city": "Oslo"}) + "\n" + call("get_time", {"zone": "UTC"}))


def test_a_named_function_admits_only_that_function(lltok, tok):
    g = tools.grammar(plan({"type": "function", "function": {"name": "get_time"}}))  # type: ignore[arg-type]
    assert accepts(lltok, tok, g, call("get_time", {"zone": "UTC"}))
    assert not accepts(lltok, tok, g, call("get_weather", {"city": "Paris"}))


def test_the_bare_json_style_forces_one_object(lltok, tok):
    g = tools.grammar(plan("required", style_template="{{ tools }}"))  # type: ignore[arg-type]
    assert g is not None and g.type == "json"
    assert accepts(lltok, tok, g, '{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert not accepts(lltok, tok, g, '{"name": "get_time", "parameters": {"city": 1}}')


# -- what the model wrote ----------------------------------------------------------------------------
def stream(text: str, style: tools.Style, cut: int) -> tuple[str, list[dict], tools.ToolParser]:
    """Feed `text` in pieces of `cut` characters; returns the content, the calls as a client would
    assemble them from the events, and the parser."""
    parser = tools.ToolParser(style)
    events = [e for i in range(0, len(text), cut) for e in parser.feed(text[i:i + cut])] + parser.finish()
    content, calls = "", []
    for e in events:
        if isinstance(e, tools.Content):
            content += e.text
        elif isinstance(e, tools.CallStart):
            assert e.index == len(calls)
            calls.append({"id": e.id, "name": e.name, "arguments": ""})
        else:
            assert isinstance(e, tools.Arguments) and calls and e.index == len(calls) - 1
            calls[e.index]["arguments"] += e.text
    return content, calls, parser


ANSWERS = [  # (style, the model's text, content, [(name, arguments)])
    ("hermes", "Paris is lovely.", "Paris is lovely.", []),
    ("hermes", call("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("hermes", "Let me look.\n" + call("get_weather", {"city": "Paris", "unit": "c"}) + "\n"
     + call("get_time", {"zone": "Europe/Paris"}), "Let me look.",
     [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"arguments": {"q": {"a": [1, "}"]}}, "name": "f"}\n</tool_call>', None,
     [("f", {"q": {"a": [1, "}"]}})]),  # name after arguments: the call in one piece
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": "a\\"b}"}}', None, [("f", {"x": 'a"b}'})]),  # unclosed
    ("hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ("hermes", "a < b and <tool", "a < b and <tool", []),
    ("json", ' {"name": "get_time", "parameters": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    ("json", "The time is noon. {\"name\": \"x\"}", "The time is noon. {\"name\": \"x\"}", []),
    ("json", '{"not": "a call"}', '{"not": "a call"}', []),
]


@pytest.mark.parametrize("style, text, content, calls", ANSWERS)
def test_calls_are_found_whole_and_streamed_in_any_cut(style, text, content, calls):
    got_content, got_calls = tools.parse(text, style)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)
    for cut in (1, 2, 3, 7, len(text)):
        s_content, s_calls, parser = stream(text, style, cut)
        assert (s_content.strip() or None if calls else s_content) == content, cut
        assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == calls, cut
        assert [c.arguments for c in parser.calls] == [c["arguments"] for c in s_calls]


def test_arguments_stream_as_they_are_written():
    parser = tools.ToolParser("hermes")
    assert parser.feed("<tool_") == []
    assert [type(e) for e in parser.feed('call>\n{"name": "get_weather", "arguments": ')] == [tools.CallStart]
    pieces = [parser.feed(p) for p in ['{"ci', 'ty": "Pa', 'ris"', '}', '}', "\n</tool_call>"]]
    assert [[e.text for e in p] for p in pieces] == [['{"ci'], ['ty": "Pa'], ['ris"'], [], ['}'], []]
    assert parser.finish() == [] and parser.calls[0].arguments == '{"city": "Paris"}'
