"""Tensor-parallel cost on this machine: throughput and per-step latency with N = 1, 2, 3 shards
of the default model, same workload, in one run.

    .venv/bin/python benchmarks/sharding.py                  # 8 requests x (128 in, 64 out), N = 1 2 3
    .venv/bin/python benchmarks/sharding.py --shards 1 2 --num-prompts 4

On a 2-core CPU no speed-up is expected: the point is the communication cost per step (all-reduce
after attention and MLP in each layer, an all-gather for the logits, one broadcast of the inputs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine


def run(n: int, args: argparse.Namespace) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(num_shard=n, max_batch_total_tokens=16384, max_total_tokens=2048))
    rng = random.Random(0)
    try:
        for warm in range(2):
            engine.add_request(f"w{warm}", [rng.randrange(100, 40000) for _ in range(16)],
                               SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        for i in range(args.num_prompts):
            engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(args.input_len)],
                               SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True))
        decode_steps: list[float] = []
        tokens, t0 = 0, time.perf_counter()
        while engine.has_unfinished():
            tokens += sum(1 for u in engine.step() if u.token_id >= 0)
            if engine.last_step.method == "decode":
                decode_steps.append(engine.last_step.seconds)
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    return {"shards": n, "wall_s": wall, "output_tok_s": tokens / wall,
            "decode_step_ms_p50": 1000 * statistics.median(decode_steps),
            "decode_batch": args.num_prompts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    rows = [run(n, args) for n in args.shards]
    base = rows[0]
    print(f"\n{args.num_prompts} requests x ({args.input_len} in, {args.output_len} out), greedy, EOS ignored\n")
    print("| shards | wall s | output tok/s | decode step p50 ms | step vs N=1 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shards']} | {r['wall_s']:.2f} | {r['output_tok_s']:.1f} | {r['decode_step_ms_p50']:.1f} | "
              f"{r['decode_step_ms_p50'] / base['decode_step_ms_p50']:.2f}x |")
    out = REPO / "benchmarks" / "results" / f"sharding-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
