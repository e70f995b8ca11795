"""gpt-oss's *harmony* format, as the model writes it after a prompt that ends ``<|start|>assistant``:
one message after another, each a header, ``<|message|>``, its text and an end token::

    <|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The header names the message's channel (``analysis``: reasoning; ``commentary``: a preamble the user
may see, or a tool call; ``final``: the answer) and, for a tool call, its recipient
(``to=functions.NAME``, before or after the channel), with an optional content type (``json`` or
``<|constrain|>json``). ``<|return|>`` and ``<|call|>`` end the answer (they are the model's EOS ids, so
they are usually not in the text at all: the answer then ends inside its last message).

`Messages` splits the text into messages as it streams; `HarmonyReasoning` is ``--reasoning-parser
harmony`` on top of it, and `pytgi.api.chat.tool_calls.HarmonyParser` the ``harmony`` tool-call
style. Nothing said is taken back: text that may be the start of a marker is held until it is clear,
and no marker ever reaches the client. No torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
# special tokens all (o200k_harmony's ids 200006, 200007, 200008, 200005, 200003, 200002, 200012): the
# answer's text keeps them for these parsers (`tools.keeps_special_tokens`)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)  # what closes a message
FUNCTIONS = "functions."  # the namespace of the request's tools in a recipient
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_PLAIN_HEAD = "to="  # an answer may open with its recipient, before its channel
Kind = Literal["reasoning", "content"]


def held(text: str) -> int:
    """How much of the end of `text` could be the start of a marker."""
    at = text.find("<", max(0, len(text) - max(map(len, MARKERS)) + 1))
    while at >= 0:
        if any(m.startswith(text[at:]) for m in MARKERS):
            return len(text) - at
        at = text.find("<", at + 1)
    return 0


@dataclass
class Message:
    channel: str | None  # analysis | commentary | final (None: the header named none)
    recipient: str | None  # e.g. functions.get_weather
    at: int  # where its text starts in all that was fed

    @property
    def function(self) -> str | None:
        """The tool it calls, when it is a call of one of the request's functions."""
        if self.recipient and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS) :] or None
        return None


def _header(text: str, at: int) -> Message:
    """A header's message: `text` is what came between its start and `<|message|>`."""
    recipient, channel = _RECIPIENT.search(text), _CHANNEL.search(text)
    return Message(channel.group(1) if channel else None, recipient.group(1) if recipient else None, at)


@dataclass
class Open:
    message: Message


@dataclass
class Text:
    text: str  # the open message's text, or text outside any message (`message` None)
    message: Message | None


@dataclass
class Close:
    message: Message
    marker: str  # END, RETURN or CALL; "" when the next message began without one


Piece = Open | Text | Close


@dataclass
class Messages:
    """Harmony text, fed piece by piece, as messages: each `feed` and `finish` returns what is clear now
    (a message's start once its header is whole, pieces of its text, its end). Text that is in no
    message (an answer that is not harmony) comes as `Text` without a message."""

    _state: str = "start"  # start | header | body | outside
    _buf: str = ""  # text not looked at yet (in a header: the header so far)
    _fed: int = 0
    _message: Message | None = None  # the open message
    _plain: bool = False  # the header opened the answer without a marker (`to=...`): it may be text

    def feed(self, text: str) -> list[Piece]:
        self._fed += len(text)
        self._buf += text
        out: list[Piece] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        while self._step(out, final=True):
            pass
        if self._state == "header" and self._plain and CHANNEL not in self._buf:
            out.append(Text(self._buf, None))  # it was text after all
        # else a header cut short: nothing of it is said; an open message ends without its marker
        self._buf, self._state, self._message = "", "outside", None
        return out

    def _step(self, out: list[Piece], final: bool) -> bool:
        """Move on through `_buf`; True when there is more to do."""
        buf = self._buf
        if self._state == "start":  # the first message's header follows the prompt's <|start|>assistant
            head = buf.lstrip()
            if head.startswith((CHANNEL, _PLAIN_HEAD)):
                self._state, self._plain = "header", not head.startswith(CHANNEL)
                return True
            if not final and (not head or CHANNEL.startswith(head) or _PLAIN_HEAD.startswith(head)):
                return False
            self._state = "outside"
            return True
        if self._state == "header":
            at = buf.find(MESSAGE)
            if at < 0:
                return False
            self._buf = buf[at + len(MESSAGE) :]
            self._message = _header(buf[:at], self._fed - len(self._buf))
            self._state = "body"
            out.append(Open(self._message))
            return True
        # in a message's text or outside any: up to the next marker
        found = [(i, m) for m in MARKERS if (i := buf.find(m)) >= 0]
        if not found:
            keep = 0 if final else held(buf)
            self._say(out, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        at, marker = min(found)
        self._say(out, buf[:at])
        self._buf = buf[at + len(marker) :]
        if marker in (START, CHANNEL):  # a new message (without its end token before it: closed anyway)
            self._close(out, "")
            self._state, self._plain = "header", False
            if marker == CHANNEL:
                self._buf = buf[at:]
        elif marker in ENDS:
            self._close(out, marker)
            self._state = "outside"
        # a stray <|message|> or <|constrain|> is dropped
        return True

    def _say(self, out: list[Piece], text: str) -> None:
        if text:
            out.append(Text(text, self._message))

    def _close(self, out: list[Piece], marker: str) -> None:
        if self._message is not None:
            out.append(Close(self._message, marker))
            self._message = None


def call_header(message: Message) -> str:
    """A call's message header as the tool-call parser reads it (the reasoning parser passes calls on)."""
    return f"{START}assistant to={message.recipient}{CHANNEL}{message.channel or 'commentary'}{MESSAGE}"


@dataclass
class HarmonyReasoning:
    """``--reasoning-parser harmony``: the analysis channel is reasoning; the final channel, commentary
    preambles and text in no message are content. A message with a recipient (a tool call) is passed on
    in the content as harmony (`call_header`, its text, `<|call|>`) for the tool-call parser to find;
    without tools, a client sees it so. Feed the answer piece by piece; each call returns the (kind,
    text) pieces that can be said now."""

    reasoning: str = ""  # all the reasoning so far
    _messages: Messages = field(default_factory=Messages)

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        return self._said(self._messages.feed(text))

    def finish(self) -> list[tuple[Kind, str]]:
        return self._said(self._messages.finish())

    def _said(self, pieces: list[Piece]) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        for p in pieces:
            m = p.message
            if isinstance(p, Open):
                text = call_header(p.message) if p.message.recipient else ""
            elif isinstance(p, Close):
                text = (p.marker if p.marker in (CALL, END) else CALL) if p.message.recipient else ""
            else:
                text = p.text
            if not text:
                continue
            if m is not None and m.channel == "analysis" and not m.recipient:
                self.reasoning += text
                out.append(("reasoning", text))
            else:
                out.append(("content", text))
        return out
