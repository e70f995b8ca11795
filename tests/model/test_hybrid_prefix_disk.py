"""The disk tier on a hybrid model (issue 64, point 3): a checkpoint's recurrent states written beside
the block it ends at, read back after a restart or after the RAM checkpoint gave way, give the bits
of a cold prefill (tokens and logprobs). A tiny random Qwen3.5 (three linear-attention layers, one
attention layer; and Qwen3-Next's, with experts), as in test_hybrid_prefix_cache.py."""

from __future__ import annotations

import pytest

from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.kv.disk_tier import STATE_SUFFIX, SUFFIX
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.scheduling.request import Request
from tests.model.test_hybrid_prefix_cache import TURN_1, TURN_2, _cold, _engine
from tests.model.test_qwen3_next import qwen3_5, qwen3_next  # noqa: F401  (fixtures)

OTHER = [(t * 7) % 100 + 1 for t in TURN_1]  # shares no block with TURN_1


def _run(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], list[float], int, int]:
    """Greedy tokens, their logprobs, the cached and the disk-read prompt tokens."""
    engine.add_request(
        f"r{len(engine.scheduler.requests)}-{id(prompt)}", prompt, SamplingParams(8, temperature=0)
    )
    tokens, lps, cached, disk = [], [], 0, 0
    while engine.has_unfinished():
        for u in engine.step():
            if u.token_id >= 0:
                tokens.append(u.token_id)
                lps.append(u.logprob)
            cached, disk = u.num_cached_tokens, u.num_disk_tokens
    return tokens, lps, cached, disk


def _files(engine: LLMEngine, suffix: str) -> list:
    assert engine.disk is not None
    return [p for p in engine.disk.store.dir.rglob("*" + suffix)]


@pytest.mark.parametrize(
    ("model", "dtype"), [("qwen3_5", "float32"), ("qwen3_5", "bfloat16"), ("qwen3_next", "float32")]
)
def test_a_restart_resumes_from_the_states_on_disk(request, tmp_path, model, dtype):
    _, path = request.getfixturevalue(model)
    first = _engine(path, dtype=dtype, prefix_cache_dir=str(tmp_path))
    try:
        assert _run(first, TURN_1)[2:] == (0, 0)
        first.disk.drain()
        states = _files(first, STATE_SUFFIX)
        assert len(states) == len(first.block_manager.checkpoints) == 1  # at 192
        assert first.disk.stats.written_states == 1
        # the states' bytes count in the bound with the blocks'
        on_disk = sum(p.stat().st_size for p in _files(first, SUFFIX) + states)
        assert first.disk.bytes == on_disk
    finally:
        first.shutdown()
    second = _engine(path, dtype=dtype, prefix_cache_dir=str(tmp_path))
    try:
        assert second.disk.state_files and not second.block_manager.checkpoints
        tokens, lps, cached, disk = _run(second, TURN_2)
        assert cached == disk == 192 and second.disk.stats.read_states == 1
        assert second.block_manager.state_restores == 1
    finally:
        second.shutdown()
    cold = _cold(path, TURN_2, dtype=dtype)
    if model == "qwen3_next":  # its experts' matmuls are not batch invariant in float: a hit in RAM
        # is close to a cold prefill, not its bits (test_hybrid_prefix_cache.py's `Exact`); from
        # disk it is the RAM hit's bits
        assert tokens == cold[0] and (tokens, lps) == _ram_hit(path, dtype)
    else:
        assert (tokens, lps) == cold  # to the bit


def _ram_hit(path, dtype: str) -> tuple[list[int], list[float]]:
    """TURN_2's answer resumed from TURN_1's checkpoint in RAM."""
    engine = _engine(path, dtype=dtype)
    try:
        _run(engine, TURN_1)
        tokens, lps, cached, _ = _run(engine, TURN_2)
    finally:
        engine.shutdown()
    assert cached == 192
    return tokens, lps


def test_states_the_ram_gave_up_come_back_from_disk(qwen3_5, tmp_path):  # noqa: F811
    """One checkpoint row: another prompt's checkpoint takes it, the blocks stay in the pool. The
    states alone are read back, into a checkpoint row, and the request resumes there."""
    _, path = qwen3_5
    engine = _engine(path)
    state = engine.runner.state_bytes
    engine.shutdown()
    engine = _engine(path, prefix_cache_dir=str(tmp_path), prefix_cache_state_bytes=state)
    try:
        bm = engine.block_manager
        _run(engine, TURN_1)
        _run(engine, OTHER)
        engine.disk.poll()
        assert len(bm.checkpoints) == 1 and engine.disk.stats.written_states == 2
        tokens, lps, cached, disk = _run(engine, TURN_2)
        assert cached == 192 and disk == 0  # every block was in the pool
        assert engine.disk.stats.read_states == 1
    finally:
        engine.shutdown()
    assert (tokens, lps) == _cold(path, TURN_2)


def test_blocks_and_states_the_pool_evicted_come_back_from_disk(qwen3_5, tmp_path):  # noqa: F811
    """A 384-token KV cache: two other prompts take TURN_1's blocks, and its checkpoint goes with its
    block; without a restart, both come back from disk."""
    _, path = qwen3_5
    engine = _engine(path, prefix_cache_dir=str(tmp_path), max_batch_total_tokens=384)
    try:
        bm = engine.block_manager
        _run(engine, TURN_1)
        for k in (1, 2):
            _run(engine, [(t * 7 + k) % 100 + 1 for t in TURN_1])
        engine.disk.drain()
        assert not bm.hash_to_block.keys() & set(bm.chain_hashes(Request("p", TURN_2, SamplingParams()), 12))
        tokens, lps, cached, disk = _run(engine, TURN_2)
        assert cached == disk == 192 and engine.disk.stats.read_states == 1
    finally:
        engine.shutdown()
    assert (tokens, lps) == _cold(path, TURN_2)


def test_a_bad_states_file_is_dropped_and_the_prefix_computed(qwen3_5, tmp_path):  # noqa: F811
    _, path = qwen3_5
    first = _engine(path, prefix_cache_dir=str(tmp_path))
    _run(first, TURN_1)
    first.shutdown()
    second = _engine(path, prefix_cache_dir=str(tmp_path))
    try:
        (states,) = _files(second, STATE_SUFFIX)
        data = bytearray(states.read_bytes())
        data[-1] ^= 1
        states.write_bytes(bytes(data))
        tokens, lps, cached, _ = _run(second, TURN_2)
        assert cached == 0 and second.disk.stats.dropped_files == 1
        assert second.disk.stats.read_states == 0 and not second.block_manager.state_restores
        second.disk.drain()
        assert len(_files(second, STATE_SUFFIX)) == 2  # TURN_2's own checkpoints (192, 256) written
    finally:
        second.shutdown()
    assert (tokens, lps) == _cold(path, TURN_2)


def test_the_bound_evicts_a_blocks_states_with_it(qwen3_5, tmp_path):  # noqa: F811
    _, path = qwen3_5
    engine = _engine(path, prefix_cache_dir=str(tmp_path))
    try:
        _run(engine, TURN_1)
        engine.disk.drain()
        tier = engine.disk
        (h,) = tier.state_files
        assert tier.files[h] > tier.state_files[h] > 0
        while h in tier.files:  # the least recently used files out, one at a time
            tier.max_bytes = tier.bytes - 1
            tier.drain()
            assert (h in tier.state_files) == (h in tier.files)
        assert tier.bytes == sum(p.stat().st_size for p in _files(engine, SUFFIX))
        assert not _files(engine, STATE_SUFFIX)  # deleted with its block's file
        tier.max_bytes = 0
        tier.drain()
        assert not tier.files and not tier.state_files and tier.bytes == 0
        assert not _files(engine, SUFFIX) and not _files(engine, STATE_SUFFIX)
    finally:
        engine.shutdown()


def test_a_layer_that_attends_too_writes_its_states_alone(tmp_path_factory, tmp_path, monkeypatch):
    """Falcon-H1's layers keep keys and values, then Mamba-2 states: the disk tier writes those
    states (every `StateSpec` of every recurrent layer, whatever the kind), and its blocks the keys
    and values; a restart resumes from them. (Mamba-2 says no state grid here: one is patched in, so
    only the tokens are compared, not the bits; the kind's grid is another change's.)"""
    from pytgi.engine.models.mamba2 import Mamba2Mixer
    from tests.model.test_falcon_h1 import _model

    monkeypatch.setattr(Mamba2Mixer, "state_grid", 64, raising=False)
    _, path = _model(tmp_path_factory, 0)
    first = _engine(path, prefix_cache_dir=str(tmp_path))
    try:
        paged = first.runner.paged
        assert first.disk.state_pool.nbytes == first.runner.state_bytes
        assert first.disk.pool.nbytes == 16 * paged.kv_bytes_per_token()  # a block: 16 tokens
        assert _run(first, TURN_1)[2] == 0
    finally:
        first.shutdown()
    second = _engine(path, prefix_cache_dir=str(tmp_path))
    try:
        tokens, _, cached, disk = _run(second, TURN_2)
        assert cached == disk == 192 and second.disk.stats.read_states == 1
    finally:
        second.shutdown()
    assert tokens == _cold(path, TURN_2)[0]


def test_no_checkpoints_no_disk_tier(qwen3_5, tmp_path):  # noqa: F811
    """Blocks on disk without states would resume nothing: where the prefix cache is off for the model
    (no room for a checkpoint here; a kind without a state grid alike), so is the disk tier."""
    _, path = qwen3_5
    engine = _engine(path, prefix_cache_dir=str(tmp_path), prefix_cache_state_bytes=0)
    try:
        assert engine.disk is None and not engine.info.enable_prefix_caching
        assert _run(engine, TURN_1)[2] == 0
    finally:
        engine.shutdown()
    assert not any(tmp_path.iterdir())
