"""The sampler's cost per step: 16 rows over the default model's vocabulary (49,152), per sampling
mode, with and without a structured-output mask (half the vocabulary allowed, as the additive bias
the engine builds). Logits are N(0, 3^2), flatter than a model's, so top-p has to look far down.

    .venv/bin/python benchmarks/sampler.py [--rows 16] [--vocab 49152] [--calls 50]

Prints a markdown table (median ms per call) and writes benchmarks/results/sampler-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.sampling.sampler import Sampler, SamplingMetadata

MODES = {
    "greedy": SamplingParams(temperature=0),
    "temperature 0.8": SamplingParams(temperature=0.8, seed=1),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50, seed=1),
    "top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    "penalties + top-p": SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.5,
                                        seed=1),
}


def per_call_ms(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, mask: torch.Tensor | None,
                calls: int) -> float:
    for _ in range(3):
        sampler(logits, meta, mask)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        sampler(logits, meta, mask)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=g) * 3
    bias = torch.zeros(args.rows, args.vocab).masked_fill(torch.rand(args.rows, args.vocab, generator=g) < 0.5,
                                                          float("-inf"))
    sampler, results = Sampler(), {}
    print(f"\n{args.rows} rows x {args.vocab} tokens, torch threads {torch.get_num_threads()}, median ms per call\n")
    print("| mode | no mask | with mask |\n|---|---:|---:|")
    for name, p in MODES.items():
        gens = [torch.Generator().manual_seed(i) for i in range(args.rows)]
        meta = SamplingMetadata.build([p] * args.rows, [[1, 2, 3]] * args.rows, [[4, 5, 6]] * args.rows, gens,
                                      args.vocab, torch.device("cpu"))
        results[name] = {"no_mask_ms": per_call_ms(sampler, logits, meta, None, args.calls),
                         "mask_ms": per_call_ms(sampler, logits, meta, bias, args.calls)}
        print(f"| {name} | {results[name]['no_mask_ms']:.2f} | {results[name]['mask_ms']:.2f} |")
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"sampler-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"args": vars(args), "modes": results}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
