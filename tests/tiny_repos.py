"""Tiny models laid out as Hub repositories, for the tests that fetch models by Hub id (tests/fake_hub.py):
a Hugging Face Llama with SmolLM2's tokenizer in bf16 safetensors, and the same shape as GGUF files
(whole, and split in two parts as llama.cpp's gguf-split writes them), built in a few seconds with
transformers and gguf-py. Random weights: these test how a model is found and fetched, not what it says."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from pytgi.core.model_files import default_gguf_path, resolve_model

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def hf_model(out: Path) -> Path:
    """config.json, generation_config.json, model.safetensors (bf16) and the default model's tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    tok = resolve_model(None, progress=False).path
    cfg = transformers.LlamaConfig(
        vocab_size=49152, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, **SHAPE
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, out / name)
    return out


def declared_gguf(path: Path, layers: int, hidden: int, inter: int, qtype: str = "Q4_0") -> Path:
    """A Llama-shaped GGUF file of any size with the default model's tokenizer whose tensors are only
    declared: the data region is a hole in a sparse file (a loader that reads no weight before
    checking the model's size never notices)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    from pytgi.engine.loading.gguf import read_tensor_index

    qt = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[qt]
    heads = hidden // 128
    writer = GGUFWriter(path, "llama")
    _llama_metadata(writer, layers, hidden, inter, heads, heads // 4 or 1, 4096)
    shapes = {"token_embd.weight": (49152, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (hidden // 4, hidden),
            f"blk.{i}.attn_v.weight": (hidden // 4, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (inter, hidden),
            f"blk.{i}.ffn_up.weight": (inter, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inter),
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
        }
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            nbytes = shape[0] * shape[1] // block * size
            writer.add_tensor_info(name, (shape[0], shape[1] // block * size), np.dtype(np.uint8), nbytes, qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "rb") as f:
        last = max(read_tensor_index(f.read()), key=lambda t: t.data_offset)
    os.truncate(path, last.data_offset + last.n_bytes)
    return path


def _llama_metadata(writer, layers: int, hidden: int, inter: int, heads: int, kv: int, context: int) -> None:
    """A Llama file's hyperparameters, and the default model's tokenizer as its file has it."""
    from gguf import GGUFReader, GGUFValueType

    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    source = GGUFReader(default_gguf_path())
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)


def gguf_model(path: Path, parts: int = 1) -> list[Path]:
    """A GGUF file of the same shape with the default model's tokenizer (F32 norms, F16 matrices);
    `parts` > 1 splits its tensors over that many files, as llama.cpp's gguf-split names them."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    hidden, inter, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    heads, kv = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    head_dim = hidden // heads
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": rng.normal(0, 0.02, (49152, hidden)).astype(np.float16),
        "output_norm.weight": np.ones(hidden, np.float32),
    }
    for i in range(layers):
        shapes = {
            "attn_q": (heads * head_dim, hidden),
            "attn_k": (kv * head_dim, hidden),
            "attn_v": (kv * head_dim, hidden),
            "attn_output": (hidden, heads * head_dim),
            "ffn_gate": (inter, hidden),
            "ffn_up": (inter, hidden),
            "ffn_down": (hidden, inter),
        }
        for name, shape in shapes.items():
            tensors[f"blk.{i}.{name}.weight"] = rng.normal(0, 0.02, shape).astype(np.float16)
        tensors[f"blk.{i}.attn_norm.weight"] = np.ones(hidden, np.float32)
        tensors[f"blk.{i}.ffn_norm.weight"] = np.ones(hidden, np.float32)
    writer = GGUFWriter(path, "llama", split_max_tensors=-(-len(tensors) // parts) if parts > 1 else 0)
    _llama_metadata(writer, layers, hidden, inter, heads, kv, SHAPE["max_position_embeddings"])
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)
