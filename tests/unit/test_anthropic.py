"""Anthropic's Messages API without an engine: the body's translation into the chat request, and the
stream's events from deltas (text, a tool call cut at every character), in Anthropic's order."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pytgi.api import anthropic as A
from pytgi.api.chat.language import Call, Named
from pytgi.api.chat.tools import CLOSE, OPEN
from pytgi.core.errors import InvalidRequest
from pytgi.core.outputs import Delta, Token


def body(**kw) -> A.MessagesRequest:
    return A.MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


def test_system_blocks_tools_and_results_become_the_chat_request() -> None:
    chat = A.to_chat(
        body(
            system=[{"type": "text", "text": "Be brief."}],
            messages=[
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "P"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "18C"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            tools=[{"name": "w", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["x"],
            temperature=0.5,
        )
    )
    msgs = chat.messages
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[2].calls == [Call("w", json.dumps({"c": "P"}), "t1")] and msgs[2].content == "Let me look."
    assert msgs[3].call_id == "t1" and msgs[3].content == "18C"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    sampling = chat.sampling
    assert sampling.stop == ["x"] and sampling.temperature == 0.5 and sampling.max_tokens == 8
    named = A.to_chat(
        body(
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"name": "w", "input_schema": {}}],
            tool_choice={"type": "tool", "name": "w"},
        )
    )
    assert named.tool_choice == Named("w")


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.5),
        dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        dict(
            messages=[
                {"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "w", "input": {}}]}
            ]
        ),
        dict(tools=[{"name": "w", "input_schema": {}}], tool_choice={"type": "tool"}),
    ],
)
def test_what_cannot_be_converted_is_a_400(kw: dict) -> None:
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequest) as e:
        A.to_chat(body(**kw))
    status, err = A.as_anthropic(e.value)
    assert status == 400 and err == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": e.value.message},
    }


def deltas(text: str, cuts: list[int], finish: str) -> list[Delta]:
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [
        Delta(i + 1, Token(0, p, None), [], p, finish if i == len(pieces) - 1 else None)
        for i, p in enumerate(pieces)
    ]


def events(text: str, cuts: list[int], style, finish: str = "eos_token") -> list[dict]:
    out = SimpleNamespace(finish_reason=finish, stop_sequence=None, num_cached_tokens=0)
    stream = A.MessageStream({"id": "msg_1"}, lambda: out, style)  # type: ignore[return-value]
    raw = stream.start() + [e for d in deltas(text, cuts, finish) for e in stream.delta(d)]
    parsed = []
    for e in raw:
        name, data = e.split("\n")[:2]
        parsed.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {parsed[-1]['type']}"
    return parsed


def test_text_stream_events_in_order() -> None:
    ev = events("Hello there", [3, 7], None, finish="length")
    assert [e["type"] for e in ev] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(e["delta"]["text"] for e in ev if e["type"] == "content_block_delta") == "Hello there"
    assert ev[-2]["delta"]["stop_reason"] == "max_tokens" and ev[-2]["usage"]["output_tokens"] == 3


def test_a_tool_call_cut_anywhere_streams_the_same_blocks() -> None:
    call = f'{OPEN}\n{{"name": "w", "arguments": {{"c": "Paris"}}}}\n{CLOSE}'
    text = "Let me check." + call
    for cut in range(1, len(text)):
        ev = events(text, [cut], "hermes")
        starts = [e["content_block"] for e in ev if e["type"] == "content_block_start"]
        assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["name"] == "w", cut
        by_block: dict[int, str] = {}
        for e in ev:
            if e["type"] == "content_block_delta":
                d = e["delta"]
                by_block[e["index"]] = by_block.get(e["index"], "") + d.get("text", d.get("partial_json", ""))
        assert by_block[0] == "Let me check." and json.loads(by_block[1]) == {"c": "Paris"}, cut
        assert ev[-2]["delta"]["stop_reason"] == "tool_use"
