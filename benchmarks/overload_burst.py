#!/usr/bin/env python
"""A burst of connections arriving together: how fast the server answers the ones over
`--max-concurrent-requests` (429), and that the admitted ones complete.

    .venv/bin/python benchmarks/overload_burst.py [--connections 1000] [--limit 128] [--url URL]
        [--server-cwd DIR]   # serve another checkout's pytgi (a before/after comparison)

It starts `pytgi serve` (the default model) on a free port unless --url is given, opens every
connection first, then sends every request at once (raw HTTP/1.1 over asyncio streams: a client
this light does not become the bottleneck), and times each from its send to its status line.
Prints a table and writes benchmarks/results/overload-burst-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytgi.core.net import free_port


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def one(host: str, port: int, path: str, body: bytes, go: asyncio.Event) -> tuple[int, float]:
    reader, writer = await asyncio.open_connection(host, port)
    request = (b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (path.encode(), len(body))) + body
    await go.wait()
    t0 = time.perf_counter()
    try:
        writer.write(request)
        await writer.drain()
        status = await reader.readline()
        elapsed = time.perf_counter() - t0
        await reader.read()  # the rest, until the server closes
    except ConnectionError:
        return 0, time.perf_counter() - t0  # reset: counted as status 0
    finally:
        writer.close()
    return int(status.split()[1]), elapsed


async def burst(host: str, port: int, n: int, new_tokens: int, route: str, chars: int) -> list[tuple[int, float]]:
    words = "keeps the light burning through the storm, "
    PROMPT = "Tell me a story about a lighthouse keeper who " + words * (chars // len(words))
    if route == "chat":  # the chat template and tokenization: work a doomed request should not cost
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                              "max_tokens": new_tokens, "ignore_eos": True}
    else:
        path, body = "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": new_tokens,
                                                                   "ignore_eos_token": True}}
    go = asyncio.Event()
    tasks = [asyncio.ensure_future(one(host, port, path, json.dumps(body).encode(), go)) for _ in range(n)]
    await asyncio.sleep(1.0)  # every connection open (accepted by the kernel) before any request
    go.set()
    return await asyncio.gather(*tasks)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=128, help="the server's --max-concurrent-requests")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--url", help="an already running server (else one is started)")
    ap.add_argument("--server-cwd", help="run `python -m pytgi.cli serve` from this checkout")
    ap.add_argument("--route", choices=["generate", "chat"], default="chat")
    ap.add_argument("--prompt-chars", type=int, default=2000, help="the body's size, about")
    ap.add_argument("--label", default="pytgi")
    args = ap.parse_args()
    _raise_nofile()
    proc = None
    if args.url:
        host, port = args.url.removeprefix("http://").split(":")
        port = int(port)
    else:
        host, port = "127.0.0.1", free_port()
        cmd = [sys.executable, "-m", "pytgi.cli", "serve", "--hostname", host, "--port", str(port),
               "--max-concurrent-requests", str(args.limit)]
        proc = subprocess.Popen(cmd, cwd=args.server_cwd or ROOT,  # its own open-files limit, as a user runs it
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONPATH": str(args.server_cwd or ROOT)})
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"http://{host}:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.5)
    try:
        t0 = time.perf_counter()
        results = asyncio.run(burst(host, port, args.connections, args.new_tokens, args.route,
                                     args.prompt_chars))
        wall = time.perf_counter() - t0
        healthy = httpx.get(f"http://{host}:{port}/health", timeout=10).status_code == 200
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    by = {}
    for code, t in results:
        by.setdefault(code, []).append(t)
    rows = {str(code): {"count": len(ts), "p50_s": statistics.median(ts), "p90_s": pct(ts, 0.9), "max_s": max(ts)}
            for code, ts in sorted(by.items())}
    print(f"{args.label}: {args.connections} connections to {args.route}, --max-concurrent-requests {args.limit}, "
          f"{wall:.1f} s in all, healthy after: {healthy}")
    print("| status | count | first byte p50 s | p90 s | max s |\n|---|---:|---:|---:|---:|")
    for code, r in rows.items():
        print(f"| {code} | {r['count']} | {r['p50_s']:.3f} | {r['p90_s']:.3f} | {r['max_s']:.3f} |")
    out = ROOT / "benchmarks" / "results" / f"overload-burst-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "route": args.route, "connections": args.connections,
                               "prompt_chars": args.prompt_chars, "limit": args.limit,
                               "new_tokens": args.new_tokens, "wall_s": wall, "healthy_after": healthy,
                               "statuses": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
