"""Which matmul for which step size: the default model's 30 layers of linears (qkv, o, gate/up,
down) plus its LM head, timed with float32, bfloat16, int8, int4 and mxfp4 weight-only kernels at each M
(tokens in the step): pytgi's kernels (`pytgi/engine/kernels/qgemv.c`: VNNI, then AMX for bigger steps,
where the CPU has them; `int4-vnni` without AMX) and PyTorch's (`int8-torch`, `int4-torch`). This
is what the crossovers in `pytgi.engine.models.cpu.Crossovers` (the `lowbit_*` and `vnni_before_amx`
step sizes) rest on.

    .venv/bin/python benchmarks/matmul_kernels.py                 # M = 1 2 4 8 12 16 32 64 256
    .venv/bin/python benchmarks/matmul_kernels.py --m 1 16

All layers are distinct tensors (as in the model), so the weights stream from memory as they do
in a real step rather than staying in cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.quant import QuantizedWeight

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
HEAD = (49152, 576)
KINDS = ("float32", "bfloat16", "int8", "int4", "mxfp4", "int4-vnni", "int8-torch", "int4-torch")


def build(kind: str) -> list:
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS + [HEAD]
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.02
        if kind.startswith("int") or kind == "mxfp4":
            bits, _, only = kind.partition("-")
            cpu = Kernels.for_device(torch.device("cpu"), torch.bfloat16, vnni=only != "torch", amx=only == "")
            out.append(QuantizedWeight(bits, w, torch.bfloat16, cpu))
        else:
            out.append(w.to(getattr(torch, kind)))
    return out


def time_pass(weights: list, kind: str, m: int, repeat: int) -> float:
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}

    def one() -> None:
        for w in weights:
            if isinstance(w, QuantizedWeight):
                w.matmul(xs[w.shape[1]])
            else:
                torch.nn.functional.linear(xs[w.shape[1]], w)

    one()
    best = float("inf")
    for _ in range(repeat):  # best of: other processes only ever make it slower
        t = time.perf_counter()
        one()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 64, 256])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kernels.json")
    args = ap.parse_args()
    rows = {m: {} for m in args.m}
    for kind in KINDS:
        weights = build(kind)
        for m in args.m:
            rows[m][kind] = time_pass(weights, kind, m, args.repeat)
        del weights
    print(f"\nms per step for all linears + LM head ({torch.get_num_threads()} threads)\n")
    print("| M | " + " | ".join(KINDS) + " | fastest |")
    print("|---|" + "---|" * (len(KINDS) + 1))
    for m, r in rows.items():
        print(f"| {m} | " + " | ".join(f"{r[k]:.1f}" for k in KINDS) + f" | {min(r, key=r.get)} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "ms": {str(m): r for m, r in rows.items()},
    }, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
