"""`pytgi serve`: TGI's launcher flags (each also read from its environment variable), the engine
process, and uvicorn. Exits non-zero when the engine dies or cannot start."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from pytgi.logs import JSON_ENV, setup_logging

DEATH_GRACE_SECONDS = 2.0

FLAGS: list[tuple[str, type, object, str]] = [
    # (flag, type, default, help); the environment variable is the flag in UPPER_SNAKE_CASE
    ("--model-id", str, None, "HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"),
    ("--revision", str, None, "reported as model_sha in /info (nothing is downloaded)"),
    ("--num-shard", int, 1, "tensor-parallel ranks"),
    ("--dtype", str, "auto", "auto (bfloat16) | float32 (exact) | bfloat16 | float16"),
    ("--quantize", str, "auto", "weight-only for small CPU steps: auto (as the GGUF file) | none | int8 | int4"),
    ("--hostname", str, "0.0.0.0", "address to listen on"),
    ("--port", int, 3000, "port to listen on"),
    ("--max-concurrent-requests", int, 128, "in-flight requests before answering 429"),
    ("--max-best-of", int, 2, "largest best_of"),
    ("--max-stop-sequences", int, 4, "most stop sequences per request"),
    ("--max-top-n-tokens", int, 5, "largest top_n_tokens"),
    ("--max-input-tokens", int, None, "longest prompt (default: max_total_tokens - 1)"),
    ("--max-total-tokens", int, None, "prompt + generated tokens (default: the model's positions)"),
    ("--waiting-served-ratio", float, 0.3, "admission rule for a running batch"),
    ("--max-batch-prefill-tokens", int, None, "tokens computed per step (default 4096 GPU, 1024 CPU)"),
    ("--max-prefill-tokens-while-decoding", int, None,
     "prompt tokens per step while others decode: bounds a long prompt's stall of running streams (default: no cap)"),
    ("--max-batch-total-tokens", int, None, "KV-cache slots (default: sized from memory)"),
    ("--max-waiting-tokens", int, 20, "steps before waiting requests join regardless"),
    ("--max-batch-size", int, None, "most running requests"),
    ("--validation-workers", int, 2, "tokenizer threads"),
    ("--api-key", str, None, "require `Authorization: Bearer <key>` on POST routes"),
    ("--payload-limit", int, 2_000_000, "largest request body in bytes"),
    ("--graceful-termination-timeout", int, 90, "seconds to finish in-flight requests on SIGTERM"),
    ("--master-addr", str, "localhost", "torch.distributed rendezvous address (shards on several machines)"),
    ("--master-port", int, None, "torch.distributed rendezvous port (default: a free local port)"),
]


def _env_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").upper()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    for flag, typ, default, help_ in FLAGS:
        env = os.environ.get(_env_name(flag))
        p.add_argument(flag, type=typ, default=typ(env) if env is not None else default,
                       help=f"{help_} [env {_env_name(flag)}]")
    p.add_argument("--cors-allow-origin", action="append", default=None,
                   help="allowed CORS origin (repeatable) [env CORS_ALLOW_ORIGIN, comma-separated]")
    p.add_argument("--json-output", action="store_true", default=os.environ.get("JSON_OUTPUT", "") not in ("", "0", "false"),
                   help="log as JSON lines [env JSON_OUTPUT]")
    p.add_argument("--disable-prefix-caching", action="store_true", help="turn the prefix cache off")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # type: ignore[no-untyped-def]
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:  # a graceful stop is a normal exit (0), not death by signal
                self._captured_signals.remove(sig)

    from pytgi.config import EngineConfig
    from pytgi.models.registry import ModelNotFound, resolve_model
    from pytgi.server.app import ServerConfig, create_app

    if args.json_output:
        os.environ[JSON_ENV] = "1"  # the engine and worker processes inherit it
    setup_logging(args.json_output)
    log = logging.getLogger("pytgi.launcher")
    if args.num_shard < 1:
        log.error("--num-shard must be >= 1, got %d", args.num_shard)
        return 2
    try:
        model_path, model_id = resolve_model(args.model_id)
    except ModelNotFound as exc:
        log.error("%s", exc)
        return 2
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # started per rank (torchrun, or by hand on several machines)
        args.num_shard = world
        if rank > 0:
            from pytgi.engine.worker import run_worker

            port = int(os.environ.get("MASTER_PORT") or args.master_port or 29500)
            addr = os.environ.get("MASTER_ADDR", args.master_addr)
            return run_worker(str(model_path), args.dtype, "auto", "torch", rank, world, addr, port, args.quantize)
    engine = EngineConfig(
        model=str(model_path), dtype=args.dtype, quantize=args.quantize, max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens, max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        max_batch_total_tokens=args.max_batch_total_tokens, max_batch_size=args.max_batch_size,
        waiting_served_ratio=args.waiting_served_ratio, max_waiting_tokens=args.max_waiting_tokens,
        enable_prefix_caching=not args.disable_prefix_caching, num_shard=args.num_shard,
        master_addr=args.master_addr, master_port=args.master_port,
    )
    origins = args.cors_allow_origin or [o for o in os.environ.get("CORS_ALLOW_ORIGIN", "").split(",") if o]
    config = ServerConfig(
        engine=engine, model_path=model_path, model_id=model_id, hostname=args.hostname, port=args.port,
        max_concurrent_requests=args.max_concurrent_requests, max_best_of=args.max_best_of,
        max_stop_sequences=args.max_stop_sequences, max_top_n_tokens=args.max_top_n_tokens,
        validation_workers=args.validation_workers, api_key=args.api_key, payload_limit=args.payload_limit,
        cors_allow_origin=origins, json_output=args.json_output,
        graceful_termination_timeout=args.graceful_termination_timeout, revision=args.revision,
    )
    app = create_app(config)
    server = _Server(uvicorn.Config(
        app, host=args.hostname, port=args.port, loop="uvloop", http="httptools", log_config=None,
        timeout_graceful_shutdown=args.graceful_termination_timeout, access_log=False,
    ))
    died: list[str] = []

    def on_death(reason: str) -> None:
        # Keep answering for a moment (health 503, requests failing fast) so that clients and
        # load balancers see why, then exit non-zero.
        died.append(reason)
        asyncio.get_running_loop().call_later(DEATH_GRACE_SECONDS, setattr, server, "should_exit", True)

    app.state.pytgi.on_engine_death.append(on_death)
    server.run()
    if died:
        log.error("exiting: %s", died[0])
        return 1
    if not server.started:
        log.error("the server did not start")
        return 1
    return 0
