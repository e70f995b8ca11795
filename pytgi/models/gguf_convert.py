"""Convert a GGUF file into a Hugging Face model directory (dequantized safetensors, tokenizer, config).

pytgi's loader reads one format; GGUF files are converted once into the cache and loaded from there.
Quantized tensors are dequantized with the `gguf` package and stored as float32 (the dequantized values
of Q4/Q8 blocks are not exactly representable in 16 bits).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pytgi.errors import UserError

# GGUF architecture → (HF architecture class, model_type). llama.cpp stores Mistral as "llama".
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's pre-tokenizer names → the Hugging Face pre-tokenizer that splits text the same way.
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class GGUFConversionError(UserError, ValueError):
    pass


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows, back to the rotate-half layout HF's Llama uses."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFConversionError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    hf_arch, model_type = ARCHITECTURES[arch]
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // n_heads
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if model_type == "qwen2":
        config["attention_bias"] = True
    if model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = False
    return config


def _hf_tensor_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")  # kind: weight | bias
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{kind}"
    raise GGUFConversionError(f"unexpected tensor {name!r} in GGUF file")


def _tensors(reader: Any, config: dict[str, Any], progress: bool):
    from gguf import dequantize
    from tqdm import tqdm

    permute = config["model_type"] == "llama"
    tensors = reader.tensors
    bar = tqdm(tensors, desc="dequantizing GGUF", unit="tensor", disable=not progress)
    for t in bar:
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        name = _hf_tensor_name(t.name)
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config["num_attention_heads"])
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config["num_key_value_heads"])
        yield name, w


def gguf_tokenizer_json(reader: Any) -> str:
    """Build a `tokenizers` byte-level BPE tokenizer equal to the one the GGUF file describes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(
            f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "convert the model to a Hugging Face directory and pass that instead"
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = {
        "smollm": _GPT2_REGEX.replace(r" ?\p{N}+", r"\p{N}"),
        "llama-bpe": _LLAMA3_REGEX,
        "qwen2": _QWEN2_REGEX,
    }.get(pre, _GPT2_REGEX)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
    )
    if pre == "smollm":  # exactly what SmolLM's own tokenizer.json does
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control (3) and user-defined (4) tokens are added tokens; control ones are special.
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3]
    )
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == 4])
    return tok.to_str()


def _tokenizer_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def tok(key: str) -> str | None:
        i = _field(reader, key)
        return None if i is None else str(tokens[int(i)])

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> Path:
    """Write `out_dir` as a Hugging Face model directory; atomic (a half-written dir never appears)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    config = gguf_config(reader)
    tokenizer_json = gguf_tokenizer_json(reader)
    tok_config = _tokenizer_config(reader, config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        types = {_hf_tensor_name(t.name): t.tensor_type.name for t in reader.tensors}
        (tmp / "quantization.json").write_text(json.dumps({"source": "gguf", "tensors": types}, indent=2))
        save_file(dict(_tensors(reader, config, progress)), str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "source": Path(gguf_path).name})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
