"""The prefix cache's disk tier with no model (`pytgi.engine.kv.disk_tier`): the scheduler over a KV pool
of plain tensors that a fake forward fills with a function of each token and position, so a block
read back from disk can be checked value for value."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig
from pytgi.core.errors import ConfigError
from pytgi.engine.kv import disk_tier as kv_disk
from pytgi.engine.kv.blocks import root_hash
from pytgi.engine.kv.disk_tier import HEADER, BadFile, DiskStore, DiskTier, fingerprint
from pytgi.engine.scheduling.request import Request, Status
from pytgi.engine.scheduling.step import StepOutput
from tests.unit.helpers import make_request
from tests.unit.test_scheduler import make_scheduler

BS, LAYERS, HEADS, DIM = 4, 2, 2, 3
FP = b"model-A-16-bytes"


def pool(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        tuple(torch.zeros(2, num_blocks * BS, HEADS, DIM, dtype=torch.bfloat16).unbind(0))  # type: ignore[misc]
        for _ in range(LAYERS)
    ]


def kv_value(token: int, position: int, layer: int) -> float:
    return float((token * 7 + position * 3 + layer) % 251)


def tier_for(root: Path, num_blocks=64, fp=FP, max_bytes=2**30, verify_rate=0.0, **kw):
    sched = make_scheduler(num_blocks=num_blocks, block_size=BS, **kw)
    kv = pool(num_blocks)
    tier = DiskTier(root, max_bytes, fp, sched.block_manager, kv, verify_rate)
    sched.disk = tier
    return sched, tier, kv


def step(sched, kv, next_token: int = 7):
    """One step: a fake forward writes each computed token's keys and values, then samples."""
    out = sched.schedule()
    if out.is_empty and sched.disk.reads:
        sched.disk.wait(5.0)
    for s in out.scheduled:
        req = s.request
        for i in range(req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens):
            slot = req.block_table[i // BS] * BS + i % BS
            for layer, (k, v) in enumerate(kv):
                k[slot] = kv_value(req.all_ids[i], i, layer)
                v[slot] = -kv_value(req.all_ids[i], i, layer)
    samples = {
        s.request.request_id: P.TokenOut(s.request.request_id, next_token) for s in out.scheduled if s.samples
    }
    sched.update_from_output(out, StepOutput(samples))
    return out


def run(sched, kv, req: Request) -> Request:
    if req.request_id not in sched.requests:
        sched.add(req)
    for _ in range(1000):
        if req.status is Status.FINISHED:
            return req
        step(sched, kv)
    raise AssertionError("the request did not finish")


def kv_right(kv, req: Request, upto: int) -> bool:
    """The pool holds the request's keys and values for its tokens before `upto`."""
    for i in range(upto):
        slot = req.block_table[i // BS] * BS + i % BS
        for layer, (k, v) in enumerate(kv):
            want = kv_value(req.all_ids[i], i, layer)
            if not (torch.all(k[slot] == want) and torch.all(v[slot] == -want)):
                return False
    return True


def admitted(sched, kv, req: Request):
    """Add the request (unless added) and step until it is admitted: the step that admitted it."""
    if req.request_id not in sched.requests:
        sched.add(req)
    for _ in range(100):
        if req.disk == "reading":
            sched.disk.wait(5.0)
        out = step(sched, kv)
        if any(s.request is req for s in out.scheduled):
            return out
    raise AssertionError("never admitted")


PROMPT = list(range(100, 141))  # 41 tokens: 10 full blocks, the last token left to compute


def first_session(root: Path):
    """A process that computed PROMPT, wrote its 10 blocks and stopped: its scheduler and request."""
    sched, tier, kv = tier_for(root)
    req = run(sched, kv, make_request("a", PROMPT, max_new_tokens=1))
    tier.drain()
    tier.close()
    return sched, req


def test_full_blocks_are_written_behind_then_read_back_after_a_restart(tmp_path):
    sched, tier, kv = tier_for(tmp_path)
    run(sched, kv, make_request("a", PROMPT, max_new_tokens=4))
    tier.drain()
    # the prompt's 10 full blocks, and the one its output filled (41 + 3 computed = 44 tokens)
    assert tier.stats.written_blocks == 11 == len(tier.files) == len(DiskStore(tmp_path, FP).scan())
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not tier.writing  # the writes' holds are gone
    tier.close()

    sched, tier, kv = tier_for(tmp_path)  # a new process: an empty pool, the files found
    assert len(tier.files) == 11
    req = make_request("b", PROMPT + [7, 7, 7, 9], max_new_tokens=2)  # a's output (7s), then more
    out = admitted(sched, kv, req)
    assert req.num_cached_tokens == 44 and req.num_disk_tokens == 44
    assert [s.num_new_tokens for s in out.scheduled] == [1]
    assert kv_right(kv, req, 44)  # the blocks read hold what the forward wrote
    assert tier.stats.read_blocks == 11
    tier.close()


def test_a_request_waits_for_its_blocks_while_the_batch_goes_on(tmp_path):
    first_session(tmp_path)
    sched, tier, kv = tier_for(tmp_path)
    gate = threading.Event()
    read = tier.store.read
    tier.store.read = lambda h, n: (gate.wait(5), read(h, n))[1]
    other = make_request("other", 6, max_new_tokens=50)
    sched.add(other)
    step(sched, kv)
    req = make_request("b", PROMPT, max_new_tokens=3)
    sched.add(req)
    for _ in range(3):  # the decode goes on while b's blocks are read
        out = step(sched, kv)
        assert [s.request.request_id for s in out.scheduled] == ["other"] and req.disk == "reading"
    gate.set()
    admitted(sched, kv, req)
    assert req.num_disk_tokens == 40 and kv_right(kv, req, 40)
    tier.close()


def test_a_torn_or_corrupted_file_is_dropped_and_ends_the_hit(tmp_path):
    sched, req = first_session(tmp_path)
    store = DiskStore(tmp_path, FP)
    hashes = sched.block_manager.chain_hashes(req, 10)
    torn = store.path(hashes[6])
    torn.write_bytes(torn.read_bytes()[:-5])  # a write cut short
    flipped = store.path(hashes[8])
    data = bytearray(flipped.read_bytes())
    data[HEADER.size + 3] ^= 1  # one bit of the payload
    flipped.write_bytes(data)

    sched, tier, kv = tier_for(tmp_path)
    req = make_request("b", PROMPT, max_new_tokens=3)
    admitted(sched, kv, req)
    assert req.num_cached_tokens == 24 and kv_right(kv, req, 24)  # blocks 0-5; 6 was torn
    tier.drain()
    assert tier.stats.dropped_files == 1
    store.read(hashes[6], tier.pool.nbytes)  # dropped, then written again from the block recomputed
    with pytest.raises(BadFile, match="checksum"):  # not read yet: found out when it is
        store.read(hashes[8], tier.pool.nbytes)
    tier.close()


def test_a_file_of_another_model_or_format_is_never_used(tmp_path):
    sched, req = first_session(tmp_path)
    other_fp = b"model-B-16-bytes"
    sched_b, tier_b, kv_b = tier_for(tmp_path, fp=other_fp)
    assert not tier_b.files  # its own directory
    # a file copied under another fingerprint's directory is refused by its header
    h0 = sched.block_manager.chain_hashes(req, 1)[0]
    dst = tier_b.store.path(h0)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(DiskStore(tmp_path, FP).path(h0).read_bytes())
    tier_b.files[h0] = dst.stat().st_size
    reqb = make_request("b", PROMPT, max_new_tokens=3)
    admitted(sched_b, kv_b, reqb)
    tier_b.drain()
    assert reqb.num_cached_tokens == 0 and tier_b.stats.dropped_files == 1
    assert HEADER.unpack_from(dst.read_bytes())[2] == other_fp  # written again, by model B
    tier_b.close()
    # the fingerprint covers what makes the bits, and pytgi's code
    assert fingerprint(model="m", dtype="bf16") != fingerprint(model="m", dtype="f32")
    assert fingerprint(model="m", dtype="bf16") == fingerprint(dtype="bf16", model="m")


def test_the_bound_keeps_the_most_recently_used_files(tmp_path):
    sched, tier, kv = tier_for(tmp_path)
    run(sched, kv, make_request("a", PROMPT, max_new_tokens=1))
    tier.drain()
    size = next(iter(tier.files.values()))
    tier.close()
    sched, tier, kv = tier_for(tmp_path, max_bytes=12 * size)
    first = make_request("b", PROMPT, max_new_tokens=3)
    admitted(sched, kv, first)  # its 10 files are now the most recently used
    run(sched, kv, first)
    run(sched, kv, make_request("c", list(range(500, 521)), max_new_tokens=1))  # 5 new blocks
    tier.drain()
    assert tier.bytes <= 12 * size and tier.stats.evicted_files == 3
    assert len(DiskStore(tmp_path, FP).scan()) == len(tier.files) == 12
    tier.close()
    # a restart keeps the order: the read files outlived older ones
    sched, tier, kv = tier_for(tmp_path, max_bytes=12 * size)
    hashes = sched.block_manager.chain_hashes(make_request("x", PROMPT), 10)
    assert all(h in tier.files for h in hashes[:7])
    tier.close()


def test_checked_reads_compare_a_recomputed_block_bit_for_bit(tmp_path):
    sched, req = first_session(tmp_path)
    sched, tier, kv = tier_for(tmp_path, verify_rate=1.0)
    b = make_request("b", PROMPT, max_new_tokens=3)
    admitted(sched, kv, b)
    assert b.num_cached_tokens == 36  # the tenth block is computed, to compare
    run(sched, kv, b)
    assert tier.stats.verified_blocks == 1 and tier.stats.verify_mismatches == 0
    tier.close()
    # a file whose checksum is right but whose values are not (a bug that wrote wrong KV)
    store = DiskStore(tmp_path, FP)
    h9 = sched.block_manager.chain_hashes(req, 10)[9]
    right = store.path(h9).read_bytes()[HEADER.size :]
    payload = bytearray(right)
    payload[0] ^= 0x40
    store.write(h9, memoryview(payload))
    sched, tier, kv = tier_for(tmp_path, verify_rate=1.0)
    c = make_request("c", PROMPT, max_new_tokens=3)
    admitted(sched, kv, c)
    assert kv_right(kv, c, 36)  # the nine blocks before the one checked were read back right
    run(sched, kv, c)
    tier.drain()
    assert tier.stats.verify_mismatches == 1 and tier.stats.dropped_files == 1
    assert store.path(h9).read_bytes()[HEADER.size :] == right  # rewritten from the recomputed block
    tier.close()


def test_copies_waiting_for_the_disk_are_bounded(tmp_path, monkeypatch):
    sched, tier, kv = tier_for(tmp_path, num_blocks=16)
    monkeypatch.setattr(kv_disk, "WRITE_QUEUE_BYTES", 4 * tier.pool.nbytes)
    gate = threading.Event()
    write = tier.store.write
    tier.store.write = lambda h, p: (gate.wait(5), write(h, p))[1]
    run(sched, kv, make_request("a", PROMPT, max_new_tokens=1))
    assert len(tier.writing) == 4 and tier.stats.write_skipped == 6
    assert sched.block_manager.num_free_blocks == 16  # the copies hold no block
    gate.set()
    tier.drain()
    assert len(tier.files) == 4 and tier.queued_bytes == 0
    tier.close()


def test_chain_hashes_are_the_same_in_every_process():
    code = "from pytgi.engine.kv.blocks import root_hash; print(root_hash(('qv', 'ab12')))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert seen == {str(root_hash(("qv", "ab12")))}


def test_the_disk_tier_settings_are_checked(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot write there"):
        DiskStore(tmp_path / "file", FP)
    with pytest.raises(ConfigError, match="num-shard"):
        EngineConfig(prefix_cache_dir="/tmp/x", num_shard=2).validate()
    with pytest.raises(ConfigError, match="disable-prefix-caching"):
        EngineConfig(prefix_cache_dir="/tmp/x", enable_prefix_caching=False).validate()
    with pytest.raises(ConfigError, match="verify_rate"):
        EngineConfig(prefix_cache_verify_rate=1.5).validate()


def test_stats_cross_the_process_boundary():
    stats = P.EngineStats(0, 0, 0.0, 0.0, 0, 0, disk=P.DiskCacheStats(bytes=5, read_blocks=2))
    back = P.from_engine.decode(P.encoder.encode(P.Heartbeat(stats)))
    assert isinstance(back, P.Heartbeat) and back.stats.disk == stats.disk
    plain = P.from_engine.decode(P.encoder.encode(P.Heartbeat(P.EngineStats(0, 0, 0.0, 0.0, 0, 0))))
    assert plain.stats.disk is None
