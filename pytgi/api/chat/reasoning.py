"""Reasoning output: a reasoning model's answer split into its reasoning and its content, whole or as
it streams (`--reasoning-parser`). The `<think>…</think>` family:

- `qwen3`: the model opens the block itself (`<think>` first, whitespace aside); an answer that does
  not start with it is all content (Qwen3 with `enable_thinking: false`, or any model that did not
  think).
- `deepseek_r1`: the chat template opens the block in the prompt, so the answer starts inside it (a
  `<think>` the model repeats is dropped) and everything up to `</think>` is reasoning; an answer
  cut before `</think>` is all reasoning.

And `harmony` (gpt-oss): the analysis channel is the reasoning, the final channel (and commentary
preambles) the content (`pytgi.api.chat.harmony`).

Nothing said is taken back: text that may be the start of a tag is held until it is clear. No torch.
"""

from __future__ import annotations

from typing import Literal

from pytgi.api.chat.harmony import HarmonyReasoning
from pytgi.core.config import REASONING_PARSERS

START, END = "<think>", "</think>"
PARSERS = REASONING_PARSERS  # each one a style of `Reasoning` below
Kind = Literal["reasoning", "content"]


def _held(text: str, tag: str) -> int:
    """How much of the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Feed the answer piece by piece; each call returns the (kind, text) pieces that can be said now."""

    def __init__(self, style: str) -> None:
        if style not in PARSERS:
            raise ValueError(f"unknown reasoning parser {style!r}: one of {', '.join(PARSERS)}")
        # "open": before the answer's first text is known; "inside": reasoning; "content": after it
        self.state = "open"
        self.starts_inside = style == "deepseek_r1"
        self.buffer = ""
        self.trim = False  # drop the whitespace that starts the content after the reasoning
        self.reasoning = ""  # all the reasoning so far
        self.harmony = HarmonyReasoning() if style == "harmony" else None  # messages, not a <think> block

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        if self.harmony is not None:
            return self._harmony(self.harmony.feed(text))
        self.buffer += text
        out: list[tuple[Kind, str]] = []
        if self.state == "open":
            head = self.buffer.lstrip()
            if START.startswith(head) and len(head) < len(START):
                return out  # still maybe the opening tag
            if head.startswith(START):
                self.buffer, self.state = head[len(START) :], "inside"
            else:
                self.state = "inside" if self.starts_inside else "content"
        if self.state == "inside":
            end = self.buffer.find(END)
            if end < 0:
                keep = _held(self.buffer, END)
                said, self.buffer = (
                    self.buffer[: len(self.buffer) - keep],
                    self.buffer[len(self.buffer) - keep :],
                )
                return self._say(out, "reasoning", said)
            self._say(out, "reasoning", self.buffer[:end])
            self.buffer, self.state, self.trim = self.buffer[end + len(END) :], "content", True
        if self.state == "content":
            if self.trim:  # the whitespace between the reasoning and the answer is neither
                self.buffer = self.buffer.lstrip()
                self.trim = not self.buffer
            said, self.buffer = self.buffer, ""
            self._say(out, "content", said)
        return out

    def finish(self) -> list[tuple[Kind, str]]:
        """The held text, once the answer is complete (a partial tag is text after all)."""
        if self.harmony is not None:
            return self._harmony(self.harmony.finish())
        inside = self.state == "inside" or (self.state == "open" and self.starts_inside)
        said, self.buffer = self.buffer, ""
        return self._say([], "reasoning" if inside else "content", said)

    def _harmony(self, pieces: list[tuple[Kind, str]]) -> list[tuple[Kind, str]]:
        assert self.harmony is not None
        self.reasoning = self.harmony.reasoning
        return pieces

    def _say(self, out: list[tuple[Kind, str]], kind: Kind, text: str) -> list[tuple[Kind, str]]:
        if text:
            if kind == "reasoning":
                self.reasoning += text
            out.append((kind, text))
        return out


def split(text: str, style: str) -> tuple[str | None, str]:
    """A whole answer's (reasoning or None, content)."""
    parser = ReasoningParser(style)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(t for k, t in pieces if k == "content")
    return (parser.reasoning or None), content
