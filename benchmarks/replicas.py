"""Two engine replicas on Ray Serve (`pytgi serve --replicas 2`): pytgi's prefix-aware router against
round robin on a shared-prefix workload, in one invocation; then what killing a replica costs.

The workload
    `--prompts` long system prompts (about `--system-tokens` tokens each, all different from the
    first token), `--users` users each: every user asks one short question under one system prompt,
    in a shuffled order, `--clients` at a time, `--tokens` output tokens each (EOS ignored). Each
    replica's KV cache (`--kv-tokens`) holds about half of the system prompts, as when a fleet
    serves more prompts than one replica can keep: routed by prefix, each replica keeps its half
    cached; routed in turn, each replica sees every prompt and evicts what it needs next.
    Reported per router: the prefix-cache hit rate (prompt tokens the replicas served from their
    caches, from `usage.prompt_tokens_details.cached_tokens`, over all prompt tokens), TTFT p50 and
    p90, output tok/s, and how the requests spread over the replicas (`x-pytgi-replica`).

The kill
    With the prefix router, `--clients` clients send requests without pause; after 5 s the
    replica actor that serves one of them is killed (SIGKILL). Reported: the requests that failed,
    the seconds until every request succeeds again, and the seconds until Ray Serve's new replica
    serves its first request.

How to run
    .venv/bin/python benchmarks/replicas.py            # the default model, about 5 minutes on 2 cores
A markdown table goes to stdout; the record to ``benchmarks/results/replicas-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pytgi.bench.peers import PytgiTarget
from pytgi.bench.procs import busiest_engine, parent

TOPICS = ["bakery", "bicycle shop", "law firm", "garden centre", "hotel", "library", "dentist", "museum",
          "train station", "pharmacy", "bookshop", "cinema", "zoo", "bank", "school", "airport"]
HEADER = "x-pytgi-replica"


def system_prompt(i: int, tokens: int) -> str:
    """A distinct system prompt of about `tokens` tokens (its first words differ from the others')."""
    topic = TOPICS[i % len(TOPICS)]
    rng = random.Random(i)
    words = ["policy", "customer", "opening", "hours", "price", "refund", "order", "question", "answer",
             "service", "delivery", "booking", "account", "help", "staff", "visit", "ticket", "schedule"]
    body = " ".join(rng.choice(words) for _ in range(tokens))
    return f"Assistant {i} of the {topic}. You answer for the {topic} only, in one sentence. Notes: {body}"


async def one(c: httpx.AsyncClient, system: str, question: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    body = {"model": "tgi", "stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    ttft, usage, replica, error = None, None, None, None
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            replica = r.headers.get(HEADER)
            if r.status_code != 200:
                error = f"HTTP {r.status_code}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"])[:200]
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                elif ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    return {"ttft": ttft, "usage": usage, "replica": replica, "error": error, "end": time.perf_counter()}


async def workload(url: str, jobs: list[tuple[str, str]], clients: int, tokens: int) -> list[dict]:
    sem = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        async def gated(system: str, question: str) -> dict:
            async with sem:
                return await one(c, system, question, tokens)

        return list(await asyncio.gather(*(gated(s, q) for s, q in jobs)))


def summarize(router: str, results: list[dict], seconds: float, tokens: int) -> dict:
    ok = [r for r in results if r["error"] is None and r["usage"]]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in ok)
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    spread = Counter(r["replica"] for r in ok)
    return {"router": router, "requests": len(results), "failed": len(results) - len(ok),
            "hit_rate": cached / max(prompt, 1), "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
            "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan"),
            "tok_s": len(ok) * tokens / seconds, "spread": sorted(spread.values(), reverse=True)}


def jobs_for(args: argparse.Namespace) -> list[tuple[str, str]]:
    systems = [system_prompt(i, args.system_tokens) for i in range(args.prompts)]
    jobs = [(s, f"User {u}: are you open on day {u}?") for s in systems for u in range(args.users)]
    random.Random(0).shuffle(jobs)
    return jobs


def flags(args: argparse.Namespace, router: str) -> str:
    return (f"--replicas 2 --replica-routing {router} --max-batch-total-tokens {args.kv_tokens} "
            f"--max-total-tokens {args.system_tokens * 2 + 256} --max-concurrent-requests 256")


def measure(args: argparse.Namespace, router: str) -> dict:
    with PytgiTarget(protocol="openai", extra_args=flags(args, router)) as target:
        asyncio.run(workload(target.url, [("Warm up.", "Hi")] * 4, 2, 2))
        t0 = time.perf_counter()
        results = asyncio.run(workload(target.url, jobs_for(args), args.clients, args.tokens))
        row = summarize(router, results, time.perf_counter() - t0, args.tokens)
    print(json.dumps(row), file=sys.stderr)
    return row


def kill_one_replica(server_pid: int) -> int:
    """SIGKILL the Ray actor of the busiest replica (by its engine process's CPU over a second)."""
    actor = parent(busiest_engine(server_pid))
    os.kill(actor, signal.SIGKILL)
    return actor


def measure_kill(args: argparse.Namespace) -> dict:
    systems = [system_prompt(100 + i, 64) for i in range(8)]
    with PytgiTarget(protocol="openai", extra_args=flags(args, "prefix")) as target:
        assert target.proc is not None
        results: list[dict] = []
        stop = time.perf_counter() + args.kill_seconds
        killed_at: list[float] = []

        async def client(k: int) -> None:
            async with httpx.AsyncClient(base_url=target.url, timeout=600) as c:
                n = 0
                while time.perf_counter() < stop:
                    r = await one(c, systems[(k + n) % len(systems)], f"Question {n}", args.tokens)
                    results.append(r)
                    n += 1

        async def killer() -> None:
            await asyncio.sleep(5.0)
            await asyncio.to_thread(kill_one_replica, target.proc.pid)
            killed_at.append(time.perf_counter())

        async def run() -> None:
            await asyncio.gather(killer(), *(client(k) for k in range(args.clients)))

        asyncio.run(run())
    t_kill = killed_at[0]
    before = {r["replica"] for r in results if r["end"] < t_kill and r["error"] is None}
    failed = [r for r in results if r["error"] is not None]
    last_failure = max((r["end"] for r in failed), default=t_kill)
    new = [r["end"] for r in results if r["error"] is None and r["replica"] not in before and r["end"] > t_kill]
    row = {"requests": len(results), "failed": len(failed),
           "seconds_to_no_failures": last_failure - t_kill,
           "seconds_to_new_replica": (min(new) - t_kill) if new else None,
           "errors": sorted({str(r["error"])[:120] for r in failed})}
    print(json.dumps(row), file=sys.stderr)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="system prompts")
    ap.add_argument("--users", type=int, default=12, help="users (requests) per system prompt")
    ap.add_argument("--system-tokens", type=int, default=400, help="about this many tokens each")
    ap.add_argument("--kv-tokens", type=int, default=2560, help="each replica's KV cache, in tokens")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--kill-seconds", type=float, default=40.0, help="how long the kill run sends (0: no kill)")
    ap.add_argument("--routers", default="prefix,round-robin", help="the routers compared")
    args = ap.parse_args()

    rows = [measure(args, router) for router in args.routers.split(",")]
    kill = measure_kill(args) if args.kill_seconds > 0 else None
    print(f"\n{args.prompts} system prompts of ~{args.system_tokens} tokens × {args.users} users, "
          f"{args.clients} clients, {args.tokens} output tokens; 2 replicas with {args.kv_tokens} KV tokens each; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    print("| router | requests | failed | prefix hit rate | TTFT p50 ms | TTFT p90 ms | output tok/s | per replica |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['router']} | {r['requests']} | {r['failed']} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | "
              f"{r['ttft_p90_ms']:.0f} | {r['tok_s']:.1f} | {' / '.join(map(str, r['spread']))} |")
    if kill is not None:
        new = kill["seconds_to_new_replica"]
        print(f"\nreplica killed: {kill['failed']} of {kill['requests']} requests failed; every request succeeded "
              f"again {kill['seconds_to_no_failures']:.1f} s after the kill; the new replica served "
              f"{'never' if new is None else f'{new:.1f} s after it'}")
    out = REPO / "benchmarks" / "results" / f"replicas-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "kill": kill}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
