"""`pytgi serve`: TGI's launcher flags (each also read from its environment variable), the engine
process, and uvicorn. Exits non-zero when the engine dies or cannot start.

`pytgi shard`: a tensor-parallel rank > 0 on another machine (docs/sharding.md)."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import resource
import signal
from typing import TYPE_CHECKING

from pytgi.logs import JSON_ENV, setup_logging

if TYPE_CHECKING:
    from pytgi.models.registry import ResolvedModel

DEATH_GRACE_SECONDS = 2.0
IGNORED_ENV: list[str] = []  # environment values not taken, said once logging is set up

FLAGS: list[tuple[str, type, object, str]] = [
    # (flag, type, default, help); the environment variable is the flag in UPPER_SNAKE_CASE
    (
        "--model-id",
        str,
        None,
        (
            "Hub id (org/name, org/name-GGUF:Q4_K_M, org/name/file.gguf), HF directory or .gguf "
            "file (default: the embedded SmolLM2-135M-Instruct, never downloaded)"
        ),
    ),
    ("--revision", str, None, "of a Hub id: a branch, tag or commit (default: main)"),
    ("--num-shard", int, 1, "tensor-parallel ranks"),
    ("--dtype", str, "auto", "auto (bfloat16) | float32 (exact) | bfloat16 | float16"),
    (
        "--quantize",
        str,
        "auto",
        (
            "weights on CPU: auto (as the GGUF file; a bf16 model as it is, on pytgi's bf16 "
            "kernel) | none (PyTorch's matmuls) | int8 | int4 (weight-only, for small steps) | bf16"
        ),
    ),
    (
        "--model-impl",
        str,
        "auto",
        "whose model code: auto (pytgi's where it has it, else transformers') | pytgi | transformers",
    ),
    ("--hostname", str, "0.0.0.0", "address to listen on"),
    ("--port", int, 3000, "port to listen on"),
    ("--max-concurrent-requests", int, 128, "in-flight requests before answering 429"),
    ("--max-best-of", int, 2, "largest best_of"),
    ("--max-stop-sequences", int, 4, "most stop sequences per request"),
    ("--max-top-n-tokens", int, 5, "largest top_n_tokens"),
    ("--max-input-tokens", int, None, "longest prompt (default: max_total_tokens - 1)"),
    ("--max-total-tokens", int, None, "prompt + generated tokens (default: the model's positions)"),
    ("--waiting-served-ratio", float, 0.3, "admission rule for a running batch"),
    (
        "--speculate",
        int,
        0,
        (
            "draft tokens verified per decode step, at most (0: off): n-gram (prompt-lookup) drafts, "
            "or --draft-model-id's"
        ),
    ),
    (
        "--draft-model-id",
        str,
        None,
        (
            "a smaller model with the same tokenizer drafts for --speculate (default 4 "
            "tokens): Hub id, HF directory or .gguf file"
        ),
    ),
    ("--max-batch-prefill-tokens", int, None, "tokens computed per step (default 4096 GPU, 1024 CPU)"),
    (
        "--max-prefill-tokens-while-decoding",
        int,
        None,
        (
            "prompt tokens per step while others decode: bounds a long prompt's stall of running streams "
            "(default: no cap)"
        ),
    ),
    ("--max-batch-total-tokens", int, None, "KV-cache slots (default: sized from memory)"),
    ("--max-waiting-tokens", int, 20, "steps before waiting requests join regardless"),
    ("--max-batch-size", int, None, "most running requests"),
    ("--validation-workers", int, 2, "tokenizer threads"),
    (
        "--api-key",
        str,
        None,
        (
            "require `Authorization: Bearer <key>` on every route but --api-key-exempt's "
            "(prefer the API_KEY environment variable: a flag shows in `ps` and /proc/*/cmdline)"
        ),
    ),
    (
        "--api-key-exempt",
        str,
        "health",
        (
            "routes open without the key, comma-separated: health, metrics, info, docs, "
            "openapi, models (or none)"
        ),
    ),
    ("--ssl-keyfile", str, None, "serve HTTPS with this private key (PEM)"),
    ("--ssl-certfile", str, None, "... and this certificate chain (PEM)"),
    ("--keep-alive-timeout", float, 5.0, "seconds an idle keep-alive connection stays open"),
    (
        "--request-header-timeout",
        float,
        10.0,
        "seconds a request's headers may take to arrive (else 408, closed)",
    ),
    ("--request-body-timeout", float, 30.0, "seconds a request body may pause between chunks (else 408)"),
    ("--payload-limit", int, 2_000_000, "largest request body in bytes"),
    ("--graceful-termination-timeout", int, 90, "seconds to finish in-flight requests on SIGTERM"),
    ("--master-addr", str, "localhost", "torch.distributed rendezvous address (shards on several machines)"),
    (
        "--master-port",
        int,
        None,
        "torch.distributed rendezvous port (default: a free local port; 29500 when ranks start apart)",
    ),
]


def _env_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").upper()


def _is_bind_address(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return value == "localhost"
    return True


def _add_flags(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    for flag, typ, default, help_ in FLAGS:
        if only is None or flag in only:
            env = os.environ.get(_env_name(flag))
            if flag == "--hostname" and env is not None and not _is_bind_address(env):
                # Docker and Kubernetes set HOSTNAME to the container's name: not an address to bind
                IGNORED_ENV.append(
                    f"HOSTNAME={env!r} is not an IP address (a container's name?): ignored; "
                    "pass --hostname to choose the address to listen on"
                )
                env = None
            p.add_argument(
                flag,
                type=typ,
                default=typ(env) if env is not None else default,
                help=f"{help_} [env {_env_name(flag)}]",
            )


def _resolve_model(
    log: logging.Logger, model_id: str | None, revision: str | None = None, progress: bool = True
) -> ResolvedModel | None:
    """The model to serve, fetched from the Hub if named by its id; None (said in one line) if not."""
    from pytgi.errors import UserError
    from pytgi.models.registry import resolve_model

    try:
        return resolve_model(model_id, progress=progress, revision=revision)
    except UserError as exc:
        log.error("%s", exc)
        return None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    _add_flags(p)
    p.add_argument(
        "--cors-allow-origin",
        action="append",
        default=None,
        help="allowed CORS origin (repeatable) [env CORS_ALLOW_ORIGIN, comma-separated]",
    )
    p.add_argument(
        "--json-output",
        action="store_true",
        default=os.environ.get("JSON_OUTPUT", "") not in ("", "0", "false"),
        help="log as JSON lines [env JSON_OUTPUT]",
    )
    p.add_argument("--disable-prefix-caching", action="store_true", help="turn the prefix cache off")
    _add_invariance_flag(p)


def _add_invariance_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--disable-batch-invariance",
        action="store_true",
        help="let a step's size pick faster kernels for long prompts on CPU: a greedy output may then "
        "depend on what else runs (docs/batch-invariance.md)",
    )


def add_shard_arguments(p: argparse.ArgumentParser) -> None:
    """The flags a rank > 0 shares with rank 0's `pytgi serve` (give the same values), and its place."""
    _add_flags(p, ("--model-id", "--revision", "--dtype", "--quantize", "--master-addr", "--master-port"))
    _add_invariance_flag(p)
    p.add_argument(
        "--rank", type=int, default=int(os.environ.get("RANK", "0")), help="this rank, >= 1 [env RANK]"
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="all ranks, rank 0 included [env WORLD_SIZE]",
    )


def _raise_open_files_limit() -> None:
    """Each connection is a file descriptor: take the hard limit (Linux's soft default, 1024, is a
    burst of a thousand clients)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def shard(args: argparse.Namespace) -> int:
    from pytgi.config import EngineConfig
    from pytgi.engine.worker import run_worker

    setup_logging(prefix=f"rank{args.rank} ")
    log = logging.getLogger("pytgi.launcher")
    if not 0 < args.rank < args.world_size:
        log.error(
            "pytgi shard needs 0 < --rank < --world-size, got rank %d of %d (rank 0 is `pytgi serve`)",
            args.rank,
            args.world_size,
        )
        return 2
    model = _resolve_model(log, args.model_id, args.revision)
    if model is None:
        return 2
    config = EngineConfig(
        model=str(model.path),
        dtype=args.dtype,
        quantize=args.quantize,
        num_shard=args.world_size,
        batch_invariant=not args.disable_batch_invariance,
        master_addr=args.master_addr,
        master_port=args.master_port or 29500,
    )
    return run_worker(config, args.rank)


def serve(args: argparse.Namespace, engine_module: str = "pytgi.engine.process") -> int:
    """`engine_module`: the engine process's entry point (tests run one that wraps the runner)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:  # a graceful stop is a normal exit (0), not death by signal
                self._captured_signals.remove(sig)

    from pytgi.config import EngineConfig
    from pytgi.server.app import ServerConfig, create_app
    from pytgi.server.http import with_header_timeout
    from pytgi.server.middleware import EXEMPTIONS

    if args.json_output:
        os.environ[JSON_ENV] = "1"  # the engine and worker processes inherit it
    setup_logging(args.json_output)
    log = logging.getLogger("pytgi.launcher")
    for line in IGNORED_ENV:
        log.warning("%s", line)
    exempt = tuple(e.strip() for e in args.api_key_exempt.split(",") if e.strip() and e.strip() != "none")
    if unknown := [e for e in exempt if e not in EXEMPTIONS]:
        log.error(
            "--api-key-exempt: unknown route name(s) %s; choose among %s",
            ", ".join(unknown),
            ", ".join(EXEMPTIONS),
        )
        return 2
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        log.error("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        return 2
    _raise_open_files_limit()
    if args.num_shard < 1:
        log.error("--num-shard must be >= 1, got %d", args.num_shard)
        return 2
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank > 0:
        log.error("RANK=%d: `pytgi serve` is rank 0; start the other ranks with `pytgi shard`", rank)
        return 2
    progress = not args.json_output  # JSON logs say each downloaded file instead of drawing bars
    model = _resolve_model(log, args.model_id, args.revision, progress)
    draft = _resolve_model(log, args.draft_model_id, progress=progress) if args.draft_model_id else None
    if model is None or (args.draft_model_id and draft is None):
        return 2
    model_path, model_id = model.path, model.model_id
    if world > 1:  # started per rank (torchrun, or by hand on several machines)
        args.num_shard = world
    engine = EngineConfig(
        model=str(model_path),
        dtype=args.dtype,
        quantize=args.quantize,
        model_impl=args.model_impl,
        max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens,
        max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        max_batch_total_tokens=args.max_batch_total_tokens,
        max_batch_size=args.max_batch_size,
        waiting_served_ratio=args.waiting_served_ratio,
        max_waiting_tokens=args.max_waiting_tokens,
        enable_prefix_caching=not args.disable_prefix_caching,
        batch_invariant=not args.disable_batch_invariance,
        speculate=args.speculate,
        draft_model=str(draft.path) if draft else None,
        num_shard=args.num_shard,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    origins = args.cors_allow_origin or [o for o in os.environ.get("CORS_ALLOW_ORIGIN", "").split(",") if o]
    config = ServerConfig(
        engine=engine,
        model_path=model_path,
        model_id=model_id,
        hostname=args.hostname,
        port=args.port,
        max_concurrent_requests=args.max_concurrent_requests,
        max_best_of=args.max_best_of,
        max_stop_sequences=args.max_stop_sequences,
        max_top_n_tokens=args.max_top_n_tokens,
        validation_workers=args.validation_workers,
        api_key=args.api_key,
        api_key_exempt=exempt,
        payload_limit=args.payload_limit,
        request_body_timeout=args.request_body_timeout,
        tls=bool(args.ssl_certfile),
        cors_allow_origin=origins,
        json_output=args.json_output,
        graceful_termination_timeout=args.graceful_termination_timeout,
        model_sha=model.sha or args.revision,
        engine_module=engine_module,
    )
    app = create_app(config)
    server = _Server(
        uvicorn.Config(
            app,
            host=args.hostname,
            port=args.port,
            loop="uvloop",
            http=with_header_timeout(args.request_header_timeout),
            log_config=None,
            timeout_graceful_shutdown=args.graceful_termination_timeout,
            access_log=False,
            timeout_keep_alive=args.keep_alive_timeout,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
        )
    )
    died: list[str] = []

    def on_death(reason: str) -> None:
        # Keep answering for a moment (health 503, requests failing fast) so that clients and
        # load balancers see why, then exit non-zero.
        died.append(reason)
        asyncio.get_running_loop().call_later(DEATH_GRACE_SECONDS, setattr, server, "should_exit", True)

    app.state.pytgi.on_engine_death.append(on_death)
    server.run()
    if died:  # the reason is already logged, once, by the engine client
        log.info("exiting with status 1")
        return 1
    if not server.started:
        log.error("the server did not start")
        return 1
    return 0
