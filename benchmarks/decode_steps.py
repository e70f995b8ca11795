"""One stream's decode step, in-process, several times in one process: how much a step varies on this
machine with nothing else running (the offline engine, no server, no hooks). Prints a table of each
generation's median and mean step and writes JSON.

    .venv/bin/python benchmarks/decode_steps.py /tmp/llama/gptoss20b-24l-bf16.gguf --runs 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pytgi import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="decode_steps.json")
    args = ap.parse_args()
    llm = LLM(args.model, max_batch_total_tokens=16384, max_total_tokens=4096, max_input_tokens=4000)
    engine = llm.engine
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0, ignore_eos=True)
    runs = []
    print("| run | prefill s | decode ms/step p50 | mean | min | max |\n|---|---|---|---|---|---|")
    for run in range(args.runs):
        engine.add_request(f"r{run}", [(7 * j + run) % 30000 + 100 for j in range(args.prompt)], params)
        steps = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        dec = [1000 * s for s in steps[1:]]
        row = {
            "prefill_s": steps[0],
            "p50_ms": statistics.median(dec),
            "mean_ms": statistics.fmean(dec),
            "min_ms": min(dec),
            "max_ms": max(dec),
        }
        runs.append(row)
        print(
            f"| {run + 1} | {row['prefill_s']:.2f} | {row['p50_ms']:.1f} | {row['mean_ms']:.1f} "
            f"| {row['min_ms']:.1f} | {row['max_ms']:.1f} |",
            flush=True,
        )
    Path(args.out).write_text(json.dumps({"model": args.model, "args": vars(args), "runs": runs}, indent=1))
    print(f"wrote {args.out}")
    llm.shutdown()


if __name__ == "__main__":
    main()
