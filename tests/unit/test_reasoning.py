"""The reasoning parser over whole answers and over every way a stream can cut them."""

from __future__ import annotations

from typing import Any

import pytest

from pytgi.api.chat.reasoning import ReasoningParser, split

CASES = [
    # (style, answer, reasoning, content)
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "It is 4."),
    ("qwen3", "  <think>a<b</think>c", "a<b", "c"),
    ("qwen3", "It is 4.", None, "It is 4."),  # did not think
    ("qwen3", "<thin", None, "<thin"),  # a partial tag that never completed is text
    ("qwen3", "<think>cut before the end", "cut before the end", ""),
    ("deepseek_r1", "Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    ("deepseek_r1", "<think>Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    ("deepseek_r1", "cut before the end </thi", "cut before the end </thi", ""),
    ("deepseek_r1", "</think>only an answer", None, "only an answer"),
]


@pytest.mark.parametrize("style, answer, reasoning, content", CASES)
def test_whole_answers(style: str, answer: str, reasoning: str | None, content: str) -> None:
    assert split(answer, style) == (reasoning, content)


@pytest.mark.parametrize("style, answer, reasoning, content", CASES)
def test_every_cut_of_a_stream_says_the_same(
    style: str, answer: str, reasoning: str | None, content: str
) -> None:
    for a in range(len(answer) + 1):
        for b in range(a, len(answer) + 1):
            p = ReasoningParser(style)
            pieces = [x for part in (answer[:a], answer[a:b], answer[b:]) for x in p.feed(part)] + p.finish()
            got_r = "".join(t for k, t in pieces if k == "reasoning") or None
            got_c = "".join(t for k, t in pieces if k == "content")
            assert (got_r, got_c) == (reasoning, content), (a, b)
            kinds = [k for k, _ in pieces]
            assert kinds == sorted(kinds, key=lambda k: k == "content"), (
                a,
                b,
            )  # reasoning first, then content


def test_unknown_style_is_refused() -> None:
    with pytest.raises(ValueError, match="deepseek_r1"):
        ReasoningParser("nope")


def test_openai_chunks_carry_reasoning_content_then_content() -> None:
    import json as _json

    from pytgi.api.openai import render
    from pytgi.core.outputs import Delta, Token

    answer = "<think>\nadd 2 and 2\n</think>\n\nIt is 4."
    for cut in range(1, len(answer)):
        r = render.StreamRenderer(True, {"id": "c"}, 1, False, False, 3, str, reasoning_style="qwen3")
        parts = [answer[:cut], answer[cut:]]
        chunks = [
            c
            for k, p in enumerate(parts)
            for c in r.delta(0, Delta(k + 1, Token(0, p, None), [], p, "eos_token" if k else None))
        ]
        deltas: list[Any] = [
            c["choices"][0]["delta"] for c in chunks
        ]  # the wire's JSON, as the test knows it
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nadd 2 and 2\n", cut
        assert "".join(d.get("content") or "" for d in deltas) == "It is 4.", cut
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    message, _ = render.chat_message(answer, "eos_token", None, "qwen3")
    assert (message["reasoning_content"], message["content"]) == ("\nadd 2 and 2\n", "It is 4.")
    assert _json.dumps(message)


def test_anthropic_thinking_blocks() -> None:
    import json as _json
    from types import SimpleNamespace

    from pytgi.api import anthropic as A
    from pytgi.core.outputs import Delta, Token

    answer = "<think>add</think>It is 4."
    out = SimpleNamespace(
        finish_reason="eos_token", stop_sequence=None, text=answer, tokens=[1, 2], num_cached_tokens=0
    )
    msg = A.message_json("m", "x", out, None, "qwen3", 3)
    assert msg["content"] == [
        {"type": "thinking", "thinking": "add", "signature": ""},
        {"type": "text", "text": "It is 4."},
    ]
    s = A.MessageStream({"id": "m"}, lambda: out, None, "qwen3")  # type: ignore[return-value]
    events = [
        _json.loads(e.split("\n")[1][6:])
        for e in s.start() + s.delta(Delta(1, Token(0, answer, None), [], answer, "eos_token"))
    ]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    kinds = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert starts == ["thinking", "text"] and kinds == ["thinking_delta", "text_delta"]


@pytest.mark.parametrize("kind", ["json_schema", "regex", "grammar"])
def test_constraints_apply_after_the_think_block(kind: str, tokenizer_dir, tok) -> None:
    import llguidance

    from pytgi.core import grammar as structured
    from pytgi.core.sampling_params import SamplingParams

    given = {
        "json_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        },
        "regex": r'\{"a": [0-9]\}',
        "grammar": 'start: "{\\"a\\": " /[0-9]/ "}"',
    }[kind]
    ll = llguidance.LLTokenizer((tokenizer_dir / "tokenizer.json").read_text(), n_vocab=tok.vocab_size)
    for style, texts_ok, texts_bad in [
        ("qwen3", ['<think>a is 1</think>\n{"a": 1}', '{"a": 1}'], ["<think>x</think>no", "no"]),
        ("deepseek_r1", ['a is 1</think>{"a": 1}'], ["a</think>no"]),
    ]:
        grammar = structured.check(SamplingParams(**{kind: given}, reasoning=style))
        for text, want in [(t, True) for t in texts_ok] + [(t, False) for t in texts_bad]:
            m = llguidance.LLMatcher(ll, grammar)
            ok = bool(m.consume_tokens(ll.tokenize_str(text))) and m.is_accepting()
            assert ok == want, (style, kind, text)


def test_a_constraint_that_writes_the_think_block_applies_from_the_start() -> None:
    from pytgi.core import grammar as structured
    from pytgi.core.sampling_params import SamplingParams

    regex = r"<think>[a-z]+</think>[A-Z]"
    assert structured.check(SamplingParams(regex=regex, reasoning="qwen3")) == structured.check(
        SamplingParams(regex=regex)
    )
