"""Converting the embedded GGUF file: tokenizer equal to transformers' reading of the same file,
config from its metadata, converted once and then served from the cache."""

from __future__ import annotations

import json
import time

import pytest

from pytgi.core.model_files import default_gguf_path, resolve_model
from pytgi.core.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world 12345 foo",
    "  multiple   spaces\n\nnewlines\tTabs é ü 中文 😀",
    "<|im_start|>user\nHi<|im_end|>\n",
    "x=3.14159; print(f'{x:.2f}')",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTGI_CACHE", str(cache))
    t0 = time.perf_counter()
    resolved = resolve_model(None, progress=False)
    path, model_id = resolved.path, resolved.model_id
    first = time.perf_counter() - t0
    yield path, model_id, first
    mp.undo()


def test_converted_directory_and_config(converted):
    path, model_id, _ = converted
    assert model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True


def test_second_resolve_uses_the_cache(converted):
    path, _, first = converted
    stamp = (path / "config.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = resolve_model(None, progress=False).path
    assert again == path and (path / "config.json").stat().st_mtime_ns == stamp
    assert time.perf_counter() - t0 < first


def test_tokenizer_equals_transformers_reading_of_the_gguf(converted):
    from transformers import AutoTokenizer

    path, _, _ = converted
    gguf = default_gguf_path()
    ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ours = Tokenizer.from_dir(path)
    for text in TEXTS:
        assert ours.encode(text) == ref(text).input_ids
    assert ours.eos_token_ids == [2] and ours.chat_template


def test_a_split_gguf_converts_as_the_whole_file(tmp_path):
    """llama.cpp's split files (-00001-of-0000N.gguf), named by their first part: the same model
    directory as the file written whole; another part, or a missing one, is refused by name."""
    from pytgi.core.errors import GGUFConversionError
    from pytgi.core.gguf_convert import convert_gguf
    from pytgi.engine.loading.gguf import open_gguf
    from tests.tiny_repos import gguf_model

    whole = gguf_model(tmp_path / "w-F16.gguf")[0]
    parts = gguf_model(tmp_path / "s-F16.gguf", parts=3)
    assert [p.name for p in parts] == [f"s-F16-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    a, b = (
        convert_gguf(whole, tmp_path / "a", progress=False),
        convert_gguf(parts[0], tmp_path / "b", progress=False),
    )
    ta, tb = dict(open_gguf(a).dense_tensors()), dict(open_gguf(b).dense_tensors())
    assert ta.keys() == tb.keys() and all((ta[k] == tb[k]).all() for k in ta)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_text() == (b / name).read_text()
    with pytest.raises(GGUFConversionError, match="part 2 of a split GGUF file: name its first part"):
        convert_gguf(parts[1], tmp_path / "c")
    parts[2].unlink()
    with pytest.raises(GGUFConversionError, match="s-F16-00003-of-00003.gguf is missing"):
        convert_gguf(parts[0], tmp_path / "d")
