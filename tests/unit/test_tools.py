"""Tool calling without a model: OpenAI's tools and tool_choice through the chat request, the template's
messages, the grammar of a forced call (checked with llguidance over the tiny tokenizer), and the
parser that finds calls in whole answers and in streams cut anywhere."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from pytgi.api.chat import tools
from pytgi.api.chat.language import Call, ChatRequest, Function, Message, Named, renamed
from pytgi.api.openai import schema
from pytgi.api.openai.error_shape import OpenAIError, as_openai_error
from pytgi.core import grammar as structured
from pytgi.core.errors import InvalidRequest
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import Tokenizer
from tests.unit.tiny_tokenizer import VOCAB_SIZE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"


def openai_chat(fns, choice=None, parallel=None) -> tuple[ChatRequest, Any]:
    """An OpenAI chat body with these tools, as the chat request (and OpenAI's names for its fields)."""
    body = schema.ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": list(fns),
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
        }
    )
    return schema.to_chat(body)


def plan(choice=None, parallel=None, style_template=HERMES_TEMPLATE, fns=(WEATHER, TIME)):
    chat, _ = openai_chat(fns, choice, parallel)
    return tools.plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls, style_template)


def history(messages: list[dict[str, Any]]) -> list[Message]:
    """OpenAI's messages as the chat request's."""
    return schema.chat_messages([schema.ChatMessage.model_validate(m) for m in messages])


# -- tools and tool_choice ---------------------------------------------------------------------------
MISTRAL_TEMPLATE = (  # shaped like Mistral v0.3's: ids of 9 letters and digits, or it refuses
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{% endfor %}]</s>{% elif m.role == 'tool' %}"
    "{% if m.tool_call_id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings "
    "with length 9!') }}{% endif %}[TOOL_RESULTS]{{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
PYTHONIC_TEMPLATE = (
    "{% if tools %}Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), "
    "func_name2(params)]{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)


def test_styles_follow_the_chat_template():
    assert tools.style_of(HERMES_TEMPLATE) == "hermes"
    assert tools.style_of(MISTRAL_TEMPLATE) == "mistral"
    assert tools.style_of("{{ '[TOOL_CALLS]' + name + '[ARGS]' + args }}") == "mistral_v11"
    assert tools.style_of(PYTHONIC_TEMPLATE) == "pythonic"
    assert tools.style_of("{% if tools %}{{ tools | tojson }}{% endif %}") == "json"
    assert tools.style_of("{% for m in messages %}{{ m.content }}{% endfor %}") == "prompted"
    assert tools.style_of(None) == "prompted"


def test_plans():
    p = plan()
    assert p is not None and p.choice == "auto" and not p.forced and p.parallel and p.style == "hermes"
    assert [f.name for f in p.functions] == ["get_weather", "get_time"]
    assert plan("none") is None and tools.plan([], None, True, None) is None
    assert plan("required").forced
    named = plan({"type": "function", "function": {"name": "get_time"}}, parallel=False)
    assert named is not None and named.choice == "get_time" and not named.parallel


@pytest.mark.parametrize(
    "fns, choice, param",
    [
        ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools.[0].function.name"),
        ([WEATHER, WEATHER], None, "tools.[1].function.name"),
        ([{"type": "retrieval"}], None, "tools.[0]"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            None,
            "tools.[0].function.parameters",
        ),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice"),
        ([], "required", "tool_choice"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(fns, choice, param):
    """OpenAI's answer: its own checks on the way into the chat request, then the chat request's,
    named as OpenAI names the field."""
    with pytest.raises((OpenAIError, InvalidRequest)) as e:
        chat, names = openai_chat(fns, choice)
        with renamed(names):
            tools.plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls, HERMES_TEMPLATE)
    err = as_openai_error(e.value)
    assert err.status == 400 and err.param == param


def test_the_chat_requests_tools_are_refused_naming_its_fields():
    f = Function("f", None, {})
    for functions, choice, param in [
        ([Function("bad name!", None, {})], None, "tools.0.name"),
        ([f, f], None, "tools.1.name"),
        ([f], Named("g"), "tool_choice"),
        ([], "required", "tool_choice"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            tools.plan(functions, choice, True, HERMES_TEMPLATE)
        assert e.value.param == param
    named = tools.plan([f], Named("f"), False, HERMES_TEMPLATE)
    assert named is not None and named.choice == "f" and named.forced and not named.parallel


# -- the template's messages -------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_a_template_with_tools_gets_them_and_the_history_as_data():
    msgs, listed = tools.template_messages(history(HISTORY), plan(), "hermes")
    time = {"type": "function", "function": {"name": "get_time", "description": ""} | TIME["function"]}
    assert listed == [WEATHER, time]  # a description always (gpt-oss's template reads it), "" if none
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and msgs[1]["content"] == ""
    assert msgs[2] == HISTORY[2]


def test_a_template_without_tools_gets_them_as_text():
    msgs, listed = tools.template_messages(history(HISTORY), plan(style_template=None), "prompted")
    assert listed is None
    assert (
        msgs[0]["role"] == "system"
        and "get_weather" in msgs[0]["content"]
        and tools.OPEN in msgs[0]["content"]
    )
    assert msgs[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    # tool_choice none: no tools offered, the history still readable
    msgs, listed = tools.template_messages(
        history([{"role": "system", "content": "Be brief."}, *HISTORY]), None, "prompted"
    )
    assert (
        listed is None and msgs[0] == {"role": "system", "content": "Be brief."} and msgs[3]["role"] == "user"
    )


def test_mistral_templates_get_call_ids_they_accept(tokenizer_dir):
    sent = [{"role": "user", "content": "Weather in Paris?"}, *HISTORY[1:]]
    msgs, _ = tools.template_messages(history(sent), plan(style_template=MISTRAL_TEMPLATE), "mistral")
    calls = msgs[1]["tool_calls"]
    assert isinstance(calls, list) and len(calls) == 1
    call = calls[0]
    assert len(call["id"]) == 9 and call["id"].isalnum() and msgs[2]["tool_call_id"] == call["id"]
    again = [Message("assistant", calls=[Call("get_weather", id=call["id"])])]
    assert tools.template_messages(again, None, "mistral")[0][0]["tool_calls"][0]["id"] == call["id"]  # kept
    mistral = Tokenizer.from_dir(tokenizer_dir)
    mistral.chat_template = MISTRAL_TEMPLATE
    text = mistral.apply_chat_template(msgs)
    assert f'"call_id": "{call["id"]}"' in text and '"arguments": {"city": "Paris"}' in text
    with pytest.raises(ValueError, match="length 9"):
        mistral.apply_chat_template(sent)  # what an OpenAI client sends, unmapped


# -- forced calls' grammars --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lltok(tokenizer_dir):
    return llguidance.LLTokenizer(
        (tokenizer_dir / "tokenizer.json").read_text(), n_vocab=VOCAB_SIZE, eos_token=[2]
    )


def accepts(lltok, tok, g, text: str) -> bool:
    kind = {"grammar": "grammar", "json": "json_schema"}[g.type]
    matcher = llguidance.LLMatcher(lltok, structured.check(SamplingParams(**{kind: g.value})))
    return (
        all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
        and matcher.is_accepting()
    )


def call(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_auto_needs_no_grammar():
    assert tools.grammar(plan()) is None


def test_required_admits_only_well_formed_calls(lltok, tok):
    g = tools.grammar(plan("required"))
    assert g is not None
    assert accepts(lltok, tok, g, call("get_weather", {"city": "Paris"}))
    assert accepts(
        lltok, tok, g, call("get_weather", {"city": "Oslo"}) + "\n" + call("get_time", {"zone": "UTC"})
    )
    assert not accepts(lltok, tok, g, call("get_weather", {"town": "Paris"}))  # not its schema
    assert not accepts(lltok, tok, g, call("get_news", {}))
    assert not accepts(lltok, tok, g, "It is sunny.")
    single = tools.grammar(plan("required", parallel=False))
    assert not accepts(
        lltok, tok, single, call("get_weather", {"city": "Oslo"}) + "\n" + call("get_time", {"zone": "UTC"})
    )


def test_a_named_function_admits_only_that_function(lltok, tok):
    g = tools.grammar(plan({"type": "function", "function": {"name": "get_time"}}))
    assert accepts(lltok, tok, g, call("get_time", {"zone": "UTC"}))
    assert not accepts(lltok, tok, g, call("get_weather", {"city": "Paris"}))


def test_the_bare_json_style_forces_one_object(lltok, tok):
    g = tools.grammar(plan("required", style_template="{{ tools }}"))
    assert g is not None and g.type == "json"
    assert accepts(lltok, tok, g, '{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert not accepts(lltok, tok, g, '{"name": "get_time", "parameters": {"city": 1}}')


# -- what the model wrote ----------------------------------------------------------------------------
def stream(pieces: list[str], style: tools.Style) -> tuple[str, list[dict], tools.CallParser]:
    """Feed the pieces; returns the content, the calls as a client would assemble them from the
    events, and the parser."""
    parser = tools.parser(style)
    content, calls = assemble([e for piece in pieces for e in parser.feed(piece)] + parser.finish())
    return content, calls, parser


def assemble(events: list[tools.Event]) -> tuple[str, list[dict]]:
    """The content and the calls a client assembles from a parser's events."""
    content, calls = "", list[Any]()
    for e in events:
        if isinstance(e, tools.Content):
            content += e.text
        elif isinstance(e, tools.CallStart):
            assert e.index == len(calls)
            calls.append({"id": e.id, "name": e.name, "arguments": ""})
        else:
            assert isinstance(e, tools.Arguments) and calls and e.index == len(calls) - 1
            calls[e.index]["arguments"] += e.text
    return content, calls


ANSWERS = [  # (style, the model's text, content, [(name, arguments)])
    ("hermes", "Paris is lovely.", "Paris is lovely.", []),
    ("hermes", call("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    (
        "hermes",
        "Let me look.\n"
        + call("get_weather", {"city": "Paris", "unit": "c"})
        + "\n"
        + call("get_time", {"zone": "Europe/Paris"}),
        "Let me look.",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "Europe/Paris"})],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"q": {"a": [1, "}"]}}, "name": "f"}\n</tool_call>',
        None,
        [("f", {"q": {"a": [1, "}"]}})],
    ),  # name after arguments: the call in one piece
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"x": "a\\"b}"}}',
        None,
        [("f", {"x": 'a"b}'})],
    ),  # unclosed
    ("hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ("hermes", "a < b and <tool", "a < b and <tool", []),
    ("json", ' {"name": "get_time", "parameters": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    ("json", 'The time is noon. {"name": "x"}', 'The time is noon. {"name": "x"}', []),
    ("json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("mistral", "Paris is lovely.", "Paris is lovely.", []),
    ("mistral", "see [1] and [TOOL", "see [1] and [TOOL", []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "mistral",
        (
            'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
            '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]'
        ),
        "Let me look.",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "Europe/Paris"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, "]}"]}, "id": "abcdefghi"}]',
        None,
        [("f", {"a": [1, "]}"]})],
    ),
    ("mistral", '[TOOL_CALLS][{"arguments": {"q": "}"}, "name": "f"}]', None, [("f", {"q": "}"})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": "{\\"x\\": 1}"}]', None, [("f", {"x": 1})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": "a\\"b}"}}', None, [("f", {"x": 'a"b}'})]),
    ("mistral", '[TOOL_CALLS][{"not": "a call"}]', '{"not": "a call"}', []),
    (
        "mistral",
        '[TOOL_CALLS] [ { "name" : "f" ,\n "arguments" :\n  { "x" :\n 1 } } ]',
        None,
        [("f", {"x": 1})],
    ),
    (
        "hermes",
        '<tool_call>{ "name" : "f" , "arguments" :\n  { "x" :\n 1 } }</tool_call>',
        None,
        [("f", {"x": 1})],
    ),
    (
        "mistral_v11",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
        "Sure.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})],
    ),
    (
        "mistral_v11",
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS] {"zone": "{UTC}"}',
        None,
        [("get_time", {"zone": "{UTC}"})],
    ),
    ("mistral_v11", "[TOOL_CALLS]get_wea", "get_wea", []),
    ("pythonic", '[get_weather(city="Paris")]', None, [("get_weather", {"city": "Paris"})]),
    (
        "pythonic",
        ' [get_weather(city=\'Paris\', unit="c"), get_time(zone="UTC")]',
        None,
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "UTC"})],
    ),
    (
        "pythonic",
        '[f(a=True, b=null, c=-1.5, d=[1, "x)"], e={"k": None}, g=(1, 2))]',
        None,
        [("f", {"a": True, "b": None, "c": -1.5, "d": [1, "x)"], "e": {"k": None}, "g": [1, 2]})],
    ),
    (
        "pythonic",
        '[tools.search(q="a]"), ping()] done',
        "done",
        [("tools.search", {"q": "a]"}), ("ping", {})],
    ),
    ("pythonic", "[1] Paris is lovely.", "[1] Paris is lovely.", []),
    ("pythonic", "[get_weather(1)]", "[get_weather(1)]", []),
    ("pythonic", "[get_weather(city=town)]", "[get_weather(city=town)]", []),
    ("pythonic", "Sure: [f(a=1)]", "Sure: [f(a=1)]", []),
]


@pytest.mark.parametrize("style, text, content, calls", ANSWERS)
def test_calls_are_found_whole_and_streamed_in_any_cut(style, text, content, calls):
    got_content, got_calls = tools.parse(text, style)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    assert all(c.id.startswith("call_") for c in got_calls) or style.startswith("mistral")
    cuts = [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 2, 3, 7)]
    cuts += [[text[:at], text[at:]] for at in range(len(text) + 1)]  # in two at every character
    for pieces in cuts:
        s_content, s_calls, parser = stream(pieces, style)
        assert (s_content.strip() or None if calls else s_content) == content, pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == calls, pieces
        assert [c.arguments for c in parser.calls] == [c["arguments"] for c in s_calls]
        assert [c.arguments for c in parser.calls] == [c.arguments for c in got_calls], pieces
        if style in ("mistral", "mistral_v11"):
            assert all(len(c.id) == 9 and c.id.isalnum() for c in parser.calls)


PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CUT = [  # (style, an answer the token limit cut in its third call, the content it leaves)
    (
        "hermes",
        f"<tool_call>{PARIS}</tool_call>\n" * 2 + '<tool_call>{"name": "get_weather", "arguments": {"ci',
    ),
    ("prompted", f"<tool_call>\n{PARIS}\n</tool_call>\n" * 2 + '<tool_call>\n{"name": "get_weather", "argu'),
    ("mistral", f"[TOOL_CALLS][{PARIS}, {PARIS}, " + '{"name": "get_weather", "arguments": {"city": "Pa'),
    (
        "mistral_v11",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}' * 2 + '[TOOL_CALLS]get_weather[ARGS]{"ci',
    ),
    ("pythonic", '[get_weather(city="Paris"), get_weather(city="Paris"), get_weather(ci'),
]


@pytest.mark.parametrize("style, text", CUT)
def test_an_answer_cut_short_keeps_its_complete_calls(style, text):
    """Issue 46.5: a response the token limit cut keeps every call that was complete; the cut call's
    text is content, as written (never a call with arguments that are no JSON)."""
    content, calls = tools.parse(text, style)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})] * 2
    assert content is not None and content.strip() and content in text, content
    assert "Paris" not in content or style == "mistral"  # only the cut call's text
    # the stream says the same complete calls (a started call it cannot take back stays, cut)
    _, s_calls, _ = stream([text[i : i + 3] for i in range(0, len(text), 3)], style)
    assert [json.loads(c["arguments"]) for c in s_calls[:2]] == [{"city": "Paris"}] * 2


def test_a_cut_bare_call_is_content():
    text = '{"name": "get_time", "parameters": {"zone": "UT'
    assert tools.parse(text, "json") == (text, [])
    assert tools.parse("<tool_call>not json", "hermes") == ("<tool_call>not json", [])  # no tag invented


def test_arguments_stream_as_they_are_written():
    parser = tools.ToolParser("hermes")
    assert parser.feed("<tool_") == []
    assert [type(e) for e in parser.feed('call>\n{"name": "get_weather", "arguments": ')] == [tools.CallStart]
    pieces = [parser.feed(p) for p in ['{"ci', 'ty": "Pa', 'ris"', "}", "}", "\n</tool_call>"]]
    assert [[e.text for e in p] for p in pieces] == [['{"ci'], ['ty": "Pa'], ['ris"'], [], ["}"], []]
    assert parser.finish() == [] and parser.calls[0].arguments == '{"city": "Paris"}'


def test_mistral_arguments_stream_as_they_are_written():
    parser = tools.parser("mistral")
    assert parser.feed("Sure.[TOOL_") == [tools.Content("Sure.")]
    assert [type(e) for e in parser.feed('CALLS] [{"name": "get_weather", "arguments": ')] == [
        tools.CallStart
    ]
    pieces = [parser.feed(p) for p in ['{"ci', 'ty": "Pa}', 'ris"', "}", ', "id": "abcdefghi"}', "]"]]
    assert [[e.text for e in p] for p in pieces] == [['{"ci'], ['ty": "Pa}'], ['ris"'], ["}"], [], []]
    assert parser.finish() == [] and parser.calls[0].arguments == '{"city": "Pa}ris"}'
    v11 = tools.parser("mistral_v11")
    assert [type(e) for e in v11.feed("[TOOL_CALLS]get_time[ARGS]")] == [tools.CallStart]
    assert [e.text for e in v11.feed('{"zone"') + v11.feed(': "UTC"}')] == ['{"zone"', ': "UTC"}']


def test_pythonic_calls_are_sent_as_each_closes():
    parser = tools.parser("pythonic")
    assert parser.feed("[get_weather(city=") == []
    found = parser.feed('"Paris"), get_')
    assert [(type(e), getattr(e, "text", None)) for e in found] == [
        (tools.CallStart, None),
        (tools.Arguments, '{"city": "Paris"}'),
    ]
    assert [type(e) for e in parser.feed('time(zone="UTC")]')] == [tools.CallStart, tools.Arguments]
    assert parser.finish() == []


def accepts_ids(lltok, g, ids: list[int]) -> bool:
    matcher = llguidance.LLMatcher(lltok, structured.check(SamplingParams(grammar=g.value)))
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_mistral_forces_its_special_token_then_a_list_of_calls(lltok, tok):
    marker = tok.special_id("<reponame>")  # the tiny tokenizer's stand-in for [TOOL_CALLS]
    assert marker == 4 and tok.special_id("reponame") is None and tok.special_id("hello") is None
    special = {"[TOOL_CALLS]": marker}.get
    g = tools.grammar(plan("required", style_template=MISTRAL_TEMPLATE), special)
    assert g is not None and f"<[{marker}]>" in g.value

    def ids(text: str) -> list[int]:
        return [marker, *tok.encode(text, add_special_tokens=False)]

    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    two = one + ', {"name": "get_time", "arguments": {"zone": "UTC"}}'
    assert accepts_ids(lltok, g, ids(f" [{one}]")) and accepts_ids(lltok, g, ids(f"[{two}]"))
    assert not accepts_ids(lltok, g, tok.encode(f"[{one}]", add_special_tokens=False))  # no marker
    assert not accepts_ids(lltok, g, ids('[{"name": "get_weather", "arguments": {"town": "Paris"}}]'))
    single = tools.grammar(plan("required", parallel=False, style_template=MISTRAL_TEMPLATE), special)
    assert single is not None and not accepts_ids(lltok, single, ids(f"[{two}]"))
    # without the special token in the vocabulary, the marker is text
    text_marker = tools.grammar(
        plan({"type": "function", "function": {"name": "get_time"}}, style_template=MISTRAL_TEMPLATE)
    )
    assert text_marker is not None
    assert accepts(
        lltok, tok, text_marker, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    )
    v11 = tools.grammar(plan("required", style_template="[TOOL_CALLS][ARGS]"), special)
    assert v11 is not None
    assert accepts_ids(
        lltok, v11, ids('get_time[ARGS]{"zone": "UTC"}') + ids('get_weather[ARGS]{"city": "Oslo"}')
    )
    assert not accepts_ids(lltok, v11, ids('get_time[ARGS]{"city": "Oslo"}'))


def test_pythonic_forces_keyword_calls_whose_values_follow_the_schema(lltok, tok):
    g = tools.grammar(plan("required", style_template=PYTHONIC_TEMPLATE))
    assert g is not None
    for text in [
        '[get_weather(city="Paris")]',
        '[get_weather(city="Paris", unit="c"), get_time(zone="UTC")]',
    ]:
        assert accepts(lltok, tok, g, text), text
        assert tools.parse(text, "pythonic")[1]
    for text in [
        '[get_weather(unit="c")]',
        "[get_weather(city=1)]",
        '[get_weather(city="Paris", town="x")]',
        '[get_weather(unit="c", city="Paris")]',
        "[get_news()]",
        "It is sunny.",
    ]:
        assert not accepts(lltok, tok, g, text), text
    optional = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
            },
        },
    }
    g = tools.grammar(plan("required", style_template=PYTHONIC_TEMPLATE, fns=(optional,)))
    assert g is not None
    for text in ["[f()]", "[f(a=1)]", "[f(b=true)]", "[f(a=1, b=false)]"]:
        assert accepts(lltok, tok, g, text), text
        assert tools.parse(text, "pythonic")[1], text
    assert not accepts(lltok, tok, g, "[f(, b=true)]")
    odd = {
        "type": "function",
        "function": {
            "name": "g",
            "parameters": {"type": "object", "properties": {"user-id": {"type": "string"}}},
        },
    }
    g = tools.grammar(plan("required", style_template=PYTHONIC_TEMPLATE, fns=(odd,)))
    assert g is not None and accepts(lltok, tok, g, '[g(user=1, x="y")]')
