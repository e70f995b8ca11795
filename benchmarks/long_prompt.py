"""A long prompt arriving while others stream: do the running streams stall?

N clients stream (input --stream-input, output --stream-output tokens, EOS ignored); after
--delay seconds one --long-input-token prompt arrives. Reported per server: the streams'
inter-token latency p50 / p99 / max over their whole lives and inside the window in which the long
prompt was being prefilled (its send → its first token), the ratio p99 / p50, and the long
prompt's time to first token. Each server config runs in the same invocation on the same prompts.

    .venv/bin/python benchmarks/long_prompt.py                                  # pytgi defaults
    .venv/bin/python benchmarks/long_prompt.py --pytgi "" --pytgi "--max-batch-prefill-tokens 2048" \\
        --llama-server /root/llamacpp/llama_cpp_python-0.3.36/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pytgi.bench import peers as bpeers
from pytgi.bench.report import git_commit, machine_info, percentile, utc_stamp
from pytgi.bench.stream_client import discover_model, make_protocol, send_request
from pytgi.bench.workload import BenchRequest, count_tokens, load_tokenizer, synthetic_requests


async def scenario(target: bpeers.Target, streams: list[BenchRequest], long: BenchRequest, delay: float,
                   count) -> dict:  # type: ignore[no-untyped-def]
    model = target.model or (discover_model(target.url) if target.protocol == "openai" else "default")
    protocol = make_protocol(target.protocol, model=model)
    limits = httpx.Limits(max_connections=len(streams) + 2)
    async with httpx.AsyncClient(base_url=target.url, timeout=600, limits=limits) as client:
        warm = BenchRequest(-1, streams[0].prompt, streams[0].input_len, 4)
        await send_request(client, protocol, warm, True, count, time.perf_counter())
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(send_request(client, protocol, r, True, count, t0)) for r in streams]
        await asyncio.sleep(delay)
        long_res = await send_request(client, protocol, long, True, count, t0)
        results = await asyncio.gather(*tasks)
    assert long_res.ok and long_res.ttft is not None, long_res.error
    window = (long_res.start, long_res.start + long_res.ttft)
    all_gaps, in_window = [], []
    for r in results:
        assert r.ok, r.error
        t = r.start + (r.ttft or 0.0)
        for gap in r.itl:
            t += gap
            all_gaps.append(gap)
            if window[0] <= t and t - gap <= window[1]:  # the gap overlaps the long prefill
                in_window.append(gap)
    ms = lambda v: None if v is None else round(v * 1e3, 1)
    p50, p99 = percentile(all_gaps, 50), percentile(all_gaps, 99)
    return {
        "server": target.name, "command": target.command,
        "itl_ms": {"p50": ms(p50), "p99": ms(p99), "max": ms(max(all_gaps))},
        "itl_in_window_ms": {"p50": ms(percentile(in_window, 50)), "max": ms(max(in_window, default=None))},
        "p99_over_p50": round(p99 / p50, 2),
        "long_prompt_tokens": long.input_len, "long_ttft_ms": ms(long_res.ttft),
        "stream_tokens": sum(r.output_tokens for r in results),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pytgi", action="append", default=None, metavar="FLAGS",
                    help="a pytgi server with these serve flags (repeatable; default: one with none)")
    ap.add_argument("--llama-server", default=None, metavar="BINARY")
    ap.add_argument("--llama-server-args", default="-np 9 -c 18432 -t 2",
                    help="9 slots of 2048 tokens: the streams and the long prompt")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-input", type=int, default=128)
    ap.add_argument("--stream-output", type=int, default=256)
    ap.add_argument("--long-input", type=int, default=2000)
    ap.add_argument("--long-output", type=int, default=8)
    ap.add_argument("--delay", type=float, default=3.0, help="seconds of streaming before the long prompt")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "long_prompt.json")
    args = ap.parse_args()

    tokenizer, _ = load_tokenizer(None)
    count = lambda text: count_tokens(tokenizer, text)
    streams = synthetic_requests(tokenizer, args.streams, args.stream_input, args.stream_input,
                                 args.stream_output, args.stream_output, seed=0)
    long = synthetic_requests(tokenizer, 1, args.long_input, args.long_input, args.long_output,
                              args.long_output, seed=1)[0]
    long = BenchRequest(args.streams, long.prompt, long.input_len, long.output_len)
    targets: list[bpeers.Target] = []
    for flags in args.pytgi if args.pytgi is not None else [""]:
        t = bpeers.PytgiTarget("tgi", flags)
        t.name = f"pytgi {flags}".strip()
        targets.append(t)
    if args.llama_server:
        targets.append(bpeers.LlamaServerTarget(args.llama_server, args=args.llama_server_args))
    rows = []
    for target in targets:
        try:
            with target:
                rows.append(asyncio.run(scenario(target, streams, long, args.delay, count)))
        except (AssertionError, bpeers.PeerError) as e:  # a failed request or server: say so, go on
            rows.append({"server": target.name, "command": target.command, "error": str(e)})
        print(f"{target.name}: {rows[-1]}", file=sys.stderr)
    print(f"\n{args.streams} streams ({args.stream_input} in / {args.stream_output} out); a {long.input_len}-token "
          f"prompt after {args.delay:g} s\n")
    print("| server | ITL p50 ms | ITL p99 ms | p99/p50 | ITL max ms | ITL p50 during long prefill | long TTFT ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['server']} | failed: {r['error'][:120]} |")
            continue
        print(f"| {r['server']} | {r['itl_ms']['p50']} | {r['itl_ms']['p99']} | {r['p99_over_p50']} | "
              f"{r['itl_ms']['max']} | {r['itl_in_window_ms']['p50']} | {r['long_ttft_ms']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"timestamp": utc_stamp(), "commit": git_commit(), "machine": machine_info(),
                                    "args": vars(args) | {"out": str(args.out)}, "runs": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
