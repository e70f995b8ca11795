"""Where a decode step's time goes: the offline engine with B requests decoding (prompt 300 tokens),
the mean step time, then `torch.profiler`'s table of the top ops over 10 steps. The C kernels
(`pytgi/engine/kernels`) run inside ctypes calls, which the profiler does not see: their time is the step
time less the ops' total.

    .venv/bin/python benchmarks/profile_step.py             # B = 1
    .venv/bin/python benchmarks/profile_step.py --batch 16
    .venv/bin/python benchmarks/profile_step.py --dtype float32
    .venv/bin/python benchmarks/profile_step.py --model-id gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pytgi import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model-id", default=None, help="a model directory or GGUF file (default: the embedded model)")
    args = ap.parse_args()
    llm = LLM(args.model_id, dtype=args.dtype, max_batch_total_tokens=16384, max_total_tokens=4096,
              max_input_tokens=4000)
    engine = llm.engine
    params = SamplingParams(max_new_tokens=args.steps + 40, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [(7 * j + i) % 30000 + 100 for j in range(args.prompt)], params)
    while engine.scheduler.waiting or any(r.num_uncomputed > 1 for r in engine.scheduler.running):
        engine.step()  # prefills
    for _ in range(5):
        engine.step()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - t) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.step()
    print(f"batch {args.batch}, dtype {engine.runner.dtype}, context ~{args.prompt}: {step_ms:.2f} ms per decode step\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    llm.shutdown()


if __name__ == "__main__":
    main()
