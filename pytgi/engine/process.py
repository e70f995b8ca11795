"""The engine process: a busy loop around `LLMEngine`, fed and drained over ZMQ.

Started by the API process as `python -m pytgi.engine.process --config JSON --inbox ADDR --outbox ADDR`
(or as another module whose entry point calls `main` with its own runner class).
No asyncio: drain the inbox, step, publish, repeat; block on the inbox only while idle.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec
import zmq

from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig, EngineInfo
from pytgi.core.errors import ConfigError, UserError
from pytgi.core.logs import setup_logging

if TYPE_CHECKING:  # imported when the engine starts (the process answers its parent first)
    from pytgi.engine.adapter_registry import AdapterRegistry
    from pytgi.engine.execution.runner import ModelRunner
    from pytgi.engine.llm_engine import LLMEngine
    from pytgi.engine.pooling.encoder_engine import PoolingEngine

log = logging.getLogger("pytgi.engine")
IDLE_POLL_MS = 500  # idle: heartbeat and parent check this often


def _request_id(raw: bytes) -> str | None:
    """The request id of an undecodable message, if it has one."""
    try:
        rid = msgspec.msgpack.decode(raw).get("request_id")
    except (msgspec.DecodeError, AttributeError):
        return None
    return rid if isinstance(rid, str) else None


class Engine(Protocol):
    """What the engine process's loop needs of an engine: `LLMEngine` (a causal LM, generating or
    pooling on the paged KV cache) and `PoolingEngine` (an encoder) are each one. A request an engine
    does not serve is refused as any invalid request is (`InvalidRequest`)."""

    info: EngineInfo
    last_step: P.StepInfo

    @property
    def adapters(self) -> AdapterRegistry | None:
        """Its LoRA adapters (None: it serves none)."""
        ...

    def submit(self, msg: P.Submit) -> None: ...
    def abort_request(self, request_id: str) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> Sequence[P.TokenOut | P.PoolOut]: ...
    def check_alive(self) -> None: ...
    def stats(self) -> P.EngineStatsFields: ...
    def shutdown(self) -> None: ...


def _stats(engine: Engine) -> P.EngineStats:
    return P.EngineStats(**engine.stats())


def _snapshot(engine: Engine) -> P.AdapterSnapshot:
    return P.AdapterSnapshot(0) if engine.adapters is None else engine.adapters.snapshot()


class EngineLoop:
    def __init__(self, engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
        self.engine, self.inbox, self.outbox, self.parent_pid = engine, inbox, outbox, parent_pid
        self.running = True
        self.unloads: dict[str, list[str]] = {}  # adapter → the unload ops waiting for its requests
        self.adapters_sent = _snapshot(engine).version  # the snapshot the API process has

    def run(self) -> None:
        while self.running:
            idle = not self.engine.has_unfinished()
            if self.inbox.poll(IDLE_POLL_MS if idle else 0):
                self._drain()
            elif idle:
                self.engine.check_alive()  # a lost shard ends the engine (non-zero exit)
                self._send(P.Heartbeat(_stats(self.engine)))
                if os.getppid() != self.parent_pid:  # the API process is gone: nobody to serve
                    return
            if self.running and self.engine.has_unfinished():
                self._step()
            if self.unloads:
                self._answer_unloads()

    def _drain(self) -> None:
        errors: list[P.TokenOut] = []
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = P.to_engine.decode(raw)
            except msgspec.DecodeError as exc:  # a message the engine cannot take fails its request alone
                rid = _request_id(raw)
                log.warning("refused a message for %s: %s", rid or "no request", exc)
                if rid is not None:
                    errors.append(P.TokenOut(rid, finish_reason="error", error=f"invalid request: {exc}"))
                continue
            if isinstance(msg, P.Submit):
                try:
                    self.engine.submit(msg)
                except Exception as exc:  # noqa: BLE001 - a request the engine refuses fails alone
                    errors.append(P.TokenOut(msg.request_id, finish_reason="error", error=str(exc)))
            elif isinstance(msg, P.Abort):
                for rid in msg.request_ids:
                    self.engine.abort_request(rid)
            elif isinstance(msg, P.AdapterOp):
                self._adapter(msg)
            elif isinstance(msg, P.Shutdown):
                self.running = False
        if errors:
            self._send(P.StepOut(errors, _stats(self.engine), P.StepInfo(failed=True)))

    def _adapter(self, op: P.AdapterOp) -> None:
        """Load or unload a LoRA adapter and say so (an unload once its requests are done)."""
        error, registry = None, self.engine.adapters
        try:
            if registry is None:
                raise ConfigError(f"the model `{self.engine.info.model_id}` serves no LoRA adapters")
            if op.source is not None:
                registry.load(op.name, op.source)
            else:
                registry.unload(op.name)  # refused to new requests from now on
                if op.name not in registry.settle():  # removed once its requests are done
                    self.unloads.setdefault(op.name, []).append(op.op_id)
                    self._publish_adapters()
                    return
        except Exception as exc:  # noqa: BLE001 - a refused operation changes nothing
            error = str(exc)
        self._publish_adapters()
        self._send(P.AdapterDone(op.op_id, error))

    def _answer_unloads(self) -> None:
        served = {} if self.engine.adapters is None else self.engine.adapters.served
        gone = [name for name in self.unloads if name not in served]
        if gone:
            self._publish_adapters()
        for name in gone:
            for op_id in self.unloads.pop(name):
                self._send(P.AdapterDone(op_id, None))

    def _publish_adapters(self) -> None:
        """The registry's snapshot, if it changed since the last one sent (before any `AdapterDone`
        that answers the change, so that the API process reads the new one when the answer arrives)."""
        snapshot = _snapshot(self.engine)
        if snapshot.version != self.adapters_sent:
            self._send(snapshot)
            self.adapters_sent = snapshot.version

    def _step(self) -> None:
        out = self.engine.step()
        updates = [u for u in out if isinstance(u, P.TokenOut)]
        pooled = [u for u in out if isinstance(u, P.PoolOut)]
        self._send(P.StepOut(updates, _stats(self.engine), self.engine.last_step, pooled))

    def _send(self, msg: msgspec.Struct) -> None:
        self.outbox.send(P.encoder.encode(msg), copy=False)


def start_engine(
    config: EngineConfig, runner_cls: type[ModelRunner] | None = None
) -> LLMEngine | PoolingEngine:
    """The engine for what the model is for (pytgi.core.pooling.model_task): `PoolingEngine` for an
    encoder (an embedding model or a cross-encoder), `LLMEngine` for a causal LM (a generator, or an
    embedder or reranker computed on the paged KV cache). The model is resolved here, once."""
    from pytgi.core.model_files import resolve_model
    from pytgi.core.pooling import is_encoder

    model = resolve_model(config.model, progress=config.progress, revision=config.revision)
    if is_encoder(model.path):
        from pytgi.engine.pooling.encoder_engine import PoolingEngine

        return PoolingEngine(config, model)
    from pytgi.engine.execution.runner import ModelRunner
    from pytgi.engine.llm_engine import LLMEngine

    return LLMEngine(config, runner_cls or ModelRunner, model)


def main(argv: list[str] | None = None, runner_cls: type[ModelRunner] | None = None) -> int:
    """`runner_cls`: rank 0's runner class, `ModelRunner` by default (a test engine process passes
    a subclass that fails some steps)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    ap.add_argument("--inbox", required=True)
    ap.add_argument("--outbox", required=True)
    ap.add_argument("--parent-pid", type=int, default=os.getppid())
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the API process decides
    setup_logging()
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(args.inbox)
    outbox.connect(args.outbox)
    outbox.setsockopt(zmq.LINGER, 2000)
    try:
        engine = start_engine(EngineConfig(**json.loads(args.config)), runner_cls)
    except Exception as exc:
        if isinstance(exc, UserError):  # the user's to fix, and its message says how: no traceback
            log.error("engine failed to start: %s", exc)
        else:
            log.exception("engine failed to start")
        outbox.send(P.encoder.encode(P.StartupFailed(f"{type(exc).__name__}: {exc}")))
        time.sleep(0.5)
        return 1
    outbox.send(P.encoder.encode(P.Ready(engine.info, _snapshot(engine))))
    try:
        EngineLoop(engine, inbox, outbox, args.parent_pid).run()
    except Exception:
        log.exception("engine loop failed")
        return 1
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
