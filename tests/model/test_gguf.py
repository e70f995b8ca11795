"""Converting the embedded GGUF file: tokenizer equal to transformers' reading of the same file,
config from its metadata, converted once and then served from the cache."""

from __future__ import annotations

import json
import time

import pytest

from pytgi.models.registry import default_gguf_path, resolve_model
from pytgi.tokenizer import Tokenizer

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
    path, model_id = resolve_model(None, progress=False)
    first = time.perf_counter() - t0
    yield path, model_id, first
    mp.undo()


def test_converted_directory_and_config(converted):
    path, model_id, _ = converted
    assert model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True


def test_second_resolve_uses_the_cache(converted):
    path, _, first = converted
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again, _ = resolve_model(None, progress=False)
    assert again == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
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
