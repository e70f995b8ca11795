"""The embedding encoder's forward alone, in-process: sentences/s and tokens/s for float32 and bf16
over one step of prompts, and each dtype's cosine to float32 (no server, no tokenizer).

    .venv/bin/python benchmarks/encoder_forward.py /tmp/minilm --prompts 64 --runs 3
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from pytgi.core.pooling import read_pooling
from pytgi.engine.models.encoder import finish, pool
from pytgi.engine.models.encoders import load_encoder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path, help="a sentence-transformers directory (BERT-family)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)  # [CLS] + 6..254 ordinary word-piece ids + [SEP]: 8..256 tokens
    batch = [
        [101, *(rng.randrange(2000, 20000) for _ in range(rng.randint(6, 254))), 102]
        for _ in range(args.prompts)
    ]
    lens = [len(b) for b in batch]
    ids = torch.tensor([t for b in batch for t in b])
    print(f"{args.prompts} prompts, {sum(lens)} tokens, {torch.get_num_threads()} threads")
    print("| dtype | sentences/s | tokens/s | cosine min to float32 |\n|---|---:|---:|---:|")
    ref = None
    for dtype in (torch.float32, torch.bfloat16):
        model = load_encoder(args.model, dtype)
        pooling = read_pooling(args.model, model.hidden_size)
        model(ids, lens)  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.runs):
            hidden = model(ids, lens)
        seconds = (time.perf_counter() - t0) / args.runs
        vecs = torch.stack([finish(v, True, None) for v in pool(hidden, lens, pooling)])
        ref = vecs if ref is None else ref
        cos = torch.nn.functional.cosine_similarity(vecs, ref).min().item()
        name = str(dtype).removeprefix("torch.")
        print(f"| {name} | {len(batch) / seconds:.1f} | {sum(lens) / seconds:.0f} | {cos:.6f} |")


if __name__ == "__main__":
    main()
