"""An engine replica: a Ray Serve deployment replica that runs one pytgi engine process, exactly as
`pytgi serve` runs it (`EngineClient`: the engine process, ZMQ, its heartbeats and death), and
relays requests to it. The replica's actor never imports torch; its engine process does.

`generate` takes a msgpack `Submit` and streams msgpack messages back: first `Routed` (the replica's
name, at once: the API process puts it in the `x-pytgi-replica` header), then the request's
`TokenOut`s (`Update`), or a pooling request's `PoolOut` (`Pooled`: an embedding model's).
Cancelling the stream aborts the request in the engine. When the engine process dies, the requests
in flight fail, `check_health` fails, and Ray Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from pytgi.api.frontend.engine_client import EngineClient
from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig
from pytgi.core.errors import EngineDead

log = logging.getLogger("pytgi.api.replicas")


class Routed(msgspec.Struct, tag="routed"):
    replica: str


class Failed(msgspec.Struct, tag="failed"):
    error: str


class Update(msgspec.Struct, tag="update"):
    out: P.TokenOut


class Pooled(msgspec.Struct, tag="pooled"):
    out: P.PoolOut


ReplicaMessage = Routed | Failed | Update | Pooled
encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ReplicaMessage)
_submit = msgspec.msgpack.Decoder(P.Submit)


class EngineReplica:
    """The class Ray Serve deploys (`serve.deployment(EngineReplica)`, pytgi.api.replicas.client)."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits it
        self, config: dict[str, Any], engine_module: str = "pytgi.engine.process", threads: int | None = None
    ) -> None:
        """`threads`: the engine's CPU threads (replicas sharing a machine share its cores)."""
        import os

        from ray import serve

        if threads is not None and "OMP_NUM_THREADS" not in os.environ:
            os.environ["OMP_NUM_THREADS"] = str(threads)  # the engine process inherits it
        self.name = serve.get_replica_context().replica_id.unique_id
        self.client = EngineClient(EngineConfig(**config), engine_module)
        self.info = await self.client.start()
        log.info("replica %s: engine ready", self.name)

    def engine_info(self) -> bytes:
        return encoder.encode(P.Ready(self.info, self.client.adapters))

    def pid(self) -> int:
        """The engine process's (the tests kill it to see a replica die)."""
        assert self.client.proc is not None
        return self.client.proc.pid

    async def generate(self, submit: bytes) -> Any:
        sub = _submit.decode(submit)
        yield encoder.encode(Routed(self.name))
        try:
            queue = self.client.submit(sub.request_id, sub.prompt_ids, sub.params, sub.images, pool=sub.pool)
        except EngineDead as exc:
            yield encoder.encode(Failed(f"replica {self.name}: {exc}"))
            return
        finished = False
        try:
            while not finished:
                update = await queue.get()
                if isinstance(update, EngineDead):
                    yield encoder.encode(Failed(f"replica {self.name}: {update}"))
                    return
                if isinstance(update, P.PoolOut):  # a pooling request's answer: its last message
                    finished = True
                    yield encoder.encode(Pooled(update))
                    continue
                finished = update.finish_reason is not None
                yield encoder.encode(Update(update))
        finally:
            if finished:
                self.client.release(sub.request_id)
            else:  # cancelled: the client went away, or the API process aborted it
                self.client.abort(sub.request_id)

    def record_routing_stats(self) -> dict[str, Any]:
        """The engine's last numbers, for the router (and the API process's metrics)."""
        s = self.client.stats
        if s is None:
            return {"healthy": self.client.healthy}
        return {"healthy": self.client.healthy, **msgspec.structs.asdict(s)}

    def check_health(self) -> None:
        if not self.client.healthy:
            raise RuntimeError(f"replica {self.name}: {self.client.dead_reason}")

    async def __del__(self) -> None:
        await asyncio.shield(self.client.stop())
