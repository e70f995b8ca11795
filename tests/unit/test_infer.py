"""`Infer`'s admissions without a model or an engine: slots are taken at once or refused, and given
back exactly once when the admission closes, aborting what still runs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pytgi.api.frontend.infer import Infer
from pytgi.api.frontend.validation import ValidRequest
from pytgi.core import protocol as P
from pytgi.core.errors import Overloaded
from pytgi.core.sampling_params import SamplingParams
from tests.waiting import async_wait_until


class FakeClient:
    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.submitted: list[Any] = []
        self.aborted: list[str] = []
        self.released: list[str] = []

    def submit(self, rid, ids, params, images=None, cache_key=None):
        if self.fail is not None:
            raise self.fail
        self.submitted.append(rid)
        return asyncio.Queue()

    def abort(self, rid):
        self.aborted.append(rid)

    def release(self, rid):
        self.released.append(rid)


def _req() -> ValidRequest:
    return ValidRequest(
        input_ids=[1, 2],
        input_length=2,
        sampling=SamplingParams(max_new_tokens=2),
        best_of=1,
        details=False,
        decoder_input_details=False,
        return_full_text=False,
        watermark=False,
        stream=False,
        inputs="ab",
        truncate=None,
    )


def test_slots_are_refused_at_once_over_the_limit_and_come_back_on_close():
    infer = Infer(FakeClient(), tokenizer=None, max_concurrent_requests=3)
    a, b = infer.admission(), infer.admission()
    a.take(2)
    with pytest.raises(Overloaded):
        b.take(2)
    b.take(1)
    assert infer.in_flight == 3
    a.close()
    a.close()  # idempotent
    assert infer.in_flight == 1
    b.close()
    assert infer.in_flight == 0


def test_closing_an_admission_aborts_its_running_streams():
    client = FakeClient()
    infer = Infer(client, tokenizer=None, max_concurrent_requests=2)
    adm = infer.admission()
    adm.take(1)
    stream = infer.stream(_req(), adm)
    adm.close()
    assert stream.closed and client.aborted == [stream.rid] and infer.in_flight == 0


def test_a_submit_that_raises_keeps_no_slot():
    infer = Infer(
        FakeClient(fail=UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates")),
        tokenizer=None,
        max_concurrent_requests=1,
    )
    adm = infer.admission()
    adm.take(1)
    with pytest.raises(UnicodeEncodeError):
        infer.stream(_req(), adm)
    adm.close()
    assert infer.in_flight == 0


class PieceTokenizer:
    """Token k decodes to `pieces[k]`; id 0 is a special token (EOS)."""

    special_ids = {0}
    eos_token_ids = [0]

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0))

    def id_to_piece(self, i: int) -> str:
        return self.pieces[i]


def _stream(pieces: list[str], **sampling):
    client = FakeClient()
    infer = Infer(client, PieceTokenizer(pieces), max_concurrent_requests=1)
    adm = infer.admission()
    adm.take(1)
    req = _req()
    req.sampling = SamplingParams(max_new_tokens=8, temperature=0, **sampling)
    return client, adm, infer.stream(req, adm)


async def _drain(stream, updates):
    for u in updates:
        stream.queue.put_nowait(u)
    return [d async for d in stream]


def test_a_stream_yields_one_delta_per_token_and_releases_when_the_engine_finished():
    from pytgi.core.protocol import TokenOut

    client, _adm, stream = _stream(["</s>", "Hel", "lo"])
    deltas = asyncio.run(
        _drain(
            stream,
            [
                TokenOut("r", 1, -0.1),
                TokenOut("r", 2, -0.2),
                TokenOut("r", 0, -0.3, finish_reason="eos_token"),
            ],
        )
    )
    assert [(d.index, d.token.text, d.text, d.finish_reason) for d in deltas] == [
        (1, "Hel", "Hel", None),
        (2, "lo", "lo", None),
        (3, "</s>", "", "eos_token"),
    ]
    assert deltas[-1].token.special and stream.output.text == "Hello"
    assert client.released == [stream.rid] and client.aborted == []  # the engine already finished it
    assert stream.timings.start and stream.timings.end


def test_a_stop_string_ends_the_stream_and_aborts_the_engine_request():
    from pytgi.core.protocol import TokenOut

    client, _adm, stream = _stream(["</s>", "Hel", "lo", " STOP", " more"], stop=["STOP"])
    deltas = asyncio.run(
        _drain(stream, [TokenOut("r", 1, -0.1), TokenOut("r", 2, -0.1), TokenOut("r", 3, -0.1)])
    )
    assert deltas[-1].finish_reason == "stop_sequence" and stream.output.text == "Hello "
    assert client.aborted == [stream.rid]


def test_engine_failure_and_death_are_generation_errors():
    from pytgi.core.errors import EngineDead, GenerationError
    from pytgi.core.protocol import TokenOut

    client, _adm, stream = _stream(["</s>", "a", "b"])
    with pytest.raises(GenerationError, match="boom"):
        asyncio.run(
            _drain(stream, [TokenOut("r", 1, -0.1), TokenOut("r", error="boom", finish_reason="error")])
        )
    assert client.released == [stream.rid] and client.aborted == []
    client, _adm, stream = _stream(["</s>", "a", "b"])
    with pytest.raises(GenerationError, match="gone"):
        asyncio.run(_drain(stream, [EngineDead("gone")]))


def test_generate_collects_the_stream_and_best_of_keeps_the_likeliest():
    from pytgi.core.protocol import TokenOut

    client = FakeClient()
    infer = Infer(client, PieceTokenizer(["</s>", "a", "b"]), max_concurrent_requests=2)
    adm = infer.admission()
    adm.take(2)
    req = _req()
    req.best_of, req.sampling = 2, SamplingParams(max_new_tokens=1, temperature=1.0, do_sample=True)

    async def main():
        task = asyncio.ensure_future(infer.generate(req, adm))
        await async_wait_until(
            lambda: len(adm.streams) == 2, 5, "generate() to open both streams", interval=0
        )
        first, second = adm.streams
        first.queue.put_nowait(TokenOut("r", 1, -2.0, finish_reason="length"))
        second.queue.put_nowait(TokenOut("r", 2, -0.5, finish_reason="length"))
        return await task

    g = asyncio.run(main())
    assert g.output.text == "b" and [o.output.text for o in g.best_of_sequences] == ["a"]
    assert len(set(client.submitted)) == 2


class PoolClient(FakeClient):
    """Answers each pooling request on its queue: a vector, or (for ids [0]) the engine's refusal."""

    def __init__(self) -> None:
        super().__init__()
        self.queues: dict[str, asyncio.Queue] = {}

    def submit(self, rid, ids, params, images=None, cache_key=None, pool=None):
        assert pool is not None
        self.submitted.append(rid)
        self.queues[rid] = asyncio.Queue()
        return self.queues[rid]

    def answer(self, rid: str, ids: list[int]) -> None:
        if ids == [0]:
            self.queues[rid].put_nowait(P.TokenOut(rid, finish_reason="error", error="refused"))
        else:
            self.queues[rid].put_nowait(P.PoolOut(rid, bytes(ids), 1, len(ids)))


def test_a_pooling_call_returns_each_inputs_vector_in_order_and_fails_whole():
    from pytgi.core.errors import GenerationError

    async def main() -> None:
        client = PoolClient()
        infer = Infer(client, tokenizer=None, max_concurrent_requests=4)
        adm = infer.admission()
        inputs = [[3], [1, 2], [4, 5, 6]]
        task = asyncio.ensure_future(infer.pool(inputs, P.PoolParams(), adm))
        await async_wait_until(lambda: len(client.submitted) == 3, 5, "three submitted")
        for rid, ids in reversed(list(zip(client.submitted, inputs, strict=True))):  # answered out of order
            client.answer(rid, ids)
        out = await task
        assert [o.data for o in out] == [bytes(i) for i in inputs]
        assert client.released == client.submitted and not client.aborted
        # one input refused: the call fails, and what still runs is aborted
        task = asyncio.ensure_future(infer.pool([[0], [7]], P.PoolParams(), adm))
        await async_wait_until(lambda: len(client.submitted) == 5, 5, "two more submitted")
        client.answer(client.submitted[3], [0])
        with pytest.raises(GenerationError, match="refused"):
            await task
        assert client.aborted == [client.submitted[4]]

    asyncio.run(main())
