"""One Mamba-2 layer's decode step (or, with --prompt, one request's prompt chunk) at Nemotron-3-Nano-
30B-A3B's shape (hidden 2688, 64 heads of 64, d_state 128, 8 groups, conv 4), PyTorch's ops against
mamba.c's (`Mamba2Mixer` with fused False and True), random bf16 weights, one request (or --batch),
best of --reps rounds of --steps steps each; the two paths alternate within each round, so a machine
loaded by other work slows both alike. Prints milliseconds a step: the whole layer (its projections
PyTorch's bf16 matmuls here, not the engine's packed kernels) and the part between the projections
alone (the projections swapped for a stub).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mamba2_decode.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mamba2_decode.py --prompt 512 --steps 3
"""

import argparse
import time

import numpy as np
import torch

from pytgi.engine.models.linear_attention import StateMetadata
from pytgi.engine.models.mamba2 import Mamba2Config, Mamba2Mixer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=0, help="instead: one prompt chunk of this length")
    args = ap.parse_args()
    torch.manual_seed(0)
    B, hidden, L = (1 if args.prompt else args.batch), 2688, args.prompt
    cfg = Mamba2Config(64, 64, 8, 128, 4)
    layers = [Mamba2Mixer(cfg, hidden, 1e-5, fused) for fused in (False, True)]
    for p in layers[0].parameters():
        p.data.copy_(torch.randn(p.shape) * 0.02)
    layers[1].load_state_dict(layers[0].state_dict())
    for layer in layers:
        layer.to(torch.bfloat16)
    pools = [
        (torch.randn(B, layers[0].conv_dim, 3).bfloat16(), torch.randn(B, 64, 64, 128) * 0.1) for _ in layers
    ]
    decodes = torch.arange(0 if L else B)
    meta = StateMetadata(
        attn=None,  # type: ignore[arg-type]
        slots=torch.arange(B),
        query_lens=[L] if L else [1] * B,
        fresh=[False] * B,
        decodes=decodes,
        decode_rows=decodes,
        reset=None,
        decode_fresh=torch.zeros(len(decodes), dtype=torch.int64),
    )
    x = torch.randn(L or B, hidden).bfloat16()
    proj = layers[0].in_proj(x)

    class Fixed(torch.nn.Module):  # the projection's output as it is: the step between the projections
        def forward(self, _: torch.Tensor) -> torch.Tensor:
            return proj

    # the same layers with the projections taken out (their weights stay shared)
    middles = [Mamba2Mixer(cfg, hidden, 1e-5, fused) for fused in (False, True)]
    for middle, layer in zip(middles, layers):
        middle.load_state_dict(layer.state_dict())
        middle.to(torch.bfloat16)
        middle.in_proj, middle.out_proj = Fixed(), torch.nn.Identity()  # type: ignore[assignment]

    runs = {
        "pytorch layer": lambda: layers[0](x, None, pools[0], meta),
        "c layer": lambda: layers[1](x, None, pools[1], meta),
        "pytorch between the projections": lambda: middles[0](x, None, pools[0], meta),
        "c between the projections": lambda: middles[1](x, None, pools[1], meta),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    with torch.inference_mode():
        for _ in range(args.reps):
            for name, fn in runs.items():
                fn()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    what = f"a prompt chunk of {L}" if L else f"batch {B}"
    print(f"threads {torch.get_num_threads()}, {what}, best of {args.reps} rounds of {args.steps} steps")
    for name, ms in times.items():
        print(f"  {name:32s} {float(np.min(ms)):7.3f} ms a step (median {float(np.median(ms)):.3f})")


if __name__ == "__main__":
    main()
