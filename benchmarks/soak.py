#!/usr/bin/env python
"""A soak: mixed load on `pytgi serve` for a while, sampling the resident memory (RSS) of the API
process and of the engine process, to tell a leak (growth that goes on) from warm-up (growth that
stops: allocator pools, tokenizer caches, the prefix cache filling its blocks).

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--concurrency 8] [--sample-seconds 10]

Requests: random prompts of 64-512 words, 64-256 new tokens (EOS ignored), a quarter of them
streamed and a tenth abandoned mid-stream (the client disconnects). Prints the RSS table and the
growth over the first and second halves; writes benchmarks/results/soak-<timestamp>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytgi.core.net import free_port

WORDS = ["the", "a", "light", "keeper", "storm", "sea", "night", "ship", "rock", "wave", "wind", "lamp", "tower", "stair", "door", "bell", "salt", "rope"]


async def client(url: str, rng: random.Random, deadline: float, counts: dict[str, int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        while time.monotonic() < deadline:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(64, 512)))
            params = {"max_new_tokens": rng.randint(64, 256), "ignore_eos_token": True}
            kind = rng.random()
            try:
                if kind < 0.25:
                    async with c.stream("POST", "/generate_stream", json={"inputs": prompt, "parameters": params}) as r:
                        async for i, _ in _enumerate(r.aiter_lines()):
                            if kind < 0.1 and i > 20:  # abandoned mid-stream
                                counts["abandoned"] += 1
                                break
                        counts[str(r.status_code)] += 1
                else:
                    r = await c.post("/generate", json={"inputs": prompt, "parameters": params})
                    counts[str(r.status_code)] += 1
            except httpx.HTTPError as exc:
                counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1


async def _enumerate(it):  # type: ignore[no-untyped-def]
    i = 0
    async for x in it:
        yield i, x
        i += 1


async def sampler(procs: dict[str, psutil.Process], every: float, deadline: float, rows: list[dict]) -> None:
    t0 = time.monotonic()
    while True:
        rows.append({"t_s": round(time.monotonic() - t0, 1),
                     **{name: p.memory_info().rss / 2**20 for name, p in procs.items()}})
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(every)


async def run(url: str, procs: dict[str, psutil.Process], args: argparse.Namespace) -> tuple[list[dict], dict]:
    deadline = time.monotonic() + 60 * args.minutes
    rows: list[dict] = []
    counts: dict[str, int] = {"200": 0, "abandoned": 0}
    rngs = [random.Random(i) for i in range(args.concurrency)]
    await asyncio.gather(sampler(procs, args.sample_seconds, deadline, rows),
                         *(client(url, rng, deadline, counts) for rng in rngs))
    return rows, counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-seconds", type=float, default=10)
    args = ap.parse_args()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pytgi.cli", "serve", "--hostname", "127.0.0.1", "--port",
                             str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if proc.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.5)
        api = psutil.Process(proc.pid)
        engine = next(c for c in api.children() if "pytgi.engine.process" in " ".join(c.cmdline()))
        rows, counts = asyncio.run(run(url, {"api_mib": api, "engine_mib": engine}, args))
    finally:
        proc.terminate()
        proc.wait(60)
    half = len(rows) // 2
    growth = {name: {"first_half_mib": rows[half][name] - rows[0][name], "second_half_mib": rows[-1][name] - rows[half][name]}
              for name in ("api_mib", "engine_mib")}
    print(f"soak: {args.minutes:g} min, {args.concurrency} clients; responses {counts}")
    print("| t s | API process RSS MiB | engine process RSS MiB |\n|---:|---:|---:|")
    step = max(1, len(rows) // 12)
    for r in rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else []):
        print(f"| {r['t_s']:.0f} | {r['api_mib']:.0f} | {r['engine_mib']:.0f} |")
    for name, g in growth.items():
        print(f"{name}: +{g['first_half_mib']:.1f} MiB in the first half, +{g['second_half_mib']:.1f} in the second")
    stamp = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    out = ROOT / "benchmarks" / "results" / f"soak-{stamp}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"minutes": args.minutes, "concurrency": args.concurrency, "responses": counts,
                               "growth": growth, "rss": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for name, label in (("api_mib", "API process"), ("engine_mib", "engine process")):
            ax.plot([r["t_s"] / 60 for r in rows], [r[name] for r in rows], label=label)
        ax.set_xlabel("minutes")
        ax.set_ylabel("RSS MiB")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"))
    except ImportError:
        pass
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
