"""What the model answered, in the chat language: a whole answer split into its reasoning, its content
and its tool calls (`read`), or an answer's deltas turned into the same pieces as they can be said
(`AnswerStream`). The reasoning parser (`--reasoning-parser`) takes the reasoning out first, then the
tool-call parser of the template's style finds the calls in the rest. Each chat API renders these in
its own shapes. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

from pytgi.api.chat import reasoning, tools
from pytgi.core.outputs import Delta


@dataclass(frozen=True)
class Reasoning:
    text: str


Piece = Reasoning | tools.Event  # reasoning, content, a call's start, a piece of its arguments


@dataclass(frozen=True)
class Answer:
    """A whole answer. `text`: what follows the reasoning, calls and all; `content`: that text without
    the calls (None when there is nothing else); `calls`: the complete calls."""

    reasoning: str | None
    text: str
    content: str | None
    calls: list[tools.ToolCall]


def read(text: str, tool_style: tools.Style | None, reasoning_style: str | None) -> Answer:
    """A whole answer's pieces (no tool style: no calls; no reasoning style: no reasoning)."""
    thought, text = reasoning.split(text, reasoning_style) if reasoning_style else (None, text)
    content, calls = (text, []) if tool_style is None else tools.parse(text, tool_style)
    return Answer(thought, text, content, calls)


class AnswerStream:
    """One answer's deltas as pieces: its reasoning first, then its content and calls. Nothing said is
    taken back; what may still turn out otherwise is held until it is clear."""

    def __init__(self, tool_style: tools.Style | None, reasoning_style: str | None) -> None:
        self.parser = tools.parser(tool_style) if tool_style else None
        self.reasoner = reasoning.ReasoningParser(reasoning_style) if reasoning_style else None

    @property
    def calls(self) -> list[tools.ToolCall]:
        """The calls found so far."""
        return self.parser.calls if self.parser is not None else []

    def feed(self, d: Delta) -> list[Piece]:
        done, text = d.finish_reason is not None, d.text
        out: list[Piece] = []
        if self.reasoner is not None:
            said = (self.reasoner.feed(d.text) if d.text else []) + (self.reasoner.finish() if done else [])
            out += [Reasoning(t) for kind, t in said if kind == "reasoning"]
            text = "".join(t for kind, t in said if kind == "content")
        if self.parser is None:
            out += [tools.Content(text)] if text else []
        else:
            out += (self.parser.feed(text) if text else []) + (self.parser.finish() if done else [])
        return out
