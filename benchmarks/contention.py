"""Serving beside a busy neighbour, and pinned to fewer cores (issue 65): what does losing cores cost?

Each server (pytgi, and llama.cpp's server where --llama-server is given, on the same GGUF file) is
measured under four conditions, one after the other:

- quiet: nothing else runs;
- busy 1, busy 2: one or two ordinary busy processes (`while True: pass`, the same priority) run
  beside it during the measurement (started after the server is ready, stopped after);
- pinned: the server started under `taskset -c <first CPU>`, so that it may use one core.

and under two loads each time: a single stream (one streamed request of --tokens new tokens; its
inter-token latency, p50 and mean, from the arrival of the streamed chunks) and a mixed load
(--requests requests of varied prompts at --concurrency clients, --tokens new tokens each; output
tokens a second). Tokens are counted as each server reports them (`usage.completion_tokens`, one chunk
a token in a stream). Both servers speak OpenAI's /v1/completions, greedy, with `ignore_eos`. Peak RSS
of each server's process tree is sampled throughout. A table (markdown) is printed and the results
are written as JSON.

    .venv/bin/python benchmarks/contention.py \\
        --llama-server /tmp/llama_cpp_python-0.3.36/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytgi.bench.procs import PeakRss
from pytgi.core.net import free_port

CONDITIONS = ("quiet", "busy 1", "busy 2", "pinned")
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
]


def prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))


class Server:
    """A server process on a free port, optionally under `taskset`, with its tree's peak RSS."""

    def __init__(self, name: str, argv: list[str], pin: str | None) -> None:
        self.name, self.port = name, free_port()
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        if pin is not None:
            argv = ["taskset", "-c", pin, *argv]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError(f"{name} not ready in 600 s")
        self.rss = PeakRss(self.proc.pid)

    def stop(self) -> int:
        peak = self.rss.stop()
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        return peak


MODEL = {"id": ""}  # the served model's name (its /v1/models), set once a server is up


def body(text: str, tokens: int, stream: bool) -> dict:
    return {
        "model": MODEL["id"],
        "prompt": text,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def single_stream(url: str, tokens: int) -> dict:
    """One streamed request: the gaps between its token chunks (the first excluded)."""
    times = []
    with httpx.stream(
        "POST", url + "/v1/completions", json=body(prompt(0, 100), tokens, True), timeout=900
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    gaps = sorted(b - a for a, b in zip(times[1:], times[2:]))
    return {
        "tokens": len(times),
        "itl_p50_ms": 1e3 * gaps[len(gaps) // 2],
        "itl_mean_ms": 1e3 * sum(gaps) / len(gaps),
    }


async def _mixed(url: str, requests: int, concurrency: int, tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=1800) as client:

        async def one(i: int) -> int:
            async with sem:
                r = await client.post(
                    url + "/v1/completions", json=body(prompt(i, 30 + 13 * i), tokens, False)
                )
                r.raise_for_status()
                return int(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(requests)))
        seconds = time.perf_counter() - start
    return {"tokens": sum(counts), "seconds": seconds, "output_tok_s": sum(counts) / seconds}


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(name: str, argv: list[str], args: argparse.Namespace) -> list[dict]:
    rows = []
    first_cpu = str(min(os.sched_getaffinity(0)))
    for pinned in (False, True):
        server = Server(name, argv, first_cpu if pinned else None)
        try:
            MODEL["id"] = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            single_stream(server.url, 16)  # warm-up
            for condition in ("pinned",) if pinned else CONDITIONS[:3]:
                hogs = busy(int(condition[-1]) if condition.startswith("busy") else 0)
                try:
                    time.sleep(0.5)
                    single = single_stream(server.url, args.tokens)
                    mixed = asyncio.run(_mixed(server.url, args.requests, args.concurrency, args.tokens))
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
                rows.append({"server": name, "condition": condition, "single": single, "mixed": mixed})
                print(
                    f"{name:12} {condition:7} ITL p50 {single['itl_p50_ms']:7.1f} ms, "
                    f"mixed {mixed['output_tok_s']:7.1f} tok/s",
                    flush=True,
                )
        finally:
            peak = server.stop()
        for row in rows:
            if (row["condition"] == "pinned") == pinned:
                row["peak_rss_gib"] = peak / 2**30
    return rows


def table(rows: list[dict]) -> str:
    quiet = {r["server"]: r for r in rows if r["condition"] == "quiet"}
    lines = [
        "| server | condition | ITL p50 ms | ITL ÷ quiet | mixed tok/s | mixed ÷ quiet | peak RSS GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q = quiet[r["server"]]
        lines.append(
            f"| {r['server']} | {r['condition']} | {r['single']['itl_p50_ms']:.1f} | "
            f"{r['single']['itl_p50_ms'] / q['single']['itl_p50_ms']:.2f}× | "
            f"{r['mixed']['output_tok_s']:.1f} | "
            f"{r['mixed']['output_tok_s'] / q['mixed']['output_tok_s']:.0%} | "
            f"{r['peak_rss_gib']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded default model's)")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (a peer)")
    p.add_argument("--pytgi-args", default="", help="extra `pytgi serve` flags")
    p.add_argument("--llama-server-args", default="-np 8 -c 16384", help="its flags (threads: its default)")
    p.add_argument("--tokens", type=int, default=128, help="new tokens a request")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "contention.json"))
    args = p.parse_args()
    if args.model is None:
        from pytgi.core.model_files import default_gguf_path

        args.model = str(default_gguf_path())
    servers = {
        "pytgi": [
            sys.executable, "-m", "pytgi.cli", "serve", "--hostname", "127.0.0.1", "--port", "{port}",
            "--model-id", args.model, *shlex.split(args.pytgi_args),
        ],
    }  # fmt: skip
    if args.llama_server:
        servers["llama-server"] = [
            args.llama_server, "-m", args.model, *shlex.split(args.llama_server_args),
            "--host", "127.0.0.1", "--port", "{port}",
        ]  # fmt: skip
    rows = [row for name, argv in servers.items() for row in measure(name, argv, args)]
    print(table(rows))
    doc = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "model": args.model,
        "args": vars(args),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
