"""What FP8 costs in fidelity, measured on a CPU: the default model's mean negative log-likelihood per
token of a held-out text with its linears' weights as the CUDA path's `--quantize fp8` holds them
(e4m3 with a scale per output channel, from the bf16 weights), with its keys and values as
`--kv-cache-dtype fp8` stores them (e4m3 with a scale per token and head), and both, against bf16
weights and cache. The values are exactly those the GPU kernels multiply by (tests/unit/test_gpu_quant.py,
tests/unit/test_gpu_kernels.py check the kernels against them); only the order of the sums differs.

    .venv/bin/python benchmarks/fp8_fidelity.py [--model PATH] [--tokens 1500]

Prints a table (nats/token, and the difference from bf16); writes benchmarks/results/fp8-fidelity.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity import mean_nll, text_arguments
from pytgi import LLM
from pytgi.engine.kernels import gpu, gpu_quant
from pytgi.engine.loading.model import load_model
from pytgi.engine.models.attention import TorchAttention
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear


def fp8_weight(w: torch.Tensor) -> torch.Tensor:
    q, s = gpu_quant.quantize_fp8(w.to(torch.bfloat16))
    return gpu_quant.fp8_values(q, s, (1, w.shape[1]))


def main() -> None:
    args = text_arguments(__doc__).parse_args()
    llm = LLM(model=args.model, dtype="float32", max_batch_total_tokens=8192, max_total_tokens=4096,
              enable_prefix_caching=False, progress=False)  # fmt: skip
    runner = llm.engine.runner
    # PyTorch's ops, so that the keys and values pass through TorchAttention.forward on their way in
    runner.model = load_model(Path(llm.engine.model_path), torch.float32, torch.device("cpu"), Kernels.none())
    ids = llm.tokenizer.encode(Path(args.text).read_text(encoding="utf-8")[: args.chars])[: args.tokens]
    linears = [m for m in runner.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    original = {m: m.weight.data.clone() for m in linears}
    write = TorchAttention.forward

    def fp8_cache(self, q, k, v, *rest):  # type: ignore[no-untyped-def]
        if k is not None and v is not None:
            k, v = (gpu.kv_fp8_values(gpu.quantize_kv_fp8(t)).to(t.dtype) for t in (k, v))
        return write(self, q, k, v, *rest)

    rows = {}
    for name, weights, kv in (("bf16 weights, bf16 cache", "bf16", False), ("fp8 weights", "fp8", False),
                              ("fp8 cache", "bf16", True), ("fp8 weights, fp8 cache", "fp8", True)):  # fmt: skip
        for m in linears:
            w = original[m]
            m.weight.data.copy_(fp8_weight(w) if weights == "fp8" else w.to(torch.bfloat16).float())
        TorchAttention.forward = fp8_cache if kv else write  # type: ignore[method-assign]
        rows[name] = mean_nll(llm, ids)
    TorchAttention.forward = write  # type: ignore[method-assign]
    base = rows["bf16 weights, bf16 cache"]
    print(f"\n{args.model or 'default model'}, {len(ids)} tokens of {Path(args.text).name}\n")
    print("| weights and cache | nats/token | over bf16 |\n|---|---:|---:|")
    for name, v in rows.items():
        print(f"| {name} | {v:.4f} | {v - base:+.4f} |")
    out = Path(__file__).resolve().parent / "results" / "fp8-fidelity.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "tokens": len(ids), "nll": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
