"""`Infer`'s admissions without a model or an engine: slots are taken at once or refused, and given
back exactly once when the admission closes, aborting what still runs."""

from __future__ import annotations

import asyncio

import pytest

from pytgi.router.infer import Infer, Overloaded
from pytgi.router.validation import ValidRequest
from pytgi.sampling_params import SamplingParams


class FakeClient:
    def __init__(self, fail: Exception | None = None) -> None:
        self.fail, self.submitted, self.aborted, self.released = fail, [], [], []

    def submit(self, rid, ids, params):  # type: ignore[no-untyped-def]
        if self.fail is not None:
            raise self.fail
        self.submitted.append(rid)
        return asyncio.Queue()

    def abort(self, rid):  # type: ignore[no-untyped-def]
        self.aborted.append(rid)

    def release(self, rid):  # type: ignore[no-untyped-def]
        self.released.append(rid)


def _req() -> ValidRequest:
    return ValidRequest(input_ids=[1, 2], input_length=2, sampling=SamplingParams(max_new_tokens=2), best_of=1,
                        details=False, decoder_input_details=False, return_full_text=False, watermark=False,
                        stream=False, inputs="ab", truncate=None)


def test_slots_are_refused_at_once_over_the_limit_and_come_back_on_close():
    infer = Infer(FakeClient(), tokenizer=None, max_concurrent_requests=3)  # type: ignore[arg-type]
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
    infer = Infer(client, tokenizer=None, max_concurrent_requests=2)  # type: ignore[arg-type]
    adm = infer.admission()
    adm.take(1)
    stream = infer.stream(_req(), adm)
    adm.close()
    assert stream.closed and client.aborted == [stream.rid] and infer.in_flight == 0


def test_a_submit_that_raises_keeps_no_slot():
    infer = Infer(FakeClient(fail=UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates")), tokenizer=None,
                  max_concurrent_requests=1)  # type: ignore[arg-type]
    adm = infer.admission()
    adm.take(1)
    with pytest.raises(UnicodeEncodeError):
        infer.stream(_req(), adm)
    adm.close()
    assert infer.in_flight == 0
