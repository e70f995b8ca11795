"""Paged attention on a GPU: pytgi's Triton kernel against the gather + SDPA backend, per layer.

What it measures
    One layer's attention of a Llama-3-8B (32 query heads, 8 KV heads, head dim 128, bf16, blocks of
    16), or of MLA's latent rows (`mla16`: DeepSeek-V2-Lite's 16 heads on one 576-wide row whose values
    are the keys; `mla128`: DeepSeek V3's 128 heads), for decode batches, whole prompts and a mixed
    step (a prefill chunk beside running decodes), every request's blocks scattered over the cache. Times are `triton.testing.do_bench`'s median of
    the backend's `prepare` + `forward` (the step's metadata is built each time, as the engine does),
    and the achieved KV-read bandwidth for the decode rows.

How to run (a CUDA machine)
    python benchmarks/gpu_attention.py            # table to stdout, JSON to benchmarks/results/
    python benchmarks/gpu_attention.py mla16      # MLA's rows (mla128: 128 heads on them)
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pytgi.engine.execution.batch import StepBatch
from pytgi.engine.models.attention import StepLayout, TorchAttention
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.triton_backend import TritonAttention

BS = 16
# name: (query heads, kv heads, head dim, values = keys: MLA's latent rows, one cache read as both)
SHAPES = {
    "llama3-8b": (32, 8, 128, False),
    "mla16": (16, 1, 576, True),  # DeepSeek-V2-Lite: 16 heads on one 576-wide latent row
    "mla128": (128, 1, 576, True),  # DeepSeek V3 / Kimi K2 on one GPU: 128 heads on it
}
CASES = {  # name: (query lengths, context lengths)
    "decode x1, ctx 512": ([1], [512]),
    "decode x64, ctx 1024": ([1] * 64, [1024] * 64),
    "decode x256, ctx 640": ([1] * 256, [640] * 256),
    "prefill 4 x 1024": ([1024] * 4, [1024] * 4),
    "chunk 2048 + decode x128 ctx 1024": ([2048] + [1] * 128, [2048] + [1024] * 128),
}


def layout(q_lens: list[int], ctx: list[int], rng: np.random.Generator) -> StepLayout:
    """Request i computes its last q_lens[i] of ctx[i] positions; its blocks scattered over the cache."""
    blocks = [-(-c // BS) for c in ctx]
    perm = rng.permutation(sum(blocks)) + 1
    tables = [t.tolist() for t in np.split(perm, np.cumsum(blocks)[:-1])]
    starts = [c - n for n, c in zip(q_lens, ctx)]
    return StepBatch.build([[0] * n for n in q_lens], starts, tables, BS).layout


def run_case(name, q_lens, ctx, shape, dev, rng, bench) -> dict:
    """One case on both backends: times (`bench(fn)`, ms), their largest difference, the KV read rate.
    MLA runs as `MLAttention` calls its backend: no new keys, the key cache as the values too."""
    H, KVH, D, mla = SHAPES[shape]
    lay = layout(q_lens, ctx, rng)
    slots = int(lay.block_tables.max() + 1) * BS
    k_cache = torch.randn(slots, KVH, D, device=dev, dtype=torch.bfloat16)
    v_cache = k_cache if mla else torch.randn_like(k_cache)
    T = int(sum(q_lens))
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k = v = None
    if not mla:
        k, v = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16), torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    row = {"case": name, "tokens": T}
    outs = {}
    for label, backend in (("triton", TritonAttention(Kernels.none(), (H, KVH, D))),
                           ("torch", TorchAttention(Kernels.none(), (H, KVH, D)))):
        def run(backend=backend):
            return backend.forward(q, k, v, k_cache, v_cache, backend.prepare(lay, dev), D**-0.5)
        outs[label] = run().float()
        row[f"{label}_ms"] = bench(run)
    row["max_abs_diff"] = float((outs["triton"] - outs["torch"]).abs().max())
    kv_bytes = sum(ctx) * KVH * D * 2 * (1 if mla else 2)
    row["triton_kv_GBps"] = kv_bytes / (row["triton_ms"] / 1e3) / 1e9
    row["speedup"] = row["torch_ms"] / row["triton_ms"]
    return row


def main() -> int:
    """`python benchmarks/gpu_attention.py [shape]`: llama3-8b (the default), mla16 or mla128."""
    from triton.testing import do_bench

    shape = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b"
    H, KVH, D, _ = SHAPES[shape]
    dev, rng = torch.device("cuda"), np.random.default_rng(0)
    bench = lambda fn: do_bench(fn, warmup=10, rep=50)
    rows = [run_case(name, q_lens, ctx, shape, dev, rng, bench) for name, (q_lens, ctx) in CASES.items()]
    print(f"\n{torch.cuda.get_device_name()}, one layer's attention, {shape}: {H} heads, {KVH} kv heads, "
          f"head dim {D} (bf16, blocks of {BS})\n")
    print("| case | tokens | Triton paged (ms) | gather + SDPA (ms) | speedup | KV read (GB/s) | max diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['tokens']} | {r['triton_ms']:.3f} | {r['torch_ms']:.3f} | {r['speedup']:.1f}x "
              f"| {r['triton_kv_GBps']:.0f} | {r['max_abs_diff']:.3g} |")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = REPO_ROOT / "benchmarks" / "results" / f"gpu-attention-{shape}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": shape, "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
