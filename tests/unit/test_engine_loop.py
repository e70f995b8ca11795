"""The engine process's loop (`pytgi.engine.process.EngineLoop`) over real ZMQ sockets, with a
stand-in engine: a message it cannot decode fails its own request and the loop goes on."""

from __future__ import annotations

import msgspec
import zmq

from pytgi.core import protocol as P
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.adapter_registry import AdapterRegistry
from pytgi.engine.process import EngineLoop
from tests.unit.test_adapter_registry import FakeRunner


class RecordingEngine:
    def __init__(self, adapters: dict[str, str] | None = None) -> None:
        self.added: list[str] = []
        self.running: set[str | None] = set()  # the adapters of running requests
        self.adapters = AdapterRegistry(
            FakeRunner(), adapters or {}, "base", progress=False, in_use=lambda: self.running
        )

    def submit(self, msg: P.Submit) -> None:
        self.added.append(msg.request_id)

    def abort_request(self, rid: str) -> None:
        pass

    def has_unfinished(self) -> bool:
        return False

    def stats(self) -> dict:
        return dict(
            running=0, waiting=0, kv_cache_usage=0.0, prefix_cache_hit_rate=0.0, preemptions=0, failed_steps=0
        )


def sockets(name: str) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket, zmq.Socket]:
    ctx: zmq.Context = zmq.Context.instance()
    to_engine, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    outbox, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inbox.bind(f"inproc://{name}-in")
    to_engine.connect(f"inproc://{name}-in")
    from_engine.bind(f"inproc://{name}-out")
    outbox.connect(f"inproc://{name}-out")
    return to_engine, inbox, outbox, from_engine


def test_an_undecodable_submit_fails_alone() -> None:
    to_engine, inbox, outbox, from_engine = sockets("loop")
    engine = RecordingEngine()
    loop = EngineLoop(engine, inbox, outbox, parent_pid=0)
    bad = msgspec.msgpack.encode(
        {"type": "submit", "request_id": "bad", "prompt_ids": [1], "params": {"repetition_penalty": 0.0}}
    )  # SamplingParams refuses it
    to_engine.send(bad)
    to_engine.send(b"\xc1 not msgpack")
    to_engine.send(P.encoder.encode(P.Submit("good", [1, 2], SamplingParams())))
    assert inbox.poll(1000)
    loop._drain()
    assert engine.added == ["good"] and loop.running
    out = P.from_engine.decode(from_engine.recv())
    assert [(u.request_id, u.finish_reason) for u in out.updates] == [("bad", "error")]
    assert "repetition_penalty" in out.updates[0].error
    for s in (to_engine, inbox, outbox, from_engine):
        s.close(0)


def test_adapter_changes_are_published_before_they_are_answered(tmp_path) -> None:
    """The API process reads the engine's snapshot: each change's snapshot arrives before the answer
    to the operation that made it, and an unload is answered once its requests are done."""
    to_engine, inbox, outbox, from_engine = sockets("adapters")
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    engine = RecordingEngine({"old": str(d)})
    engine.running = {"old"}
    loop = EngineLoop(engine, inbox, outbox, parent_pid=0)

    def received() -> list:
        got = []
        while from_engine.poll(100):
            got.append(P.from_engine.decode(from_engine.recv()))
        return got

    to_engine.send(P.encoder.encode(P.AdapterOp("1", "new", str(d))))
    to_engine.send(P.encoder.encode(P.AdapterOp("2", "old")))
    to_engine.send(P.encoder.encode(P.AdapterOp("3", "new", str(d))))  # the name is taken now
    assert inbox.poll(1000)
    loop._drain()
    first, done1, second, done3 = received()
    assert (
        first.served.keys() == {"old", "new"} and first.unloading == [] and done1 == P.AdapterDone("1", None)
    )
    assert second.unloading == ["old"] and second.names().keys() == {"new"}  # refused to new requests now
    assert done3.op_id == "3" and "already served" in done3.error
    loop._answer_unloads()
    assert received() == []  # "old" still has a running request
    engine.running = set()
    engine.adapters.settle()  # as the step that finishes its last request does
    loop._answer_unloads()
    third, done2 = received()
    assert (
        third.served.keys() == {"new"}
        and third.version > second.version
        and done2 == P.AdapterDone("2", None)
    )
    for s in (to_engine, inbox, outbox, from_engine):
        s.close(0)
