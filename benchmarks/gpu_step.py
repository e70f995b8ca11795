"""Where a CUDA step's time goes: a decode step replayed from its CUDA graph against the same step run
eagerly, at several batch sizes, and a prefill step's throughput, on the GPU alone (no scheduling,
no sampling: the model's forward and logits, timed with CUDA events).

The engine's own per-step wall time is in `benchmarks/engine.py`'s "steps" line; the difference is
what the host adds around the GPU's work.

How to run (a CUDA machine; a model directory, e.g. from `benchmarks/engine.py --make-random-model`)
    python benchmarks/gpu_step.py --model /tmp/llama3-8b-random [--sizes 1,64,256,512] [--ctx 640]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pytgi import LLM
from pytgi.engine.execution.batch import StepBatch


def cuda_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", default="1,64,256,512")
    p.add_argument("--ctx", type=int, default=640, help="each decoding request's context")
    p.add_argument("--prefill", default="16x1024", help="a prefill step: REQUESTSxTOKENS")
    p.add_argument("--quantize", default="auto", help="pytgi's --quantize (fp8: e4m3 weights)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    llm = LLM(model=args.model, dtype=args.dtype, device="cuda", max_batch_size=max(sizes),
              max_batch_prefill_tokens=16384, quantize=args.quantize)
    paged = llm.engine.runner.paged
    bs, rows = paged.block_size, []
    per_seq = -(-(args.ctx + 1) // bs)
    for B in sizes:
        tables = (np.arange(B * per_seq).reshape(B, per_seq) % (paged.num_blocks - 1)) + 1
        step = StepBatch.build([[100]] * B, [args.ctx] * B, tables.tolist(), bs)
        last = step.last_rows
        graph_ms = cuda_ms(lambda: paged.forward(step, last), 20)
        graphs, paged.graphs = paged.graphs, None
        eager_ms = cuda_ms(lambda: paged.forward(step, last), 10)
        paged.graphs = graphs
        rows.append(dict(step=f"decode x{B}, ctx {args.ctx}", tokens=B, graph_ms=graph_ms, eager_ms=eager_ms,
                         tokens_per_s=B / graph_ms * 1e3))
    n, t = (int(x) for x in args.prefill.split("x"))
    per_seq = -(-t // bs)
    tables = (np.arange(n * per_seq).reshape(n, per_seq) % (paged.num_blocks - 1)) + 1
    step = StepBatch.build([list(range(100, 100 + t))] * n, [0] * n, tables.tolist(), bs)
    last = step.last_rows
    ms = cuda_ms(lambda: paged.forward(step, last), 5)
    rows.append(dict(step=f"prefill {n} x {t}", tokens=n * t, graph_ms=None, eager_ms=ms, tokens_per_s=n * t / ms * 1e3))
    print(f"\n{torch.cuda.get_device_name()}, {args.model} ({args.dtype}, --quantize {args.quantize}): "
          "one step's forward + logits on the GPU\n")
    print("| step | tokens | CUDA graph (ms) | eager (ms) | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        graph = "" if r["graph_ms"] is None else f"{r['graph_ms']:.2f}"
        print(f"| {r['step']} | {r['tokens']} | {graph} | {r['eager_ms']:.2f} | {r['tokens_per_s']:.0f} |")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"gpu-step-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "model": args.model, "quantize": args.quantize,
                               "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
