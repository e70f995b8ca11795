"""The embedding engine alone, in-process: sentences/s and tokens/s for float32 and bf16 over a batch
of prompts handed to `PoolingEngine` at once (its one-thread workers, pytgi's kernels: what a
server computes, without HTTP, tokenizer or clients), and each dtype's cosine to float32.

    .venv/bin/python benchmarks/encoder_forward.py /tmp/minilm --prompts 64 --runs 3
    PYTGI_NO_KERNELS=1 .venv/bin/python benchmarks/encoder_forward.py /tmp/minilm   # PyTorch's paths
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig
from pytgi.core.model_files import ResolvedModel
from pytgi.engine.pooling.encoder_engine import PoolingEngine


def vectors(eng: PoolingEngine, batch: list[list[int]], tag: str) -> torch.Tensor:
    for i, ids in enumerate(batch):
        eng.add_pool_request(f"{tag}{i}", ids, P.PoolParams())
    out: dict[str, P.PoolOut] = {}
    while eng.has_unfinished():
        out.update({o.request_id: o for o in eng.step() if isinstance(o, P.PoolOut)})
    assert len(out) == len(batch), "a prompt failed"
    data = [bytearray(out[f"{tag}{i}"].data) for i in range(len(batch))]
    return torch.stack([torch.frombuffer(d, dtype=torch.float32) for d in data])


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
    tokens = sum(len(b) for b in batch)
    print(f"{args.prompts} prompts, {tokens} tokens")
    print("| dtype | workers | sentences/s (best of runs) | tokens/s | cosine min to float32 |")
    print("|---|---:|---:|---:|---:|")
    ref = None
    for dtype in ("float32", "bfloat16"):
        eng = PoolingEngine(EngineConfig(model=str(args.model), dtype=dtype), ResolvedModel(args.model, "m"))
        vecs = vectors(eng, batch, "warm")
        best = float("inf")
        for run in range(args.runs):
            t0 = time.perf_counter()
            vectors(eng, batch, f"r{run}-")
            best = min(best, time.perf_counter() - t0)
        eng.shutdown()
        ref = vecs if ref is None else ref
        cos = torch.nn.functional.cosine_similarity(vecs, ref).min().item()
        print(
            f"| {dtype} | {eng.workers_count} | {len(batch) / best:.1f} | {tokens / best:.0f} | {cos:.6f} |"
        )


if __name__ == "__main__":
    main()
