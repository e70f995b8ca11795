from pytgi.engine.kv.blocks import BlockManager
from tests.unit.helpers import make_request


def test_allocate_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request("a", 10)
    assert bm.allocate(req, 10)
    assert len(req.block_table) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in req.block_table)
    bm.free(req)
    assert bm.num_free_blocks == 8 and req.block_table == []


def test_allocate_refuses_without_changing_anything():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_request("a", 12)
    assert not bm.allocate(req, 12)
    assert bm.num_free_blocks == 2 and req.block_table == []


def test_decode_grows_block_table_only_at_block_boundary():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request("a", 4)
    assert bm.allocate(req, 4)
    req.num_computed_tokens = 4
    req.append_token(9)
    assert bm.blocks_needed(req, 1) == 1
    assert bm.allocate(req, 1)
    assert len(req.block_table) == 2
    req.num_computed_tokens = 5
    req.append_token(9)
    assert bm.blocks_needed(req, 1) == 0


def _computed(bm: BlockManager, req, n: int) -> None:
    assert bm.allocate(req, n)
    req.num_computed_tokens += n
    bm.cache_full_blocks(req)


def test_prefix_reuse_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(100, 110)))  # 2 full blocks + 2 tokens
    _computed(bm, a, 10)
    b = make_request("b", list(range(100, 108)) + [1, 2, 3])  # shares the 2 full blocks
    cached = bm.cached_prefix(b)
    assert cached == a.block_table[:2]
    assert bm.allocate(b, b.num_tokens - 8, cached)
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in cached] == [2, 2]
    assert bm.hit_rate == 8 / (10 + 11)


def test_prefix_lookup_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(100, 108)))
    _computed(bm, a, 8)
    same = make_request("b", list(range(100, 108)))
    assert len(bm.cached_prefix(same)) == 1  # the last block is recomputed for its logits


def test_prefix_differs_after_first_block_stops_the_chain():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _computed(bm, a, 9)
    b = make_request("b", [1, 2, 3, 4, 0, 6, 7, 8, 9])
    assert bm.cached_prefix(b) == a.block_table[:1]
    # the same second block after a different first block is a different chain
    c = make_request("c", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.cached_prefix(c) == []


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(100, 109)))  # blocks: 2 full + 1 partial
    _computed(bm, a, 9)
    first, second = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_request("b", list(range(100, 109)))
    assert bm.cached_prefix(b) == [first, second]  # still cached after free
    # Never-used and unhashed blocks go first, then the chain's tail before its head.
    x = make_request("x", [50] * 8)
    assert bm.allocate(x, 8)
    assert bm.cached_prefix(b) == [first, second]
    z = make_request("z", [60] * 4)
    assert bm.allocate(z, 4)
    assert bm.cached_prefix(b) == [first]
    bm.free(x)
    bm.free(z)
    y = make_request("y", [60] * 16)
    assert bm.allocate(y, 16)  # every block, so the whole cache is evicted
    assert bm.cached_prefix(b) == []


def test_claiming_a_free_cached_block_counts_against_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(100, 109)))
    _computed(bm, a, 9)
    bm.free(a)
    b = make_request("b", list(range(100, 112)))
    cached = bm.cached_prefix(b)
    assert len(cached) == 2
    assert bm.blocks_needed(b, 4, cached) == 3  # two claimed from the free list, one new
    assert bm.allocate(b, 4, cached)
    assert bm.num_free_blocks == 0


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(100, 109)))
    _computed(bm, a, 9)
    assert bm.cached_prefix(make_request("b", list(range(100, 109)))) == []


def test_prompt_logprob_requests_skip_the_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(100, 109)))
    _computed(bm, a, 9)
    b = make_request("b", list(range(100, 109)), prompt_logprobs=True)
    assert bm.cached_prefix(b) == []


# -- pins (Anthropic's cache_control) ----------------------------------------------------------------
def _pinned_chain(bm: BlockManager, prompt: list[int], until: float) -> tuple[list[int], list[int]]:
    """A request computes `prompt`, pins its full blocks and finishes: (its blocks, their hashes)."""
    req = make_request("p", prompt)
    _computed(bm, req, len(prompt))
    hashes = bm.chain_hashes(req, len(prompt) // bm.block_size)
    assert bm.pin(hashes, until) == len(hashes)
    blocks = list(req.block_table)
    bm.free(req)
    return blocks, hashes


def test_a_pinned_block_outlives_eviction_until_it_expires():
    bm = BlockManager(num_blocks=6, block_size=4)
    blocks, _ = _pinned_chain(bm, list(range(100, 108)), until=10.0)
    assert bm.num_free_blocks == 4 and all(bm.ref_counts[b] == 1 for b in blocks)
    churn = make_request("churn", 16)  # takes every unpinned block, evicting what they cached
    _computed(bm, churn, 16)
    bm.free(churn)
    later = make_request("later", [*range(100, 108), 1])
    assert bm.cached_prefix(later) == blocks  # the pinned prefix survived
    bm.expire_pins(9.9)
    assert len(bm.pins) == 2
    bm.expire_pins(10.0)
    assert not bm.pins and bm.num_free_blocks == 6
    assert bm.cached_prefix(later) == blocks  # unpinned, still cached until evicted


def test_a_later_pin_extends_and_never_shortens():
    bm = BlockManager(num_blocks=8, block_size=4)
    blocks, hashes = _pinned_chain(bm, list(range(8)), until=10.0)
    bm.pin(hashes[:1], 50.0)
    bm.pin(hashes, 5.0)
    assert bm.pins == {blocks[0]: 50.0, blocks[1]: 10.0}
    assert bm.ref_counts[blocks[0]] == 1  # one reference per pinned block, however often pinned


def test_pins_stop_at_the_first_uncached_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    _, hashes = _pinned_chain(bm, list(range(4)), until=10.0)
    assert bm.pin([*hashes, 12345, hashes[0]], 20.0) == 1


def test_pins_take_at_most_half_the_pool_the_sooner_ending_give_way():
    bm = BlockManager(num_blocks=8, block_size=4)  # at most 4 pinned
    first, _ = _pinned_chain(bm, list(range(16)), until=10.0)
    req = make_request("second", list(range(200, 208)))
    _computed(bm, req, 8)
    second = bm.chain_hashes(req, 2)
    assert bm.pin(second, until=20.0) == 2
    assert set(bm.pins) == {*first[:2], *req.block_table}  # the first chain's tail gave way
    assert bm.pin(second, until=5.0) == 2  # already pinned: extends nothing, displaces nothing
    bm.free(req)
    short = make_request("short", list(range(300, 304)))
    _computed(bm, short, 4)
    assert bm.pin(bm.chain_hashes(short, 1), until=1.0) == 0  # ends before every pin: not taken
    assert len(bm.pins) == 4


def test_yield_pins_frees_the_soonest_ending_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    blocks, _ = _pinned_chain(bm, list(range(12)), until=10.0)
    assert bm.yield_pins(2)  # asked for 2 more free blocks: the pool had 5, it has 7
    assert list(bm.pins) == blocks[:1] and bm.num_free_blocks == 7
    assert bm.yield_pins(5) and not bm.pins
    assert not bm.yield_pins(1)  # nothing left to give
