"""Tokenization, chat templates and streaming detokenization for the API process.

This module runs where torch and transformers must never be imported, so it rebuilds what
`transformers.AutoTokenizer` does from the `tokenizers` library, `jinja2` and the stdlib alone.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.models import BPE

NO_TEMPLATE = "this model has no chat template; send a plain prompt"
# Previous tokens decoded before a prompt's end, so the first output token decodes in context.
PROMPT_CONTEXT_TOKENS = 5


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: object) -> str | None:
    """tokenizer_config stores a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _special_token_strings(config: dict, special_map: dict) -> dict[str, str]:
    """Template variables like bos_token: every `*_token` entry, as in transformers' special_tokens_map."""
    merged = {**special_map, **config}  # tokenizer_config wins; special_tokens_map.json fills gaps
    extra = merged.get("extra_special_tokens")
    items = {**merged, **(extra if isinstance(extra, dict) else {})}
    out = {}
    for key, value in items.items():
        content = _token_content(value)
        if key.endswith("_token") and content is not None:
            out[key] = content
    return out


def _load_chat_template(path: Path, config: dict) -> str | None:
    """Newer transformers save the template as chat_template.jinja, which then wins over the config entry."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: jinja's built-in tojson escapes HTML characters, which templates don't want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    """The same environment transformers renders chat templates in; compiled once per template text."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (only used for non-BPE tokenizers that ask for it)."""
    for old, new in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(old, new)
    return text


class Tokenizer:
    """A Hugging Face tokenizer directory, read without transformers."""

    def __init__(
        self,
        hf: _HFTokenizer,
        config: dict,
        special_map: dict,
        model_configs: list[dict],
        chat_template: str | None,
    ):
        # transformers encodes without the truncation/padding a tokenizer.json may carry
        hf.no_truncation()
        hf.no_padding()
        self._hf = hf
        self._truncating: dict[int, _HFTokenizer] = {}  # encode_pair's, by length
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, str] = _special_token_strings(config, special_map)
        self.chat_template: str | None = chat_template
        self.special_ids: frozenset[int] = frozenset(
            i for i, tok in hf.get_added_tokens_decoder().items() if tok.special
        )
        self.bos_token_id: int | None = self._bos_id(model_configs)
        self.eos_token_ids: list[int] = self._eos_ids(model_configs)
        add_bos = config.get("add_bos_token")
        self.add_bos_token: bool = add_bos if isinstance(add_bos, bool) else self._post_processor_adds_bos()
        # transformers skips the clean-up for BPE models: it would strip real spaces before punctuation
        is_bpe = isinstance(hf.model, BPE)
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and not is_bpe

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: pytgi needs a Hugging Face fast-tokenizer file (tokenizer.json)"
            )
        config = _read_json(path / "tokenizer_config.json")
        model_configs = [_read_json(path / "generation_config.json"), _read_json(path / "config.json")]
        return cls(
            _HFTokenizer.from_file(str(tokenizer_file)),
            config,
            _read_json(path / "special_tokens_map.json"),
            model_configs,
            _load_chat_template(path, config),
        )

    def _bos_id(self, model_configs: list[dict]) -> int | None:
        bos = self.special_tokens.get("bos_token")
        bos_id = self._hf.token_to_id(bos) if bos is not None else None
        if bos_id is not None:
            return bos_id
        # no bos string in the tokenizer files: fall back to the model's own config
        return next((ids[0] for c in model_configs if (ids := _as_id_list(c.get("bos_token_id")))), None)

    def _eos_ids(self, model_configs: list[dict]) -> list[int]:
        ids = [i for c in model_configs for i in _as_id_list(c.get("eos_token_id"))]
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (eos_id := self._hf.token_to_id(eos)) is not None:
            ids.append(eos_id)
        return list(dict.fromkeys(ids))  # union, first-seen order (generation_config first)

    def _post_processor_adds_bos(self) -> bool:
        ids = self._hf.encode("", add_special_tokens=True).ids
        return self.bos_token_id is not None and ids[:1] == [self.bos_token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_truncated(
        self, text: str, most: int, side: str = "right", add_special_tokens: bool = True
    ) -> list[int]:
        """At most `most` ids: the text's tokens cut on `side` ("right" keeps the start), the special
        tokens kept around them, as transformers' and sentence-transformers' truncation does."""
        if not add_special_tokens:
            ids = self._hf.encode(text, add_special_tokens=False).ids
            return ids[-most:] if side == "left" else ids[:most]
        enc = self._hf.encode(text, add_special_tokens=False)
        enc.truncate(max(most - self._hf.num_special_tokens_to_add(False), 0), direction=side)
        return self._hf.post_process(enc).ids

    def encode_pair(self, first: str, second: str, most: int | None = None) -> tuple[list[int], int | None]:
        """A pair as a cross-encoder reads it (`[CLS] first [SEP] second [SEP]` for BERT), and where
        its second segment starts (None: the tokenizer gives the pair one segment, as RoBERTa's does).
        `most`: cut the longer text first until the pair fits, as transformers' longest_first does."""
        hf = self._hf
        if most is not None:
            cut = self._truncating.get(most)
            if (
                cut is None
            ):  # a copy of its own: truncation is a tokenizer's state, and threads share this one
                cut = _HFTokenizer.from_str(self._hf.to_str())
                cut.no_padding()
                cut.enable_truncation(most, strategy="longest_first")
                self._truncating[most] = cut
            hf = cut
        enc = hf.encode(first, second, add_special_tokens=True)
        types = enc.type_ids
        return enc.ids, next((i for i, t in enumerate(types) if t == 1), None)

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and the character span of `text` each covers."""
        enc = self._hf.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, enc.offsets

    def token(self, id: int) -> str:
        """The vocabulary's string for `id` ("[CLS]", "Ġthe"), as it is written there."""
        return self._hf.id_to_token(id) or ""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def special_id(self, text: str) -> int | None:
        """The id of the special token written `text`; None when there is no such token."""
        id = self._hf.token_to_id(text)
        return id if id is not None and id in self.special_ids else None

    def id_to_piece(self, id: int) -> str:
        return self._hf.decode([id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: object,
    ) -> str:
        """Render like transformers' apply_chat_template(..., tokenize=False); `kwargs`: more of the
        template's variables."""
        if self.chat_template is None:
            raise ValueError(NO_TEMPLATE)
        # transformers drops None-valued keys (OpenAI clients send content=None with tool calls)
        messages = [
            {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages
        ]
        variables = {**self.special_tokens, "documents": None, **kwargs}  # kwargs override special tokens
        try:
            template = _compile_template(self.chat_template)
            return template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise ValueError(str(e)) from e  # the template's own message, e.g. from raise_exception


class IncrementalDetokenizer:
    """Per-request streaming detokenization.

    Keeps a window of token ids: those before `_read` were already emitted and are decoded again only as
    context (some decoders, e.g. SentencePiece's, render a token differently at the start of a string);
    text is emitted as decode(window) minus decode(window[:_read]). Text is held back while it ends in
    U+FFFD, since the next token may complete a multi-byte UTF-8 character.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._read = len(self._window)
        self.text = ""

    def _pending_text(self) -> str:
        """Text of the tokens after `_read`, decoded in the context of the tokens before it."""
        prefix = self._tokenizer.decode(self._window[: self._read], self._skip)
        full = self._tokenizer.decode(self._window, self._skip)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _emit(self, delta: str) -> str:
        # the emitted tokens become the next call's context; older ones are no longer needed
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self.text += delta
        return delta

    def add(self, token_id: int) -> str:
        self._window.append(token_id)
        delta = self._pending_text()
        if not delta or delta.endswith("\ufffd"):
            return ""  # nothing new, or possibly a partial character: wait for more tokens
        return self._emit(delta)

    def flush(self) -> str:
        return self._emit(self._pending_text())


def find_stop(text: str, stops: list[str], start: int) -> tuple[int, int] | None:
    """Earliest occurrence of any stop string that ends after position `start` (involves new text).

    Returns (match_start, match_end) or None; of matches starting at the same place the shortest wins,
    as it would have completed first while streaming.
    """
    best: tuple[int, int] | None = None
    for stop in stops:
        if not stop:
            continue
        # only occurrences ending after `start`, i.e. starting at or after start - len(stop) + 1
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i >= 0 and (best is None or (i, i + len(stop)) < best):
            best = (i, i + len(stop))
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    A streaming server holds that much text back: the next tokens may complete the stop.
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(text), len(stop) - 1), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
