#!/usr/bin/env python
"""A GGUF file of a real model's shape written straight from random blocks, with llama.cpp's Q4_K_M
recipe of types per tensor: for a machine without llama.cpp's tools or the memory for a float model
(the GPU machine, where a 5 GB file cannot travel).

    python benchmarks/make_random_gguf.py --shape llama8b /tmp/l8b-q4_k_m.gguf
    python benchmarks/make_random_gguf.py --tokenizer-only .gpu/tok.gguf   # the vocabulary alone (~3 MB)
    python benchmarks/make_random_gguf.py --shape llama8b --tokenizer .gpu/tok.gguf /tmp/l8b.gguf

- Types as llama.cpp's Q4_K_M gives them to a Llama: Q6_K for the output head, and for attn_v and
  ffn_down in the layers its `use_more_bits` picks (the first and last eighth, every third between);
  Q4_K elsewhere, F32 norms.
- Each block's bytes are random but for its scale fields (fp16 d, dmin), set so that the weights are
  of about N(0, 0.02)'s size: the levels, sub-block scales and mins are whatever the bytes say, so
  every decoder path (levels, 6-bit scales, high bits) is exercised.
- The tokenizer (49,152 tokens) is the default model's, from its GGUF or from a file written with
  --tokenizer-only; config.vocab_size is the shape's own (the vocabulary padded as llama.cpp pads it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {
    "llama8b": dict(vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv=8, theta=500000.0),
    "llama3b": dict(vocab=128256, hidden=3072, inter=8192, layers=28, heads=24, kv=8, theta=500000.0),
    "llama1b": dict(vocab=128256, hidden=2048, inter=8192, layers=16, heads=32, kv=8, theta=500000.0),
    "small": dict(vocab=49152, hidden=512, inter=1536, layers=4, heads=8, kv=2, theta=10000.0),  # tests
}
Q4_K_BYTES, Q6_K_BYTES = 144, 210  # per 256 values


def more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_types(s: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF name → (shape as rows, columns; type)."""
    H, L, hd = s["hidden"], s["layers"], s["hidden"] // s["heads"]
    out = {"token_embd.weight": ((s["vocab"], H), "Q4_K"), "output_norm.weight": ((H,), "F32"),
           "output.weight": ((s["vocab"], H), "Q6_K")}  # fmt: skip
    for i in range(L):
        v_down = "Q6_K" if more_bits(i, L) else "Q4_K"
        out |= {
            f"blk.{i}.attn_norm.weight": ((H,), "F32"),
            f"blk.{i}.ffn_norm.weight": ((H,), "F32"),
            f"blk.{i}.attn_q.weight": ((s["heads"] * hd, H), "Q4_K"),
            f"blk.{i}.attn_k.weight": ((s["kv"] * hd, H), "Q4_K"),
            f"blk.{i}.attn_v.weight": ((s["kv"] * hd, H), v_down),
            f"blk.{i}.attn_output.weight": ((H, s["heads"] * hd), "Q4_K"),
            f"blk.{i}.ffn_gate.weight": ((s["inter"], H), "Q4_K"),
            f"blk.{i}.ffn_up.weight": ((s["inter"], H), "Q4_K"),
            f"blk.{i}.ffn_down.weight": ((H, s["inter"]), v_down),
        }
    return out


def random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes] of random blocks with sane scales."""
    size = Q4_K_BYTES if qtype == "Q4_K" else Q6_K_BYTES
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    if qtype == "Q4_K":  # d, dmin at 0 and 2: w = d·sc·q − dmin·m, sc and m 6-bit, q 4-bit
        blocks[..., 0:2] = np.frombuffer(np.float16(2.5e-5).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(3.0e-4).tobytes(), np.uint8)
    else:  # Q6_K: d last: w = d·sc·(q − 32), sc int8, q 6-bit
        blocks[..., 208:210] = np.frombuffer(np.float16(6.0e-6).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def copy_tokenizer(writer, source: Path) -> None:  # type: ignore[no-untyped-def]
    from gguf import GGUFReader, GGUFValueType

    for field in GGUFReader(source).fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)


def main() -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    from pytgi.core.model_files import default_gguf_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="llama8b", choices=list(SHAPES))
    p.add_argument("--tokenizer", type=Path, default=None, help="a GGUF to take the tokenizer from")
    p.add_argument("--tokenizer-only", action="store_true", help="write only the default model's tokenizer")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    writer = GGUFWriter(str(args.out), "llama")
    copy_tokenizer(writer, args.tokenizer or default_gguf_path())
    if not args.tokenizer_only:
        s = SHAPES[args.shape]
        writer.add_block_count(s["layers"])
        writer.add_context_length(131072)
        writer.add_embedding_length(s["hidden"])
        writer.add_feed_forward_length(s["inter"])
        writer.add_head_count(s["heads"])
        writer.add_head_count_kv(s["kv"])
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(s["theta"])
        writer.add_vocab_size(s["vocab"])
        rng = np.random.default_rng(args.seed)
        for name, (shape, qtype) in tensor_types(s).items():
            if qtype == "F32":
                writer.add_tensor(name, np.ones(shape, np.float32))
            else:
                data = random_blocks(*shape, qtype, rng)
                writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
