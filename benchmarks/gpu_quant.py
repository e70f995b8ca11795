"""The CUDA path's low-bit matmuls (`pytgi.engine.kernels.gpu_quant`) against cuBLAS's bf16 one, on a
Llama-3-8B's linears: time per call and the weight bytes read per second, by step size; then, for
batch 1, a sweep of the kernel's tiles (the heuristic's pick is marked).

Each timing rotates over enough copies of the weight to leave the 60 MB L2 cold (CUDA events through
`triton.testing.do_bench`, median). A 4.3 TB/s copy is the ceiling a weight-bound step can reach.

    python benchmarks/gpu_quant.py [--sizes 1,16,64,256] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pytgi.engine.kernels import gpu_quant

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}  # fmt: skip
SWEEP = [(1, bn, bk, split, 4, 3) for bn in (8, 16, 32) for bk in (256, 512) for split in (1, 2)] + [
    (1, 16, 512, 1, 8, 3), (1, 32, 512, 1, 8, 3), (1, 8, 256, 1, 2, 3), (1, 16, 256, 1, 2, 4)]  # fmt: skip


def make(kind: str, N: int, K: int) -> gpu_quant.LowbitWeight | torch.Tensor:
    dev = "cuda"
    if kind == "bf16":
        return (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
    if kind == "fp8":
        q, s = gpu_quant.quantize_fp8(torch.randn(N, K, device=dev) * 0.02)
        return gpu_quant.LowbitWeight(q, s, (N, K), 0, fp8_block=(1, K))
    bits, group = (4, 32) if kind == "int4" else (8, 16)
    u = torch.randint(0, 16 if bits == 4 else 64, (N, K), device=dev)
    d = torch.rand(N, K // group, device=dev) * 1e-3
    m = -torch.rand(N, K // group, device=dev) * 1e-2
    q, s = gpu_quant.pack_levels(u, d, m, bits)
    return gpu_quant.LowbitWeight(q, s, (N, K), bits, group)


def nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.qweight.numel() + w.scales.numel() * w.scales.element_size()


def timed(ws: list, x: torch.Tensor, blocks=None) -> float:
    i = [0]

    def call() -> None:
        w = ws[i[0] % len(ws)]
        i[0] += 1
        if isinstance(w, torch.Tensor):
            torch.nn.functional.linear(x, w)
        else:
            w.matmul(x, blocks)

    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,4,16,64,256")
    p.add_argument("--kinds", default="bf16,int4,int8x16,fp8")
    p.add_argument("--sweep", default="gate_up,down", help="shapes whose batch-1 tiles are swept ('' none)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows, sweep = [], []
    for name, (N, K) in SHAPES.items():
        for kind in args.kinds.split(","):
            one = make(kind, N, K)
            ws = [one] + [make(kind, N, K) for _ in range(max(0, -(-(256 << 20) // nbytes(one)) - 1))]
            for M in (int(s) for s in args.sizes.split(",")):
                x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
                ms = timed(ws, x)
                rows.append(dict(shape=name, N=N, K=K, kind=kind, M=M, ms=ms, gbs=nbytes(one) / ms / 1e6))
            if name in args.sweep.split(",") and (kind == "int4" or (kind == "fp8" and name == "gate_up")):
                x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
                pick = gpu_quant._blocks(1, N, K, one.bits or 8, one.sms)
                for blocks in SWEEP + [pick]:
                    try:
                        ms = timed(ws, x, blocks)
                    except Exception as exc:  # a tile the compiler refuses (shared memory)
                        print(f"  {name} {kind} {blocks}: {type(exc).__name__}")
                        continue
                    sweep.append(dict(shape=name, kind=kind, blocks=blocks, ms=ms, pick=blocks == pick,
                                      gbs=nbytes(one) / ms / 1e6))
            del ws, one
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}: one linear of Llama-3-8B, bf16 activations (ms, weight GB/s)\n")
    kinds = args.kinds.split(",")
    print("| linear | M | " + " | ".join(kinds) + " |")
    print("|---|---:|" + "---:|" * len(kinds))
    for name in SHAPES:
        for M in (int(s) for s in args.sizes.split(",")):
            cells = []
            for kind in kinds:
                r = next(r for r in rows if r["shape"] == name and r["M"] == M and r["kind"] == kind)
                cells.append(f"{r['ms'] * 1e3:.0f} us, {r['gbs']:.0f}")
            print(f"| {name} | {M} | " + " | ".join(cells) + " |")
    if sweep:
        print("\nbatch-1 tiles (BLOCK_M (1: GEMV), BLOCK_N, BLOCK_K, SPLIT, warps, stages): best five and the pick")
        for name in args.sweep.split(","):
            for kind in ("int4", "fp8"):
                these = sorted((s for s in sweep if s["shape"] == name and s["kind"] == kind), key=lambda s: s["ms"])
                for s in these[:5] + [s for s in these[5:] if s["pick"]]:
                    mark = " (pick)" if s["pick"] else ""
                    print(f"  {name} {kind} {s['blocks']}: {s['ms'] * 1e3:.1f} us, {s['gbs']:.0f} GB/s{mark}")
    out = args.out or REPO_ROOT / "benchmarks" / "results" / "gpu-quant.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "sweep": sweep}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
