"""An agent session replayed against each server, with a restart in the middle: what does a long
conversation's prefix cost when it is cached, evicted, or lost?

The session is recorded (the same text for every server): a system prompt of --system-tokens (an
agent's instructions and tool definitions), then --turns turns, each adding a tool result of about
--tool-tokens and the recorded answer of the turn before. Each turn sends the whole conversation so
far to /v1/completions (streamed, greedy, --answer-tokens new tokens with `ignore_eos`), as agents
do, and its text is dropped: the next turn appends the recorded answer. After turn --restart-after the
server is stopped and started again (each start is followed by one short request of another prefix,
so that first-request costs are not a turn's). Reported per server: each turn's TTFT, the session's time
(the turns' times, restarts excluded), the cold, warm and after-restart TTFTs and their ratios.

Servers (each in the same invocation, on the same GGUF file):
- pytgi, the KV pool's prefix cache only (a restart loses it);
- pytgi with --prefix-cache-dir (the disk tier; a fresh directory per run, kept across the restart);
- the same with --kv-cache-dtype int8 (the KV pool, and so the files, in int8);
- llama.cpp's server, one slot, `cache_prompt` on every request, and its slot saved with
  `POST /slots/0?action=save` before the restart and restored after it (`--slot-save-path`), as its
  README documents; the restore's time counts in the next turn's TTFT.

    .venv/bin/python benchmarks/agent_session.py \\
        --llama-server /tmp/llama_cpp_python-0.3.36/build/bin/llama-server
    .venv/bin/python benchmarks/agent_session.py --model /tmp/llama/l1b-q4_k_m.gguf --system-tokens 4000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytgi.bench import peers as bpeers
from pytgi.bench.report import git_commit, machine_info, utc_stamp
from pytgi.bench.stream_client import discover_model
from pytgi.bench.workload import count_tokens, load_tokenizer

WORDS = ("file path line error test build module function class return value config request server "
         "cache token block model step batch queue stream client thread memory disk write read check "
         "patch diff commit branch merge review issue result output input list map index key").split()


def text_of(tokenizer, rng: random.Random, tokens: int, make) -> str:  # type: ignore[no-untyped-def]
    """Pieces from `make(rng)` joined until the text has about `tokens` tokens."""
    parts: list[str] = []
    n = 0
    while n < tokens:
        piece = make(rng)
        parts.append(piece)
        n += count_tokens(tokenizer, piece)
    return "".join(parts)


def tool(rng: random.Random) -> str:
    name = "_".join(rng.sample(WORDS, 2))
    desc = " ".join(rng.choices(WORDS, k=12))
    params = ", ".join(f'"{w}": {{"type": "string", "description": "the {w} to use"}}' for w in rng.sample(WORDS, 3))
    return f'{{"name": "{name}", "description": "{desc}", "parameters": {{{params}}}}}\n'


def tool_output(rng: random.Random) -> str:
    return f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}.py:{rng.randint(1, 900)}: {' '.join(rng.choices(WORDS, k=10))}\n"


def answer(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=8)).capitalize() + ". "


def record_session(tokenizer, args) -> tuple[str, list[tuple[str, str]]]:  # type: ignore[no-untyped-def]
    """The system prompt, and per turn (tool result, the answer recorded for it)."""
    rng = random.Random(0)
    system = ("You are a coding agent. Use the tools below to inspect and change the repository; answer "
              "with one tool call or a short summary.\n# Tools\n") + text_of(tokenizer, rng, args.system_tokens, tool)
    turns = [(text_of(tokenizer, rng, args.tool_tokens, tool_output), text_of(tokenizer, rng, args.answer_tokens, answer))
             for _ in range(args.turns)]
    return system, turns


def prompt_at(system: str, turns: list[tuple[str, str]], k: int) -> str:
    """The conversation sent at turn k (0-based): the turns before with their answers, then turn k's tool result."""
    parts = [system, "\n# Task\nFix the failing test in the cache module.\n"]
    for i in range(k):
        parts += [f"\n<tool_result>\n{turns[i][0]}</tool_result>\n<assistant>\n", turns[i][1], "\n</assistant>\n"]
    parts += [f"\n<tool_result>\n{turns[k][0]}</tool_result>\n<assistant>\n"]
    return "".join(parts)


def stream_turn(url: str, prompt: str, max_tokens: int, extra: dict) -> tuple[float, float, int | None]:
    """(TTFT, the turn's time, the prompt tokens the server's cache served) of one streamed completion
    (the last: where the server reports it, in the usage chunk `stream_options.include_usage` asks for)."""
    body = {"model": discover_model(url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, **extra}
    t0 = time.perf_counter()
    ttft, cached = None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if ttft is None and line.startswith("data:") and '"text"' in line:
                ttft = time.perf_counter() - t0
            if line.startswith("data:") and '"prompt_tokens_details"' in line:
                usage = json.loads(line[5:]).get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return ttft or float("nan"), time.perf_counter() - t0, cached


class Server:
    """One server kind: how to start it, talk to it, and carry its cache over a restart."""

    def __init__(self, name: str, target_factory, extra: dict, save=None, restore=None):  # type: ignore[no-untyped-def]
        self.name, self.factory, self.extra, self.save, self.restore = name, target_factory, extra, save, restore


def started(server: Server):  # type: ignore[no-untyped-def]
    """A server started and warmed by one short request of another prefix (first-request costs, such as
    kernels built or threads started, are not the session's)."""
    target = server.factory()
    target.start()
    stream_turn(target.url, "Hello there, how are you today?", 2, server.extra)
    return target


def run_session(server: Server, system: str, turns, args) -> dict:  # type: ignore[no-untyped-def]
    rows, restarts = [], []
    target = started(server)
    try:
        for k in range(len(turns)):
            if k == args.restart_after:
                if server.save:
                    server.save(target.url)
                target.stop()
                t0 = time.perf_counter()
                target = started(server)
                restarts.append(round(time.perf_counter() - t0, 2))
            t_restore = 0.0
            if k == args.restart_after and server.restore:
                t0 = time.perf_counter()
                server.restore(target.url)
                t_restore = time.perf_counter() - t0
            ttft, total, cached = stream_turn(target.url, prompt_at(system, turns, k), args.answer_tokens, server.extra)
            rows.append({"turn": k + 1, "ttft_s": round(ttft + t_restore, 3), "turn_s": round(total + t_restore, 3),
                         "restore_s": round(t_restore, 3) if t_restore else None, "cached_tokens": cached})
            print(f"  {server.name} turn {k + 1}: TTFT {rows[-1]['ttft_s']:.2f} s, turn {rows[-1]['turn_s']:.2f} s, "
                  f"cached prompt tokens {cached}", file=sys.stderr)
    finally:
        target.stop()
    # (--restart-after past the last turn: no restart; "warm" is then the last turn's)
    restarted = args.restart_after < len(rows)
    cold, warm = rows[0]["ttft_s"], rows[min(args.restart_after, len(rows)) - 1]["ttft_s"]
    after = rows[args.restart_after]["ttft_s"] if restarted else None
    return {"server": server.name, "command": target.command, "turns": rows, "restart_s": restarts,
            "session_s": round(sum(r["turn_s"] for r in rows), 2), "cold_ttft_s": cold, "warm_ttft_s": warm,
            "cold_over_warm": round(cold / warm, 2), "after_restart_ttft_s": after,
            "after_over_warm": round(after / warm, 2) if after else None,
            "cold_over_after": round(cold / after, 2) if after else None}


def llama_slot(action: str, filename: str):  # type: ignore[no-untyped-def]
    def call(url: str) -> None:
        r = httpx.post(f"{url}/slots/0?action={action}", json={"filename": filename}, timeout=600)
        r.raise_for_status()
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--system-tokens", type=int, default=12000)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--tool-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=150)
    ap.add_argument("--restart-after", type=int, default=10, help="past --turns: no restart")
    ap.add_argument("--pytgi-args", default="", help="serve flags for both pytgi servers")
    ap.add_argument(
        "--skip", action="append", default=[], help="a server to leave out: ram | disk | int8 | llama"
    )
    ap.add_argument("--llama-server", default=None, metavar="BINARY")
    ap.add_argument("--llama-server-args", default="-np 1 -c 32768 -t 2")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "agent_session.json")
    args = ap.parse_args()

    tokenizer, _ = load_tokenizer(None)
    system, turns = record_session(tokenizer, args)
    last = prompt_at(system, turns, len(turns) - 1)
    print(f"session: system {count_tokens(tokenizer, system)} tokens, {len(turns)} turns, the last prompt "
          f"{count_tokens(tokenizer, last)} tokens", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="agent-session-"))
    model = ["--model-id", args.model] if args.model else []
    pytgi_flags = " ".join([*model, args.pytgi_args]).strip()
    servers = []
    usage = {"stream_options": {"include_usage": True}}  # each turn's cached prompt tokens
    if "ram" not in args.skip:
        servers.append(Server("pytgi (RAM)", lambda: bpeers.PytgiTarget("openai", pytgi_flags, log_dir=work), usage))
    if "disk" not in args.skip:
        flags = f"{pytgi_flags} --prefix-cache-dir {work / 'kv'}"
        servers.append(Server("pytgi (RAM + disk)", lambda: bpeers.PytgiTarget("openai", flags, log_dir=work), usage))
    if "int8" not in args.skip:
        flags8 = f"{pytgi_flags} --prefix-cache-dir {work / 'kv8'} --kv-cache-dtype int8"
        servers.append(
            Server("pytgi (RAM + disk, int8 KV)", lambda: bpeers.PytgiTarget("openai", flags8, log_dir=work), usage)
        )
    if args.llama_server and "llama" not in args.skip:
        slots = work / "slots"
        slots.mkdir()
        largs = f"{args.llama_server_args} --slot-save-path {slots}"
        servers.append(Server(
            "llama-server", lambda: bpeers.LlamaServerTarget(args.llama_server, args.model, largs, log_dir=work),
            {"cache_prompt": True}, llama_slot("save", "agent.bin"), llama_slot("restore", "agent.bin")))
    runs = []
    for server in servers:
        try:
            runs.append(run_session(server, system, turns, args))
        except (RuntimeError, bpeers.PeerError, httpx.HTTPError) as e:
            runs.append({"server": server.name, "error": str(e)[:500]})
        print(f"{server.name}: {json.dumps({k: v for k, v in runs[-1].items() if k != 'turns'})}", file=sys.stderr)

    print(f"\nagent session: system {count_tokens(tokenizer, system)} tokens, {len(turns)} turns of ~{args.tool_tokens} "
          f"tool tokens and {args.answer_tokens} answer tokens, restart after turn {args.restart_after}\n")
    print("| server | session s | cold TTFT s | warm TTFT s (turn %d) | cold / warm | after restart TTFT s | after / warm "
          "| cold / after |" % min(args.restart_after, len(turns)))
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        if "error" in r:
            print(f"| {r['server']} | failed: {r['error'][:100]} |")
            continue
        print(f"| {r['server']} | {r['session_s']} | {r['cold_ttft_s']} | {r['warm_ttft_s']} | {r['cold_over_warm']} | "
              f"{r['after_restart_ttft_s']} | {r['after_over_warm']} | {r['cold_over_after']} |")
    ok = [r for r in runs if "error" not in r]
    if ok:
        print("\nTTFT per turn (s; the prompt tokens the cache served, where the server says):\n")
        print("| turn | " + " | ".join(r["server"] for r in ok) + " |")
        print("|---" * (len(ok) + 1) + "|")

        def cell(row: dict) -> str:
            cached = row.get("cached_tokens")
            return str(row["ttft_s"]) + ("" if cached is None else f" ({cached})")

        for k in range(len(turns)):
            print(f"| {k + 1} | " + " | ".join(cell(r["turns"][k]) for r in ok) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"timestamp": utc_stamp(), "commit": git_commit(), "machine": machine_info(),
                                    "args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
