"""`pytgi serve`: TGI's launcher flags (each also read from its environment variable), the engine
process, and uvicorn. Exits non-zero when the engine dies or cannot start.

`pytgi shard`, a tensor-parallel rank > 0 on another machine, is the engine side's
(`pytgi.engine.distributed.remote_rank`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging
import os
import resource
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from pytgi.core import flags
from pytgi.core.config import ConfigError, EngineConfig, ServerConfig
from pytgi.core.logs import JSON_ENV, setup_logging
from pytgi.core.model_files import resolve_or_none
from pytgi.core.settings import Setting

if TYPE_CHECKING:
    from pytgi.api.state import State

DEATH_GRACE_SECONDS = 2.0
IGNORED_ENV: list[str] = []  # environment values not taken, said once logging is set up


def _is_bind_address(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return value == "localhost"
    return True


def _from_env(s: Setting) -> object:
    """A setting's value from its environment variable; HOSTNAME only when it is an address."""
    env = os.environ.get(s.env)
    if s.name == "hostname" and env is not None and not _is_bind_address(env):
        # Docker and Kubernetes set HOSTNAME to the container's name: not an address to bind
        IGNORED_ENV.append(
            f"HOSTNAME={env!r} is not an IP address (a container's name?): ignored; "
            "pass --hostname to choose the address to listen on"
        )
        return s.default
    return s.from_env()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_arguments(p, env=_from_env)


def _raise_open_files_limit() -> None:
    """Each connection is a file descriptor: take the hard limit (Linux's soft default, 1024, is a
    burst of a thousand clients)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class _QuietStartupFailure(logging.Filter):
    """When the engine did not start, its reason is one line (the engine's or the lifespan's): uvicorn's
    lifespan traceback of it and its "Application startup failed" are not printed."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        return self.state.start_failed is None or record.levelno < logging.ERROR


def _listen(host: str, port: int) -> socket.socket:
    """The HTTP port, bound before the model is fetched or the engine starts: a port in use is a
    start-up error at once, and nothing started meanwhile (the engine, Ray's workers and their
    ephemeral ports) can take it. Not inherited by the processes started after it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def serve(args: argparse.Namespace, engine_module: str = "pytgi.engine.process") -> int:
    """`engine_module`: the engine process's entry point (tests run one that wraps the runner)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:  # a graceful stop is a normal exit (0), not death by signal
                self._captured_signals.remove(sig)

    from pytgi.api.app import create_app
    from pytgi.api.http import with_header_timeout

    if args.json_output:
        os.environ[JSON_ENV] = "1"  # the engine and worker processes inherit it
    setup_logging(args.json_output)
    log = logging.getLogger("pytgi.launcher")
    for line in IGNORED_ENV:
        log.warning("%s", line)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank > 0:
        log.error("RANK=%d: `pytgi serve` is rank 0; start the other ranks with `pytgi shard`", rank)
        return 2
    if world > 1:  # started per rank (torchrun, or by hand on several machines)
        args.num_shard = world
    # every setting checked before the model is fetched or loaded; the model resolved after
    config = ServerConfig(
        engine=EngineConfig(**flags.from_args(args, "engine")),
        model_path=Path(args.model or "."),
        model_id=args.model or "",
        **flags.from_args(args, "server"),
        engine_module=engine_module,
    )
    try:
        config.engine.validate()
        config.validate()
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    _raise_open_files_limit()
    try:
        listener = _listen(config.hostname, config.port)
    except OSError as exc:
        log.error("cannot listen on %s port %d: %s", config.hostname, config.port, exc.strerror or exc)
        return 2
    progress = not args.json_output  # JSON logs say each downloaded file instead of drawing bars
    model = resolve_or_none(log, args.model, args.revision, progress)
    draft = resolve_or_none(log, args.draft_model, progress=progress) if args.draft_model else None
    if model is None or (args.draft_model and draft is None):
        listener.close()
        return 2
    config = dataclasses.replace(
        config,
        engine=dataclasses.replace(
            config.engine, model=str(model.path), draft_model=str(draft.path) if draft else None
        ),
        model_path=model.path,
        model_id=model.model_id,
        model_sha=model.sha or args.revision,
    )
    try:
        app = create_app(config)
    except (FileNotFoundError, ValueError) as exc:  # a model directory without its tokenizer: one line
        log.error("%s", exc)
        listener.close()
        return 2
    server = _Server(
        uvicorn.Config(
            app,
            host=config.hostname,
            port=config.port,
            loop="uvloop",
            http=with_header_timeout(config.request_header_timeout),
            log_config=None,
            timeout_graceful_shutdown=config.graceful_termination_timeout,
            access_log=False,
            timeout_keep_alive=config.keep_alive_timeout,
            ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile,
        )
    )
    died: list[str] = []

    def on_death(reason: str) -> None:
        # Keep answering for a moment (health 503, requests failing fast) so that clients and
        # load balancers see why, then exit non-zero.
        died.append(reason)
        asyncio.get_running_loop().call_later(DEATH_GRACE_SECONDS, setattr, server, "should_exit", True)

    app.state.pytgi.on_engine_death.append(on_death)
    quiet = _QuietStartupFailure(app.state.pytgi)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    if app.state.pytgi.start_failed:  # said in one line already
        return 1
    if died:  # the reason is already logged, once, by the engine client
        log.info("exiting with status 1")
        return 1
    if not server.started:
        log.error("the server did not start")
        return 1
    return 0
