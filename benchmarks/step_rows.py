"""What a verified draft costs: one request's step of k rows (its last token and k - 1 draft tokens)
at a given context, timed in the runner, split into the decoder layers and the LM head, and the
sampler's time for k rows. Prints a table and writes benchmarks/results/step-rows-<timestamp>.json.

    .venv/bin/python benchmarks/step_rows.py [--context 400] [--model PATH] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytgi import LLM, SamplingParams
from pytgi.bench.report import git_commit, machine_info, utc_stamp
from pytgi.engine.sampling.sampler import SamplingMetadata
from pytgi.engine.scheduling.step import ScheduledRequest


def median_ms(fn, n: int = 30) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=400)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_batch_total_tokens=16384)
    eng, run = llm.engine, llm.engine.runner
    eng.add_request("a", [(7 * j) % 30000 + 100 for j in range(args.context)],
                    SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True))
    while not eng.scheduler.running or eng.scheduler.running[0].num_uncomputed > 1:
        eng.step()
    req = eng.scheduler.running[0]
    eng.block_manager.allocate(req, 17)  # room for 16 rows; their KV writes are never committed
    model, rows_out = run.model, []
    params = SamplingParams(max_new_tokens=100, temperature=0)
    for k in (1, 2, 3, 4, 5, 6, 8, 9, 12, 16):
        step = run.layout([ScheduledRequest(req, k, [101 + i for i in range(k - 1)])])
        ids_t, pos_t, rows = torch.from_numpy(step.ids), torch.from_numpy(step.positions), torch.arange(k)
        hidden = {}

        @torch.inference_mode()
        def body() -> None:
            meta = model.attention.prepare(step.layout, run.device)
            hidden["h"] = model(ids_t, pos_t, run.paged.kv_caches, meta)

        @torch.inference_mode()
        def head() -> None:
            hidden["logits"] = model.compute_logits(hidden["h"][rows])

        def sample() -> None:
            meta = SamplingMetadata.build([params] * k, [req.prompt_ids] * k, [req.output_ids] * k, [None] * k,
                                          run.vocab_size, run.device)
            run.sampling.sampler(hidden["logits"], meta)

        b, h, s = median_ms(body), median_ms(head), median_ms(sample)
        rows_out.append({"rows": k, "layers_ms": round(b, 2), "head_ms": round(h, 2), "sampler_ms": round(s, 3),
                         "total_ms": round(b + h + s, 2)})
    llm.shutdown()
    one = rows_out[0]["total_ms"]
    print(f"one request, context {args.context}: a step of k rows (k - 1 draft tokens)")
    print(f"{'rows':>4} {'layers ms':>9} {'head ms':>8} {'sampler ms':>10} {'total ms':>9} {'vs 1 row':>8}")
    for r in rows_out:
        print(f"{r['rows']:>4} {r['layers_ms']:>9} {r['head_ms']:>8} {r['sampler_ms']:>10} {r['total_ms']:>9} "
              f"{r['total_ms'] / one:>7.2f}x")
    path = REPO / "benchmarks" / "results" / f"step-rows-{utc_stamp()}.json"
    path.write_text(json.dumps({"commit": git_commit(), "machine": machine_info(), "context": args.context,
                                "model": args.model, "dtype": args.dtype, "rows": rows_out}, indent=2))
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
