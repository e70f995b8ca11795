"""Scheduler behaviour with no model: build requests, schedule, feed fake tokens back."""

from pytgi.core.config import EngineInfo
from pytgi.engine.kv.blocks import BlockManager
from pytgi.engine.scheduling.request import Request, Status
from pytgi.engine.scheduling.scheduler import Scheduler
from tests.unit.helpers import make_request, run_step


def make_scheduler(num_blocks=64, block_size=4, **kw) -> Scheduler:
    cfg = dict(
        max_batch_size=8,
        max_batch_prefill_tokens=64,
        max_prefill_tokens_while_decoding=None,
        waiting_served_ratio=0.3,
        max_waiting_tokens=20,
        enable_chunked_prefill=True,
    )
    cfg.update(kw)
    info = EngineInfo(
        model_id="fake",
        model_path="",
        model_dtype="float32",
        model_device_type="cpu",
        vocab_size=1000,
        num_shard=1,
        max_input_tokens=255,
        max_total_tokens=256,
        max_batch_total_tokens=num_blocks * block_size,
        enable_prefix_caching=True,
        block_size=block_size,
        num_blocks=num_blocks,
        **cfg,
    )
    return Scheduler(info, BlockManager(num_blocks, block_size), watermark=0.0)


def scheduled(out) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_prefill_then_decode():
    sched = make_scheduler()
    req = make_request("a", 10, max_new_tokens=3)
    sched.add(req)
    assert scheduled(run_step(sched)) == {"a": 10}
    assert req.output_ids == [7] and req.status is Status.RUNNING
    assert scheduled(run_step(sched)) == {"a": 1}
    run_step(sched)
    assert req.status is Status.FINISHED and len(req.output_ids) == 3
    assert sched.block_manager.num_free_blocks == 64
    assert not sched.has_work()


def test_fifo_admission_under_prefill_budget():
    sched = make_scheduler(max_batch_prefill_tokens=25, enable_chunked_prefill=False)
    for rid in "abc":
        sched.add(make_request(rid, 10))
    assert scheduled(run_step(sched)) == {"a": 10, "b": 10}  # c would exceed 25
    assert scheduled(run_step(sched)) == {"a": 1, "b": 1, "c": 10}


def test_fifo_is_not_skipped_by_a_smaller_later_request():
    sched = make_scheduler(max_batch_prefill_tokens=20, enable_chunked_prefill=False)
    sched.add(make_request("a", 15))
    sched.add(make_request("big", 20))
    sched.add(make_request("small", 2))
    assert scheduled(run_step(sched)) == {"a": 15}  # small must not overtake big


def test_max_batch_size_caps_running():
    sched = make_scheduler(max_batch_size=2)
    for rid in "abc":
        sched.add(make_request(rid, 4))
    assert set(scheduled(run_step(sched))) == {"a", "b"}
    assert set(scheduled(run_step(sched))) == {"a", "b"}
    assert len(sched.waiting) == 1


def test_chunked_prefill_mixes_with_decodes():
    sched = make_scheduler(max_batch_prefill_tokens=16)
    sched.add(make_request("a", 4, max_new_tokens=10))
    run_step(sched)
    long = make_request("long", 40)
    sched.add(long)
    out = run_step(sched)
    assert scheduled(out) == {"a": 1, "long": 15}
    assert long.output_ids == []  # no token until the whole prompt is computed
    assert scheduled(run_step(sched)) == {"a": 1, "long": 15}
    assert scheduled(run_step(sched)) == {"a": 1, "long": 10}
    assert long.output_ids == [7]
    assert scheduled(run_step(sched)) == {"a": 1, "long": 1}


def test_waiting_served_ratio_holds_new_requests_until_enough_can_join():
    sched = make_scheduler(max_batch_size=16, waiting_served_ratio=0.5, max_waiting_tokens=3)
    for i in range(4):
        sched.add(make_request(f"r{i}", 4, max_new_tokens=50))
    run_step(sched)
    sched.add(make_request("late", 4, max_new_tokens=50))
    # 4 running × 0.5 = 2 must be able to join: one waiting request is held back...
    assert "late" not in scheduled(run_step(sched))
    assert "late" not in scheduled(run_step(sched))
    # ... until max_waiting_tokens steps have passed without admission.
    assert "late" in scheduled(run_step(sched))


def test_waiting_served_ratio_admits_when_enough_wait():
    sched = make_scheduler(max_batch_size=16, waiting_served_ratio=0.5, max_waiting_tokens=100)
    for i in range(4):
        sched.add(make_request(f"r{i}", 4, max_new_tokens=50))
    run_step(sched)
    sched.add(make_request("x", 4))
    assert "x" not in scheduled(run_step(sched))
    sched.add(make_request("y", 4))
    assert {"x", "y"} <= set(scheduled(run_step(sched)))


def test_preemption_of_newest_when_blocks_run_out_then_resume():
    sched = make_scheduler(num_blocks=4, block_size=4, max_batch_prefill_tokens=64)
    a = make_request("a", 4, max_new_tokens=8)
    b = make_request("b", 4, max_new_tokens=8)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a, b prefilled: 1 block each, 1 token generated each
    run_step(sched)  # both decode into a second block: 4 blocks used
    assert sched.block_manager.num_free_blocks == 0
    for _ in range(3):  # positions 5..7 fit in the second blocks
        run_step(sched)
    assert b.num_preemptions == 0
    run_step(sched)
    # a's next decode needs a 3rd block: b (newest) is preempted, not dropped
    assert b.status is Status.WAITING and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert sched.waiting[0] is b
    generated_before = list(b.output_ids)
    while a.status is not Status.FINISHED:
        run_step(sched)
    # b is recomputed from prompt + its generated tokens and continues where it was
    out = run_step(sched)
    # (its blocks that survived in the prefix cache are reused)
    assert scheduled(out) == {"b": 4 + len(generated_before) - b.num_cached_tokens}
    assert b.num_computed_tokens == 4 + len(generated_before)
    assert b.output_ids[: len(generated_before)] == generated_before
    while b.status is not Status.FINISHED:
        run_step(sched)
    assert len(b.output_ids) == 8
    assert sched.block_manager.num_free_blocks == 4


def test_a_lone_request_that_outgrows_the_cache_preempts_itself_without_loss():
    sched = make_scheduler(num_blocks=2, block_size=4)
    a = make_request("a", 4, max_new_tokens=10)
    sched.add(a)
    for _ in range(5):
        run_step(sched)
    # 8 tokens fill both blocks; the 9th needs a third: a preempts itself and waits
    out = sched.schedule()
    assert out.preempted == [a] and out.scheduled == []
    assert a.status is Status.WAITING


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request("a", 8, max_new_tokens=20), make_request("b", 4, max_new_tokens=20)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # 3 of 4 blocks used
    sched.add(make_request("c", 1))
    out = sched.schedule()  # a takes the last block for position 8; b must preempt itself
    assert out.preempted == [b]
    assert "c" not in scheduled(out) and list(sched.waiting)[:1] == [b]


def test_finish_removes_waiting_or_running_and_frees_blocks():
    sched = make_scheduler()
    a, b = make_request("a", 8), make_request("b", 8)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(a)
    sched.finish(b)
    assert not sched.has_work()
    assert sched.block_manager.num_free_blocks == 64


def test_prefix_cache_hit_schedules_only_the_rest():
    sched = make_scheduler(block_size=4)
    shared = list(range(100, 112))
    a = make_request("a", shared + [1, 2])
    sched.add(a)
    run_step(sched)
    b = make_request("b", shared + [3, 4, 5])
    sched.add(b)
    assert scheduled(run_step(sched))["b"] == 3
    assert b.num_cached_tokens == 12


def test_prompt_tokens_are_capped_while_others_decode():
    sched = make_scheduler(
        max_batch_prefill_tokens=64, max_prefill_tokens_while_decoding=8, max_waiting_tokens=1
    )
    sched.add(make_request("a", 10, max_new_tokens=50))
    assert scheduled(run_step(sched)) == {"a": 10}  # nothing decodes yet: the full budget
    sched.add(make_request("long", 30))
    assert scheduled(run_step(sched)) == {"a": 1, "long": 8}  # a decodes: 8 prompt tokens per step
    assert scheduled(run_step(sched)) == {"a": 1, "long": 8}
    sched.add(make_request("c", 5))
    assert scheduled(run_step(sched)) == {"a": 1, "long": 8}  # the cap is shared, FIFO: c waits
    assert scheduled(run_step(sched)) == {"a": 1, "long": 6, "c": 2}
    assert scheduled(run_step(sched)) == {"a": 1, "long": 1, "c": 3}


def test_no_cap_without_decodes_or_when_unset():
    sched = make_scheduler(max_batch_prefill_tokens=64, max_prefill_tokens_while_decoding=8)
    sched.add(make_request("a", 30))
    sched.add(make_request("b", 20))
    assert scheduled(run_step(sched)) == {"a": 30, "b": 20}
    sched = make_scheduler(max_batch_prefill_tokens=64)
    sched.add(make_request("a", 10, max_new_tokens=5))
    run_step(sched)
    sched.add(make_request("long", 40))
    assert scheduled(run_step(sched)) == {"a": 1, "long": 40}


class _Span:
    """An image in a prompt whose positions [lo, hi) attend to each other both ways (Gemma 3's)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.span = (lo, hi)


def test_a_chunk_never_ends_inside_a_two_way_image():
    """Chunks end before such an image, or (when it starts where the chunk starts) after it, over the
    budget; a prefix-cache hit that ends inside one is continued to its end."""
    sched = make_scheduler(max_batch_prefill_tokens=6)
    req = make_request("a", 30)
    req.images = [_Span(4, 14), _Span(20, 22)]
    sched.add(req)
    chunks = [scheduled(run_step(sched))["a"] for _ in range(5)]
    assert chunks == [4, 10, 6, 6, 4]  # 0-4 | the image 4-14 | 14-20 | 20-26 (the second image) | 26-30
    from pytgi.engine.scheduling.scheduler import whole_images

    assert whole_images(req, 8, 3) == 6  # from inside an image (a cache hit): to its end
    assert whole_images(req, 0, 30) == 30  # the whole prompt: nothing to move
    req.images = []
    assert whole_images(req, 0, 5) == 5


# -- clients' pins (SamplingParams.cache_pins: Anthropic's cache_control) ----------------------------
def _drain(sched: Scheduler) -> None:
    while sched.has_work():
        run_step(sched)


def _system_then_traffic(sched: Scheduler) -> Request:
    """A request with a 12-token system prompt pinned for 300 s, then traffic that cycles through
    every unpinned block, then a request with the same system prompt (returned, finished)."""
    system = list(range(100, 112))  # 3 blocks
    sched.add(make_request("a", [*system, 1, 2], max_new_tokens=2, cache_pins=[(12, 300.0)]))
    _drain(sched)
    for i in range(6):  # each takes 4 of the 16 blocks
        sched.add(make_request(f"other{i}", 14, max_new_tokens=2))
        _drain(sched)
    b = make_request("b", [*system, 3], max_new_tokens=1)
    sched.add(b)
    _drain(sched)
    return b


def test_a_pinned_prefix_survives_traffic_that_evicts_everything_else(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("pytgi.engine.scheduling.scheduler.time.monotonic", lambda: now[0])
    sched = make_scheduler(num_blocks=16, prefix_cache_max_pin_seconds=3600.0)
    assert _system_then_traffic(sched).num_cached_tokens == 12
    bm = sched.block_manager
    assert len(bm.pins) == 3 and set(bm.pins.values()) == {400.0}
    now[0] = 400.0  # the pin ends with the step that sees its time
    run_step(sched)
    assert not bm.pins and bm.num_free_blocks == 16


def test_an_unpinned_prefix_is_evicted_by_the_same_traffic():
    sched = make_scheduler(num_blocks=16, prefix_cache_max_pin_seconds=0.0)  # pins are off
    assert _system_then_traffic(sched).num_cached_tokens == 0
    assert not sched.block_manager.pins


def test_a_pin_lasts_at_most_the_servers_limit(monkeypatch):
    monkeypatch.setattr("pytgi.engine.scheduling.scheduler.time.monotonic", lambda: 0.0)
    sched = make_scheduler(prefix_cache_max_pin_seconds=60.0)
    sched.add(make_request("a", list(range(9)), max_new_tokens=1, cache_pins=[(4, 5.0), (8, 3600.0)]))
    _drain(sched)
    assert sorted(sched.block_manager.pins.values()) == [60.0, 60.0]  # the second pin extends the first


def test_pins_give_way_to_a_request_that_needs_their_blocks():
    sched = make_scheduler(num_blocks=16, prefix_cache_max_pin_seconds=3600.0)
    sched.add(make_request("a", 33, max_new_tokens=1, cache_pins=[(32, 3600.0)]))
    _drain(sched)
    assert len(sched.block_manager.pins) == 8  # half the pool: the cap
    big = make_request("big", 60, max_new_tokens=2)  # 15 blocks of 16: waits for no one
    sched.add(big)
    run_step(sched)
    assert big.status is Status.RUNNING and len(sched.block_manager.pins) < 8
    _drain(sched)
    assert big.status is Status.FINISHED


def test_a_pooling_request_is_chunked_then_ends_with_its_answer():
    """An embedding's request (`Request.pool`): its prompt scheduled in chunks beside a generator's
    decodes, and the step that reaches its end gives its answer instead of a token: it finishes
    there, its blocks freed, with no decode."""
    from pytgi.core import protocol as P
    from pytgi.engine.scheduling.step import StepOutput

    sched = make_scheduler(max_batch_prefill_tokens=16)
    gen = make_request("gen", 4, max_new_tokens=8)
    sched.add(gen)
    run_step(sched)
    pool = make_request("emb", 40, max_new_tokens=1)
    pool.pool = P.PoolParams()
    sched.add(pool)
    answers = []
    for _ in range(10):
        out = sched.schedule()
        if not out.scheduled:
            break
        done = {s.request.request_id for s in out.scheduled if s.samples}
        result = StepOutput(
            {r: P.TokenOut(r, 7) for r in done if r != "emb"},
            pooled={"emb": P.PoolOut("emb", b"\0" * 8, 1, 40)} if "emb" in done else {},
        )
        answers += [u for u in sched.update_from_output(out, result) if isinstance(u, P.PoolOut)]
        if answers:
            break
    assert [a.request_id for a in answers] == ["emb"]
    assert pool.status is Status.FINISHED and pool.output_ids == [] and pool.num_computed_tokens == 40
    assert "emb" not in sched.requests and gen.status is Status.RUNNING
    assert len(gen.output_ids) == 4  # the generator decoded in every step the prompt's chunks took


def test_free_cached_blocks_of_a_later_admission_are_not_taken_by_an_earlier_one():
    """Two requests admitted in one step: the second's cached blocks are free and first in the
    eviction order; the first's new blocks must come from elsewhere."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_batch_prefill_tokens=64)
    shared = list(range(100, 108))
    a = make_request("a", shared + [1], max_new_tokens=1)
    sched.add(a)
    run_step(sched)
    x = make_request("x", 20, max_new_tokens=1)
    sched.add(x)
    run_step(sched)
    assert a.status is x.status is Status.FINISHED  # a's blocks are free, cached, first to be evicted
    first = make_request("first", 12, max_new_tokens=1)
    second = make_request("second", shared + [2], max_new_tokens=1)
    sched.add(first)
    sched.add(second)
    assert scheduled(sched.schedule()) == {"first": 12, "second": 1}
    assert second.num_cached_tokens == 8
    assert not set(first.block_table) & set(second.block_table)  # (until 2026-12-07 they shared two)
