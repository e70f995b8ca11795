"""OpenAI's Responses API without an engine: input items into chat messages, the store's bound, and
the stream's events from deltas with a tool call cut at every character."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pytgi.api.chat.language import Message
from pytgi.api.chat.tools import CLOSE, OPEN
from pytgi.api.openai import responses as R
from pytgi.api.openai.error_shape import OpenAIError
from pytgi.core.outputs import Delta, Token


def test_input_items_become_chat_messages() -> None:
    msgs = R.input_messages(
        [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"c": "P"}'},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"c": "R"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {"type": "function_call_output", "call_id": "c2", "output": {"t": 20}},
        ]
    )
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "tool"]  # developer: system
    assert [c.id for c in msgs[2].calls] == ["c1", "c2"]  # consecutive calls: one turn
    assert msgs[4].content == '{"t": 20}' and R.input_messages("hi") == [Message("user", "hi")]
    with pytest.raises(OpenAIError):
        R.input_messages([{"type": "input_image"}])


def test_the_store_keeps_the_newest() -> None:
    store = R.Store(size=2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r2") == ({"id": "r2"}, [])


def test_the_store_stays_under_its_byte_bound() -> None:
    """2,000 large conversations (100 kB each) through a 1 MB store: the newest kept, the bytes bounded,
    one bigger than the bound never kept; a response stored again under its id counts once."""
    store = R.Store(size=1000, max_bytes=1_000_000)
    big = [{"role": "user", "content": "x" * 100_000}]
    for i in range(2000):
        store.put({"id": f"r{i}"}, big)
        assert store.bytes <= 1_000_000
    kept = [i for i in range(2000) if store.get(f"r{i}") is not None]
    assert kept == list(range(2000 - len(kept), 2000)) and 5 <= len(kept) <= 9
    assert store.bytes == sum(len(json.dumps([{"id": f"r{i}"}, big]).encode()) for i in kept)
    store.put({"id": "r1999"}, big)
    assert len([i for i in range(2000) if store.get(f"r{i}") is not None]) == len(kept)
    store.put({"id": "huge"}, [{"role": "user", "content": "y" * 2_000_000}])
    assert store.get("huge") is None and store.get("r1999") is not None


def stream_events(text: str, cut: int, style) -> list[dict]:
    done: dict[str, Any] = {}

    def final(status, items, generated):
        done.update(status=status, items=[dict(i) for i in items], generated=generated)
        return {"id": "resp_1", "status": status}

    s = R.ResponseStream(final, style, None)
    raw = s.start({"id": "resp_1"})
    for k, part in enumerate([text[:cut], text[cut:]]):
        raw += s.delta(Delta(k + 1, Token(0, part, None), [], part, "eos_token" if k else None))
    events = [json.loads(e.split("\n")[1][6:]) for e in raw]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_text_then_a_call_cut_anywhere() -> None:
    text = "Checking." + f'{OPEN}\n{{"name": "w", "arguments": {{"c": "Paris"}}}}\n{CLOSE}'
    for cut in range(1, len(text)):
        events = stream_events(text, cut, "hermes")
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == ["message", "function_call"], cut
        said = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        assert said == "Checking." and json.loads(args) == {"c": "Paris"}, cut
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done[0]["content"][0]["text"] == "Checking." and json.loads(done[1]["arguments"]) == {
            "c": "Paris"
        }
        assert events[-1]["type"] == "response.completed"
