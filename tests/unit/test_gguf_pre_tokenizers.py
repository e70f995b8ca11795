"""Byte-level BPE GGUF vocabularies (`tokenizer.ggml.model` = gpt2): the text splits pytgi's tokenizer
makes for each `tokenizer.ggml.pre` name are llama.cpp's. The reference is llama.cpp's own list of
regular expressions per name (tests/unit/llama_cpp_pre_regexes.py, taken from its llama-vocab.cpp)
applied in order by Python's `regex` module as llama.cpp applies them; pytgi's side is `tokenizers`'
pre-tokenizer (Oniguruma) built from the file, from the model's original tokenizer.json expression
where llama.cpp rewrote it. Names pytgi cannot reproduce, and names llama.cpp does not know, are
refused at load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import regex
from tokenizers import Tokenizer

from pytgi.core.errors import GGUFConversionError
from pytgi.core.gguf_convert import PRE_TOKENIZER_SPLITS, gguf_tokenizer_json
from tests.unit.llama_cpp_pre_regexes import NAMES, REGEXES

TEXT = (
    "Hello World! HTTPServer's config isn't READY; we'll see... I'M SURE they'RE fine.\n"
    "Numbers: 12345, 3.14159 and 1,000,000 - done (2024-06-01).\n\n"
    "def main():\n    x = a // b  /* note */\n\tif x:\n        return {'k': [1, 2]}\n"
    "// comment\r\n"
    "中文分词测试，日本語のテキストです。カタカナ ひらがな 한국어 문장입니다\n"
    "café naïve Über élan façade São Paulo Ελληνικά русский\n"
    "emoji 🙂👍🏽 and   three spaces,  $100 + 5% <tag> a|b ~x^y `code`\n\n\n"
    "trailing   \n  \n   "
)

# Kimi K2: llama.cpp's list holds a marker ("\p{Han}+") for hand-written code that follows the
# tiktoken pattern its comment quotes; the reference is that pattern (`regex`'s V1 for `&&`).
KIMI_K2 = (
    r"(?V1)[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def llama_cpp_split(pre: str, text: str) -> list[str]:
    """llama.cpp's `unicode_regex_split`: each expression splits every piece so far into its matches
    and the stretches between them."""
    exprs = [KIMI_K2] if pre == "kimi-k2" else REGEXES[NAMES[pre]]
    pieces = [text]
    for expr in exprs:
        pattern = regex.compile(expr)
        out = []
        for piece in pieces:
            at = 0
            for m in pattern.finditer(piece):
                out += [piece[at : m.start()], m.group()]
                at = m.end()
            out.append(piece[at:])
        pieces = [p for p in out if p]
    return pieces


def reader(pre: str | None, tokens=("a",), merges=()) -> SimpleNamespace:
    values = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.token_type": [1] * len(tokens),
        "tokenizer.ggml.merges": list(merges),
    }
    if pre is not None:
        values["tokenizer.ggml.pre"] = pre
    return SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in values.items()})


def pytgi_split(pre: str | None, text: str) -> list[str]:
    tok = Tokenizer.from_str(gguf_tokenizer_json(reader(pre)))
    return [text[start:end] for _, (start, end) in tok.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_SPLITS))
def test_the_split_is_llama_cpps(pre):
    got = pytgi_split(pre, TEXT)
    assert "".join(got) == TEXT
    assert got == llama_cpp_split(pre, TEXT)


@pytest.mark.parametrize(
    "text",
    ["x", "  ", "a\n\nb", "HTTPServer's 12345", "\n", "tab\there", "end   "],
    ids=["letter", "spaces", "newlines", "word", "newline", "tab", "trailing"],
)
@pytest.mark.parametrize("pre", ["tekken", "deepseek-llm", "deepseek-v3", "kimi-k2", "glm4", "qwen35"])
def test_short_texts_split_as_llama_cpp(pre, text):
    assert pytgi_split(pre, text) == llama_cpp_split(pre, text)


def test_a_file_without_the_name_splits_as_llama_cpps_default():
    assert pytgi_split(None, TEXT) == llama_cpp_split("", TEXT) == pytgi_split("default", TEXT)


def test_every_name_llama_cpp_knows_is_served_or_refused():
    """pytgi's table holds no name llama.cpp does not know, each with the pre-tokenizer type's
    expressions (checked above); the names left out are refused."""
    assert set(PRE_TOKENIZER_SPLITS) <= set(NAMES)
    left_out = sorted(set(NAMES) - set(PRE_TOKENIZER_SPLITS))
    assert left_out == sorted(
        [
            "afmoe",
            "gemma4",
            "granite-embed-multi-311m",
            "sarvam-moe",
            "superbpe",
            "whitespace",
        ]
    )
    for pre in left_out:
        with pytest.raises(GGUFConversionError, match=regex.escape(repr(pre))):
            gguf_tokenizer_json(reader(pre))


@pytest.mark.parametrize(
    "pre",
    [
        "tekken",
        "deepseek-llm",
        "deepseek-v3",
        "kimi-k2",
        "glm4",
        "chatglm-bpe",
        "minimax-m2",
        "qwen35",
        "llama3",
        "pixtral",
        "falcon3",
        "deepseek-r1-qwen",
        "llama4",
        "exaone4",
    ],
)
def test_the_families_names_are_known(pre):
    assert pre in PRE_TOKENIZER_SPLITS


def test_an_unknown_name_is_refused():
    with pytest.raises(GGUFConversionError, match="pre-tokenizer 'no-such-model'.*not supported"):
        gguf_tokenizer_json(reader("no-such-model"))


@pytest.mark.parametrize(("pre", "ids"), [("llama-bpe", [4]), ("tekken", [4]), ("qwen2", [3, 2])])
def test_a_piece_in_the_vocabulary_skips_merges_where_llama_cpp_does(pre, ids):
    """llama.cpp's `ignore_merges` (Llama 3's, Tekken's, GLM-4.5's...): "abc" is a token though no
    merge makes it."""
    tokens = ("a", "b", "c", "ab", "abc")
    tok = Tokenizer.from_str(gguf_tokenizer_json(reader(pre, tokens, ["a b"])))
    assert tok.encode("abc", add_special_tokens=False).ids == ids


# Combining marks (Devanagari's, a decomposed "é") and capitals outside ASCII
MARKS = "नमस्ते दुनिया, cafe\u0301 ÉCOLE aÉ ǅemal"
# llama.cpp rewrote these models' expressions for its engine: capitals as "a letter not a-z", lower
# case as "a letter not A-Z", marks left out of words. pytgi keeps the original (what the model's
# tokenizer.json, or tiktoken for o200k, splits), so the two part on MARKS.
REWRITTEN = {"tekken", "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"}


@pytest.mark.parametrize("pre", sorted(set(PRE_TOKENIZER_SPLITS) - REWRITTEN))
def test_marks_and_capitals_split_as_llama_cpp(pre):
    assert pytgi_split(pre, MARKS) == llama_cpp_split(pre, MARKS)


@pytest.mark.parametrize("pre", sorted(REWRITTEN))
def test_where_llama_cpp_rewrote_the_expression_the_original_splits(pre):
    (original,) = PRE_TOKENIZER_SPLITS[pre]
    assert pytgi_split(pre, MARKS) == regex.findall(original, MARKS)
    assert pytgi_split(pre, MARKS)[:4] == ["नमस्ते", " दुनिया", ",", " cafe\u0301"]
    assert pytgi_split(pre, "ÉCOLE aÉ") == ["ÉCOLE", " a", "É"]  # llama.cpp: "É", "COLE", " aÉ"
    assert pytgi_split(pre, MARKS) != llama_cpp_split(pre, MARKS)


def test_kimi_k2_splits_camel_case_as_its_tiktoken_pattern():
    """(llama.cpp's hand-written K2 code takes a run of letters whole, whatever their case)"""
    assert pytgi_split("kimi-k2", "helloWorld 你好abc") == ["hello", "World", " ", "你好", "abc"]
