"""Tool calling: which tools a chat request offers (`Function`s) and how it lets the model use them
(its `tool_choice`), the prompt they reach the model in, and the grammar that forces a call;
`tool_calls` finds the calls in what the model writes. Every chat API translates its tools into this
(`pytgi.api.chat.language`); refusals name the chat request's fields. No torch here.

The model's chat template decides the format (`style_of`):

- ``hermes``: the template knows ``<tool_call>`` (Qwen2.5/3, Hermes, SmolLM3, ...). It renders the
  tools itself, and the model answers ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``mistral``: the template knows ``[TOOL_CALLS]`` (Mistral 7B v0.3, Nemo, Small, ...): the answer is
  ``[TOOL_CALLS]`` and a JSON list of calls; ``mistral_v11`` when the template writes ``[ARGS]``
  (Mistral Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}`` per call. Call ids are 9
  letters and digits, as these templates demand of the history.
- ``pythonic``: the template asks for a Python list of calls (``[func_name1(params_name1=...``, as the
  Llama 3.2 / Llama 4 pythonic templates do): ``[get_weather(city="Paris")]``.
- ``harmony``: the template writes ``<|channel|>`` (gpt-oss): the answer is harmony messages, a call
  one addressed ``to=functions.NAME`` whose text is its JSON arguments (`pytgi.api.chat.harmony`).
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pytgi.api.chat import harmony
from pytgi.api.chat.language import (
    Call,
    Function,
    Message,
    Named,
    Text,
    ToolChoice,
)
from pytgi.api.chat.tool_calls import (
    CLOSE,
    MISTRAL_ARGS,
    MISTRAL_CALLS,
    MISTRAL_STYLES,
    OPEN,
    Arguments,
    CallParser,
    CallStart,
    Content,
    Event,
    Style,
    ToolCall,
    ToolParser,
    mistral_id,
    parse,
    parser,
)
from pytgi.api.frontend.bodies import GrammarType
from pytgi.api.json_response import JSON, JSONObject
from pytgi.core.errors import InvalidRequest
from pytgi.core.grammar import bounded_whitespace

__all__ = [
    "CLOSE",
    "MISTRAL_STYLES",
    "OPEN",
    "Arguments",
    "CallParser",
    "CallStart",
    "Content",
    "Event",
    "Function",
    "Style",
    "ToolCall",
    "ToolParser",
    "ToolPlan",
    "grammar",
    "keeps_special_tokens",
    "parse",
    "parser",
    "plan",
    "style_of",
    "template_messages",
]
_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
_PYTHONIC = re.compile(r"\[\s*func_name1\s*\(")  # the pythonic templates' instruction shows the format
_EMPTY_PARAMETERS: JSONObject = {"type": "object", "properties": {}}


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
def _check(functions: Sequence[Function]) -> None:
    """Each function's name as templates and parsers take it, and no name twice."""
    seen: set[str] = set()
    for i, f in enumerate(functions):
        if not _NAME.match(f.name):
            raise InvalidRequest(
                f"a tool's name must be 1 to 64 letters, digits, '_', '.' or '-'. Given: {f.name!r}",
                f"tools.{i}.name",
            )
        if f.name in seen:
            raise InvalidRequest(f"`tools` has two functions named `{f.name}`", f"tools.{i}.name")
        seen.add(f.name)


def _choice(tool_choice: ToolChoice | None, names: set[str]) -> str:
    if tool_choice is None:
        return "auto"
    if not isinstance(tool_choice, Named):
        return tool_choice
    if tool_choice.name not in names:
        raise InvalidRequest(
            f"`tool_choice` names the function `{tool_choice.name}`, which `tools` does not have",
            "tool_choice",
        )
    return tool_choice.name


def style_of(chat_template: str | None) -> Style:
    if chat_template and harmony.CHANNEL in chat_template:
        return "harmony"
    if chat_template and OPEN in chat_template:
        return "hermes"
    if chat_template and MISTRAL_CALLS in chat_template:
        return "mistral_v11" if MISTRAL_ARGS in chat_template else "mistral"
    if chat_template and _PYTHONIC.search(chat_template):
        return "pythonic"
    if chat_template and re.search(r"\btools\b", chat_template):
        return "json"
    return "prompted"


def keeps_special_tokens(
    chat_template: str | None, style: Style | None, reasoning_parser: str | None
) -> bool:
    """Whether a chat answer's text keeps its special tokens, for the parsers to see them (as vLLM's):
    Mistral's calls open with one, and harmony's structure is all special tokens (its parsers take them
    out; without one, a client sees the harmony rather than its words run together)."""
    harmony = style_of(chat_template) == "harmony" or reasoning_parser == "harmony"
    return style in MISTRAL_STYLES or harmony


def plan(
    functions: Sequence[Function],
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
    chat_template: str | None,
) -> ToolPlan | None:
    """The request's tools and how they may be used; None when the model is to write text only."""
    if not functions:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("`tool_choice` needs `tools`", "tool_choice")
        return None
    _check(functions)
    choice = _choice(tool_choice, {f.name for f in functions})
    if choice == "none":
        return None
    return ToolPlan(tuple(functions), choice, parallel_tool_calls, style_of(chat_template))


# -- the prompt ------------------------------------------------------------------------------------
def _call_text(name: str, arguments: JSON) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def _arguments(call: Call) -> JSON:
    """An earlier call's arguments as data (they are JSON text; templates want an object)."""
    try:
        value: JSON = json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments
    return value


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


def _content(m: Message) -> str | list[JSON]:
    """A turn's content as templates take it: text (parts joined), or parts where it has an image
    (`{"type": "image"}`: the image itself goes to the engine apart)."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    if all(isinstance(p, Text) for p in m.content):
        return "\n".join(p.text for p in m.content if isinstance(p, Text))
    return [{"type": "text", "text": p.text} if isinstance(p, Text) else {"type": "image"} for p in m.content]


def _call(c: Call, style: Style) -> JSONObject:
    """An earlier call as templates take it, its arguments as data; with an id Mistral's templates
    accept in a Mistral style."""
    out: JSONObject = {"type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
    if c.id is not None:
        out = {"id": mistral_id(c.id) if style in MISTRAL_STYLES else c.id, **out}
    return out


def template_messages(
    messages: Sequence[Message], tool_plan: ToolPlan | None, style: Style
) -> tuple[list[JSONObject], list[JSONObject] | None]:
    """The messages and `tools` for the chat template. Earlier calls and tool results pass as the
    template expects them; for a template that knows no tools they become text."""
    out: list[JSONObject] = []
    for m in messages:
        content = _content(m)
        d: JSONObject
        if style == "prompted" and m.role == "assistant" and m.calls:
            texts = [_call_text(c.name, _arguments(c)) for c in m.calls]
            said = content if isinstance(content, str) else ""
            d = {"role": "assistant", "content": "\n".join(filter(None, [said, *texts]))}
        elif style == "prompted" and m.role == "tool":
            d = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        else:
            d = {"role": m.role, "content": content, **m.fields}
            if m.calls:
                d["tool_calls"] = [_call(c, style) for c in m.calls]
            if m.call_id is not None:
                d["tool_call_id"] = mistral_id(m.call_id) if style in MISTRAL_STYLES else m.call_id
        out.append(d)
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
def _call_schema(f: Function, arguments_key: str) -> JSONObject:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", arguments_key],
        "properties": {"name": {"const": f.name}, arguments_key: f.parameters},
    }


def grammar(
    tool_plan: ToolPlan, special_id: Callable[[str], int | None] = lambda _: None
) -> GrammarType | None:
    """For `required` or a named function: a grammar that admits only well-formed calls (llguidance's
    Lark with JSON schemas inside); None for `auto`. `special_id` gives the id of a special token
    (Mistral's `[TOOL_CALLS]`, harmony's markers), which the grammar names by id."""
    if not tool_plan.forced:
        return None
    functions = [f for f in tool_plan.functions if tool_plan.choice in ("required", f.name)]
    many = tool_plan.parallel and tool_plan.choice == "required"
    style = tool_plan.style
    if style == "json":
        schemas = [_call_schema(f, "parameters") for f in functions]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return GrammarType(type="json", value=schema)

    def marker(text: str) -> str:
        token = special_id(text)
        return json.dumps(text) if token is None else f"<[{token}]>"

    bodies, rules = [], []
    for i, f in enumerate(functions):
        if style == "pythonic":
            args, arg_rules = _python_arguments(f, i)
            bodies.append(f'"{f.name}(" {args} ")"')
            rules += arg_rules
        elif style == "mistral_v11":
            params = json.dumps(bounded_whitespace(f.parameters or _EMPTY_PARAMETERS))
            bodies.append(f'{marker(MISTRAL_CALLS)} "{f.name}" {marker(MISTRAL_ARGS)} %json {params}')
        elif style == "mistral":
            bodies.append(f"%json {json.dumps(bounded_whitespace(_call_schema(f, 'arguments')))}")
        elif style == "harmony":
            # <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
            params = json.dumps(bounded_whitespace(f.parameters or _EMPTY_PARAMETERS))
            head = (
                f'{marker(harmony.CHANNEL)} "commentary to=functions.{f.name} " {marker(harmony.CONSTRAIN)}'
            )
            bodies.append(f'{head} "json" {marker(harmony.MESSAGE)} %json {params} {marker(harmony.CALL)}')
        else:
            text = json.dumps(bounded_whitespace(_call_schema(f, "arguments")))
            bodies.append(f'"{OPEN}\\n" %json {text} "\\n{CLOSE}"')
    if style == "pythonic":
        start = '"[" call (", " call)* "]"' if many else '"[" call "]"'
    elif style == "mistral":
        more = ' ("," " "? call)*' if many else ""
        start = f'{marker(MISTRAL_CALLS)} " "? "[" call{more} "]"'
    elif style == "mistral_v11":
        start = "call+" if many else "call"
    elif style == "harmony":  # <|call|> ends the answer (an EOS): one call per answer
        start = "call"
    else:
        start = 'call ("\\n" call)*' if many else "call"
    lark = "\n".join(
        [
            f"start: {start}",
            "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
            *(f"call_{i}: {body}" for i, body in enumerate(bodies)),
            *rules,
        ]
    )
    return GrammarType(type="grammar", value=lark)


def _python_arguments(f: Function, i: int) -> tuple[str, list[str]]:
    """A pythonic call's keyword arguments for function `i`: each property of its schema as
    `name=<JSON value of its schema>` in the schema's order, the required ones always, the others
    optional; any keyword with any JSON value when the properties are no Python names."""
    schema = f.parameters or _EMPTY_PARAMETERS
    found = schema.get("properties")
    props: JSONObject = found if isinstance(found, dict) else {}
    listed = schema.get("required")
    required = {n for n in listed if isinstance(n, str)} if isinstance(listed, list) else set()
    names = list(props)
    if not all(isinstance(n, str) and n.isidentifier() for n in names):
        kwarg = f"kw_{i}"
        return f'({kwarg} (", " {kwarg})*)?', [f'{kwarg}: /[A-Za-z_][A-Za-z0-9_]*/ "=" %json {{}}']
    if not names:
        return "", []
    values = [bounded_whitespace(v) if isinstance(v, dict) else {} for v in props.values()]
    rules = [f'kw_{i}_{j}: "{n}=" %json {json.dumps(v)}' for j, (n, v) in enumerate(zip(names, values))]

    def rest(j: int) -> str:  # the properties from j on, each after ", "
        return " ".join(
            f'", " kw_{i}_{k}' if names[k] in required else f'(", " kw_{i}_{k})?'
            for k in range(j, len(names))
        )

    # args_{i}_{j}: the arguments when property j is the first one written
    for j, n in enumerate(names):
        first = f"kw_{i}_{j} {rest(j + 1)}".strip()
        if n not in required and j + 1 < len(names):
            first += f" | args_{i}_{j + 1}"
        rules.append(f"args_{i}_{j}: {first}")
    return (f"args_{i}_0" if required else f"args_{i}_0?"), rules
