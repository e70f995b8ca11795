"""pytgi.core.tokenizer against transformers' AutoTokenizer, which is the reference it must reproduce.

Here on the tiny SmolLM2-shaped tokenizer of tests/unit/tiny_tokenizer.py; tests/model/
test_tokenizer_default.py runs the tokenizer-wide checks again on the default model's own tokenizer."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from pytgi.core.tokenizer import NO_TEMPLATE, IncrementalDetokenizer, Tokenizer, find_stop, partial_stop_len

TEXTS = [
    "",
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 and 1,000,000.",
    "  leading and trailing spaces   ",
    "tabs\tand\t\tmany     spaces\n\nnew\r\nlines\n",
    "naïve café déjà vu — Ærøskøbing, Größe",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "emoji 🎉🚀 family 👨‍👩‍👧 flags 🇫🇷 skin 👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> and <repo_name> inside",
    "def f(x):\n    return {'a': [1, 2]}  # code\n",
    "ünïcödé\u200bzero-width\u00a0nbsp",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello there 👋 — ça va?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
    [
        {"role": "system", "content": "multi\nline\n\nsystem"},
        {"role": "user", "content": "中文"},
        {"role": "assistant", "content": "好的"},
    ],
]


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    out = "".join(detok.add(i) for i in ids) + detok.flush()
    assert detok.text == out
    return out


# --- loading and attributes -------------------------------------------------------------------


def test_attributes_match_transformers(tok: Tokenizer, hf) -> None:
    assert tok.vocab_size == len(hf)
    assert tok.bos_token_id == hf.bos_token_id == 1
    assert hf.eos_token_id in tok.eos_token_ids
    assert tok.special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert set(hf.all_special_ids) <= tok.special_ids
    assert tok.chat_template == hf.chat_template
    assert tok.add_bos_token is False


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_truncation_and_padding_in_tokenizer_json_are_ignored(
    tmp_path: Path, tokenizer_dir: Path, tok: Tokenizer
) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    raw = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    raw.enable_truncation(max_length=4)
    raw.enable_padding(length=64)
    raw.save(str(tmp_path / "tokenizer.json"))
    text = "a sentence that is longer than four tokens"
    assert Tokenizer.from_dir(tmp_path).encode(text) == tok.encode(text)


def test_module_does_not_import_torch_or_transformers(tokenizer_dir: Path) -> None:
    code = (
        "import sys; from pytgi.core.tokenizer import Tokenizer, IncrementalDetokenizer\n"
        f"t = Tokenizer.from_dir({str(tokenizer_dir)!r})\n"
        "t.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "d = IncrementalDetokenizer(t); [d.add(i) for i in t.encode('hi there')]\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


# --- encode / decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf, text: str) -> None:
    assert tok.encode(text) == hf(text).input_ids
    assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids


def test_special_token_text_encodes_to_one_id(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, hf, skip: bool) -> None:
    rng = random.Random(7)
    cases = [tok.encode(t) for t in TEXTS]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))] for _ in range(50)]
    cases += [[1, 2, 0, 3] + tok.encode("x") + [2]]
    for ids in cases:
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_decode_roundtrip(tok: Tokenizer) -> None:
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_id_to_piece(tok: Tokenizer, hf) -> None:
    for i in range(tok.vocab_size):  # every id: specials, lone bytes, merges
        assert tok.id_to_piece(i) == hf.decode([i], skip_special_tokens=False)
    assert tok.id_to_piece(1) == "<|im_start|>"  # special tokens are reported, not skipped


# --- chat templates ----------------------------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf, conversation, gen: bool) -> None:
    expected = hf.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False)
    assert tok.apply_chat_template(conversation, add_generation_prompt=gen) == expected


def test_chat_template_default_adds_generation_prompt(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")  # SmolLM's template adds a default system prompt


def make_dir(tmp_path: Path, tokenizer_dir: Path, config: dict, **files: str) -> Path:
    """A tokenizer directory with the default tokenizer.json and the given config and extra files."""
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (tmp_path / name.replace("__", ".")).write_text(text)
    return tmp_path


CUSTOM_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}TOOLS: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'assistant' and loop.first %}{{ raise_exception('assistant first') }}{% endif %}"
    "[{{ loop.index }}/{{ loop.length }}] {{ m['role'] }}: {{ m['content'] | tojson }}"
    "{% if not loop.last %}\n{% endif %}"
    "{% if m['content'] == 'stop' %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}\n[assistant]{% endif %}{{ eos_token }}"
)


@pytest.fixture
def custom_dir(tmp_path: Path, tokenizer_dir: Path) -> Path:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": CUSTOM_TEMPLATE,
    }
    return make_dir(tmp_path, tokenizer_dir, config)


def test_custom_template_matches_transformers(custom_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(custom_dir))
    tok = Tokenizer.from_dir(custom_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "Zürich <&>"}}}]
    conv = [
        {"role": "user", "content": 'quote " and é & <b>'},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "stop"},
        {"role": "assistant", "content": "never rendered"},
    ]
    for kwargs in ({}, {"tools": tools}):
        for gen in (True, False):
            expected = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False, **kwargs)
            assert tok.apply_chat_template(conv, add_generation_prompt=gen, **kwargs) == expected
    rendered = tok.apply_chat_template(conv, tools=tools)
    assert rendered.startswith("<|endoftext|>TOOLS: ") and "Zürich <&>" in rendered  # no HTML escaping
    assert "[3/4] user" in rendered and "never rendered" not in rendered


def test_template_kwargs_are_variables_and_override_special_tokens(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    template = "{{ bos_token }}{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"
    path = make_dir(tmp_path, tokenizer_dir, {"bos_token": "<|im_start|>", "chat_template": template})
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    tok = Tokenizer.from_dir(path)
    conv = [{"role": "user", "content": "q"}]
    for kwargs in ({}, {"enable_thinking": True}, {"bos_token": "BOS", "enable_thinking": False}):
        expected = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False, **kwargs)
        assert tok.apply_chat_template(conv, **kwargs) == expected
    assert tok.apply_chat_template(conv, bos_token="BOS", enable_thinking=True) == "BOS<think>q"


def test_template_exception_becomes_value_error(custom_dir: Path) -> None:
    tok = Tokenizer.from_dir(custom_dir)
    with pytest.raises(ValueError, match="^Unknown role: system$"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="assistant first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_syntax_error_becomes_value_error(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_dir(make_dir(tmp_path, tokenizer_dir, {"chat_template": "{% for m in messages %}"}))
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_is_a_clear_error(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_dir(make_dir(tmp_path, tokenizer_dir, {}))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert "plain prompt" in NO_TEMPLATE


def test_template_files_special_tokens_and_eos_sources(tmp_path: Path, tokenizer_dir: Path) -> None:
    config = {"chat_template": "from config", "eos_token": {"content": "<|im_end|>"}}
    template = "{{ bos_token }}|{{ pad_token }}|{{ strftime_now('%Y') }}|{{ messages|length }}"
    files = {
        "chat_template__jinja": template,
        "special_tokens_map__json": json.dumps(
            {"bos_token": "<|im_start|>", "pad_token": {"content": "<filename>"}}
        ),
        "generation_config__json": json.dumps({"eos_token_id": [0, 2]}),
        "config__json": json.dumps({"eos_token_id": 5, "bos_token_id": 1}),
    }
    tok = Tokenizer.from_dir(make_dir(tmp_path, tokenizer_dir, config, **files))
    year = datetime.now().strftime("%Y")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == f"<|im_start|>|<filename>|{year}|1"
    assert tok.bos_token_id == 1
    assert sorted(tok.eos_token_ids) == [0, 2, 5]


def test_chat_template_json_and_none_valued_keys(tmp_path: Path, tokenizer_dir: Path) -> None:
    template = "{% for m in messages %}{{ m['role'] }}={{ m.get('content', 'MISSING') }};{% endfor %}"
    tok = Tokenizer.from_dir(
        make_dir(tmp_path, tokenizer_dir, {}, chat_template__json=json.dumps({"chat_template": template}))
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert tok.apply_chat_template(msgs) == "user=a;assistant=MISSING;"


# --- incremental detokenization ----------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_on_chat_prompt(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode(tok.apply_chat_template(CONVERSATIONS[3]), add_special_tokens=False)
    assert stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids) == tok.decode(ids, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_on_random_ids(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    partial = [i for i in range(17, 400) if "\ufffd" in tok.id_to_piece(i)]  # lone UTF-8 byte tokens
    assert partial, "expected byte-level tokens that decode to U+FFFD on their own"
    specials = sorted(tok.special_ids)
    for _ in range(400):
        pools = [partial] * 4 + [specials] + [range(tok.vocab_size)] * 5  # 40% byte tokens, 10% specials
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randrange(1, 25))]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        assert stream(detok, ids) == tok.decode(ids, skip), ids


@pytest.mark.parametrize("text", [t for t in TEXTS if t] + ["🎉" * 20, "日本語" * 10 + "🇯🇵"])
def test_detokenizer_on_multibyte_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    pieces = [detok.add(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)  # partial characters are held back, never emitted
    assert "".join(pieces) + detok.flush() == text


def test_detokenizer_holds_back_split_emoji(tok: Tokenizer) -> None:
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1, "the test needs an emoji split across tokens"
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]
    assert detok.flush() == ""


def test_detokenizer_flush_returns_dangling_partial_char(tok: Tokenizer) -> None:
    ids = tok.encode("a🎉", add_special_tokens=False)[:-1]  # cut the emoji short
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add(i) for i in ids)
    assert streamed == "a"
    assert streamed + detok.flush() == tok.decode(ids) == "a\ufffd"


def test_detokenizer_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("The answer is 日", add_special_tokens=False)
    output = tok.encode("本 🎉 done", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    expected = tok.decode(prompt + output)[len(tok.decode(prompt)) :]
    assert stream(detok, output) == expected == "本 🎉 done"


def test_detokenizer_decodes_a_small_window_only(tok: Tokenizer, tokenizer_dir: Path) -> None:
    seen: list[int] = []

    class Spy(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    spy = Spy.from_dir(tokenizer_dir)
    ids = tok.encode("long output with 日本語 and 🎉 " * 100, add_special_tokens=False)
    assert stream(IncrementalDetokenizer(spy, prompt_ids=list(range(100, 400))), ids) == tok.decode(ids)
    assert len(ids) > 500 and max(seen) <= 8


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory) -> Path:
    """A tiny SentencePiece-style tokenizer: decoding drops the first token's leading space."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = HFTokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    corpus = ["hello world, the quick brown fox jumps over the lazy dog"] * 20 + ["héllo 日本"]
    t.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("metaspace")
    t.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_metaspace_decode_and_context(metaspace_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(metaspace_dir))
    tok = Tokenizer.from_dir(metaspace_dir)
    ids = tok.encode("hello world the fox", add_special_tokens=False)
    assert ids == hf("hello world the fox", add_special_tokens=False).input_ids
    assert tok.decode(ids[1:]) == hf.decode(ids[1:]) == "world the fox"  # no leading space on its own...
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:1])
    assert stream(detok, ids[1:]) == " world the fox"  # ...but the prompt gives the space back
    rng = random.Random(5)
    for skip in (True, False):
        for _ in range(200):
            rand = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 20))]
            assert tok.decode(rand, skip) == hf.decode(rand, skip_special_tokens=skip)
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            assert stream(detok, rand) == tok.decode(rand, skip)


# --- stop strings ------------------------------------------------------------------------------


def test_find_stop() -> None:
    # a stop that straddles old and new text is found
    assert find_stop("hello wor" + "ld!", ["world"], start=9) == (6, 11)
    # a stop entirely in old text is not reported again
    assert find_stop("STOP and more", ["STOP"], start=8) is None
    # ... but one ending exactly one character after start is
    assert find_stop("abcSTOP", ["STOP"], start=6) == (3, 7)
    # several stops: the earliest match wins, whatever the list order
    assert find_stop("xx END yy HALT", ["HALT", "END"], start=0) == (3, 6)
    assert find_stop("xx END yy HALT", ["HALT", "END"], start=10) == (10, 14)
    # overlapping stops starting at the same place: the shorter completed first
    assert find_stop("ab abc", ["abc", "ab"], start=3) == (3, 5)
    assert find_stop("a-b", ["b-", "-b"], start=0) == (1, 3)
    # no match, empty stops ignored
    assert find_stop("nothing here", ["zzz", ""], start=0) is None
    assert find_stop("", ["a"], start=0) is None
    assert find_stop("aaa", [], start=0) is None


def test_partial_stop_len() -> None:
    assert partial_stop_len("hello wo", ["world"]) == 2
    assert partial_stop_len("hello world", ["world"]) == 0  # a full stop is not a proper prefix
    assert partial_stop_len("hello", ["xyz"]) == 0
    assert partial_stop_len("text <|im", ["<|im_end|>", "</s>"]) == 4
    assert partial_stop_len("text <", ["<|im_end|>", "</s>"]) == 1
    assert partial_stop_len("aab", ["aabx", "bx"]) == 3  # the longest over all stops
    assert partial_stop_len("abab", ["ababc"]) == 4
    assert partial_stop_len("ab", ["abab"]) == 2
    assert partial_stop_len("", ["abc"]) == 0
    assert partial_stop_len("abc", [""]) == 0


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path) -> None:
    from pytgi.core.config import read_chat_template

    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    assert read_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0].content }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
