"""Which files a Hub id means (pytgi.core.hub): parsing ids, GGUF quantization tags, split files,
and the refusals, from a repository's file list alone (no network)."""

import pytest

from pytgi.core.errors import HubError
from pytgi.core.hub import HubRef, choose_files, gguf_tag, parse_hub_id

HF_REPO = [
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
    ".gitattributes",
    "pytorch_model.bin",
    "onnx/model.onnx",
    "original/consolidated.safetensors",
    "chat_template.jinja",
]
GGUF_REPO = [
    "README.md",
    "gemma-3-1b-it-Q4_K_M.gguf",
    "gemma-3-1b-it-Q8_0.gguf",
    "gemma-3-1b-it-BF16.gguf",
    "gemma-3-1b-it-UD-Q4_K_XL.gguf",
    "mmproj-model-f16.gguf",
    "gemma-3-1b-it.IQ4_XS.gguf",
    "big/gemma-3-1b-it-Q6_K-00001-of-00002.gguf",
    "big/gemma-3-1b-it-Q6_K-00002-of-00002.gguf",
]


@pytest.mark.parametrize(
    "text, ref",
    [
        ("Qwen/Qwen3-0.6B", HubRef("Qwen/Qwen3-0.6B")),
        ("ggml-org/gemma-3-1b-it-GGUF:Q4_K_M", HubRef("ggml-org/gemma-3-1b-it-GGUF", tag="Q4_K_M")),
        ("org/name/sub/file-Q8_0.gguf", HubRef("org/name", file="sub/file-Q8_0.gguf")),
        ("meta-llama/Llama-3.2-1B-Instruct", HubRef("meta-llama/Llama-3.2-1B-Instruct")),
    ],
)
def test_hub_ids_parse(text, ref):
    assert parse_hub_id(text) == ref and str(ref) == text


@pytest.mark.parametrize(
    "text", ["model.gguf", "/abs/path", "./rel/dir", "~/m", "a/b/c", "org/name:", "a b/c"]
)
def test_paths_and_malformed_ids_are_not_hub_ids(text):
    assert parse_hub_id(text) is None


@pytest.mark.parametrize(
    "name, tag",
    [
        ("gemma-3-1b-it-Q4_K_M.gguf", "Q4_K_M"),
        ("model.IQ4_XS.gguf", "IQ4_XS"),
        ("x-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
        ("Qwen3-0.6B-bf16.gguf", "BF16"),
        ("m-q8_0-00001-of-00003.gguf", "Q8_0"),
        ("Q6_K/model-00001-of-00002.gguf", "Q6_K"),
        ("tinyllama.gguf", None),
        ("llama-3.2-1b-F16.gguf", "F16"),
    ],
)
def test_gguf_tags_come_from_the_name_or_its_folder(name, tag):
    assert gguf_tag(name) == tag


def test_a_model_directory_takes_only_what_pytgi_reads():
    sel = choose_files("org/m", HF_REPO, HubRef("org/m"))
    assert sel.kind == "hf" and sel.files == (
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    )


def test_gguf_by_tag_default_and_file():
    pick = lambda ref: choose_files("org/g", GGUF_REPO, ref).files
    assert pick(HubRef("org/g")) == ("gemma-3-1b-it-Q4_K_M.gguf",)  # no tag: Q4_K_M
    assert pick(HubRef("org/g", tag="q8_0")) == ("gemma-3-1b-it-Q8_0.gguf",)  # case-insensitive
    assert pick(HubRef("org/g", tag="UD-Q4_K_XL")) == ("gemma-3-1b-it-UD-Q4_K_XL.gguf",)
    assert pick(HubRef("org/g", tag="Q6_K")) == (
        "big/gemma-3-1b-it-Q6_K-00001-of-00002.gguf",
        "big/gemma-3-1b-it-Q6_K-00002-of-00002.gguf",
    )  # parts joined, in order
    assert pick(HubRef("org/g", file="gemma-3-1b-it-BF16.gguf")) == ("gemma-3-1b-it-BF16.gguf",)
    assert pick(HubRef("org/g", file="big/gemma-3-1b-it-Q6_K-00001-of-00002.gguf"))[1].endswith(
        "00002-of-00002.gguf"
    )
    assert choose_files("org/one", ["README.md", "only-Q5_K_S.gguf"], HubRef("org/one")).files == (
        "only-Q5_K_S.gguf",
    )


def test_a_lora_adapter_repository_takes_its_config_and_weights():
    files = [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_args.bin",
        "tokenizer.json",
    ]
    sel = choose_files("org/lora", files, HubRef("org/lora"))
    assert sel.kind == "hf" and sel.files == ("adapter_config.json", "adapter_model.safetensors")


def test_a_tag_in_a_model_directory_means_its_gguf_files():
    files = HF_REPO + ["model-Q4_K_M.gguf"]
    assert choose_files("org/m", files, HubRef("org/m")).kind == "hf"
    assert choose_files("org/m", files, HubRef("org/m", tag="Q4_K_M")).files == ("model-Q4_K_M.gguf",)


@pytest.mark.parametrize(
    "files, ref, said",
    [
        (
            GGUF_REPO,
            HubRef("org/g", tag="Q3_K_S"),
            (
                "org/g: no GGUF file for the tag Q3_K_S "
                "(tags here: BF16, IQ4_XS, Q4_K_M, Q6_K, Q8_0, UD-Q4_K_XL)"
            ),
        ),
        (
            ["a-Q8_0.gguf", "a-F16.gguf"],
            HubRef("org/g"),
            "several GGUF files and no Q4_K_M: name one with org/g:TAG",
        ),
        (["a-Q8_0.gguf", "b-Q8_0.gguf"], HubRef("org/g", tag="Q8_0"), "2 GGUF files carry the tag Q8_0"),
        (["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf"], HubRef("org/g"), "is missing parts"),
        (GGUF_REPO, HubRef("org/g", file="nope.gguf"), "org/g: no file nope.gguf in the repository"),
        (
            ["config.json", "pytorch_model.bin"],
            HubRef("org/p"),
            "org/p has only pickled PyTorch weights (pytorch_model.bin)",
        ),
        (["README.md"], HubRef("org/e"), "holds no model pytgi can load"),
        (
            HF_REPO[:5],
            HubRef("org/m", tag="Q4_K_M"),
            "names a GGUF quantization, but the repository has no GGUF files",
        ),
    ],
)
def test_refusals_name_the_repository_and_the_fix(files, ref, said):
    with pytest.raises(HubError) as exc:
        choose_files(ref.repo, files, ref)
    assert said in str(exc.value)


def test_an_embedding_model_takes_its_sentence_transformers_files():
    files = [
        "1_Pooling/config.json",
        "2_Normalize/.gitkeep",
        "README.md",
        "config.json",
        "config_sentence_transformers.json",
        "model.safetensors",
        "modules.json",
        "onnx/model.onnx",
        "pytorch_model.bin",
        "sentence_bert_config.json",
        "tokenizer.json",
        "vocab.txt",
    ]
    assert choose_files("sentence-transformers/m", files, HubRef("sentence-transformers/m")).files == (
        "1_Pooling/config.json",
        "config.json",
        "config_sentence_transformers.json",
        "model.safetensors",
        "modules.json",
        "sentence_bert_config.json",
        "tokenizer.json",
    )
