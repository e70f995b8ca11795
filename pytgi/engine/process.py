"""The engine process: a busy loop around `LLMEngine`, fed and drained over ZMQ.

Started by the API process as `python -m pytgi.engine.process --config JSON --inbox ADDR --outbox ADDR`.
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

import msgspec
import zmq

from pytgi import protocol as P
from pytgi.config import EngineConfig
from pytgi.logs import setup_logging

log = logging.getLogger("pytgi.engine")
IDLE_POLL_MS = 500  # idle: heartbeat and parent check this often


def _stats(engine) -> P.EngineStats:  # type: ignore[no-untyped-def]
    return P.EngineStats(**engine.stats())


def _fault_injector(engine) -> None:  # type: ignore[no-untyped-def]
    """Testing hook: PYTGI_FAULT_INJECT="1,2,3" makes any step containing a request whose prompt
    starts with these token ids raise, to exercise per-step failure isolation end to end."""
    spec = os.environ.get("PYTGI_FAULT_INJECT")
    if not spec:
        return
    prefix = [int(x) for x in spec.split(",")]
    real = engine.runner.execute

    def execute(batch):  # type: ignore[no-untyped-def]
        if any(s.request.prompt_ids[: len(prefix)] == prefix for s in batch):
            raise RuntimeError("injected fault (PYTGI_FAULT_INJECT)")
        return real(batch)

    engine.runner.execute = execute


class EngineLoop:
    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:  # type: ignore[no-untyped-def]
        self.engine, self.inbox, self.outbox, self.parent_pid = engine, inbox, outbox, parent_pid
        self.running = True

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

    def _drain(self) -> None:
        errors: list[P.TokenOut] = []
        while True:
            try:
                msg = P.to_engine.decode(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(msg, P.Submit):
                try:
                    self.engine.add_request(msg.request_id, msg.prompt_ids, msg.params)
                except Exception as exc:  # a request the engine refuses fails alone
                    errors.append(P.TokenOut(msg.request_id, finish_reason="error", error=str(exc)))
            elif isinstance(msg, P.Abort):
                for rid in msg.request_ids:
                    self.engine.abort_request(rid)
            elif isinstance(msg, P.Shutdown):
                self.running = False
        if errors:
            self._send(P.StepOut(errors, _stats(self.engine), 0.0, 0, 0, "prefill", failed=True))

    def _step(self) -> None:
        updates = self.engine.step()
        info = self.engine.last_step
        out = [
            P.TokenOut(
                u.request_id,
                token_id=u.token.token_id if u.token else -1,
                logprob=u.token.logprob if u.token else 0.0,
                top=u.token.top if u.token else [],
                finish_reason=u.finish_reason,
                error=u.error,
                prompt_logprobs=u.prompt_logprobs,
                num_cached_tokens=u.num_cached_tokens,
            )
            for u in updates
        ]
        method = "prefill" if info.prefill else "decode"
        self._send(P.StepOut(out, _stats(self.engine), info.seconds, info.batch_size, info.num_tokens, method,
                             info.failed))

    def _send(self, msg: msgspec.Struct) -> None:
        self.outbox.send(P.encoder.encode(msg), copy=False)


def main(argv: list[str] | None = None) -> int:
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
        from pytgi.engine.engine import LLMEngine

        engine = LLMEngine(EngineConfig(**json.loads(args.config)))
        _fault_injector(engine)
    except Exception as exc:
        log.exception("engine failed to start")
        outbox.send(P.encoder.encode(P.StartupFailed(f"{type(exc).__name__}: {exc}")))
        time.sleep(0.5)
        return 1
    e = engine
    outbox.send(P.encoder.encode(P.Ready(P.EngineInfo(
        model_id=e.model_id, model_path=str(e.model_path), model_dtype=str(e.runner.dtype).removeprefix("torch."),
        model_device_type=e.runner.device.type, max_input_tokens=e.max_input_tokens,
        max_total_tokens=e.max_total_tokens, max_batch_prefill_tokens=e.max_batch_prefill_tokens,
        max_batch_total_tokens=e.max_batch_total_tokens, max_batch_size=e.max_batch_size,
        num_shard=e.config.num_shard, vocab_size=e.runner.vocab_size,
    ))))
    try:
        EngineLoop(engine, inbox, outbox, args.parent_pid).run()
    except Exception:
        log.exception("engine loop failed")
        return 1
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
