"""Speculative decoding without a model: n-gram drafts, their verification's bookkeeping in the
scheduler (tokens, KV positions, blocks, stops) and the draft length's adaptation."""

from pytgi.core import protocol as P
from pytgi.engine.scheduling.request import Status
from pytgi.engine.scheduling.step import StepOutput
from pytgi.engine.speculation.ngram import Drafter, accepted_prefix
from tests.unit.helpers import make_request
from tests.unit.test_scheduler import make_scheduler


def test_ngram_draft_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    req = make_request("a", [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3])
    # suffix (2, 3) last occurred at 5..6, followed by 5, 6, 2, 3; (3,) too, but the longer match wins
    assert Drafter(4).propose(req, 16) == [5, 6, 2, 3]
    req = make_request("b", [1, 2, 3, 4, 1, 2])
    assert Drafter(3).propose(req, 16) == [3, 4, 1]
    assert Drafter(3).propose(req, 2) == [3, 4]  # the step's spare rows bound it
    assert Drafter(3).propose(make_request("c", [1, 2, 3]), 16) == []  # nothing repeats
    req = make_request("d", [5, 6, 5, 6], max_new_tokens=2)
    assert Drafter(4).propose(req, 16) == [5]  # one token is sampled anyway: max_new_tokens - 1 drafted


def test_a_longer_match_picks_an_older_occurrence_and_a_one_token_match_drafts_little():
    # (1, 2, 3) occurs twice before the suffix; 8, 1, 2, 3 only at the first: its continuation wins
    req = make_request("a", [7, 8, 1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 7, 8, 1, 2, 3])
    assert Drafter(4).propose(req, 16) == [4, 9, 9, 1]
    # only the last token matches (weak evidence): at most WEAK_DRAFT tokens
    req = make_request("b", [5, 1, 2, 3, 4, 5])
    assert Drafter(4).propose(req, 16) == [1, 2]


def test_the_index_grows_with_the_output():
    d, req = Drafter(2), make_request("a", [1, 2, 3])
    assert d.propose(req, 8) == []
    for t in (1, 2):
        req.append_token(t)
    assert d.propose(req, 8) == [3, 1]  # suffix (1, 2) occurred at the start


def test_accepted_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 1]) == 3
    assert accepted_prefix([4], [3, 4]) == 0


def test_draft_length_adapts_to_acceptance():
    d, req = Drafter(4), make_request("a", [1, 2, 1, 2, 1, 2, 1, 2, 1])
    assert len(d.propose(req, 16)) == 4
    d.observe(req, 4, 0)
    assert d.states["a"].length == 2.0
    d.observe(req, 2, 0)
    d.observe(req, 1, 0)
    assert d.states["a"].length == 1.0  # never below one while a match exists
    d.observe(req, 1, 1)
    d.observe(req, 2, 2)
    assert d.states["a"].length == 4.0  # doubled twice
    d.observe(req, 4, 4)
    assert d.states["a"].length == 4.0  # at most k
    d.observe(req, 4, 1)
    assert d.states["a"].length == 2.0  # accepted + 1
    assert (d.states["a"].drafted, d.states["a"].accepted) == (18, 8)


def repeating_request(rid="a", max_new_tokens=16, **kw):
    return make_request(rid, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], max_new_tokens=max_new_tokens, **kw)


def step(sched, sample):
    """One step whose fake model samples `sample(request, row)` for each sampled row; the runner's
    verification (accepted draft prefix plus one) is applied as ModelRunner._sample does."""
    out = sched.schedule()
    res = StepOutput()
    for s in out.scheduled:
        if not s.samples:
            continue
        rid = s.request.request_id
        tokens = [sample(s.request, j) for j in range(len(s.draft) + 1)]
        keep = accepted_prefix(s.draft, tokens)
        res.samples[rid] = P.TokenOut(rid, tokens[0])
        if keep:
            res.more[rid] = [P.TokenOut(rid, t) for t in tokens[1 : keep + 1]]
    return out, sched.update_from_output(out, res)


def test_verified_draft_tokens_advance_the_request_and_its_kv():
    sched = make_scheduler(num_blocks=64, block_size=4, speculate=3)
    req = repeating_request()
    sched.add(req)
    step(sched, lambda r, j: 4)  # prefill: samples 4 (the pattern goes on)
    out, updates = step(sched, lambda r, j: [1, 2, 3, 4][(len(r.all_ids) + j) % 4])  # the model agrees
    assert out.scheduled[0].draft == [1, 2, 3] and out.scheduled[0].num_new_tokens == 4
    assert [u.token_id for u in updates] == [1, 2, 3, 4]  # three accepted, one more sampled
    assert req.output_ids == [4, 1, 2, 3, 4]
    assert req.num_computed_tokens == req.num_tokens - 1  # KV for all but the newest token
    assert len(req.block_table) == sched.block_manager.blocks_for(req.num_tokens)
    assert (sched.spec_drafted, sched.spec_accepted) == (3, 3)


def test_a_rejected_draft_gives_back_its_blocks():
    sched = make_scheduler(num_blocks=64, block_size=4, speculate=3)
    req = repeating_request()
    sched.add(req)
    step(sched, lambda r, j: 4)
    free = sched.block_manager.num_free_blocks
    out, updates = step(sched, lambda r, j: 9)  # the model disagrees at once
    assert len(out.scheduled[0].draft) == 3
    assert [u.token_id for u in updates] == [9]
    assert req.num_computed_tokens == 12 and req.num_tokens == 13
    assert sched.block_manager.num_free_blocks == free - (sched.block_manager.blocks_for(13) - 3)
    assert sched.drafter.states["a"].length == 1.5  # halved
    assert len(step(sched, lambda r, j: 9)[0].scheduled[0].draft) <= 1


def test_a_stop_inside_the_accepted_tokens_ends_the_request_there():
    sched = make_scheduler(speculate=4)
    req = repeating_request(max_new_tokens=3)
    sched.add(req)
    step(sched, lambda r, j: 4)
    out, updates = step(sched, lambda r, j: [1, 2, 3, 4][(len(r.all_ids) + j) % 4])
    assert len(out.scheduled[0].draft) == 1  # max_new_tokens bounds the draft: 2 left, one sampled
    assert [u.token_id for u in updates] == [1, 2] and updates[-1].finish_reason == "length"
    assert updates[-1].num_skipped == 1
    assert req.status is Status.FINISHED and sched.block_manager.num_free_blocks == 64
    eos = make_request("e", [1, 2, 3, 4, 1, 2, 3], max_new_tokens=16)
    eos.eos_token_ids = frozenset({3})
    sched.add(eos)
    step(sched, lambda r, j: 4)
    out, updates = step(sched, lambda r, j: [1, 2, 3, 4][(len(r.all_ids) + j) % 4])
    assert out.scheduled[0].draft == [1, 2, 3, 4]
    assert [u.token_id for u in updates] == [1, 2, 3]  # all four confirmed, but 3 is EOS: the rest is dropped
    assert updates[-1].finish_reason == "eos_token" and eos.status is Status.FINISHED


def test_no_drafts_for_big_batches_grammars_or_without_speculate():
    sched = make_scheduler(speculate=2, max_batch_size=32, max_batch_prefill_tokens=1024, num_blocks=256)
    for i in range(20):
        sched.add(repeating_request(f"r{i}"))
    step(sched, lambda r, j: 4)
    out, _ = step(sched, lambda r, j: 1)
    drafted = sum(len(s.draft) for s in out.scheduled)
    assert len(out.scheduled) == 20 and drafted == 0  # 20 decodes already exceed the rows worth verifying
    sched = make_scheduler(speculate=2)
    req = repeating_request()
    req.speculative = False  # a grammar or a watermark
    sched.add(req)
    step(sched, lambda r, j: 4)
    assert step(sched, lambda r, j: 1)[0].scheduled[0].draft == []
    sched = make_scheduler()
    sched.add(repeating_request())
    step(sched, lambda r, j: 4)
    assert step(sched, lambda r, j: 1)[0].scheduled[0].draft == []


class FakeProposer:
    """A draft model stand-in: records the scheduler's calls."""

    def __init__(self, draft):
        self.draft, self.calls, self.released, self.observed = draft, [], [], []

    def propose_batch(self, reqs, spare):
        self.calls.append(([r.request_id for r in reqs], spare))
        return [self.draft[:spare] for _ in reqs]

    def observe(self, req, drafted, accepted):
        self.observed.append((req.request_id, drafted, accepted))

    def release(self, req):
        self.released.append(req.request_id)


def test_a_proposer_drafts_for_the_steps_decodes_and_hears_of_their_end():
    fake = FakeProposer([7, 7, 7])
    sched = make_scheduler(num_blocks=64, block_size=4)
    sched = type(sched)(sched.config, sched.block_manager, watermark=0.0, drafter=fake)
    a, b = repeating_request("a", max_new_tokens=3), repeating_request("b", max_new_tokens=16)
    for r in (a, b):
        sched.add(r)
    step(sched, lambda r, j: 4)  # prefills: no drafts
    assert fake.calls == []
    out, _updates = step(sched, lambda r, j: 7)  # every draft token confirmed
    assert fake.calls == [(["a", "b"], 14)]  # 16 rows less the two decodes
    assert [len(s.draft) for s in out.scheduled] == [3, 3]
    assert ("a", 3, 3) in fake.observed and ("b", 3, 3) in fake.observed
    assert a.status is Status.FINISHED and fake.released == ["a"]  # max_new_tokens inside the draft
    sched.finish(b)  # an abort
    assert fake.released == ["a", "b"]
