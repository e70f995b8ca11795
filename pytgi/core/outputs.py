"""One request's output, from the engine's token updates to text.

Incremental detokenization, stop strings (cut in this one place, with the hold-back a stream needs),
logprobs as tokens with their text, and the finish reason. The offline `LLM`, `Infer` (TGI's routes)
and the OpenAI routes all read a request's output through `OutputProcessor`, so they agree on every
one of these. Torch-free: it runs in the API process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pytgi.core import protocol as P
from pytgi.core.errors import GenerationError
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, partial_stop_len


@dataclass(slots=True)
class Token:
    id: int
    text: str
    logprob: float | None
    special: bool = False


@dataclass(slots=True)
class Delta:
    """What one engine update added to a request's output."""

    index: int  # 1-based position of the token among the generated ones
    token: Token  # text: the token's share of the output text (a special token: its piece)
    top_tokens: list[Token]
    text: str  # output text that can be sent now: a possible stop string's start is held back
    finish_reason: str | None = None  # length | eos_token | stop_sequence, on the last delta


@dataclass(slots=True)
class OutputProcessor:
    """Folds one request's `TokenOut`s into its output; `process` returns each token's `Delta`."""

    tokenizer: Tokenizer
    prompt_ids: list[int]
    params: SamplingParams
    text: str = ""  # the output text so far (once finished: cut at the stop string)
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None  # when asked; the first is None
    finish_reason: str | None = None
    stopped: bool = False  # a stop string ended it here: the engine does not know, tell it (abort)
    stop_sequence: str | None = None  # which stop string ended it
    num_cached_tokens: int = 0
    num_disk_tokens: int = 0  # of them, read back from the disk tier
    _detok: IncrementalDetokenizer | None = None
    _sent: int = 0  # how much of `text` the deltas have handed out

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids, self.params.skip_special_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill(self) -> list[Token]:
        """The prompt tokens with their logprobs (TGI's `details.prefill`), when they were asked for."""
        if self.prompt_logprobs is None:
            return []
        return [self._token(i, lp) for i, lp in zip(self.prompt_ids, self.prompt_logprobs)]

    def _token(self, token_id: int, logprob: float | None) -> Token:
        return Token(
            token_id, self.tokenizer.id_to_piece(token_id), logprob, token_id in self.tokenizer.special_ids
        )

    def process(self, out: P.TokenOut) -> Delta | None:
        """Fold one update in. None when it carried no token (prompt logprobs of a chunk);
        `GenerationError` when the engine failed the request."""
        if out.error is not None:
            raise GenerationError(out.error)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.token_id < 0:
            return None
        assert self._detok is not None and not self.finished
        self.num_cached_tokens, self.num_disk_tokens = out.num_cached_tokens, out.num_disk_tokens
        before = len(self.text)
        finish = out.finish_reason
        if not (finish == "eos_token" and out.token_id in self.tokenizer.eos_token_ids):
            self.text += self._detok.add(out.token_id)  # (the EOS is no text, even with special tokens kept)
        if finish is not None:
            self.text += self._detok.flush()
        stops = self.params.stop
        match = find_stop(self.text, stops, before) if stops else None
        if match is not None:
            self.stop_sequence = self.text[match[0] : match[1]]
            self.text = self.text[: match[1] if self.params.include_stop_str_in_output else match[0]]
            finish, self.stopped = "stop_sequence", True
        self.finish_reason = finish
        special = out.token_id in self.tokenizer.special_ids
        token = Token(
            out.token_id,
            self.tokenizer.id_to_piece(out.token_id) if special else self.text[before:],
            out.logprob,
            special,
        )
        top = [self._token(i, lp) for i, lp in out.top]
        self.tokens.append(token)
        self.top_tokens.append(top)
        return Delta(len(self.tokens), token, top, self._sendable(), finish)

    def _sendable(self) -> str:
        end = len(self.text)
        if not self.finished and self.params.stop:
            end -= partial_stop_len(self.text, self.params.stop)
        if end <= self._sent:
            return ""
        new, self._sent = self.text[self._sent : end], end
        return new
