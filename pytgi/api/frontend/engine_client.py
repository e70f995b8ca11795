"""The API process's handle on the engine process: start it, submit and abort requests, route
each step's tokens to per-request queues, and notice when the engine dies."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from pytgi.core import protocol as P
from pytgi.core.adapters import AdapterError
from pytgi.core.config import EngineConfig
from pytgi.core.errors import EngineDead
from pytgi.core.sampling_params import SamplingParams

log = logging.getLogger("pytgi.api.frontend")


class Engine(Protocol):
    """What the API process uses of its engine: one engine process (`EngineClient`), or engine
    replicas on Ray Serve (`pytgi.api.replicas.client.ReplicaClient`)."""

    info: P.EngineInfo | None
    adapters: P.AdapterSnapshot  # the engine's last word on the LoRA adapters served
    healthy: bool
    on_step: Callable[[P.StepOut], None] | None
    on_stats: Callable[[P.EngineStats], None] | None
    on_death: Callable[[str], None] | None

    async def start(self, timeout: float = 900.0) -> P.EngineInfo: ...

    async def stop(self, timeout: float = 5.0) -> None: ...

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        images: list[bytes] | None = None,
        cache_key: str | None = None,
        pool: P.PoolParams | None = None,
    ) -> asyncio.Queue:
        """Send a request; its `TokenOut`s (or an `EngineDead`) arrive on the returned queue.
        `cache_key`: requests sharing it go to the same replica where there are several. `pool`: an
        embedding model's request, whose `PoolOut` (or an error's `TokenOut`) arrives instead."""
        ...

    async def adapter(self, name: str, source: str | None) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def release(self, request_id: str) -> None: ...


class EngineClient:
    def __init__(self, config: EngineConfig, engine_module: str = "pytgi.engine.process") -> None:
        self.config = config
        self.engine_module = engine_module  # run as `python -m`; its main() is pytgi.engine.process's
        self.info: P.EngineInfo | None = None
        self.adapters = P.AdapterSnapshot(-1)  # none before the engine is up
        self.stats: P.EngineStats | None = None
        self.healthy = False
        self.dead_reason: str | None = None
        self.on_step: Callable[[P.StepOut], None] | None = None  # metrics hooks
        self.on_stats: Callable[[P.EngineStats], None] | None = None
        self.on_death: Callable[[str], None] | None = None
        self.proc: subprocess.Popen | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._adapter_ops: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._dir = Path(tempfile.mkdtemp(prefix="pytgi-"))  # the two sockets; removed at stop, or at exit
        atexit.register(shutil.rmtree, self._dir, True)
        self._ctx = zmq.asyncio.Context()
        self._inbox = self._ctx.socket(zmq.PUSH)  # the engine's inbox
        self._outbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(f"ipc://{self._dir}/inbox")
        self._outbox.bind(f"ipc://{self._dir}/outbox")
        self._inbox.setsockopt(zmq.LINGER, 0)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self, timeout: float = 900.0) -> P.EngineInfo:
        """Spawn the engine process and wait until its model is loaded."""
        cmd = [
            sys.executable,
            "-m",
            self.engine_module,
            "--config",
            json.dumps(dataclasses.asdict(self.config)),
            "--inbox",
            f"ipc://{self._dir}/inbox",
            "--outbox",
            f"ipc://{self._dir}/outbox",
            "--parent-pid",
            str(os.getpid()),
        ]
        self.proc = subprocess.Popen(cmd)  # noqa: ASYNC220 (a fork and exec; the wait below is async)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise EngineDead(f"{_exit_reason(self.proc.returncode)} while starting")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise EngineDead(f"engine did not start within {timeout:.0f}s")
            if await self._outbox.poll(200):
                msg = P.from_engine.decode(await self._outbox.recv())
                if isinstance(msg, P.StartupFailed):
                    raise EngineDead(f"engine failed to start: {msg.message}")  # (app.STARTUP_FAILED)
                if isinstance(msg, P.Ready):
                    self.info, self.adapters = msg.info, msg.adapters
                    break
        self.healthy = True
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]
        return self.info

    async def stop(self, timeout: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # their clean-up needs the sockets
        if self.proc and self.proc.poll() is None:
            await self._inbox.send(P.encoder.encode(P.Shutdown()))
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout)
            except asyncio.TimeoutError:
                self.proc.kill()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- requests --------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        images: list[bytes] | None = None,
        cache_key: str | None = None,  # one engine: nothing to route by it
        pool: P.PoolParams | None = None,
    ) -> asyncio.Queue:
        """Send a request (`images`: for its image tokens); its `TokenOut`s (or an `EngineDead`) arrive
        on the returned queue."""
        if not self.healthy:
            raise EngineDead(self.dead_reason or "engine is not running")
        # may raise: nothing registered yet
        msg = P.encoder.encode(P.Submit(request_id, prompt_ids, params, images or [], pool=pool))
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._inbox.send(msg)
        return queue

    async def adapter(self, name: str, source: str | None) -> None:
        """Load (`source`: a directory or a Hub id) or unload (None) a LoRA adapter; an unload returns
        once the adapter's requests are done. `AdapterError` when the engine refused it. `adapters`
        is the engine's new snapshot by the time this returns."""
        if not self.healthy:
            raise EngineDead(self.dead_reason or "engine is not running")
        op_id = uuid.uuid4().hex
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._adapter_ops[op_id] = future
        self._inbox.send(P.encoder.encode(P.AdapterOp(op_id, name, source)))
        error = await future
        if error is not None:
            raise AdapterError(error)

    def abort(self, request_id: str) -> None:
        """Forget the request here and free its KV blocks in the engine's next drain."""
        log.debug("abort %s", request_id)
        if self._queues.pop(request_id, None) is not None and self.healthy:
            self._inbox.send(P.encoder.encode(P.Abort([request_id])))

    def release(self, request_id: str) -> None:
        """The request finished on its own: just stop routing."""
        self._queues.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    # -- background tasks ------------------------------------------------------------------------
    async def _read(self) -> None:
        """Route the engine's messages. The socket's file descriptor wakes the loop, and each wake-up
        drains every waiting message with plain non-blocking reads: one step's tokens cost one
        callback, not the future per message that `await socket.recv()` costs (it showed in
        profiles as a large part of the API process's CPU per streamed token)."""
        sock: zmq.Socket = zmq.Socket.shadow(self._outbox.underlying)
        fd = sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, self._drain, sock)
        try:
            self._drain(sock)  # messages that arrived before the reader was registered
            await asyncio.Event().wait()  # until cancelled by stop()
        finally:
            loop.remove_reader(fd)

    def _drain(self, sock: zmq.Socket) -> None:
        while True:  # the descriptor is edge-triggered: read until there is nothing left
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(P.from_engine.decode(raw))
            except Exception:  # one bad message must not stop the routing of the others
                log.exception("failed to handle an engine message")

    def _handle(self, msg: object) -> None:
        if isinstance(msg, P.AdapterSnapshot):
            if msg.version > self.adapters.version:
                self.adapters = msg
            return
        if isinstance(msg, P.AdapterDone):
            future = self._adapter_ops.pop(msg.op_id, None)
            if future is not None and not future.done():
                future.set_result(msg.error)
            return
        if isinstance(msg, P.Heartbeat):
            self.stats = msg.stats
            if self.on_stats is not None:
                self.on_stats(msg.stats)
        if not isinstance(msg, P.StepOut):
            return
        self.stats = msg.stats
        for update in msg.updates:
            queue = self._queues.get(update.request_id)
            if queue is not None:
                queue.put_nowait(update)
        for pooled in msg.pooled:
            queue = self._queues.get(pooled.request_id)
            if queue is not None:
                queue.put_nowait(pooled)
        if self.on_step is not None:
            self.on_step(msg)

    async def _watch(self) -> None:
        assert self.proc is not None
        while self.proc.poll() is None:
            await asyncio.sleep(0.2)
        self._die(_exit_reason(self.proc.returncode))

    def _die(self, reason: str) -> None:
        log.error("%s: failing %d pending requests; the server stops", reason, len(self._queues))
        self.healthy, self.dead_reason = False, reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDead(reason))
        self._queues.clear()
        for future in self._adapter_ops.values():
            if not future.done():
                future.set_exception(EngineDead(reason))
        self._adapter_ops.clear()
        if self.on_death is not None:
            self.on_death(reason)


def _exit_reason(code: int) -> str:
    """Why the engine process ended, in words (a negative code is the signal that killed it)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's OOM killer sends it when memory runs out)" if name == "SIGKILL" else ""
        return f"engine process killed by {name}{hint}"
    return f"engine process exited with code {code}"
