"""The `pytgi` command."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from pytgi import LLM, SamplingParams
    from pytgi.core.errors import InvalidRequest

    llm = LLM(
        model=args.model,
        revision=args.revision,
        dtype=args.dtype,
        max_batch_total_tokens=args.max_batch_total_tokens,
    )
    prompt: str = args.prompt
    if not args.raw and llm.tokenizer.chat_template:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt_ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    else:
        prompt_ids = llm.encode(prompt)
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop or [],
        )
        for text in llm.stream(prompt_ids, params):
            sys.stdout.write(text)
            sys.stdout.flush()
    except InvalidRequest as exc:
        print(f"\npytgi: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    return 0


def _download(args: argparse.Namespace) -> int:
    from pytgi.core import hub
    from pytgi.core.errors import UserError
    from pytgi.core.logs import setup_logging

    setup_logging(args.json_output)
    ref = hub.parse_hub_id(args.model_id)
    if ref is None:
        raise UserError(
            f"{args.model_id!r} is not a Hub id: org/name, org/name:TAG (a GGUF quantization) "
            "or org/name/file.gguf"
        )
    print(hub.fetch(ref, args.revision, progress=not args.json_output).path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pytgi.api.launcher import serve

    return serve(args)


def _shard(args: argparse.Namespace) -> int:
    from pytgi.engine.distributed.remote_rank import shard

    return shard(args)


def _bench(args: argparse.Namespace) -> int:
    from pytgi.bench.command import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pytgi", description="Text generation inference in Python.")
    sub = parser.add_subparsers(dest="command", required=True)
    from pytgi.api.launcher import add_serve_arguments
    from pytgi.core import flags

    srv = sub.add_parser("serve", help="serve a model over TGI's HTTP API (default: the embedded model)")
    add_serve_arguments(srv)
    srv.set_defaults(func=_serve)
    shd = sub.add_parser(
        "shard", help="run a tensor-parallel rank > 0 for a `pytgi serve` on another machine"
    )
    flags.add_shard_arguments(shd)
    shd.set_defaults(func=_shard)
    dl = sub.add_parser(
        "download", help="fetch a model from the Hugging Face Hub into its cache; print its path"
    )
    dl.add_argument(
        "model_id", help="org/name, org/name:TAG (a GGUF quantization, e.g. Q4_K_M) or org/name/file.gguf"
    )
    flags.add_arguments(dl, only=("revision", "json_output"))
    dl.set_defaults(func=_download)
    from pytgi.bench.command import add_bench_arguments

    bench = sub.add_parser("bench", help="benchmark a server (default: pytgi) with streamed requests")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    gen = sub.add_parser("generate", help="stream a completion of one prompt to the terminal")
    gen.add_argument("prompt")
    flags.add_arguments(gen, only=("model", "revision", "dtype", "max_batch_total_tokens"))
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pytgi.core.errors import UserError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:  # the user's to fix: one line, no traceback
        print(f"pytgi: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
