"""The prefix cache's disk tier under the real engine: blocks read back after a restart or after the
KV pool evicted them give the output a cold run gives, the restored bits equal a recomputation's
(`--prefix-cache-verify-rate`), and another model's files are never used."""

from __future__ import annotations

import pytest

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.scheduling.request import Request
from tests.model.tiny_llama import tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"), max_positions=256)


@pytest.fixture(scope="module")
def tiny_gemma4(tmp_path_factory):
    """test_tiny_models' Gemma 4 (caches of two shapes, two layers reading others' caches)."""
    from tests.model.test_tiny_models import save_tiny_gemma4

    return save_tiny_gemma4(tmp_path_factory.mktemp("gemma4"))


def generate(engine: LLMEngine, prompt: list[int], n: int = 6) -> tuple[list[int], int, int]:
    """Greedy tokens, and the cached and disk-read prompt tokens."""
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=n, temperature=0))
    tokens, last = [], None
    while engine.has_unfinished():
        for u in engine.step():
            tokens.append(u.token_id)
            last = u
    assert last is not None
    return tokens, last.num_cached_tokens, last.num_disk_tokens


def engine_for(model, cache_dir=None, **kw) -> LLMEngine:
    kw = {"max_batch_total_tokens": 512, "block_size": 4, "progress": False, **kw}
    return LLMEngine(EngineConfig(model=str(model), prefix_cache_dir=cache_dir and str(cache_dir), **kw))


PROMPT = [(i * 37) % 120 + 3 for i in range(90)]


def test_a_restart_reads_the_prefix_back_and_the_output_is_the_cold_ones(tiny, tmp_path):
    cold = engine_for(tiny)
    want = generate(cold, PROMPT + [5, 6])[0]
    cold.shutdown()
    first = engine_for(tiny, tmp_path)
    assert generate(first, PROMPT)[1:] == (0, 0)
    first.shutdown()  # the writes in flight land first
    second = engine_for(tiny, tmp_path, prefix_cache_verify_rate=1.0)
    tokens, cached, disk = generate(second, PROMPT + [5, 6])
    stats = second.disk.stats
    second.shutdown()
    assert tokens == want
    assert cached == disk == 84  # 22 blocks of 4 on disk, the last one recomputed to check it
    assert stats.verified_blocks == 1 and stats.verify_mismatches == 0 and stats.read_blocks == 21


def test_gemma4_caches_of_two_shapes_and_shared_layers_come_back_from_disk(tiny_gemma4, tmp_path):
    """Each of Gemma 4's own caches is written once (its last layers read earlier layers'), the
    layers' heads differing; read back after a restart they give the cold run's output. (Not bit
    for bit against a recomputation: its sliding layers' prompt chunks past the window are
    attended on the gathered path, whose bits depend on the chunk, as Gemma 3's are at head size 16.)"""
    cold = engine_for(tiny_gemma4)
    want = generate(cold, PROMPT + [5, 6])[0]
    cold.shutdown()
    first = engine_for(tiny_gemma4, tmp_path)
    assert generate(first, PROMPT)[1:] == (0, 0)
    nbytes = first.disk.pool.nbytes
    first.shutdown()
    # layers 0-3 own a cache: 2 × (2 heads × 16 + 1 × 32 + 2 × 16 + 1 × 32) values a slot, 4 slots a block
    assert nbytes == 2 * 128 * 4 * 2  # bf16
    second = engine_for(tiny_gemma4, tmp_path)
    tokens, cached, disk = generate(second, PROMPT + [5, 6])
    stats = second.disk.stats
    second.shutdown()
    assert tokens == want
    assert cached == disk == 88 and stats.read_blocks == 22


def test_blocks_the_pool_evicted_come_back_from_disk(tiny, tmp_path):
    engine = engine_for(tiny, tmp_path, max_batch_total_tokens=128)  # 32 blocks
    want = generate(engine, PROMPT)[0]
    for k in range(3):  # other prompts take the pool's blocks
        generate(engine, [(i * 11 + k) % 120 + 3 for i in range(100)])
    engine.disk.drain()
    probe = Request("probe", PROMPT, SamplingParams(max_new_tokens=1))
    assert engine.block_manager.cached_prefix(probe) == []  # not in the pool any more
    tokens, cached, disk = generate(engine, PROMPT)
    engine.shutdown()
    assert tokens == want and cached == disk == 88


def test_another_models_files_are_not_used(tiny, tmp_path, tmp_path_factory):
    engine = engine_for(tiny, tmp_path)
    generate(engine, PROMPT)
    engine.shutdown()
    other = engine_for(tiny_llama(tmp_path_factory.mktemp("other"), seed=1, max_positions=256), tmp_path)
    assert not other.disk.files
    assert generate(other, PROMPT)[1:] == (0, 0)
    other.shutdown()
    again = engine_for(tiny, tmp_path, dtype="float32")  # the same model, other KV bits
    assert not again.disk.files
    again.shutdown()


def test_the_default_models_restored_blocks_equal_recomputed_ones_bit_for_bit(tmp_path):
    """The CPU's kernels are batch invariant: a block computed inside a long prefill and the same block
    computed at the head of a short one have the same bits, which is what a checked read compares."""
    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    engine = LLMEngine(EngineConfig(prefix_cache_dir=str(tmp_path), progress=False))
    want = generate(engine, prompt)[0]
    engine.shutdown()
    engine = LLMEngine(
        EngineConfig(prefix_cache_dir=str(tmp_path), prefix_cache_verify_rate=1.0, progress=False)
    )
    tokens, cached, disk = generate(engine, prompt)
    stats = engine.disk.stats
    engine.shutdown()
    assert tokens == want and cached == disk == 272  # 18 blocks of 16 read, the 19th recomputed
    assert stats.verified_blocks == 1 and stats.verify_mismatches == 0
