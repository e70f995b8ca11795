"""Structured output: what a request's output must match, as one llguidance grammar.

`SamplingParams` carries the user's constraint: a JSON schema, a regex, a choice among strings, or a
grammar (Lark, or GBNF/EBNF as llama.cpp and vLLM users write it). `grammar_of` turns it into the
grammar string llguidance's matcher takes, and `check` refuses an invalid one with a message that
names what is wrong. Torch-free: the API process checks a request's grammar before anything is
queued, and the engine builds its matchers from the same string (`pytgi.engine.sampling.grammars`).

llguidance rather than xgrammar: it needs no torch (so the API process can check grammars), builds a
matcher lazily (no per-grammar compile of the whole vocabulary), and computes masks fast on this CPU
(docs/structured-output.md has the measurements).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from pytgi.core.errors import InvalidRequest
from pytgi.core.sampling_params import SamplingParams

# OpenAI's json_object: any JSON object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def has_constraint(p: SamplingParams) -> bool:
    return p.json_schema is not None or p.regex is not None or p.choice is not None or p.grammar is not None


# JSON's free whitespace, bounded (as llama.cpp's JSON grammars bound it): one space, or a newline and
# an indent of at most 20. Unbounded, a small model sampling at a high temperature can run on in
# whitespace until max_tokens and never close the object. A schema's own "x-guidance" wins.
JSON_WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})"


def bounded_whitespace(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema, with JSON_WHITESPACE as its whitespace unless it says its own."""
    if "x-guidance" in schema:
        return schema
    return {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, **schema}


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("the JSON schema must be an object")
    return value


def ascii_digits(regex: str) -> str:
    """`\\d` as `[0-9]`, as JavaScript, JSON Schema's patterns and other servers' regexes read it
    (llguidance's, like Python's, also matches every Unicode digit, and a model will pick them)."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            pair = regex[i : i + 2]
            out.append(("0-9" if in_class else "[0-9]") if pair == "\\d" else pair)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def grammar_of(p: SamplingParams) -> str | None:
    """llguidance's grammar for the request's constraint, or None when it has none."""
    given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(p, name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"give one structured-output constraint, not several: {', '.join(given)}")
    try:
        return _grammar(p)
    except InvalidRequest:
        raise
    except UnicodeError:
        raise InvalidRequest(f"`{given[0]}` must be valid Unicode (no lone surrogates)") from None
    except Exception as e:  # noqa: BLE001 - the converter's own error names the place
        raise InvalidRequest(f"the {given[0]} is not valid: {e}") from None


def _grammar(p: SamplingParams) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if p.reasoning is not None:
        answer = _answer_lark(p)
        if answer is not None:
            return LLMatcher.grammar_from_lark(_after_reasoning(answer, p.reasoning))
    if p.json_schema is not None:
        return LLMatcher.grammar_from_json_schema(bounded_whitespace(_schema(p.json_schema)))
    if p.regex is not None:
        return LLMatcher.grammar_from_regex(ascii_digits(p.regex))
    if p.choice is not None:
        if not p.choice or not all(isinstance(c, str) and c for c in p.choice):
            raise InvalidRequest("`choice` must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in p.choice))
    assert p.grammar is not None
    return LLMatcher.grammar_from_lark(any_to_lark(p.grammar))


def _answer_lark(p: SamplingParams) -> str | None:
    """The constraint as Lark rules whose start is `pytgi_answer`; None (it then applies from the
    first token) for a choice, for a regex or grammar that writes the `<think>` block itself, and for
    a grammar that refers to its own start."""
    from llguidance.gbnf_to_lark import any_to_lark

    if "<think>" in (p.regex or p.grammar or ""):
        return None
    if p.json_schema is not None:
        return "pytgi_answer: %json " + json.dumps(bounded_whitespace(_schema(p.json_schema)))
    if p.regex is not None:
        return "pytgi_answer: /" + ascii_digits(p.regex).replace("/", "\\/") + "/"
    if p.choice is not None:
        return None  # a choice is short: no room to reason before it
    assert p.grammar is not None
    lark = re.sub(r"^start(\s*[:\[])", r"pytgi_answer\1", any_to_lark(p.grammar), count=1, flags=re.MULTILINE)
    return None if re.search(r"\bstart\b", lark) else lark


def _after_reasoning(answer: str, parser: str) -> str:
    """A grammar whose constraint applies once the `<think>` block (pytgi.api.chat.reasoning) ends:
    the block is free text up to `</think>`; `qwen3` may skip it, `deepseek_r1` starts inside it."""
    think = 'pytgi_think[stop="</think>"]: /(.|\\n)*/'
    if parser == "deepseek_r1":
        start = "start: pytgi_think /[ \\t\\n]*/ pytgi_answer"
    else:
        start = 'start: ("<think>" pytgi_think /[ \\t\\n]*/)? pytgi_answer'
    return f"{start}\n{think}\n{answer}"


def check(p: SamplingParams) -> str | None:
    """The request's grammar, validated; `InvalidRequest` names the fault."""
    grammar = grammar_of(p)
    if grammar is None:
        return None
    error = _validate(grammar)
    if error:
        raise InvalidRequest(error)
    return grammar


@lru_cache(maxsize=256)
def _validate(grammar: str) -> str:
    """llguidance's complaint about a grammar ("" when valid), cached: clients repeat their schemas."""
    from llguidance import LLMatcher

    try:
        message = LLMatcher.validate_grammar(grammar).strip()
        return "" if message.startswith("WARNING") else message
    except Exception as e:  # noqa: BLE001 - e.g. a schema llguidance cannot represent
        return str(e).strip() or type(e).__name__
