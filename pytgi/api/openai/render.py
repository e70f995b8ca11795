"""OpenAI's response shapes from the router's outputs: completions and chat completions, whole or as
stream chunks, logprobs in both of OpenAI's shapes, usage. No torch here."""

from __future__ import annotations

from collections.abc import Callable

from pytgi.api.chat import answer, tools
from pytgi.api.json_response import JSON, JSONObject
from pytgi.core.outputs import Delta, OutputProcessor, Token
from pytgi.core.version import __version__

MIN_LOGPROB = -9999.0  # -inf is not JSON
SYSTEM_FINGERPRINT = f"pytgi-{__version__}"


def finish_reason(reason: str | None, tool_calls: bool = False) -> str | None:
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"  # eos_token, stop_sequence


def _lp(value: float | None) -> float | None:
    return None if value is None else max(float(value), MIN_LOGPROB)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JSONObject:
    """OpenAI's usage; `cached_tokens`: prompt tokens the prefix cache served."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def head(kind: str, rid: str, created: int, model: str) -> JSONObject:
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def chat_logprobs(pieces: list[str], tokens: list[Token], tops: list[list[Token]]) -> JSONObject:
    content: list[JSON] = [
        {
            "token": piece,
            "logprob": _lp(t.logprob),
            "bytes": [*piece.encode("utf-8")],
            "top_logprobs": [
                {"token": a.text, "logprob": _lp(a.logprob), "bytes": [*a.text.encode("utf-8")]} for a in alts
            ],
        }
        for piece, t, alts in zip(pieces, tokens, tops)
    ]
    return {"content": content, "refusal": None}


def text_logprobs(
    pieces: list[str], tokens: list[Token], tops: list[list[Token] | None], offsets: list[int]
) -> JSONObject:
    """The legacy completions shape; `top_logprobs` holds the alternatives and always the chosen token
    (None where there is no logprob: the prompt's first token)."""
    top: list[JSON] = []
    for piece, t, alts in zip(pieces, tokens, tops):
        if t.logprob is None:
            top.append(None)
            continue
        d: JSONObject = {}
        for a in alts or []:
            d.setdefault(a.text, _lp(a.logprob))
        d.setdefault(piece, _lp(t.logprob))
        top.append(d)
    return {
        "tokens": [*pieces],
        "token_logprobs": [_lp(t.logprob) for t in tokens],
        "top_logprobs": top,
        "text_offset": [*offsets],
    }


def _offsets(texts: list[str], base: int) -> list[int]:
    out, at = [], base
    for text in texts:
        out.append(at)
        at += len(text)
    return out


def completion_logprobs(out: OutputProcessor, echo: str | None) -> JSONObject:
    """A whole completion's logprobs; with `echo` (the prompt's text) the prompt's tokens first."""
    pieces = [out.tokenizer.id_to_piece(t.id) for t in out.tokens]
    texts = ["" if t.special else t.text for t in out.tokens]
    offsets = _offsets(texts, len(echo or ""))
    if echo is None:
        return text_logprobs(pieces, out.tokens, list(out.top_tokens), offsets)
    prefill = out.prefill or [Token(i, out.tokenizer.id_to_piece(i), None) for i in out.prompt_ids]
    prompt_pieces = [t.text for t in prefill]
    return text_logprobs(
        prompt_pieces + pieces,
        prefill + out.tokens,
        [None] * len(prefill) + list(out.top_tokens),
        _offsets(prompt_pieces, 0) + offsets,
    )


def tool_call(call: tools.ToolCall) -> JSONObject:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(
    text: str, finish: str | None, tool_style: tools.Style | None, reasoning_style: str | None = None
) -> tuple[JSONObject, str | None]:
    """A whole answer's message and finish reason (OpenAI's); with a reasoning parser, the reasoning
    apart (`reasoning_content`, as vLLM and DeepSeek's API name it); with tools, the calls found in
    the rest."""
    a = answer.read(text, tool_style, reasoning_style)
    message: JSONObject = {"role": "assistant", "content": a.text, "refusal": None}
    if reasoning_style is not None:
        message["reasoning_content"] = a.reasoning
    if a.calls or tool_style == "harmony":  # (harmony's content is not its text, even without calls)
        message["content"] = a.content
    if a.calls:
        message["tool_calls"] = [tool_call(c) for c in a.calls]
    return message, finish_reason(finish, bool(a.calls))


def chat_message_logprobs(out: OutputProcessor) -> JSONObject:
    return chat_logprobs([out.tokenizer.id_to_piece(t.id) for t in out.tokens], out.tokens, out.top_tokens)


class StreamRenderer:
    """OpenAI chunks from each choice's `Delta`s. The deltas' text already holds back what might start
    a stop string, so nothing sent is ever taken back; logprobs go with the text they belong to."""

    def __init__(
        self,
        chat: bool,
        head: JSONObject,
        count: int,
        logprobs: bool,
        include_usage: bool,
        prompt_tokens: int,
        id_to_piece: Callable[[int], str],
        echo: list[str] | None = None,
        tool_style: tools.Style | None = None,
        reasoning_style: str | None = None,
    ) -> None:
        self.chat, self.logprobs, self.id_to_piece = chat, logprobs, id_to_piece
        self.head = dict(head)
        if include_usage:
            self.head["usage"] = None
        self.include_usage, self.prompt_tokens = include_usage, prompt_tokens
        self.echo = echo  # completions: the prompt text per choice, sent first
        self.count = count
        self.pending: list[list[Delta]] = [[] for _ in range(count)]  # deltas whose logprobs are unsent
        self.offsets = [len(e) if e and not chat else 0 for e in (echo or [""] * count)]
        self.completion_tokens = 0
        self.cached_tokens = 0  # set before `end` (the streams know it)
        # chat: each choice's reasoning (`delta.reasoning_content`, first) and tool calls apart
        self.answers = [answer.AnswerStream(tool_style, reasoning_style) for _ in range(count)]

    def _chunk(self, choice: JSONObject) -> JSONObject:
        return {**self.head, "choices": [choice]}

    def _choice(
        self, i: int, text: str | None, logprobs: JSONObject | None, finish: str | None
    ) -> JSONObject:
        if self.chat:
            delta: JSONObject = {"content": text} if text is not None else {}
            return self._chunk({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        return self._chunk({"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish})

    def start(self) -> list[JSONObject]:
        """Chat: the assistant role first, per choice; completions with `echo`: the prompt first."""
        out = []
        for i in range(self.count):
            if self.chat:
                out.append(
                    self._chunk(
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                )
            elif self.echo and self.echo[i]:
                out.append(
                    self._chunk({"index": i, "text": self.echo[i], "logprobs": None, "finish_reason": None})
                )
        return out

    def _take_logprobs(self, i: int) -> JSONObject | None:
        deltas, self.pending[i] = self.pending[i], []
        if not self.logprobs or not deltas:
            return None
        tokens = [d.token for d in deltas]
        pieces = [self.id_to_piece(t.id) for t in tokens]
        tops = [d.top_tokens for d in deltas]
        if self.chat:
            return chat_logprobs(pieces, tokens, tops)
        texts = ["" if t.special else t.text for t in tokens]
        offsets = _offsets(texts, self.offsets[i])
        self.offsets[i] = offsets[-1] + len(texts[-1])
        return text_logprobs(pieces, tokens, list(tops), offsets)

    def delta(self, i: int, d: Delta) -> list[JSONObject]:
        self.pending[i].append(d)
        out = []
        for piece in self.answers[i].feed(d):
            if isinstance(piece, answer.Reasoning):
                delta: JSONObject = {"reasoning_content": piece.text}
                out.append(self._chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None}))
            elif isinstance(piece, tools.Content):
                out.append(self._choice(i, piece.text, self._take_logprobs(i), None))
            else:
                out.append(self._tool_chunk(i, piece))
        if d.finish_reason is not None:
            self.completion_tokens += d.index
            reason = finish_reason(d.finish_reason, bool(self.answers[i].calls))
            out.append(self._choice(i, None if self.chat else "", self._take_logprobs(i), reason))
        return out

    def _tool_chunk(self, i: int, e: tools.CallStart | tools.Arguments) -> JSONObject:
        """A chat chunk for a call's start or a piece of its arguments."""
        call: JSONObject
        if isinstance(e, tools.CallStart):
            call = {
                "index": e.index,
                "id": e.id,
                "type": "function",
                "function": {"name": e.name, "arguments": ""},
            }
        else:
            call = {"index": e.index, "function": {"arguments": e.text}}
        return self._chunk(
            {
                "index": i,
                "delta": {"tool_calls": [call]},
                "logprobs": self._take_logprobs(i),
                "finish_reason": None,
            }
        )

    def end(self) -> list[JSONObject]:
        if not self.include_usage:
            return []
        use = usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        return [{**self.head, "choices": [], "usage": use}]
