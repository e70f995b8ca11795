"""The prefix cache's checkpoints of recurrent states (a hybrid model's), with no model: where the
scheduler cuts a prefill, which checkpoints it keeps and drops, and the row copies a step makes."""

from pytgi.engine.kv.blocks import BlockManager
from pytgi.engine.scheduling.request import Status
from pytgi.engine.scheduling.scheduler import Scheduler
from tests.unit.helpers import make_request, run_step
from tests.unit.test_scheduler import make_scheduler, scheduled

BS = 16  # with the kernel's 64-token grid: a checkpoint every 64 tokens


def hybrid_scheduler(num_blocks=64, state_slots=4, checkpoints=2, **kw) -> Scheduler:
    kw.setdefault("max_batch_prefill_tokens", 512)
    sched = make_scheduler(num_blocks, BS, **kw)
    sched.block_manager = BlockManager(num_blocks, BS, True, state_slots, checkpoints, 64)
    return sched


def test_a_prefill_is_cut_at_its_last_checkpoint_boundary_and_saved_there():
    sched = hybrid_scheduler()
    bm = sched.block_manager
    a = make_request("a", 210, max_new_tokens=2)
    sched.add(a)
    out = run_step(sched)
    assert scheduled(out) == {"a": 192} and not out.state_copies
    assert list(bm.checkpoints.values()) == [4]  # the first row past the running ones
    out = run_step(sched)
    assert scheduled(out) == {"a": 18}
    assert out.state_copies == [(a.state_slot, 4)]  # saved before the next forward
    run_step(sched)
    assert a.status is Status.FINISHED
    # the next turn: the prompt, the answer, more; resumes from the state at 192
    b = make_request("b", a.all_ids + list(range(500, 560)), max_new_tokens=1)
    sched.add(b)
    out = run_step(sched)
    assert b.num_cached_tokens == 192 and scheduled(out) == {"b": 64}  # to the next boundary, 256
    assert out.state_copies == [(4, b.state_slot)]
    assert bm.state_restores == 1


def test_pending_copies_wait_for_a_forward():
    sched = hybrid_scheduler()
    a = make_request("a", 100, max_new_tokens=1)
    sched.add(a)
    run_step(sched)  # 64 tokens, saved after
    slot = a.state_slot
    sched.finish(a)
    out = sched.schedule()
    assert out.is_empty and not out.state_copies
    c = make_request("c", 10)
    sched.add(c)
    out = run_step(sched)
    # the save reads the finished request's row before the new request (given that slot) runs
    assert c.state_slot == slot and out.state_copies == [(slot, 4)]


def test_a_checkpoint_goes_with_its_block_and_the_least_recently_used_gives_way():
    bm = BlockManager(24, BS, True, state_slots=2, checkpoint_slots=2, state_grid=64)

    def prefill(rid, prompt):
        req = make_request(rid, prompt)
        cached = bm.cached_prefix(req)
        assert bm.allocate(req, 64, cached)
        req.num_computed_tokens += 64
        bm.state_step(req, 64)
        bm.cache_full_blocks(req)
        bm.checkpoint(req)
        bm.free(req)
        return req

    reqs = [prefill(rid, 70) for rid in "abc"]  # three checkpoints, two rows: a's gives way
    assert set(bm.checkpoints) == {r.block_hashes[3] for r in reqs[1:]}
    hit = make_request("d", reqs[2].prompt_ids[:64] + [1, 2])
    assert len(bm.cached_prefix(hit)) == 4
    miss = make_request("e", reqs[0].prompt_ids[:64] + [1, 2])
    assert bm.cached_prefix(miss) == []  # a's blocks are cached, its state is not: not a hit
    # a big request takes every free block: the cached blocks are evicted, their checkpoints too
    big = make_request("big", 24 * BS)
    assert bm.allocate(big, 24 * BS)
    assert not bm.checkpoints and sorted(bm.free_checkpoints) == [2, 3]


def test_a_state_off_the_grid_is_not_kept():
    bm = BlockManager(24, BS, True, state_slots=2, checkpoint_slots=2, state_grid=64)
    req = make_request("a", 200)
    assert bm.allocate(req, 40)
    req.num_computed_tokens = 40
    for n in (24, 64):  # 40..64 starts off the grid: so are the states after it
        assert bm.allocate(req, n)
        req.num_computed_tokens += n
        bm.state_step(req, n)
        bm.cache_full_blocks(req)
        bm.checkpoint(req)
    assert req.num_computed_tokens == 128 and not bm.checkpoints
    assert not bm.state_copies
    assert not bm.hash_to_block  # nor their blocks: their KV is not a cold prefill's either


def test_the_shared_prefix_and_pins_are_cut_at_too():
    sched = hybrid_scheduler(checkpoints=4)
    a = make_request("a", 300, max_new_tokens=1)
    sched.add(a)
    run_step(sched)
    run_step(sched)
    # a prompt sharing a's first 150 tokens: 128 of them are a checkpoint boundary
    b = make_request("b", a.prompt_ids[:150] + list(range(700, 850)), max_new_tokens=1)
    sched.add(b)
    assert scheduled(run_step(sched)) == {"b": 128}
    assert scheduled(run_step(sched)) == {"b": 128}  # to 256, the last boundary
    run_step(sched)
    assert b.status is Status.FINISHED
    pinned = make_request("p", 260, max_new_tokens=1, cache_pins=[(70, 60.0)])
    sched.add(pinned)
    assert scheduled(run_step(sched)) == {"p": 64}  # the pin's 70 tokens: 64 on the grid
    assert scheduled(run_step(sched)) == {"p": 192}


def test_prefix_caching_off_keeps_no_checkpoint_and_cuts_on_the_grid_only():
    sched = hybrid_scheduler(max_batch_prefill_tokens=100)
    sched.block_manager = BlockManager(64, BS, False, 4, 2, 64)
    a = make_request("a", 210)
    sched.add(a)
    assert scheduled(run_step(sched)) == {"a": 64}  # 100 tokens: on the grid, 64
    assert scheduled(run_step(sched)) == {"a": 64}
    assert not sched.block_manager.checkpoints and not sched.block_manager.state_copies


def test_a_failed_step_drops_the_checkpoints_it_was_saving():
    sched = hybrid_scheduler()
    bm = sched.block_manager
    a = make_request("a", 100, max_new_tokens=4)
    sched.add(a)
    run_step(sched)  # 64 tokens: a save queued
    assert len(bm.checkpoints) == 1
    out = sched.schedule()
    assert out.state_copies == [(a.state_slot, 4)]
    sched.fail(out, "boom")
    assert not bm.checkpoints and sorted(bm.free_checkpoints) == [4, 5]


def test_a_row_for_states_from_disk_is_never_one_a_copy_or_an_admission_uses():
    """`spare_checkpoint_row` (the disk tier reads states into it, on its thread): a free row, else the
    least recently used checkpoint's; never a row a queued copy reads or writes (the copy would race
    the read, or overwrite it at the next forward), nor the checkpoint after a block a request being
    admitted claims (its restore reads that row)."""
    bm = BlockManager(24, BS, True, state_slots=2, checkpoint_slots=3, state_grid=64)
    bm.state_copies = [(0, 4)]  # a save into row 4 (freed since: its block was evicted)
    bm.free_checkpoints = [3, 4]  # popped from the end: 4 would be next
    assert bm.spare_checkpoint_row(set()) == 3 and bm.free_checkpoints == [4]
    bm.free_checkpoints = []
    bm.checkpoints.update({11: 4, 12: 2, 13: 3})  # least recently used first
    assert bm.spare_checkpoint_row({12}) == 3  # 4 is copied into, 12 kept
    assert list(bm.checkpoints) == [11, 12]
    assert bm.spare_checkpoint_row({12}) is None
    bm.take_state_copies()
    assert bm.spare_checkpoint_row(set()) == 4 and list(bm.checkpoints) == [12]
