"""`pytgi bench`: a serving benchmark and load generator for pytgi or any TGI / OpenAI server.

pytgi bench                                   # starts `pytgi serve` itself and benchmarks it
pytgi bench --url http://host:3000            # any TGI server (or --protocol openai)
pytgi bench --peer llama-server=./llama-server --peer transformers-serve   # pytgi, then the peers
pytgi bench --sweep-concurrency 1,2,4,8,16,32 # one run per value, and a PNG plot
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pytgi.bench import peers as bpeers

if TYPE_CHECKING:  # the rest is imported when a benchmark runs: `pytgi serve` builds this parser too
    from pytgi.bench import stream_client as bclient
    from pytgi.bench.report import Run
    from pytgi.bench.workload import BenchRequest
    from pytgi.core.tokenizer import Tokenizer

WARMUP_TOKENS = 8
PROTOCOLS = ("tgi", "openai")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _peer(text: str) -> tuple[str, str | None]:
    try:
        return bpeers.parse_peer(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    e = os.environ.get
    g = p.add_argument_group("server")
    g.add_argument(
        "--url",
        default=e("PYTGI_BENCH_URL"),
        help="benchmark this server (default: start `pytgi serve` on a free port)",
    )
    g.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="tgi",
        help="for --url and the pytgi peer: TGI's /generate_stream or OpenAI's /v1/completions",
    )
    g.add_argument(
        "--openai-endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="OpenAI route: /v1/completions (prompt lengths exact) or /v1/chat/completions",
    )
    g.add_argument(
        "--model",
        default=None,
        help='`model` in OpenAI bodies (default: the first of /v1/models, else "default")',
    )
    g.add_argument("--api-key", default=e("PYTGI_BENCH_API_KEY"), help="sent as Authorization: Bearer <key>")
    g.add_argument(
        "--peer",
        action="append",
        type=_peer,
        default=[],
        metavar="KIND[=VALUE]",
        help="also benchmark, one after another on the same prompts: pytgi, llama-server=/path/to/"
        "llama-server, transformers-serve, tgi=URL, openai=URL (repeatable). Without --url, "
        "pytgi runs first unless listed elsewhere",
    )
    g.add_argument("--pytgi-args", default="", help="extra `pytgi serve` flags for the pytgi peer")
    g.add_argument(
        "--llama-server-args",
        default=bpeers.DEFAULT_LLAMA_SERVER_ARGS,
        help="llama-server flags besides -m/--host/--port (default: %(default)s)",
    )
    g.add_argument("--llama-server-model", default=None, help="GGUF file (default: the default model's)")
    g.add_argument(
        "--transformers-serve-cmd",
        default=bpeers.DEFAULT_TRANSFORMERS_SERVE_CMD,
        help="how to run transformers serve (default: %(default)s)",
    )
    g.add_argument("--transformers-serve-args", default="", help='extra flags, e.g. "--dtype bfloat16"')
    g.add_argument(
        "--transformers-serve-model",
        default=None,
        help="HF model directory (default: the default model's); served from a copy without EOS",
    )
    g.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for a peer's /health"
    )
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")

    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64, help="requests per run (default: %(default)s)")
    w.add_argument("--input-min", type=int, default=64)
    w.add_argument("--input-max", type=int, default=512)
    w.add_argument("--output-min", type=int, default=64)
    w.add_argument("--output-max", type=int, default=256)
    w.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="N",
        help="every random prompt starts with the same N-token text (a system prompt; prefix "
        "caching), followed by its own input-min..input-max tokens",
    )
    w.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals (default: %(default)s)")
    w.add_argument(
        "--dataset",
        default=None,
        metavar="FILE.jsonl",
        help='prompts from {"prompt": str, "output_len": int} lines instead of random text',
    )
    w.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="tokenizer.json directory that builds prompts and counts tokens (default: the default model's)",
    )
    w.add_argument(
        "--count-tokens",
        choices=("text", "events"),
        default="events",
        help="count output tokens as the servers report them (usage, details, token events) and time TTFT "
        "and ITL by token events (the default: random-weight models' tokens often stream as empty text, "
        "and text re-tokenizes to other counts), or by re-tokenizing the streamed text",
    )
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask servers to generate every requested token (default: on)",
    )

    ld = p.add_argument_group("load")
    ld.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: this many clients, each sending its next request when its last one "
        "ends (default 16); with --request-rate, the most in flight (default: no limit)",
    )
    ld.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals at this many requests/s (seeded)",
    )
    ld.add_argument(
        "--sweep-concurrency",
        type=_int_list,
        default=None,
        metavar="1,2,4,...",
        help="one closed-loop run per value; also writes a PNG plot",
    )
    ld.add_argument(
        "--warmup",
        type=int,
        default=1,
        help=f"requests ({WARMUP_TOKENS} tokens each) sent to each server before measuring",
    )

    o = p.add_argument_group("output")
    o.add_argument(
        "--out",
        default=None,
        help="JSON file (default: benchmarks/results/bench-<timestamp>.json); a .md table "
        "(and a .png plot for sweeps) goes next to it",
    )
    o.add_argument("--save-text", action="store_true", help="keep each request's generated text in the JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


# -- running ------------------------------------------------------------------------------------------
def build_targets(args: argparse.Namespace) -> list[bpeers.Target]:
    chat = args.openai_endpoint == "chat"
    common: bpeers.StartOptions = {"startup_timeout": args.startup_timeout}
    targets: list[bpeers.Target] = []
    if args.url:
        targets.append(
            bpeers.Target(
                name=_host_name(args.url), url=args.url, protocol=args.protocol, chat=chat, model=args.model
            )
        )
    elif not any(kind == "pytgi" for kind, _ in args.peer):
        targets.append(
            bpeers.PytgiTarget(args.protocol, args.pytgi_args, chat=chat, model=args.model, **common)
        )
    for kind, value in args.peer:
        if kind == "pytgi":  # pytgi=FLAGS: a pytgi with these serve flags instead of --pytgi-args
            target = bpeers.PytgiTarget(
                args.protocol,
                args.pytgi_args if value is None else value,
                chat=chat,
                model=args.model,
                **common,
            )
            if value is not None:
                target.name = f"pytgi {value}"
            targets.append(target)
        elif kind == "llama-server":
            targets.append(
                bpeers.LlamaServerTarget(
                    value, args.llama_server_model, args.llama_server_args, chat=chat, **common
                )
            )
        elif kind == "transformers-serve":
            targets.append(
                bpeers.TransformersServeTarget(
                    args.transformers_serve_model,
                    args.transformers_serve_cmd,
                    args.transformers_serve_args,
                    chat=chat,
                    **common,
                )
            )
        else:  # tgi=URL, openai=URL
            assert value is not None
            targets.append(bpeers.Target(name=_host_name(value), url=value, protocol=kind, chat=chat))
    names: dict[str, int] = {}
    for t in targets:  # unique row names
        names[t.name] = names.get(t.name, 0) + 1
        if names[t.name] > 1:
            t.name = f"{t.name}#{names[t.name]}"
    return targets


def _host_name(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


def make_requests(args: argparse.Namespace, tokenizer: Tokenizer) -> list[BenchRequest]:
    from pytgi.bench.workload import dataset_requests, synthetic_requests

    if args.dataset:
        return dataset_requests(tokenizer, args.dataset, args.num_prompts)
    return synthetic_requests(
        tokenizer,
        args.num_prompts,
        args.input_min,
        args.input_max,
        args.output_min,
        args.output_max,
        args.seed,
        args.shared_prefix_len,
    )


def protocol_for(
    target: bpeers.Target, timeout: float = 10.0, headers: dict[str, str] | None = None
) -> bclient.Protocol:
    from pytgi.bench import stream_client as bclient

    model = target.model
    if target.protocol == "openai" and model is None:
        model = bclient.discover_model(target.url, timeout, headers)
    return bclient.make_protocol(
        target.protocol, model or "default", chat=target.chat, send_ignore_eos=target.send_ignore_eos
    )


def benchmark(
    target: bpeers.Target,
    requests: list[BenchRequest],
    tokenizer: Tokenizer,
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    timeout: float = 600.0,
    api_key: str | None = None,
    progress: bool = False,
    save_text: bool = False,
    protocol: bclient.Protocol | None = None,
) -> Run:
    """One run against a started target: {server, url, protocol, endpoint, model, concurrency, request_rate,
    summary, requests}."""
    from pytgi.bench import report
    from pytgi.bench import stream_client as bclient
    from pytgi.bench.workload import count_tokens

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    protocol = protocol or protocol_for(target, headers=headers)
    if request_rate is None and not concurrency:
        concurrency = 16
    bar = None
    on_done = None
    if progress:
        from tqdm import tqdm

        load_text = f"{request_rate:g} req/s" if request_rate is not None else f"c={concurrency}"
        bar = tqdm(
            total=len(requests),
            desc=f"{target.name} {load_text}",
            unit="req",
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
        )
        errors = 0

        def on_done(r: bclient.RequestResult) -> None:
            nonlocal errors
            errors += not r.ok
            bar.update(1)
            if errors:
                bar.set_postfix(errors=errors)

    try:
        load = asyncio.run(
            bclient.run_load(
                target.url,
                protocol,
                requests,
                count=lambda text: count_tokens(tokenizer, text),
                concurrency=concurrency,
                request_rate=request_rate,
                seed=seed,
                ignore_eos=ignore_eos,
                timeout=timeout,
                headers=headers,
                progress=on_done,
            )
        )
    finally:
        if bar is not None:
            bar.close()
    run: Run = {
        **target.describe(),
        "model": getattr(protocol, "model", None),
        "concurrency": concurrency,
        "request_rate": request_rate,
        "ignore_eos": ignore_eos,
        "summary": report.summarize(load),
        "requests": [r.to_json(with_text=save_text) for r in load.results],
    }
    return run


def warmup(
    target: bpeers.Target,
    requests: list[BenchRequest],
    tokenizer: Tokenizer,
    n: int,
    protocol: bclient.Protocol,
    api_key: str | None,
    timeout: float,
) -> list[str]:
    from pytgi.bench.workload import BenchRequest

    if n <= 0 or not requests:
        return []
    short = [
        BenchRequest(r.index, r.prompt, r.input_len, min(r.output_len, WARMUP_TOKENS)) for r in requests[:n]
    ]
    run = benchmark(
        target, short, tokenizer, concurrency=1, timeout=timeout, api_key=api_key, protocol=protocol
    )
    return [e["message"] for e in run["summary"]["error_messages"]]


def run_bench(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("pytgi bench: needs httpx: pip install 'pytgi[bench]'", file=sys.stderr)
        return 2
    from pytgi.bench import report
    from pytgi.bench.workload import load_tokenizer

    if args.request_rate is not None and args.sweep_concurrency:
        print("pytgi bench: --request-rate and --sweep-concurrency do not go together", file=sys.stderr)
        return 2
    if args.num_prompts < 1:
        print("pytgi bench: --num-prompts must be at least 1", file=sys.stderr)
        return 2
    try:
        tokenizer, tok_dir = load_tokenizer(args.tokenizer)
        requests = make_requests(args, tokenizer)
        targets = build_targets(args)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"pytgi bench: {e}", file=sys.stderr)
        return 2
    loads: list[tuple[int | None, float | None]]
    if args.sweep_concurrency:
        loads = [(c, None) for c in args.sweep_concurrency]
    else:
        loads = [
            (
                args.concurrency if args.request_rate is not None else (args.concurrency or 16),
                args.request_rate,
            )
        ]
    out = Path(args.out) if args.out else report.default_out_path()
    print(
        f"pytgi bench: {len(requests)} requests (input {sum(r.input_len for r in requests)} tokens, output "
        f"{sum(r.output_len for r in requests)} tokens asked), {len(targets)} server(s): "
        f"{', '.join(t.name for t in targets)}",
        file=sys.stderr,
    )

    runs: list[Run] = []
    failures: list[str] = []
    for target in targets:
        try:
            if isinstance(target, bpeers.ManagedTarget):
                print(f"pytgi bench: starting {target.name} ...", file=sys.stderr)
            with target:
                if isinstance(target, bpeers.ManagedTarget):
                    print(
                        f"pytgi bench: {target.name} ready at {target.url} ({' '.join(target.command)})",
                        file=sys.stderr,
                    )
                headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
                protocol = protocol_for(target, headers=headers)
                protocol.by_events = args.count_tokens == "events"
                for msg in warmup(
                    target, requests, tokenizer, args.warmup, protocol, args.api_key, args.timeout
                ):
                    print(f"pytgi bench: {target.name} warm-up error: {msg}", file=sys.stderr)
                for conc, rate in loads:
                    run = benchmark(
                        target,
                        requests,
                        tokenizer,
                        concurrency=conc,
                        request_rate=rate,
                        seed=args.seed,
                        ignore_eos=args.ignore_eos,
                        timeout=args.timeout,
                        api_key=args.api_key,
                        progress=not args.no_progress,
                        save_text=args.save_text,
                        protocol=protocol,
                    )
                    runs.append(run)
                    s = run["summary"]
                    print(
                        f"pytgi bench: {target.name} {report.load_label(run)}: {s['completed']} ok, "
                        f"{s['errors']} errors, {s['output_throughput']:.1f} output tok/s",
                        file=sys.stderr,
                    )
        except bpeers.PeerError as e:
            failures.append(str(e))
            print(f"pytgi bench: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print("pytgi bench: interrupted", file=sys.stderr)
            failures.append("interrupted")
            break

    table = report.markdown_table(runs) if runs else ""
    doc = {
        "kind": "pytgi-bench",
        "version": 1,
        "timestamp": report.utc_stamp(),
        "command": ["pytgi", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else sys.argv,
        "machine": report.machine_info(),
        "commit": report.git_commit(),
        "workload": {
            "source": args.dataset or "random",
            "tokenizer": str(tok_dir),
            "num_prompts": len(requests),
            "seed": args.seed,
            "input_range": None if args.dataset else [args.input_min, args.input_max],
            "shared_prefix_len": 0 if args.dataset else args.shared_prefix_len,
            "output_range": None if args.dataset else [args.output_min, args.output_max],
            "input_tokens": sum(r.input_len for r in requests),
            "requested_output_tokens": sum(r.output_len for r in requests),
            "ignore_eos": args.ignore_eos,
            "count_tokens": args.count_tokens,
            "warmup": args.warmup,
        },
        "servers": [t.describe() for t in targets],
        "runs": runs,
        "failures": failures,
        "table": table,
    }
    report.write_json(out, doc)
    md = [table, ""] + [f"- {line}" for line in report.error_lines(runs) + failures]
    out.with_suffix(".md").write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    if table:
        print(table)
    for line in report.error_lines(runs):
        print(f"errors: {line}")
    written = [str(out), str(out.with_suffix(".md"))]
    if args.sweep_concurrency and runs:
        png = report.plot_sweep(runs, out.with_suffix(".png"), title=f"pytgi bench, {len(requests)} requests")
        if png is None:
            print(
                "pytgi bench: no plot (matplotlib is not installed: pip install 'pytgi[bench]')",
                file=sys.stderr,
            )
        else:
            written.append(str(png))
    print(f"pytgi bench: wrote {', '.join(written)}", file=sys.stderr)
    if failures or any(r["summary"]["completed"] == 0 for r in runs):
        return 1
    return 0
