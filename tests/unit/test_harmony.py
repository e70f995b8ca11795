"""gpt-oss's harmony format (issue 46): the reasoning parser and the tool-call parser over whole answers
and every way a stream can cut them, the style the chat template picks, the grammar of a forced call
(checked with llguidance over a tiny tokenizer that has harmony's special tokens), the special tokens
kept in the answer's text, and gpt-oss's own chat template (gpt_oss_chat_template.jinja, Apache-2.0,
as published with openai/gpt-oss-20b; its source is noted in its first line) rendering a tool call and
its result as harmony."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pydantic
import pytest

from pytgi.api.chat import harmony, tools
from pytgi.api.chat.language import Message
from pytgi.api.chat.reasoning import ReasoningParser, split
from pytgi.api.openai import render, responses, schema
from pytgi.core import grammar as structured
from pytgi.core import protocol as P
from pytgi.core.outputs import Delta, OutputProcessor, Token
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import Tokenizer
from tests.unit.test_tools import assemble

TEMPLATE = (Path(__file__).parent / "gpt_oss_chat_template.jinja").read_text()
# harmony's special tokens at small ids (gpt-oss's are 200002...200012; the parsers read text)
SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"]
SPECIALS += ["<|return|>", "<|call|>"]
ID = {t: i for i, t in enumerate(SPECIALS)}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE tokenizer directory with harmony's special tokens, gpt-oss's chat template
    and its generation config's EOS ids (<|return|>, <|endoftext|>, <|call|>)."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("harmony-tokenizer")
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    corpus = ["analysis commentary final assistant to=functions.get_weather json", '{"city": "Paris"}']
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(corpus * 4, trainer)
    hf.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": ID["<|endoftext|>"]}))
    eos = [ID["<|return|>"], ID["<|endoftext|>"], ID["<|call|>"]]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


@pytest.fixture(scope="module")
def htok(harmony_dir) -> Tokenizer:
    return Tokenizer.from_dir(harmony_dir)


def plan(choice: Any = None, fns: tuple = (WEATHER, TIME)) -> tools.ToolPlan:
    body = schema.ChatCompletionRequest.model_validate(
        {"messages": [], "tools": list(fns), "tool_choice": choice}
    )
    chat, _ = schema.to_chat(body)
    found = tools.plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls, TEMPLATE)
    assert found is not None
    return found


def call_text(name: str, args: str, recipient_first: bool = False) -> str:
    if recipient_first:
        return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{args}<|call|>"
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"


THINK = "<|channel|>analysis<|message|>The user wants a<b. Use the tool.<|end|>"


# -- the reasoning parser ----------------------------------------------------------------------------
REASONING = [  # (answer, reasoning, content)
    (
        THINK + "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
        "The user wants a<b. Use the tool.",
        "It is 4.",
    ),
    (
        THINK + "<|start|>assistant<|channel|>final<|message|>Cut mid-sent",
        "The user wants a<b. Use the tool.",
        "Cut mid-sent",
    ),
    ("<|channel|>analysis<|message|>cut while thinking <|", "cut while thinking <|", ""),
    (THINK + "<|start|>assistant<|chan", "The user wants a<b. Use the tool.", ""),  # a header cut short
    ("<|channel|>commentary<|message|>Let me look.<|end|>", None, "Let me look."),  # a preamble
    ("Plain text, no harmony.", None, "Plain text, no harmony."),
    ("to be or not", None, "to be or not"),  # looks like a recipient at first
    ("<|channel|>final<|message|>a<|end|><|channel|>final<|message|>b", None, "ab"),  # no <|start|> between
    (
        THINK + call_text("get_weather", '{"city": "Paris"}')[:-8],  # the <|call|> was the EOS
        "The user wants a<b. Use the tool.",
        '<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{"city": "Paris"}',
    ),
    (
        ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>',
        None,
        '<|start|>assistant to=functions.get_time<|channel|>commentary<|message|>{"zone": "UTC"}<|call|>',
    ),
]


@pytest.mark.parametrize("answer, reasoning, content", REASONING)
def test_reasoning_whole_and_in_every_cut(answer: str, reasoning: str | None, content: str) -> None:
    assert split(answer, "harmony") == (reasoning, content)
    for a in range(len(answer) + 1):
        for b in range(a, len(answer) + 1):
            p = ReasoningParser("harmony")
            pieces = [x for part in (answer[:a], answer[a:b], answer[b:]) for x in p.feed(part)] + p.finish()
            got = "".join(t for k, t in pieces if k == "reasoning") or None
            assert (got, "".join(t for k, t in pieces if k == "content")) == (reasoning, content), (a, b)
            assert p.reasoning == (reasoning or "")


def test_markers_never_reach_the_reasoning_or_the_final_answer() -> None:
    p = ReasoningParser("harmony")
    said = [p.feed(c) for c in THINK + "<|start|>assistant<|channel|>final<|message|>Hi <3<|return|>"]
    text = "".join(t for pieces in said for _, t in pieces) + "".join(t for _, t in p.finish())
    assert text == "The user wants a<b. Use the tool.Hi <3"
    assert p.feed("") == []


# -- the tool-call parser ----------------------------------------------------------------------------
PARIS, UTC = '{"city": "Paris"}', '{"zone": "UTC"}'
ANSWERS = [  # (the model's text, content, [(name, arguments)])
    (THINK + call_text("get_weather", PARIS), None, [("get_weather", {"city": "Paris"})]),
    (THINK + call_text("get_weather", PARIS)[:-8], None, [("get_weather", {"city": "Paris"})]),  # EOS
    (THINK + call_text("get_time", UTC, recipient_first=True), None, [("get_time", {"zone": "UTC"})]),
    (
        call_text("get_time", UTC, recipient_first=True)[len("<|start|>assistant") :],
        None,
        [("get_time", {"zone": "UTC"})],
    ),
    (
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        + call_text("get_weather", '{"city":"Oslo"}')
        + call_text("get_time", UTC),
        "Checking both.",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})],
    ),
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>", "It is sunny.", []),
    ('<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>', "", []),  # not ours
    ("Just text.", "Just text.", []),
    (call_text("get_time", "")[len("<|start|>assistant") :], None, [("get_time", {})]),  # no arguments
]


def stream(pieces: list[str], style: str = "harmony", reasoning: bool = False) -> tuple[str, list[dict], Any]:
    """Feed the pieces (through the reasoning parser first, as the renderers do, when `reasoning`);
    returns the content, the calls as a client would assemble them from the events, and the parser."""
    parser = tools.parser("harmony")
    r = ReasoningParser("harmony") if reasoning else None

    def content_of(said: list[tuple[str, str]]) -> str:
        return "".join(t for k, t in said if k == "content")

    events = []
    for piece in pieces:
        text = content_of(r.feed(piece)) if r else piece
        events += parser.feed(text) if text else []
    events += (parser.feed(content_of(r.finish())) if r else []) + parser.finish()
    content, calls = assemble(events)
    return content, calls, parser


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_calls_are_found_whole_and_streamed_in_any_cut(text, content, calls):
    got_content, got_calls = tools.parse(text, "harmony")
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(calls)
    _, after_reasoning = split(text, "harmony")  # --reasoning-parser harmony: the tool parser reads the rest
    assert [(c.name, c.arguments) for c in tools.parse(after_reasoning, "harmony")[1]] == [
        (c.name, c.arguments) for c in got_calls
    ]
    cuts = [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 2, 3, 7)]
    cuts += [[text[:at], text[at:]] for at in range(len(text) + 1)]
    for pieces in cuts:
        for reasoning in (False, True):
            s_content, s_calls, parser = stream(pieces, reasoning=reasoning)
            assert (s_content.strip() or None if calls else s_content) == content, (pieces, reasoning)
            assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == calls, pieces
            assert [c.arguments for c in parser.calls] == [c["arguments"] for c in s_calls]
            assert parser.cut is None


def test_a_call_cut_short_is_no_call_and_its_text_is_content():
    cut = (
        THINK
        + call_text("get_weather", PARIS)
        + call_text("get_time", UTC)
        + call_text("get_weather", '{"ci')[:-8]
    )
    content, calls = tools.parse(cut, "harmony")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", PARIS), ("get_time", UTC)]
    assert content == '{"ci'  # what it wrote of its arguments, no markers
    _, rest = split(cut, "harmony")  # the same after the reasoning parser
    after, again = tools.parse(rest, "harmony")
    assert after == content and [(c.name, c.arguments) for c in again] == [
        (c.name, c.arguments) for c in calls
    ]
    # cut inside its header: nothing of it was said
    content, calls = tools.parse(
        THINK + "<|start|>assistant<|channel|>commentary to=functions.get_we", "harmony"
    )
    assert (content, calls) == ("", [])


def test_arguments_stream_as_they_are_written():
    parser = tools.parser("harmony")
    assert parser.feed(THINK + "<|start|>assistant<|channel|>commentary to=functions.get_weather ") == []
    assert [type(e) for e in parser.feed("<|constrain|>json<|mess")] == []
    assert [type(e) for e in parser.feed("age|>")] == [tools.CallStart]
    pieces = [parser.feed(p) for p in ['{"ci', 'ty": "Pa', 'ris"}<', "|ca", "ll|>"]]
    assert [[e.text for e in p] for p in pieces] == [['{"ci'], ['ty": "Pa'], ['ris"}'], [], []]
    assert parser.finish() == [] and parser.calls[0].arguments == PARIS


# -- the chat template and the style -----------------------------------------------------------------
def test_gpt_oss_template_is_the_harmony_style():
    assert tools.style_of(TEMPLATE) == "harmony"
    assert tools.style_of("{{ tools }}<tool_call>") == "hermes"
    assert tools.keeps_special_tokens(TEMPLATE, None, None)  # the parsers need the markers
    assert tools.keeps_special_tokens(None, None, "harmony")
    assert tools.keeps_special_tokens(None, "mistral", None)
    assert not tools.keeps_special_tokens("{{ tools }}<tool_call>", "hermes", "qwen3")


def test_a_tool_call_and_its_result_render_as_harmony(htok):
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = schema.ChatCompletionRequest.model_validate(
        {"messages": history, "tools": [WEATHER], "reasoning_effort": "low"}
    )
    chat, _ = schema.to_chat(body)
    msgs, tool_list = tools.template_messages(chat.messages, plan(), "harmony")
    text = htok.apply_chat_template(msgs, tools=tool_list, **chat.template_kwargs)
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: low\n" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n" in text
    assert "// The weather in a city\ntype get_weather = (_: {\ncity: string,\n}) => any;" in text
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in text
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        in text
    )
    assert text.endswith(
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant'
    )
    plain = htok.apply_chat_template(msgs, tools=tool_list)
    assert "Reasoning: medium\n" in plain  # the template's default


def test_reasoning_effort_is_accepted_on_chat_and_responses():
    body = schema.ChatCompletionRequest.model_validate(
        {
            "messages": [],
            "reasoning_effort": "high",
            "chat_template_kwargs": {"reasoning_effort": "low", "x": 1},
        }
    )
    assert schema.to_chat(body)[0].template_kwargs == {"reasoning_effort": "high", "x": 1}
    assert schema.to_chat(schema.ChatCompletionRequest(messages=[]))[0].template_kwargs == {}
    with pytest.raises(pydantic.ValidationError):
        schema.ChatCompletionRequest.model_validate({"messages": [], "reasoning_effort": "extreme"})
    r = responses.ResponseRequest.model_validate(
        {"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}
    )
    assert responses.to_chat(r, [Message("user", "hi")]).template_kwargs == {"reasoning_effort": "low"}
    plain = responses.ResponseRequest.model_validate({"input": "hi"})
    assert responses.to_chat(plain, [Message("user", "hi")]).reasoning_effort is None


# -- the tokenizer: special tokens kept, <|call|> and <|return|> end the answer --------------------------
def test_the_answer_keeps_harmony_markers_and_ends_at_call_or_return(htok):
    assert {ID["<|call|>"], ID["<|return|>"]} <= set(htok.eos_token_ids)
    assert htok.special_id("<|channel|>") == ID["<|channel|>"] and htok.special_id("channel") is None
    answer = (
        THINK
        + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + PARIS
    )
    ids = htok.encode(answer, add_special_tokens=False) + [ID["<|call|>"]]
    out = OutputProcessor(
        htok, [ID["<|start|>"]], SamplingParams(max_new_tokens=100, skip_special_tokens=False)
    )
    for i, t in enumerate(ids):
        out.process(P.TokenOut("r", t, finish_reason="eos_token" if i == len(ids) - 1 else None))
    assert out.text == answer  # every marker kept; the EOS (<|call|>) is no text
    reasoning, content = split(out.text, "harmony")
    assert reasoning == "The user wants a<b. Use the tool."
    assert [(c.name, c.arguments) for c in tools.parse(content, "harmony")[1]] == [("get_weather", PARIS)]
    skipped = OutputProcessor(htok, [], SamplingParams(max_new_tokens=100))
    for t in ids[:8]:
        skipped.process(P.TokenOut("r", t))
    assert "<|" not in skipped.text  # what the parsers could not read: hence keeps_special_tokens


# -- the grammar of a forced call --------------------------------------------------------------------
def test_required_forces_one_well_formed_call(harmony_dir, htok):
    ll = llguidance.LLTokenizer((harmony_dir / "tokenizer.json").read_text(), n_vocab=htok.vocab_size)
    g = tools.grammar(plan("required"), htok.special_id)
    assert g is not None and f"<[{ID['<|call|>']}]>" in g.value

    def ids(text: str) -> list[int]:  # the markers as their special tokens, the rest as text
        out: list[int] = []
        for i, part in enumerate(text.replace("<|", "\0<|").replace("|>", "|>\0").split("\0")):
            out += [ID[part]] if part in ID else htok.encode(part, add_special_tokens=False)
        return out

    def accepts(grammar: Any, text: str) -> bool:
        m = llguidance.LLMatcher(ll, structured.check(SamplingParams(grammar=grammar.value)))
        return all(m.consume_token(t) for t in ids(text)) and m.is_accepting()

    def forced(name: str, args: str) -> str:
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"

    assert accepts(g, forced("get_weather", PARIS)) and accepts(g, forced("get_time", UTC))
    assert not accepts(g, forced("get_weather", '{"town": "Paris"}'))  # not its schema
    assert not accepts(g, forced("get_news", "{}"))
    assert not accepts(g, forced("get_weather", PARIS) + "<|start|>assistant" + forced("get_time", UTC))
    assert not accepts(g, "<|channel|>final<|message|>It is sunny.<|return|>")
    assert "<|" not in g.value  # every marker is named by its special token's id
    named = tools.grammar(plan({"type": "function", "function": {"name": "get_time"}}), htok.special_id)
    assert accepts(named, forced("get_time", UTC)) and not accepts(named, forced("get_weather", PARIS))
    # what the grammar forces is a call for the parser
    text = htok.decode(
        ids(forced("get_weather", PARIS))[:-1], skip_special_tokens=False
    )  # the EOS is no text
    assert [(c.name, c.arguments) for c in tools.parse(text, "harmony")[1]] == [("get_weather", PARIS)]


# -- what the OpenAI routes send ---------------------------------------------------------------------
def test_openai_chunks_and_message_with_harmony_reasoning_and_calls():
    answer = THINK + call_text("get_weather", PARIS)[:-8]
    for cut in range(1, len(answer)):
        r = render.StreamRenderer(
            True, {"id": "c"}, 1, False, False, 3, str, tool_style="harmony", reasoning_style="harmony"
        )
        parts = [answer[:cut], answer[cut:]]
        chunks = [
            c
            for k, p in enumerate(parts)
            for c in r.delta(0, Delta(k + 1, Token(0, p, None), [], p, "eos_token" if k else None))
        ]
        deltas: list[Any] = [
            c["choices"][0]["delta"] for c in chunks
        ]  # the wire's JSON, as the test knows it
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants a<b. Use the tool."
        assert "".join(d.get("content") or "" for d in deltas) == "", cut
        args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
        assert args == PARIS, cut
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message, finish = render.chat_message(answer, "eos_token", "harmony", "harmony")
    assert message["reasoning_content"] == "The user wants a<b. Use the tool." and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": PARIS}]
    assert finish == "tool_calls"
    # tools without the reasoning parser: the analysis is neither content nor anything else
    message, finish = render.chat_message(
        THINK + "<|start|>assistant<|channel|>final<|message|>Sunny.", "eos_token", "harmony"
    )
    assert (message["content"], finish) == ("Sunny.", "stop") and "reasoning_content" not in message


def test_the_markers_are_the_harmony_special_tokens():
    assert set(harmony.MARKERS) == set(SPECIALS[1:])
    assert harmony.held("abc<|ca") == 4 and harmony.held("a<b") == 0 and harmony.held("x<") == 1
