"""GGUF SentencePiece vocabularies (`tokenizer.ggml.model` = llama: Llama 2, Mistral, TinyLlama...):
pytgi's tokenizer built from the file gives the token ids transformers' reading of the same file
gives, with and without the prefix space, byte fallback, BOS and control tokens. The files are
tiny vocabularies written here (no model weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from pytgi.core.gguf_convert import gguf_tokenizer_json

# Pieces with scores out of file order, so merges must follow the scores.
PIECES = [
    ("\u2581", -1.0),
    ("h", -2.0),
    ("e", -3.0),
    ("l", -4.0),
    ("o", -5.0),
    ("w", -6.0),
    ("r", -7.0),
    ("d", -8.0),
    ("t", -9.0),
    ("!", -10.0),
    ("lo", -11.5),
    ("ll", -11.0),
    ("el", -12.0),
    ("\u2581h", -13.0),
    ("\u2581he", -14.0),
    ("llo", -15.0),
    ("\u2581hello", -16.0),
    ("\u2581w", -17.0),
    ("or", -18.0),
    ("\u2581wor", -19.0),
    ("ld", -20.0),
    ("\u2581world", -21.0),
    ("he", -22.0),
    ("\u2581t", -23.0),
    ("\u2581the", -24.0),
    ("\u2581\u2581", -25.0),
    ("<|user|>", 0.0),
]
TEXTS = [
    "hello world",
    " hello",
    "hello  world!",
    "héllo wörld",
    "the\nhello",
    "",
    "  ",
    "hello<s>world",
    "<|user|>hello",
    "</s>",
    "ww",
    "world hello the",
]


def _spm_gguf(path: Path, add_space_prefix: bool | None) -> Path:
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in PIECES]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [s for _, s in PIECES]
    types = (
        [2, 3, 3] + [6] * 256 + [1] * (len(PIECES) - 1) + [4]
    )  # unknown, control, byte, normal, user-defined
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("add_space_prefix", [None, True], ids=["unset", "prefix"])
def test_sentencepiece_gguf_tokenizer_equals_transformers(tmp_path, add_space_prefix):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    path = _spm_gguf(tmp_path / "spm.gguf", add_space_prefix)
    ours = Tokenizer.from_str(gguf_tokenizer_json(GGUFReader(str(path))))
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text


def test_no_space_prefix_when_the_file_says_so(tmp_path):
    """`add_space_prefix = false` (as llama.cpp reads it): the first word gets no '▁'. transformers
    5.24 prepends one whatever the flag says, so this case is checked against the vocabulary."""
    from gguf import GGUFReader

    path = _spm_gguf(tmp_path / "spm.gguf", False)
    ours = Tokenizer.from_str(gguf_tokenizer_json(GGUFReader(str(path))))
    index = {p: 259 + i for i, (p, _) in enumerate(PIECES)}
    assert ours.encode("hello world").ids == [1, index["he"], index["llo"], index["\u2581world"]]
    assert ours.encode(" hello").ids == [1, index["\u2581hello"]]
    for text in TEXTS:
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=True) == text.replace(
            "<s>", ""
        ).replace("</s>", "")
