"""OpenAI's tool calling: which tools a request offers and how it lets the model use them, the prompt
they reach the model in, the grammar that forces a call, and the parser that finds calls in what the
model writes (whole or as it streams). No torch here.

The model's chat template decides the format (`style_of`):

- ``hermes``: the template knows ``<tool_call>`` (Qwen2.5/3, Hermes, SmolLM3, ...). It renders the
  tools itself, and the model answers ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``json``: the template takes ``tools`` but has no tag (Llama 3.1/3.2): the answer is one bare JSON
  object ``{"name": ..., "parameters": {...}}``.
- ``prompted``: the template knows no tools (SmolLM2, the default model). The tools go into the
  system message with an instruction to answer in the hermes format; earlier calls and tool results
  are rewritten into text the template can show.

``tool_choice``: ``none`` renders no tools and parses nothing (as TGI); ``auto`` lets the model choose
between text and calls, and the parser reads what it wrote; ``required`` and a named function force a
call with a grammar whose arguments follow each function's JSON schema, so the call always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pytgi.router.request import GrammarType
from pytgi.server.openai.errors import invalid
from pytgi.structured import bounded_whitespace

Style = Literal["hermes", "json", "prompted"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
# A call's head, as soon as its name is known: {"name": "f", "arguments": (or "parameters")
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool object, as chat templates take it."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[Function, ...]
    choice: str  # "auto" | "required" | a function's name
    parallel: bool
    style: Style

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


# -- the request's tools ---------------------------------------------------------------------------
def _functions(tools: list[dict[str, Any]]) -> tuple[Function, ...]:
    out: dict[str, Function] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise invalid(f'`tools[{i}]` must be {{"type": "function", "function": {{...}}}}', f"tools.[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid(
                f"`tools[{i}].function.name` must be 1 to 64 letters, digits, '_', '.' or '-'. "
                f"Given: {name!r}",
                f"tools.[{i}].function.name",
            )
        if name in out:
            raise invalid(f"`tools` has two functions named `{name}`", f"tools.[{i}].function.name")
        params = fn.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise invalid(
                f"`tools[{i}].function.parameters` must be a JSON schema object",
                f"tools.[{i}].function.parameters",
            )
        desc = fn.get("description")
        out[name] = Function(name, desc if isinstance(desc, str) else None, params)
    return tuple(out.values())


def _choice(tool_choice: str | dict[str, Any] | None, names: set[str]) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise invalid(
                f'`tool_choice` must be "none", "auto", "required" or a named function. '
                f"Given: {tool_choice!r}",
                "tool_choice",
            )
        return tool_choice
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid(
            'a named `tool_choice` must be {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    if name not in names:
        raise invalid(
            f"`tool_choice` names the function `{name}`, which `tools` does not have", "tool_choice"
        )
    return name


def style_of(chat_template: str | None) -> Style:
    if chat_template and OPEN in chat_template:
        return "hermes"
    if chat_template and re.search(r"\btools\b", chat_template):
        return "json"
    return "prompted"


def plan(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    chat_template: str | None,
) -> ToolPlan | None:
    """The request's tools and how they may be used; None when the model is to write text only."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("`tool_choice` needs `tools`", "tool_choice")
        return None
    functions = _functions(tools)
    choice = _choice(tool_choice, {f.name for f in functions})
    if choice == "none":
        return None
    return ToolPlan(functions, choice, parallel_tool_calls is not False, style_of(chat_template))


# -- the prompt ------------------------------------------------------------------------------------
def _call_text(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def _arguments(call: dict[str, Any]) -> Any:
    """An earlier call's arguments as data (OpenAI sends them as a JSON string; templates want an object)."""
    args = (call.get("function") or {}).get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args if args is not None else {}


def _system_prompt(functions: tuple[Function, ...]) -> str:
    listed = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
    return (
        "You may call functions to answer. These are the functions, as JSON schemas:\n<tools>\n"
        + listed
        + "\n</tools>\nTo call one, answer with a JSON object holding the function's name and its arguments "
        f"inside tags, one block per call:\n{OPEN}\n"
        '{"name": <function-name>, "arguments": <arguments-object>}\n'
        f"{CLOSE}\nOtherwise, answer in plain text."
    )


def template_messages(
    messages: list[dict[str, Any]], tool_plan: ToolPlan | None, style: Style
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` for the chat template. Earlier calls and tool results pass through as
    the template expects them; for a template that knows no tools they become text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if style == "prompted":
            if m["role"] == "assistant" and calls:
                texts = [_call_text((c.get("function") or {}).get("name", ""), _arguments(c)) for c in calls]
                m = {
                    "role": "assistant",
                    "content": "\n".join(filter(None, [m.get("content") or "", *texts])),
                }
            elif m["role"] == "tool":
                m = {
                    "role": "user",
                    "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>",
                }
        elif calls:
            m["tool_calls"] = [
                {**c, "function": {**(c.get("function") or {}), "arguments": _arguments(c)}} for c in calls
            ]
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tool_plan is None:
        return out, None
    if style != "prompted":
        return out, [f.as_tool() for f in tool_plan.functions]
    prompt = _system_prompt(tool_plan.functions)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


# -- the grammar of a forced call ------------------------------------------------------------------
def _call_schema(f: Function, arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", arguments_key],
        "properties": {"name": {"const": f.name}, arguments_key: f.parameters},
    }


def grammar(tool_plan: ToolPlan) -> GrammarType | None:
    """For `required` or a named function: a grammar that admits only well-formed calls (llguidance's
    Lark with JSON schemas inside); None for `auto`."""
    if not tool_plan.forced:
        return None
    functions = [f for f in tool_plan.functions if tool_plan.choice in ("required", f.name)]
    if tool_plan.style == "json":
        schemas = [_call_schema(f, "parameters") for f in functions]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return GrammarType(type="json", value=schema)
    texts = [json.dumps(bounded_whitespace(_call_schema(f, "arguments"))) for f in functions]
    rules = [f'call_{i}: "{OPEN}\\n" %json {text} "\\n{CLOSE}"' for i, text in enumerate(texts)]
    calls = "call" if not tool_plan.parallel or tool_plan.choice != "required" else 'call ("\\n" call)*'
    lark = "\n".join(
        [f"start: {calls}", "call: " + " | ".join(f"call_{i}" for i in range(len(functions))), *rules]
    )
    return GrammarType(type="grammar", value=lark)


# -- what the model wrote --------------------------------------------------------------------------
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
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return d if index is None else {"index": index, **d}


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

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
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
                    self._call, self._text = stripped, ""
                    return True
            self._content(events, self._text)
            self._text = ""
            return False
        at = self._text.find(OPEN)
        if at >= 0:
            self._content(events, self._text[:at])
            self._call, self._text = self._text[at + len(OPEN) :], ""
            return True
        keep = _partial_suffix(self._text, OPEN)
        self._content(events, self._text[: len(self._text) - keep])
        self._text = self._text[len(self._text) - keep :]
        return False

    def _content(self, events: list[Event], text: str) -> None:
        if text and not (self.calls and not text.strip()):  # no whitespace between calls
            events.append(Content(text))

    # -- inside a call -----------------------------------------------------------------------------
    def _inside(self, events: list[Event], final: bool) -> bool:
        """Move on through the open call; True when it closed and text follows it."""
        assert self._call is not None
        if self._args_at < 0:
            head = _HEAD.match(self._call)
            if head:
                self._start(events, json.loads(f'"{head.group(1)}"'))
                self._args_at = head.end()
        close = self._call.find(CLOSE) if self.style != "json" else -1
        if close < 0 and not final:
            if self._args_at >= 0:
                self._send(events, _settled_arguments(self._call[self._args_at :]))
            return False
        body = self._call if close < 0 else self._call[:close]
        rest = "" if close < 0 else self._call[close + len(CLOSE) :]
        self._close(events, body)
        self._call, self._args_at, self._sent = None, -1, ""
        self._text += rest
        return bool(rest)

    def _start(self, events: list[Event], name: str) -> None:
        self.calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, ""))
        events.append(CallStart(len(self.calls) - 1, self.calls[-1].id, name))

    def _send(self, events: list[Event], settled: str) -> None:
        if len(settled) > len(self._sent) and settled.startswith(self._sent):
            events.append(Arguments(len(self.calls) - 1, settled[len(self._sent) :]))
            self._sent = settled
            self.calls[-1].arguments = settled

    def _close(self, events: list[Event], body: str) -> None:
        """The call's whole text is known: finish it, or, if it is no call after all, say it as text."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not isinstance(args, dict):
            if self._args_at < 0:  # nothing of it was sent as a call: it is text
                opener = "" if self.style == "json" else OPEN
                self._content(events, opener + body + ("" if self.style == "json" else CLOSE))
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


def parse(text: str, style: Style) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when only calls) and its calls."""
    parser = ToolParser(style)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    if parser.calls:
        return (content.strip() or None), parser.calls
    return content, []
