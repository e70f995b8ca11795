"""The engine process's loop (`pytgi.engine.process.EngineLoop`) over real ZMQ sockets, with a
stand-in engine: a message it cannot decode fails its own request and the loop goes on."""

from __future__ import annotations

import msgspec
import zmq

from pytgi.core import protocol as P
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.process import EngineLoop


class RecordingEngine:
    def __init__(self) -> None:
        self.added: list[str] = []

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams, images=()) -> None:
        self.added.append(rid)

    def abort_request(self, rid: str) -> None:
        pass

    def has_unfinished(self) -> bool:
        return False

    def stats(self) -> dict:
        return dict(
            running=0, waiting=0, kv_cache_usage=0.0, prefix_cache_hit_rate=0.0, preemptions=0, failed_steps=0
        )


def test_an_undecodable_submit_fails_alone() -> None:
    ctx = zmq.Context.instance()
    to_engine, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    outbox, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inbox.bind("inproc://loop-in")
    to_engine.connect("inproc://loop-in")
    from_engine.bind("inproc://loop-out")
    outbox.connect("inproc://loop-out")
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
