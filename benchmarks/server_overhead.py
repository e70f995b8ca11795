"""What the HTTP path costs: the same workload through `pytgi serve` (TGI's /generate_stream) and
through the offline engine (`LLM.generate`) in one run, plus the time to first token of one short
request both ways.

    .venv/bin/python benchmarks/server_overhead.py                 # 32 requests, in 64-256, out 64-128
    .venv/bin/python benchmarks/server_overhead.py --num-prompts 8 --output-max 32   # quick

Prompts are random token ids decoded to text, so both paths tokenize the same text; EOS is ignored
so each request generates exactly its count. Prints a table, writes benchmarks/results/server-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytgi import LLM, SamplingParams
from tests.e2e.server import Server


def workload(args: argparse.Namespace, llm: LLM) -> tuple[list[str], list[int]]:
    rng = random.Random(args.seed)
    texts, outs = [], []
    for _ in range(args.num_prompts):
        ids = [rng.randrange(100, llm.tokenizer.vocab_size - 100) for _ in range(rng.randint(args.input_min, args.input_max))]
        texts.append(llm.tokenizer.decode(ids))
        outs.append(rng.randint(args.output_min, args.output_max))
    return texts, outs


def offline(llm: LLM, texts: list[str], outs: list[int]) -> tuple[float, int]:
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in outs]
    t0 = time.perf_counter()
    res = llm.generate(texts, params)
    return time.perf_counter() - t0, sum(len(r.token_ids) for r in res)


async def one_stream(c: httpx.AsyncClient, text: str, n: int) -> tuple[int, float]:
    body = {"inputs": text, "parameters": {"max_new_tokens": n, "ignore_eos_token": True}}
    t0, first, count = time.perf_counter(), 0.0, 0
    async with c.stream("POST", "/generate_stream", json=body) as s:
        async for line in s.aiter_lines():
            if line.startswith("data:"):
                count += 1
                first = first or time.perf_counter() - t0
    return count, first


async def over_http(url: str, texts: list[str], outs: list[int]) -> tuple[float, int]:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as c:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_stream(c, t, n) for t, n in zip(texts, outs)))
    return time.perf_counter() - t0, sum(r[0] for r in res)


def ttft_offline(llm: LLM, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        next(iter(llm.stream("Hello, how are", SamplingParams(max_new_tokens=1, temperature=0))))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ttft_http(url: str, reps: int) -> float:
    async def run() -> list[float]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return [(await one_stream(c, "Hello, how are", 1))[1] for _ in range(reps)]

    return statistics.median(asyncio.run(run()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-min", type=int, default=64)
    ap.add_argument("--input-max", type=int, default=256)
    ap.add_argument("--output-min", type=int, default=64)
    ap.add_argument("--output-max", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-reps", type=int, default=10)
    args = ap.parse_args()
    args.output_min = min(args.output_min, args.output_max)

    llm = LLM(max_batch_total_tokens=32768)
    texts, outs = workload(args, llm)
    offline(llm, texts[:2], [4, 4])  # warm-up
    off_s, off_tokens = offline(llm, texts, outs)
    off_ttft = ttft_offline(llm, args.ttft_reps)
    del llm  # one engine at a time on this machine

    srv = Server().wait_ready()
    try:
        asyncio.run(over_http(srv.url, texts[:2], [4, 4]))  # warm-up
        http_s, http_tokens = asyncio.run(over_http(srv.url, texts, outs))
        http_ttft = ttft_http(srv.url, args.ttft_reps)
    finally:
        srv.stop()

    rows = [("offline LLM.generate", off_s, off_tokens, off_ttft), ("HTTP /generate_stream", http_s, http_tokens, http_ttft)]
    print(f"\n{args.num_prompts} requests, input {args.input_min}-{args.input_max}, output {args.output_min}-{args.output_max}, "
          f"all submitted at once; TTFT: one short request, median of {args.ttft_reps}\n")
    print("| path | wall s | output tokens | output tok/s | TTFT ms |")
    print("|---|---|---|---|---|")
    for name, s, n, ttft in rows:
        print(f"| {name} | {s:.2f} | {n} | {n / s:.1f} | {ttft * 1000:.1f} |")
    print(f"\nHTTP throughput / offline: {(http_tokens / http_s) / (off_tokens / off_s):.3f}")
    out = REPO / "benchmarks" / "results" / f"server-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": [dict(zip(("path", "wall_s", "output_tokens", "ttft_s"), r))
                                                              for r in rows]}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
