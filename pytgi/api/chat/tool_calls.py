"""Tool calls in what the model writes, whole or as it streams: one parser per format (the chat
template chooses it, `tools.style_of`). Each parser's `feed` and `finish` return what can be said now:
content, a call's start (its id and name), pieces of its arguments; nothing said is taken back, and text
that may begin a call is held until it is clear. No torch here.

- ``hermes``/``prompted``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number.
- ``json``: one bare object ``{"name": ..., "parameters": {...}}`` as the whole answer (Llama 3.1/3.2).
- ``mistral``: ``[TOOL_CALLS]`` (a special token, kept in the text for this format) and then a JSON list
  of ``{"name", "arguments"}`` objects (Mistral 7B v0.3, Nemo, Small 3.0/3.1), or, from tokenizer v11
  (Mistral Small 3.2, Magistral, Devstral), ``[TOOL_CALLS]name[ARGS]{...}`` once per call.
- ``pythonic``: a Python list of calls with keyword arguments, ``[get_weather(city="Paris"), ...]``, as
  the whole answer (Llama 3.2 / Llama 4 pythonic templates); argument values are Python or JSON literals.
- ``harmony``: gpt-oss's messages (`pytgi.api.chat.harmony`); each one addressed ``to=functions.NAME`` is
  a call whose arguments are its text, up to ``<|call|>``; the final channel and commentary preambles are
  content, the analysis channel is neither (``--reasoning-parser harmony`` makes it the reasoning).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pytgi.api.chat import harmony
from pytgi.api.json_response import JSON, JSONObject

Style = Literal["hermes", "json", "prompted", "mistral", "mistral_v11", "pythonic", "harmony"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MISTRAL_STYLES = ("mistral", "mistral_v11")
# A call's head, as soon as its name is known: {"name": "f", "arguments": (or "parameters")
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class CallParser(Protocol):
    calls: list[ToolCall]
    cut: int | None  # after `finish`: where the last call's text starts, when it was cut short

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def new_call_id(style: Style) -> str:
    """A fresh call id: OpenAI's `call_...`, or the 9 letters and digits Mistral's templates demand."""
    if style in MISTRAL_STYLES:
        return uuid.uuid4().hex[:9]
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_id(call_id: str) -> str:
    """An earlier call's id as Mistral's templates accept it (9 letters and digits), the same for a call
    and its result."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def parser(style: Style) -> CallParser:
    if style in MISTRAL_STYLES:
        return MistralParser(style)
    if style == "pythonic":
        return PythonicParser()
    if style == "harmony":
        return HarmonyParser()
    return ToolParser(style)


def parse(text: str, style: Style) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when only calls) and its calls. A last call the answer cut short
    (the token limit, a stop string) is no call: its text joins the content, as written."""
    p = parser(style)
    events = p.feed(text) + p.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = p.calls
    if p.cut is not None:
        calls = calls[:-1]
        content = (content.rstrip() + "\n" if content.strip() else "") + text[p.cut :].lstrip()
    if calls:
        return (content.strip() or None), calls
    return content, []


def _content(events: list[Event], calls: list[ToolCall], text: str) -> None:
    if text and not (calls and not text.strip()):  # no whitespace between calls
        events.append(Content(text))


# -- hermes and bare JSON --------------------------------------------------------------------------
def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _settled_arguments(text: str) -> str:
    """A call's arguments so far, without what may yet turn out to close the call (the outer object's
    `}`, whitespace, a partial closing tag)."""
    text = text[: len(text) - _partial_suffix(text, CLOSE)].rstrip()
    return text[:-1].rstrip() if text.endswith("}") else text


@dataclass
class ToolParser:
    """Finds tool calls in the model's text, fed piece by piece as it streams; `feed` and `finish`
    return what can be said now: content, a call's start (its id and name), pieces of its arguments.
    Nothing said is taken back: text that may begin a call is held until it is clear."""

    style: Style
    calls: list[ToolCall] = field(default_factory=list)
    _text: str = ""  # held text outside a call
    _call: str | None = None  # the open call's text after its opening tag (None: outside a call)
    _args_at: int = -1  # where the open call's arguments start in `_call` (-1: name not known yet)
    _sent: str = ""  # the open call's arguments sent so far
    _started: bool = False  # anything but whitespace seen (the bare JSON style opens only at the start)
    _fed: int = 0  # characters fed so far
    _call_at: int = 0  # where the open call's text (its opening tag) starts in what was fed
    cut: int | None = None

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._fed += len(text)
        if self._call is not None:
            self._call += text
        else:
            self._text += text
        while True:
            if self._call is None:
                if not self._outside(events):
                    return events
            elif not self._inside(events, final=False):
                return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._call is not None:
            self._inside(events, final=True)
        if self._text:
            self._content(events, self._text)
            self._text = ""
        return events

    # -- outside a call: content, until a call opens ----------------------------------------------
    def _outside(self, events: list[Event]) -> bool:
        """Move on through held text; True when a call opened (more to do)."""
        if self.style == "json":
            if not self._started:
                stripped = self._text.lstrip()
                if not stripped:
                    return False
                self._started = True
                if stripped[0] == "{":
                    self._call_at = self._fed - len(stripped)
                    self._call, self._text = stripped, ""
                    return True
            self._content(events, self._text)
            self._text = ""
            return False
        at = self._text.find(OPEN)
        if at >= 0:
            self._content(events, self._text[:at])
            self._call_at = self._fed - len(self._text) + at
            self._call, self._text = self._text[at + len(OPEN) :], ""
            return True
        keep = _partial_suffix(self._text, OPEN)
        self._content(events, self._text[: len(self._text) - keep])
        self._text = self._text[len(self._text) - keep :]
        return False

    def _content(self, events: list[Event], text: str) -> None:
        _content(events, self.calls, text)

    # -- inside a call -----------------------------------------------------------------------------
    def _inside(self, events: list[Event], final: bool) -> bool:
        """Move on through the open call; True when it closed and text follows it."""
        assert self._call is not None
        if self._args_at < 0:
            head = _HEAD.match(self._call)
            if head:
                self._start(events, json.loads(f'"{head.group(1)}"'))
                self._args_at = head.end()
        if self._args_at >= 0 and not self._sent:  # whitespace after the head is not the arguments'
            self._args_at = len(self._call) - len(self._call[self._args_at :].lstrip())
        close = self._call.find(CLOSE) if self.style != "json" else -1
        if close < 0 and not final:
            if self._args_at >= 0:
                self._send(events, _settled_arguments(self._call[self._args_at :]))
            return False
        body = self._call if close < 0 else self._call[:close]
        rest = "" if close < 0 else self._call[close + len(CLOSE) :]
        self._close(events, body, closed=close >= 0)
        self._call, self._args_at, self._sent = None, -1, ""
        self._text += rest
        return bool(rest)

    def _start(self, events: list[Event], name: str) -> None:
        self.calls.append(ToolCall(new_call_id(self.style), name, ""))
        events.append(CallStart(len(self.calls) - 1, self.calls[-1].id, name))

    def _send(self, events: list[Event], settled: str) -> None:
        if len(settled) > len(self._sent) and settled.startswith(self._sent):
            events.append(Arguments(len(self.calls) - 1, settled[len(self._sent) :]))
            self._sent = settled
            self.calls[-1].arguments = settled

    def _close(self, events: list[Event], body: str, closed: bool) -> None:
        """The call's whole text is known (`closed`: its closing tag came; else the answer ended): finish
        it, or, if it is no call after all, say it as text."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not isinstance(args, dict):
            if self._args_at < 0:  # nothing of it was sent as a call: it is text
                opener = "" if self.style == "json" else OPEN
                self._content(events, opener + body + (CLOSE if closed and self.style != "json" else ""))
            elif not closed:  # started as a call, cut short
                self.cut = self._call_at
            return
        if self._args_at < 0:  # its fields came in another order: the call in one piece
            self._start(events, name)
        text = (
            json.dumps(args, ensure_ascii=False)
            if self._args_at < 0
            else _settled_arguments(body[self._args_at :])
        )
        if not text.startswith(self._sent):
            text = self._sent  # cannot happen for well-formed text; never take back what was sent
        self._send(events, text)
        self.calls[-1].arguments = text


# -- Mistral ---------------------------------------------------------------------------------------
_CALL_NAME = re.compile(r"[a-zA-Z0-9_.-]{1,64}")


@dataclass
class _JsonEnd:
    """Finds where a JSON object or list ends, fed piece by piece from its first character."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def feed(self, text: str) -> int:
        """The index in `text` just after the value's last character; -1 while it goes on."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


def _call_object(text: str) -> tuple[str, JSONObject] | None:
    """A call object's name and arguments, when `text` is one (arguments may come as a JSON string)."""
    try:
        obj: JSON = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (name, args) if isinstance(name, str) and isinstance(args, dict) else None


@dataclass
class MistralParser:
    """``[TOOL_CALLS]`` then a JSON list of call objects (streamed: each call's arguments as they are
    written), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (tokenizer v11 on)."""

    style: Style = "mistral"
    calls: list[ToolCall] = field(default_factory=list)
    _state: str = "text"  # text | marker | list | object | name | args
    _buf: str = ""  # text not looked at yet
    _obj: str = ""  # the open call object's text (list form) or its arguments' text (v11 form)
    _end: _JsonEnd = field(default_factory=_JsonEnd)
    _args_at: int = -1  # list form: where the arguments start in `_obj` (-1: the name is not known yet)
    _args_end: _JsonEnd | None = None  # list form: the arguments object's end, while it streams
    _args_seen: int = 0  # list form: how much of `_obj` after `_args_at` `_args_end` has seen
    _args_len: int = -1  # list form: the arguments' length, once they are closed
    _sent: str = ""
    _fed: int = 0  # characters fed so far
    _call_at: int = 0  # where the open call's text starts in what was fed (v11: its marker)
    cut: int | None = None

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._fed += len(text)
        self._buf += text
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self._step(events, final=True):
            pass
        if self._state == "object" and self._args_at < 0:  # cut off before its name: it was text
            _content(events, self.calls, self._obj)
        elif self._state == "object" or (self._state == "args" and self._obj):  # a call cut short
            self.cut = self._call_at
        elif self._state == "args" and not self._obj:
            self._send(events, "{}")
        elif self._state == "name":
            _content(events, self.calls, self._buf)
        self._state, self._buf, self._obj = "text", "", ""
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """Move on through `_buf`; True when there is more to do."""
        state, buf = self._state, self._buf
        if state == "text":
            at = buf.find(MISTRAL_CALLS)
            if at >= 0:
                _content(events, self.calls, buf[:at])
                self._call_at = self._fed - len(buf) + at
                self._state, self._buf = "marker", buf[at + len(MISTRAL_CALLS) :]
                return True
            keep = 0 if final else _partial_suffix(buf, MISTRAL_CALLS)
            _content(events, self.calls, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        if state in ("marker", "list"):
            rest = buf.lstrip(" \t\r\n" + ("," if state == "list" else ""))
            self._buf = rest
            if not rest:
                return False
            if state == "marker":
                self._state = "list" if rest[0] == "[" else "name"
                self._buf = rest[1:] if rest[0] == "[" else rest
            elif rest[0] == "{":
                self._call_at = self._fed - len(rest)
                self._state, self._obj, self._end, self._args_at = "object", "", _JsonEnd(), -1
            else:  # the list's end (or something else: text)
                self._state, self._buf = "text", rest[1:] if rest[0] == "]" else rest
            return True
        if state == "name":
            at = buf.find(MISTRAL_ARGS)
            if at < 0:
                return False
            name = buf[:at].split(MISTRAL_CALL_ID)[0].strip()
            self._buf = buf[at + len(MISTRAL_ARGS) :]
            if not _CALL_NAME.fullmatch(name):
                _content(events, self.calls, buf[: at + len(MISTRAL_ARGS)])
                self._state = "text"
                return True
            self._start(events, name)
            self._state, self._obj, self._end = "args", "", _JsonEnd()
            return True
        if state == "args" and not self._obj:
            buf = self._buf = buf.lstrip()
            if not buf:
                return False
            if buf[0] != "{":
                self._send(events, "{}")
                self._state = "text"
                return True
        # inside a JSON object: the call object (list form) or its arguments (v11 form)
        end = self._end.feed(buf)
        self._obj += buf if end < 0 else buf[:end]
        self._buf = "" if end < 0 else buf[end:]
        if state == "args":
            self._send(events, self._obj)
        else:
            self._stream_arguments(events)
        if end < 0:
            return False
        if state == "object":
            self._close_object(events)
            self._state = "list"
        else:
            self._state = "text"
        return True

    def _start(self, events: list[Event], name: str) -> None:
        self.calls.append(ToolCall(new_call_id(self.style), name, ""))
        events.append(CallStart(len(self.calls) - 1, self.calls[-1].id, name))
        self._sent = ""

    def _send(self, events: list[Event], settled: str) -> None:
        if len(settled) > len(self._sent) and settled.startswith(self._sent):
            events.append(Arguments(len(self.calls) - 1, settled[len(self._sent) :]))
            self._sent = settled
            self.calls[-1].arguments = settled

    def _stream_arguments(self, events: list[Event]) -> None:
        """List form: the call's start once its name is known, then its arguments object as written."""
        if self._args_at < 0:
            head = _HEAD.match(self._obj)
            if head is None:
                return
            self._start(events, json.loads(f'"{head.group(1)}"'))
            self._args_at, self._args_end, self._args_seen, self._args_len = head.end(), None, 0, -1
        if self._args_seen < 0 or self._args_len >= 0:
            return
        args = self._obj[self._args_at :]
        if self._args_seen == 0 and args[:1].isspace():  # whitespace after the head is not the arguments'
            self._args_at += len(args) - len(args.lstrip())
            args = args.lstrip()
        if not args:
            return
        if args[0] != "{":
            self._args_seen = -1
            return
        if self._args_end is None:
            self._args_end = _JsonEnd()
        end = self._args_end.feed(args[self._args_seen :])
        if end >= 0:
            self._args_len = self._args_seen + end
        self._args_seen = len(args)
        self._send(events, args if self._args_len < 0 else args[: self._args_len])

    def _close_object(self, events: list[Event]) -> None:
        call = _call_object(self._obj)
        if call is None:
            if self._args_at < 0:  # nothing of it was sent as a call: it is text
                _content(events, self.calls, self._obj)
            return
        name, args = call
        if self._args_at < 0:  # its fields came in another order: the call in one piece
            self._start(events, name)
        if self._args_seen < 0 or self._args_at < 0:
            self._send(events, json.dumps(args, ensure_ascii=False))
        self._args_at = -1


# -- pythonic --------------------------------------------------------------------------------------
_PY_LIST = re.compile(r"\s*\[\s*[A-Za-z_][\w.]*\s*\(")  # the answer opens a list of calls
_PY_LIST_PREFIX = re.compile(r"\s*(?:\[\s*(?:[A-Za-z_][\w.]*\s*)?)?")  # ... or may yet
_PY_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> JSON:
    """A Python (or JSON) literal's value; ValueError for anything else (names, calls, operators)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _PY_NAMES:
        return _PY_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(
        isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys
    ):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[union-attr]
    raise ValueError("not a literal")


def _python_call(text: str) -> tuple[str, str] | None:
    """`name(key=value, ...)`'s name and its arguments as JSON text; None when it is not such a call."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        return None
    name = ast.unparse(node.func)
    if not _CALL_NAME.fullmatch(name):
        return None
    try:
        args = {k.arg: _literal(k.value) for k in node.keywords}
        return name, json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None


@dataclass
class PythonicParser:
    """An answer that opens with a Python list of calls: each call is sent whole (its start and its
    arguments) as soon as its closing parenthesis arrives; anything that is not such a list is content."""

    calls: list[ToolCall] = field(default_factory=list)
    _text: str = ""  # everything fed
    _done: int = 0  # `_text` up to here was sent (as content or calls)
    _mode: str = "start"  # start | list | text
    _pos: int = 0  # list mode: scanned up to here
    _depth: int = 0  # brackets open inside the list
    _quote: str = ""  # the open string's quote
    _escaped: bool = False
    cut: int | None = None  # calls are sent whole: a cut one was never a call (its text is content)

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._text += text
        self._run(events, final=False)
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        self._run(events, final=True)
        self._text_out(events)
        return events

    def _text_out(self, events: list[Event]) -> None:
        _content(events, self.calls, self._text[self._done :])
        self._done = len(self._text)

    def _run(self, events: list[Event], final: bool) -> None:
        if self._mode == "start":
            m = _PY_LIST.match(self._text)
            if m:
                self._mode, self._pos = "list", self._text.index("[") + 1
            elif _PY_LIST_PREFIX.fullmatch(self._text) and not final:
                return
            else:
                self._mode = "text"
        if self._mode == "text":
            self._text_out(events)
            return
        self._scan(events)

    def _scan(self, events: list[Event]) -> None:
        text, i = self._text, self._pos
        while i < len(text):
            c = text[i]
            i += 1
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == self._quote:
                    self._quote = ""
            elif c in "'\"":
                self._quote = c
            elif c in "([{":
                self._depth += 1
            elif c in ")]}" and self._depth > 0:
                self._depth -= 1
                if self._depth == 0 and c == ")" and not self._call(events, self._start, i):
                    break
            elif c == "]":  # the list's end
                if text[self._start : i - 1].strip(" \t\r\n,"):
                    break  # something that is no call before it
                self._done, self._mode = i, "text"
                self._text_out(events)
                return
            elif c in ")}":
                break
        else:
            self._pos = i
            return
        self._mode = "text"  # not a list of calls after all: what is left is text
        self._text_out(events)

    @property
    def _start(self) -> int:
        """Where the next call's text starts: after the list's `[` or the last call."""
        return self._done if self.calls else self._text.index("[") + 1

    def _call(self, events: list[Event], start: int, end: int) -> bool:
        """The call written in `_text[start:end]`, sent; False when it is none."""
        found = _python_call(self._text[start:end].lstrip(" \t\r\n,"))
        if found is None:
            return False
        name, arguments = found
        self.calls.append(ToolCall(new_call_id("pythonic"), name, arguments))
        index = len(self.calls) - 1
        events += [CallStart(index, self.calls[-1].id, name), Arguments(index, arguments)]
        self._done = end
        return True


# -- harmony (gpt-oss) -----------------------------------------------------------------------------
@dataclass
class HarmonyParser:
    """gpt-oss's messages: a message to ``functions.NAME`` is a call, its start said once its header is
    whole and its text streamed as its arguments, as written; the final channel, commentary preambles
    and text in no message are content. The analysis channel is dropped (the reasoning parser, when
    there is one, took it out already; a client without one gets the answer, as vLLM's), and so are
    messages to tools that are not the request's (gpt-oss's built-in browser and python)."""

    calls: list[ToolCall] = field(default_factory=list)
    _messages: harmony.Messages = field(default_factory=harmony.Messages)
    _call: harmony.Message | None = None  # the open message, when it is a call
    _sent: str = ""  # its arguments so far
    cut: int | None = None  # a call cut short: where its text (its arguments) starts

    def feed(self, text: str) -> list[Event]:
        return self._events(self._messages.feed(text), final=False)

    def finish(self) -> list[Event]:
        return self._events(self._messages.finish(), final=True)

    def _events(self, pieces: list[harmony.Piece], final: bool) -> list[Event]:
        events: list[Event] = []
        for p in pieces:
            m = p.message
            if isinstance(p, harmony.Open):
                name = p.message.function
                if name is not None and _CALL_NAME.fullmatch(name):
                    self.calls.append(ToolCall(new_call_id("harmony"), name, ""))
                    events.append(CallStart(len(self.calls) - 1, self.calls[-1].id, name))
                    self._call, self._sent = p.message, ""
            elif isinstance(p, harmony.Close):
                if m is self._call:
                    self._end(events)
            elif m is not None and m is self._call:
                self._send(events, p.text)
            elif m is None or (not m.recipient and m.channel != "analysis"):
                _content(events, self.calls, p.text)
        if final and self._call is not None:  # the answer ended inside a call: its <|call|> was the EOS
            try:
                json.loads(self._sent)
            except json.JSONDecodeError:
                self.cut = self._call.at  # cut short by the token limit (or no JSON: no call)
            self._call = None
        return events

    def _send(self, events: list[Event], text: str) -> None:
        if not self._sent:
            text = text.lstrip()  # whitespace before the arguments is not theirs
        if text:
            self._sent += text
            self.calls[-1].arguments = self._sent
            events.append(Arguments(len(self.calls) - 1, text))

    def _end(self, events: list[Event]) -> None:
        """The call's end token came: its arguments are whole (none written: an empty object)."""
        if not self._sent:
            self._send(events, "{}")
        self._call = None
