"""pytgi.api.frontend.engine_client.EngineClient without an engine process: the test plays the engine's side
with real zmq sockets connected to the client's ipc addresses."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable

import pytest
import zmq
import zmq.asyncio

from pytgi.api.frontend.engine_client import EngineClient
from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig
from pytgi.core.errors import EngineDead
from pytgi.core.sampling_params import SamplingParams

TIMEOUT = 5.0
STATS = P.EngineStats(
    running=1, waiting=0, kv_cache_usage=0.25, prefix_cache_hit_rate=0.0, preemptions=0, failed_steps=0
)


class FakeEngine:
    """The engine process's two sockets: it receives from the client's inbox and sends to its outbox."""

    def __init__(self, client: EngineClient) -> None:
        self._ctx = zmq.asyncio.Context()
        self.inbox = self._ctx.socket(zmq.PULL)
        self.inbox.connect(f"ipc://{client._dir}/inbox")
        self.outbox = self._ctx.socket(zmq.PUSH)
        self.outbox.connect(f"ipc://{client._dir}/outbox")

    async def recv(self) -> P.Submit | P.Abort | P.Shutdown | P.AdapterOp:
        return P.to_engine.decode(await asyncio.wait_for(self.inbox.recv(), TIMEOUT))

    async def nothing_received(self) -> bool:
        return not await self.inbox.poll(100)

    async def send(self, msg: object) -> None:
        await self.outbox.send(msg if isinstance(msg, bytes) else P.encoder.encode(msg))

    async def step(self, *updates: P.TokenOut) -> None:
        await self.send(
            P.StepOut(
                list(updates),
                STATS,
                P.StepInfo(seconds=0.01, batch_size=len(updates), num_tokens=len(updates), method="decode"),
            )
        )

    def close(self) -> None:
        self._ctx.destroy(linger=0)


def with_engine(test: Callable[[EngineClient, FakeEngine], Awaitable[None]]) -> None:
    """Run `test` with a healthy client whose reader runs, as after `start()`, and a fake engine."""

    async def main() -> None:
        client = EngineClient(EngineConfig())
        engine = FakeEngine(client)
        client.healthy = True
        reader = asyncio.create_task(client._read())
        try:
            await test(client, engine)
        finally:
            engine.close()
            # stop() cancels its tasks without waiting for them, then closes the sockets the reader's
            # clean-up still reads: let the reader finish first
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            assert reader.cancelled()
            await client.stop()  # no process to shut down: closes the sockets
            shutil.rmtree(client._dir, ignore_errors=True)

    asyncio.run(main())


async def get(queue: asyncio.Queue) -> object:
    return await asyncio.wait_for(queue.get(), TIMEOUT)


def test_submit_sends_a_submit_the_engine_decodes() -> None:
    async def test(client: EngineClient, engine: FakeEngine) -> None:
        params = SamplingParams(max_new_tokens=7, temperature=0.5, stop=["END", "é\n"], seed=3)
        queue = client.submit("r1", [1, 2, 3], params)
        assert isinstance(queue, asyncio.Queue) and client.num_pending == 1
        assert await engine.recv() == P.Submit("r1", [1, 2, 3], params)

    with_engine(test)


def test_step_updates_are_routed_to_their_requests() -> None:
    steps: list[P.StepOut] = []

    async def test(client: EngineClient, engine: FakeEngine) -> None:
        client.on_step = steps.append
        qa = client.submit("a", [1], SamplingParams())
        qb = client.submit("b", [2], SamplingParams())
        await engine.step(P.TokenOut("a", 10), P.TokenOut("b", 20, logprob=-0.5))
        await engine.step(P.TokenOut("b", 21, finish_reason="length"), P.TokenOut("a", 11))
        assert [await get(qa), await get(qa)] == [P.TokenOut("a", 10), P.TokenOut("a", 11)]
        assert [await get(qb), await get(qb)] == [
            P.TokenOut("b", 20, logprob=-0.5),
            P.TokenOut("b", 21, finish_reason="length"),
        ]
        assert qa.empty() and qb.empty()
        assert client.stats == STATS and [len(s.updates) for s in steps] == [2, 2]

    with_engine(test)


def test_unknown_request_and_bad_messages_are_ignored() -> None:
    async def test(client: EngineClient, engine: FakeEngine) -> None:
        queue = client.submit("a", [1], SamplingParams())
        await engine.step(P.TokenOut("never-submitted", 5))
        await engine.send(b"not msgpack for any engine message")
        await engine.step(P.TokenOut("ghost", 6), P.TokenOut("a", 7))
        assert await get(queue) == P.TokenOut("a", 7)  # routing went on
        assert queue.empty() and client.num_pending == 1 and client.healthy

    with_engine(test)


def test_abort_sends_abort_and_stops_routing() -> None:
    async def test(client: EngineClient, engine: FakeEngine) -> None:
        qa = client.submit("a", [1], SamplingParams())
        qb = client.submit("b", [2], SamplingParams())
        assert [(await engine.recv()).request_id for _ in range(2)] == ["a", "b"]
        client.abort("a")
        assert await engine.recv() == P.Abort(["a"])
        assert client.num_pending == 1
        await engine.step(P.TokenOut("a", 1), P.TokenOut("b", 2))  # a step already under way
        assert await get(qb) == P.TokenOut("b", 2)  # the same message: a's update was handled before
        assert qa.empty()
        client.abort("a")  # twice, or after the request finished: nothing more to tell the engine
        client.abort("unknown")
        assert await engine.nothing_received()

    with_engine(test)


def test_release_stops_routing_without_an_abort() -> None:
    async def test(client: EngineClient, engine: FakeEngine) -> None:
        qa = client.submit("a", [1], SamplingParams())
        await engine.recv()
        client.release("a")
        assert client.num_pending == 0
        client.submit("c", [3], SamplingParams())
        assert await engine.recv() == P.Submit("c", [3], SamplingParams())  # no Abort before it
        qc = client._queues["c"]
        await engine.step(P.TokenOut("a", 1), P.TokenOut("c", 3))
        assert await get(qc) == P.TokenOut("c", 3)
        assert qa.empty()

    with_engine(test)


def test_heartbeat_updates_stats() -> None:
    seen: list[P.EngineStats] = []

    async def test(client: EngineClient, engine: FakeEngine) -> None:
        client.on_stats = seen.append
        queue = client.submit("a", [1], SamplingParams())
        idle = P.EngineStats(0, 0, 0.0, 0.5, 2, 1)
        await engine.send(P.Heartbeat(idle))
        await engine.step(P.TokenOut("a", 1))
        await get(queue)  # the heartbeat, sent first, was handled
        assert seen == [idle] and client.stats == STATS

    with_engine(test)


def test_death_fails_every_pending_request() -> None:
    deaths: list[str] = []

    async def test(client: EngineClient, engine: FakeEngine) -> None:
        client.on_death = deaths.append
        queues = [client.submit(rid, [1], SamplingParams()) for rid in ("a", "b", "c")]
        client.release("c")
        client._die("engine process exited with code -9")
        assert not client.healthy and client.dead_reason == "engine process exited with code -9"
        assert client.num_pending == 0 and deaths == ["engine process exited with code -9"]
        for queue in queues[:2]:
            dead = queue.get_nowait()
            assert isinstance(dead, EngineDead) and str(dead) == "engine process exited with code -9"
            assert queue.empty()
        assert queues[2].empty()  # released before the death: no longer this client's to fail
        with pytest.raises(EngineDead, match="exited with code -9"):
            client.submit("d", [1], SamplingParams())
        assert client.num_pending == 0
        for _ in range(3):
            await engine.recv()  # the three submits...
        client.abort("a")  # ...and nothing after them: the dead client forgot its requests
        assert await engine.nothing_received()

    with_engine(test)


def test_submit_before_start_raises() -> None:
    async def main() -> None:
        client = EngineClient(EngineConfig())
        try:
            with pytest.raises(EngineDead, match="engine is not running"):
                client.submit("a", [1], SamplingParams())
            assert client.num_pending == 0
        finally:
            await client.stop()
            shutil.rmtree(client._dir, ignore_errors=True)

    asyncio.run(main())


def test_submit_that_cannot_be_encoded_registers_nothing() -> None:
    async def test(client: EngineClient, engine: FakeEngine) -> None:
        client.submit("a", [1], SamplingParams())
        with pytest.raises(UnicodeEncodeError):
            client.submit("b", [1], SamplingParams(stop=["\ud800"]))  # a lone surrogate
        assert client.num_pending == 1 and "b" not in client._queues
        assert (await engine.recv()).request_id == "a"
        assert await engine.nothing_received()
        client.submit("b", [1], SamplingParams(stop=["ok"]))  # the id is free to use
        assert (await engine.recv()).request_id == "b"

    with_engine(test)
