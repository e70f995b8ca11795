#!/usr/bin/env python
"""A hybrid linear-attention model at a real shape, in pytgi's engine: start time, peak memory, prefill
and decode speed, and how much of a step the gated DeltaNet layers take.

    .venv/bin/python benchmarks/make_shaped.py --shape qwen35 --layers 8     # /tmp/llama/qwen35-8l-hf
    .venv/bin/python benchmarks/hybrid.py --model /tmp/llama/qwen35-8l-hf [--prompt 512] [--batch 1,8]

Measured in this one process (the engine in-process, one shard): the load (weights, KV cache and the
state pool), a `--prompt`-token prefill alone (TTFT), then `--new` greedy tokens for each batch size
in `--batch` (prompts of 64 tokens, EOS ignored): the mean inter-token latency of the decode steps,
and the share of the decode and prefill steps spent in the linear-attention layers (timed around
`GatedDeltaNet.forward`). Peak RSS is the process's. A table goes to stdout, the record to
benchmarks/results/hybrid-<timestamp>.json. No peer here: llama.cpp's qwen35 GGUF is not read by
pytgi yet (docs/models.md), so the comparison with llama-server waits for it.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.models.linear_attention import GatedDeltaNet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    spent = [0.0]
    forward = GatedDeltaNet.forward

    def timed(self, *a, **kw):
        t = time.perf_counter()
        out = forward(self, *a, **kw)
        spent[0] += time.perf_counter() - t
        return out

    GatedDeltaNet.forward = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, max_batch_total_tokens=16384, max_batch_size=16)
    )
    load_s = time.perf_counter() - t0
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    vocab = engine.info.vocab_size
    rec: dict = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads()}
    rec.update(load_s=load_s, peak_rss_after_load_gib=rss_load, state_bytes=engine.runner.state_bytes)

    def go(prompts: list[list[int]], new: int) -> tuple[float, list[float], float]:
        """(the first step's seconds, the other steps', the linear layers' seconds in the others)"""
        params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
        times, first, t = [], None, time.perf_counter()
        spent[0] = 0.0
        while engine.has_unfinished():
            engine.step()
            now = time.perf_counter()
            times.append(now - t)
            t = now
            first = first if first is not None else spent[0]
        return times[0], times[1:], spent[0] - (first or 0.0)  # the decode steps' linear time

    go([[5] * 16], 2)  # warm-up
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, min(vocab, 49152), (args.prompt,), generator=g).tolist()
    ttft, _, _ = go([prompt], 1)
    rec["prefill"] = {
        "tokens": args.prompt,
        "ttft_s": ttft,
        "tok_s": args.prompt / ttft,
        "linear_share": spent[0] / ttft,  # the one step was the prefill
    }
    rec["decode"] = []
    for b in map(int, args.batch.split(",")):
        prompts = [torch.randint(100, 49152, (64,), generator=g).tolist() for _ in range(b)]
        _, steps, linear = go(prompts, args.new)
        itl = sum(steps) / len(steps)
        rec["decode"].append(
            {"batch": b, "itl_ms": itl * 1000, "tok_s": b / itl, "linear_share": linear / sum(steps)}
        )
    rec["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    engine.shutdown()

    state_mib = rec["state_bytes"] / 2**20
    print(f"\nload {load_s:.1f} s, peak RSS {rec['peak_rss_gib']:.2f} GiB, state {state_mib:.1f} MiB/request")
    p = rec["prefill"]
    print(f"prefill {p['tokens']} tokens: TTFT {p['ttft_s']:.2f} s ({p['tok_s']:.0f} tok/s), "
          f"linear layers {100 * p['linear_share']:.0f}%")
    print("| batch | ITL ms | tok/s | linear layers |\n|---|---|---|---|")
    for d in rec["decode"]:
        print(f"| {d['batch']} | {d['itl_ms']:.1f} | {d['tok_s']:.1f} | {100 * d['linear_share']:.0f}% |")
    out = Path(__file__).parent / "results" / f"hybrid-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rec, indent=1))
    print(out)


if __name__ == "__main__":
    main()
