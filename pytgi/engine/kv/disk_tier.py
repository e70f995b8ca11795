"""The prefix cache's disk tier (`--prefix-cache-dir`): full KV blocks written behind to files named by
their chained hash, read back when a new request's prefix is on disk but not in the KV pool: after the
pool evicted it, or after a restart.

The engine thread keeps the books (`DiskTier`: which hashes are on disk, least recently used first;
the blocks a read fills); two threads do the I/O (`DiskStore`'s files), so a
step never waits for a disk:

- **Writes.** The blocks the prefix cache names for the first time in a step
  (`BlockManager.cache_full_blocks`) are copied out of the pool at the step's end (one gather, a
  memory copy) and handed to the writer thread, which writes each as `<hash>.kv` (a temporary file
  renamed into place). While `WRITE_QUEUE_BYTES` of copies wait for the disk, new blocks are not
  written (a slow disk costs hits, never memory or steps).
- **Reads.** A waiting request whose prefix goes on, past the pool's cached blocks, in files takes
  free blocks for them and waits (`Request.disk`) while the reader thread fills them; the running
  batch goes on stepping meanwhile. The blocks read are named in the prefix cache as if computed, and
  the request is admitted as a cache hit.
- **Trust.** A file starts with a header: format, the fingerprint of everything that makes KV bits
  (the model's files, the dtypes, the block shape, pytgi's engine code), its own hash, the payload's
  length and CRC-32. A file that fails any check is deleted and is a miss, so a torn write or another
  model's file is never read into the pool. With `--prefix-cache-verify-rate p`, a read is checked
  with probability p: its last block is computed instead of restored, and its bits compared with the
  file's (the CPU's kernels are batch invariant, so they must be equal); a mismatch drops the file.
- **Bounds.** `--prefix-cache-disk-bytes`: the least recently used files are deleted past it (a read
  refreshes a file's time, so the order survives a restart).
- **Recurrent states.** A hybrid model's checkpoint (`BlockManager.checkpoint`: the states after a
  block, in a pool row) is written behind too, when it is taken: its request's row is copied out at
  the step's end with the blocks, to `<hash>.state` beside the block file of the hash it ends at
  (written only where that block's file is or goes). It shares its block's place in the books: its
  bytes count with the block's, and it is deleted with it. A read resumes at the longest run of the
  request's blocks, each in the pool or in a file, that ends at a block with states in RAM or on
  disk: the states read go into a checkpoint row (`BlockManager.spare_checkpoint_row`), named a
  checkpoint once the blocks before them are read.

One engine process per directory and model; replicas may share one (each keeps its own view of the
bound). Tensor-parallel ranks each hold a part of a block's KV (and of a state): the tier runs on one
rank only, and is refused with several.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import random
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pytgi.core import protocol as P
from pytgi.core.errors import ConfigError
from pytgi.engine.kv.blocks import BlockManager
from pytgi.engine.scheduling.request import Request

log = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"PYTGI-KV"
# magic, format, fingerprint (16 bytes), block hash (16 bytes), payload bytes, payload CRC-32
HEADER = struct.Struct("<8sI16s16sQI")
SUFFIX = ".kv"
STATE_SUFFIX = ".state"  # a hybrid model's recurrent states after the block of the same hash
MAGICS = {SUFFIX: MAGIC, STATE_SUFFIX: b"PYTGI-ST"}
WRITE_QUEUE_BYTES = 1 << 30  # copies of blocks waiting for the writer, at most


def code_stamp() -> str:
    """A digest of the engine's code (Python, C), whose changes may change KV bits."""
    root = Path(__file__).parent
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(p for ext in ("*.py", "*.c", "*.h") for p in root.rglob(ext)):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def fingerprint(**facts: object) -> bytes:
    """16 bytes naming what a KV block's bits depend on besides its tokens: the facts given, this
    engine's code and the file format."""
    facts = {**facts, "format": FORMAT, "code": code_stamp()}
    return hashlib.blake2b(repr(sorted(facts.items())).encode(), digest_size=16).digest()


class BadFile(Exception):
    """A file that must not be read into the pool (torn, corrupted, another model's)."""


class DiskStore:
    """A fingerprint's directory of block files: `<dir>/<fingerprint>/<hash[:2]>/<hash>.kv`."""

    def __init__(self, root: Path, fp: bytes) -> None:
        self.fp = fp
        self.dir = root / fp.hex()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"--prefix-cache-dir {root}: cannot write there ({exc})") from exc

    def path(self, h: int, suffix: str = SUFFIX) -> Path:
        name = h.to_bytes(16, "little").hex()
        return self.dir / name[:2] / (name + suffix)

    def scan(self) -> list[tuple[int, int, str]]:
        """(hash, bytes, suffix) of the files here, least recently used first; temporary files left by
        a crash are deleted."""
        found = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    if time.time() - entry.stat().st_mtime > 600:  # not a write in progress
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                name, suffix = os.path.splitext(entry.name)
                if suffix not in MAGICS:
                    continue
                try:
                    h = int.from_bytes(bytes.fromhex(name), "little")
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, h, st.st_size, suffix))
        return [(h, size, suffix) for _, h, size, suffix in sorted(found)]

    def write(self, h: int, payload: memoryview, suffix: str = SUFFIX) -> int:
        """Write one block's file, or the states after it (atomically: a temporary file renamed); its
        size."""
        path = self.path(h, suffix)
        path.parent.mkdir(exist_ok=True)
        hb = h.to_bytes(16, "little")
        header = HEADER.pack(MAGICS[suffix], FORMAT, self.fp, hb, payload.nbytes, zlib.crc32(payload))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        return HEADER.size + payload.nbytes

    def read(self, h: int, nbytes: int, suffix: str = SUFFIX) -> bytearray:
        """One block's payload (or its states') of `nbytes`, checked (`BadFile` if any check fails)."""
        path = self.path(h, suffix)
        buf = bytearray(HEADER.size + nbytes)
        try:
            with open(path, "rb") as f:
                got = f.readinto(buf)
                extra = f.read(1)
        except FileNotFoundError as exc:
            raise BadFile("gone") from exc
        if got != len(buf) or extra:
            raise BadFile(f"{got} bytes, expected {len(buf)}")
        magic, fmt, fp, hb, length, crc = HEADER.unpack_from(buf)
        if magic != MAGICS[suffix] or fmt != FORMAT or length != nbytes:
            raise BadFile("not this format")
        if fp != self.fp or hb != h.to_bytes(16, "little"):
            raise BadFile("another model's or another block's")
        payload = memoryview(buf)[HEADER.size :]
        if zlib.crc32(payload) != crc:
            raise BadFile("checksum mismatch (a torn or corrupted write)")
        return buf

    def touch(self, h: int) -> None:
        """Mark a file used now: a restart reads the files back least recently used first."""
        with contextlib.suppress(OSError):
            os.utime(self.path(h))

    def delete(self, h: int, suffixes: Sequence[str] = (SUFFIX, STATE_SUFFIX)) -> None:
        for suffix in suffixes:
            self.path(h, suffix).unlink(missing_ok=True)


class PoolRows:
    """Copies rows between pool tensors (each indexed by row on its first axis) and CPU tensors of
    shape (rows, bytes): a row's bytes in each tensor, one tensor after another."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.sizes = [t[0].nbytes for t in self.tensors]
        self.device = self.tensors[0].device
        self.nbytes = sum(self.sizes)

    def gather(self, blocks: Sequence[int]) -> torch.Tensor:
        idx = torch.tensor(blocks, device=self.device)
        rows = [t.index_select(0, idx).view(len(blocks), -1).view(torch.uint8) for t in self.tensors]
        return torch.cat(rows, 1).cpu()

    def scatter(self, blocks: Sequence[int], data: torch.Tensor) -> None:
        idx = torch.tensor(blocks, device=self.device)
        data = data.to(self.device)
        for t, part in zip(self.tensors, data.split(self.sizes, 1)):
            t.index_copy_(0, idx, part.contiguous().view(t.dtype).view(len(blocks), *t.shape[1:]))

    def as_bytes(self, block: torch.Tensor) -> memoryview:
        return memoryview(block.contiguous().numpy()).cast("B")  # type: ignore[arg-type]

    def from_bytes(self, buf: bytearray) -> torch.Tensor:
        return torch.frombuffer(buf, dtype=torch.uint8, offset=HEADER.size)


def pool_blocks(kv_caches: Sequence[tuple[torch.Tensor, ...]], block_size: int) -> PoolRows:
    """The KV pool's whole blocks as rows (one K and one V tensor per layer, `block_size` slots a
    block). Each tensor once: a layer reading another layer's cache (Gemma 4) adds none, and the
    layers' heads may differ; a value cache without columns (MLA's: its values are its keys' rows)
    holds nothing to copy."""
    distinct = {t.data_ptr(): t for kv in kv_caches for t in kv if t.numel()}
    return PoolRows([t.view(-1, block_size, *t.shape[1:]) for t in distinct.values()])


@dataclass(eq=False)
class _Read:
    """One request's read: the blocks it took, the files' hashes, the last file kept aside to check;
    a hybrid's: the states after its last block (their hash and the checkpoint row they go to), and
    the cached blocks among its blocks, held while it reads."""

    request: Request
    blocks: list[int]
    hashes: list[int]
    check: int | None = None  # the hash of a file to compare with its block once recomputed
    state: tuple[int, int] | None = None  # (hash, checkpoint row) of the states to read
    held: list[int] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    state_ok: bool = False
    check_data: torch.Tensor | None = None
    bad: list[tuple[int, str]] = field(default_factory=list)
    bad_state: str = ""


@dataclass(eq=False)
class _Write:
    hashes: list[int]
    data: torch.Tensor | None  # the blocks' copies, in the pool's layout
    sizes: list[int] = field(default_factory=list)  # 0: not written
    error: str | None = None
    state_hashes: list[int] = field(default_factory=list)  # a hybrid's checkpoints
    state_data: torch.Tensor | None = None  # their states' copies
    state_sizes: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Delete:
    """A file to delete: a block's (and the states after it), or only the states."""

    hash: int
    suffixes: tuple[str, ...] = (SUFFIX, STATE_SUFFIX)


# a thread's jobs: a read, a write, a deletion, a barrier to set, None to stop
_Job = _Read | _Write | _Delete | threading.Event | None


class DiskTier:
    """`states`: a hybrid model's recurrent state tensors (`PagedModel.state_tensors`), whose rows
    at a checkpoint are written beside the block the checkpoint ends at (docs/prefix-cache.md)."""

    def __init__(
        self,
        root: str | Path,
        max_bytes: int,
        fp: bytes,
        block_manager: BlockManager,
        kv_caches: Sequence[tuple[torch.Tensor, ...]],
        verify_rate: float = 0.0,
        states: Sequence[torch.Tensor] = (),
    ) -> None:
        self.store = DiskStore(Path(root), fp)
        self.bm = block_manager
        self.pool = pool_blocks(kv_caches, block_manager.block_size)
        self.state_pool = PoolRows(states) if states else None
        self.max_bytes = max_bytes
        self.verify_rate = verify_rate
        self.rng = random.Random(0)
        # hash → bytes of its block's file and of the states after it, least recently used first
        self.files: OrderedDict[int, int] = OrderedDict()
        self.state_files: dict[int, int] = {}  # hash → bytes of the states' file (its block's is in files)
        self.bytes = 0
        state_files = []
        for h, size, suffix in self.store.scan():
            if suffix == SUFFIX:
                self.files[h] = size
                self.bytes += size
            else:
                state_files.append((h, size))
        for h, size in state_files:  # in the books with their block, in its place in the order
            if self.state_pool is not None and h in self.files:
                self.files[h] += size
                self.state_files[h] = size
                self.bytes += size
            else:  # states without their block, or a model whose states this is not
                self.store.delete(h, (STATE_SUFFIX,))
        self.writing: set[int] = set()  # hashes being written
        self.writing_states: set[int] = set()
        self.queued_bytes = 0  # of the copies waiting for the writer
        self.to_write: list[tuple[int, int]] = []  # this step's new (block, hash), copied by `submit`
        self.states_to_write: list[tuple[int, int]] = []  # this step's checkpoints: (state row, hash)
        self.checks: OrderedDict[int, torch.Tensor] = OrderedDict()  # hash → a file's block to compare
        self.loaded: list[int] = []  # blocks read this step, held until the admissions are planned
        self.stats = P.DiskCacheStats()
        self._jobs: dict[str, queue.Queue[_Job]] = {
            "read": queue.Queue(),
            "write": queue.Queue(),
        }
        self._done: queue.Queue[_Read | _Write] = queue.Queue()
        self._finished = threading.Event()  # set when a job is done
        self.reads = 0  # reads in flight
        self._threads = [
            threading.Thread(target=self._serve, args=(q,), name=f"kv-disk-{name}", daemon=True)
            for name, q in self._jobs.items()
        ]
        for t in self._threads:
            t.start()
        self._evict()
        log.info(
            "prefix cache on disk: %s, %d blocks, %d with states (%.2f GiB of %.2f GiB)",
            self.store.dir,
            len(self.files),
            len(self.state_files),
            self.bytes / 2**30,
            max_bytes / 2**30,
        )

    # -- the engine thread ------------------------------------------------------------------------
    def start_read(self, req: Request, num_cached: int, free: int, keep: Collection[int]) -> int:
        """Read the request's next blocks after its `num_cached` cached ones, those on disk, into
        free blocks (at most `free`, none of `keep`); the blocks taken. The request waits
        (`req.disk`) until `poll` has them."""
        req.disk = "done"
        last = (req.num_tokens - 1) // self.bm.block_size  # a token is left to compute
        if self.state_pool is not None:
            return self._start_state_read(req, num_cached, free, keep, last)
        hashes = []
        for h in self.bm.chain_hashes(req, last)[num_cached:]:
            if h not in self.files:
                break
            hashes.append(h)
        if not hashes:
            return 0
        for h in reversed(hashes):  # a chain's head used last: the tail is evicted first
            self.files.move_to_end(h)
        check = hashes.pop() if self.rng.random() < self.verify_rate else None
        hashes = hashes[: max(0, free)]
        blocks = self.bm.take_free(len(hashes), keep)
        hashes = hashes[: len(blocks)]
        if not hashes and check is None:
            return 0
        req.disk = "reading"
        self.reads += 1
        self._jobs["read"].put(_Read(req, blocks, hashes, check))
        return len(blocks)

    def _start_state_read(
        self, req: Request, num_cached: int, free: int, keep: Collection[int], last: int
    ) -> int:
        """A hybrid's read: its prefix resumes only where the states after it are known. The longest
        run of its blocks past its `num_cached` (which end at a checkpoint in RAM), each cached in RAM
        or on disk, up to the last one with a checkpoint in RAM or states on disk: the blocks on disk
        alone are read into free blocks, the states (if on disk alone) into a checkpoint row, and the
        cached blocks among them are held meanwhile. (No checked reads: a block recomputed in place of
        its file would need the states before it, which a checkpoint is not kept for.)"""
        bm = self.bm
        chain = bm.chain_hashes(req, last)
        ends = []  # where the run could end: a block with states after it
        for i in range(num_cached, len(chain)):
            h = chain[i]
            if h not in bm.hash_to_block and h not in self.files:
                break
            if h in bm.checkpoints or h in self.state_files:
                ends.append(i + 1)
        for end in reversed(ends):  # the longest run whose reads fit in the free blocks
            run = chain[num_cached:end]
            held = [bm.hash_to_block[h] for h in run if h in bm.hash_to_block]
            hashes = [h for h in run if h not in bm.hash_to_block]
            taken = len(hashes) + sum(1 for b in held if bm.ref_counts[b] == 0)
            if taken <= free:
                break
        else:
            return 0
        row = None
        if chain[end - 1] not in bm.checkpoints:
            kept = {bh for b in keep if (bh := bm.block_hash[b]) is not None}
            row = bm.spare_checkpoint_row(kept)
            if row is None:  # every row is in use now: the request computes its prefix
                return 0
        elif not hashes:
            return 0  # (the RAM prefix ends at its checkpoint already)
        for block in held:  # before taking free blocks: those must not be these
            bm.hold(block)
        blocks = bm.take_free(len(hashes), keep)
        if len(blocks) < len(hashes):  # (cannot happen: `free` counts them)
            for block in held + blocks:
                bm.release(block)
            if row is not None:
                bm.free_checkpoints.append(row)
            return 0
        for h in reversed(run):  # a chain's head used last: the tail is evicted first
            if h in self.files:
                self.files.move_to_end(h)
        state = None if row is None else (chain[end - 1], row)
        req.disk = "reading"
        self.reads += 1
        self._jobs["read"].put(_Read(req, blocks, hashes, state=state, held=held))
        return taken

    def offer(self, added: Sequence[tuple[int, int]]) -> None:
        """Blocks the prefix cache named now: written behind unless on disk (checked first if a read
        kept their file aside)."""
        for block, h in added:
            expected = self.checks.pop(h, None)
            if expected is not None:
                self._verify(block, h, expected)
            if h in self.files or h in self.writing:
                continue
            if self.queued_bytes >= WRITE_QUEUE_BYTES:
                self.stats.write_skipped += 1
                continue
            self.writing.add(h)
            self.queued_bytes += self.pool.nbytes
            self.to_write.append((block, h))

    def offer_state(self, row: int, h: int) -> None:
        """A hybrid's checkpoint taken now, its states in pool row `row` until the next step: written
        behind beside the block of hash `h` (after its block's file: states alone are no use)."""
        if self.state_pool is None or h in self.state_files or h in self.writing_states:
            return
        if h not in self.files and h not in self.writing:
            return  # its block is not on disk (nor going)
        if self.queued_bytes >= WRITE_QUEUE_BYTES:
            self.stats.write_skipped += 1
            return
        self.writing_states.add(h)
        self.queued_bytes += self.state_pool.nbytes
        self.states_to_write.append((row, h))

    def submit(self) -> None:
        """Copy this step's new blocks and states out of the pool for the writer (before a step may
        reuse them)."""
        if not (self.to_write or self.states_to_write):
            return
        job = _Write([], None)
        if self.to_write:
            blocks, hashes = zip(*self.to_write, strict=True)
            job.hashes, job.data = list(hashes), self.pool.gather(blocks)
            self.to_write = []
        if self.states_to_write:
            assert self.state_pool is not None
            rows, hashes = zip(*self.states_to_write, strict=True)
            job.state_hashes, job.state_data = list(hashes), self.state_pool.gather(rows)
            self.states_to_write = []
        self._jobs["write"].put(job)

    def poll(self) -> None:
        """Take the finished reads and writes: reads' blocks named in the prefix cache (held until
        `drop_holds`), written files in the books, the bound kept."""
        self._finished.clear()
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, _Write):
                self._written(job)
            else:
                self.reads -= 1
                self._read(job)
        self._evict()

    def wait(self, timeout: float) -> None:
        """Nothing else to step: wait for a job to finish (a spinning engine thread would slow the
        reader, which needs the interpreter too)."""
        self._finished.wait(timeout)

    def drop_holds(self) -> None:
        """After admission: drop the holds on the blocks read (the requests admitted claimed theirs)."""
        for block in self.loaded:
            self.bm.release(block)
        self.loaded = []

    def drain(self, timeout: float = 30.0) -> None:
        """Finish the reads, writes and deletions queued so far (at shutdown: a restart finds them)."""
        self.submit()
        for _ in range(2):  # the writes, then the deletions their books made past the bound
            for q in self._jobs.values():
                done = threading.Event()
                q.put(done)  # each thread's jobs run in order: once it is set, those before it are done
                done.wait(timeout)
            self.poll()

    def close(self) -> None:
        for q in self._jobs.values():
            q.put(None)

    # -- books --------------------------------------------------------------------------------------
    def _read(self, job: _Read) -> None:
        good = 0  # the files read, a prefix of the job's (a chain ends at its first bad file)
        for block, h, ok in zip(job.blocks, job.hashes, job.ok, strict=True):
            if ok and self.bm.register(block, h):
                self.loaded.append(block)  # held until the admissions are planned
            else:
                self.bm.release(block)  # its file failed, or a computed block has its hash now
            good += ok
        self.loaded += job.held  # (their holds dropped with the blocks read)
        for h, why in job.bad:
            self._drop(h, why)
        self.stats.read_blocks += good
        if job.state is not None:
            h, row = job.state
            if job.bad_state:
                self._drop_state(h, job.bad_state)
            bm = self.bm
            # a checkpoint lives while its block is cached (`BlockManager._forget`)
            if job.state_ok and h in bm.hash_to_block and h not in bm.checkpoints:
                bm.checkpoints[h] = row
                self.stats.read_states += 1
            else:
                bm.free_checkpoints.append(row)
        if job.check is not None and job.check_data is not None:
            self.checks[job.check] = job.check_data
            while len(self.checks) > 64:  # checks whose requests went away
                self.checks.popitem(last=False)
        job.request.disk = "done"
        job.request.num_disk_tokens = good * self.bm.block_size

    def _written(self, job: _Write) -> None:
        sizes = job.sizes or [0] * len(job.hashes)
        self.queued_bytes -= len(job.hashes) * self.pool.nbytes
        for h, size in reversed(list(zip(job.hashes, sizes, strict=True))):
            self.writing.discard(h)
            if size:
                self.files[h] = size
                self.bytes += size
                self.stats.written_blocks += 1
        if job.state_hashes:
            assert self.state_pool is not None
            self.queued_bytes -= len(job.state_hashes) * self.state_pool.nbytes
            sizes = job.state_sizes or [0] * len(job.state_hashes)
            for h, size in zip(job.state_hashes, sizes, strict=True):
                self.writing_states.discard(h)
                if not size:
                    continue
                if h in self.files and h not in self.state_files:
                    self.files[h] += size
                    self.state_files[h] = size
                    self.bytes += size
                    self.stats.written_states += 1
                else:  # its block's file went (evicted, dropped) while the states were written
                    self._jobs["write"].put(_Delete(h, (STATE_SUFFIX,)))
        if job.error:
            self.stats.write_errors += 1
            log.warning("prefix cache: writing %d blocks failed: %s", len(job.hashes), job.error)

    def _verify(self, block: int, h: int, expected: torch.Tensor) -> None:
        if torch.equal(self.pool.gather([block])[0].view(torch.uint8), expected.view(torch.uint8)):
            self.stats.verified_blocks += 1
            return
        self.stats.verify_mismatches += 1
        self._drop(h, "its KV differs from the block recomputed")

    def _drop(self, h: int, why: str) -> None:
        log.warning("prefix cache: dropping %s: %s", self.store.path(h).name, why)
        self.stats.dropped_files += 1
        size = self.files.pop(h, None)
        if size is not None:
            self.bytes -= size
        self.state_files.pop(h, None)
        self._jobs["write"].put(_Delete(h))

    def _drop_state(self, h: int, why: str) -> None:
        """A states' file that failed a check: deleted, its block's file kept."""
        log.warning("prefix cache: dropping %s: %s", self.store.path(h, STATE_SUFFIX).name, why)
        self.stats.dropped_files += 1
        size = self.state_files.pop(h, None)
        if size is not None:
            self.files[h] -= size
            self.bytes -= size
        self._jobs["write"].put(_Delete(h, (STATE_SUFFIX,)))

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self.files:
            h, size = self.files.popitem(last=False)  # a block goes with the states after it
            self.state_files.pop(h, None)
            self.bytes -= size
            self.stats.evicted_files += 1
            self._jobs["write"].put(_Delete(h))  # by the writer thread, in order with the writes
        self.stats.bytes, self.stats.files = self.bytes, len(self.files)

    # -- the I/O threads ----------------------------------------------------------------------------
    def _serve(self, jobs: queue.Queue[_Job]) -> None:
        while (job := jobs.get()) is not None:
            if isinstance(job, _Delete):
                with contextlib.suppress(OSError):
                    self.store.delete(job.hash, job.suffixes)
                continue
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                if isinstance(job, _Write):
                    self._do_write(job)
                else:
                    self._do_read(job)
            except Exception as exc:  # never lose a job's answer: its holds must be dropped
                log.exception("prefix cache I/O failed")
                if isinstance(job, _Write):
                    job.error, job.sizes, job.state_sizes = f"{type(exc).__name__}: {exc}", [], []
                else:
                    job.ok, job.state_ok = [False] * len(job.blocks), False
            self._done.put(job)
            self._finished.set()

    def _do_write(self, job: _Write) -> None:
        data = job.data
        sizes = [0] * len(job.hashes)
        for i in reversed(range(len(job.hashes))):  # a chain's tail first: its head is the newest file
            assert data is not None
            try:
                sizes[i] = self.store.write(job.hashes[i], self.pool.as_bytes(data[i]))
            except OSError as exc:  # a full disk: the rest is not written either
                job.error = f"{type(exc).__name__}: {exc}"
                break
        job.sizes = sizes
        job.state_sizes = [0] * len(job.state_hashes)
        if job.error or job.state_data is None:
            return
        assert self.state_pool is not None
        for i, h in enumerate(job.state_hashes):
            try:
                job.state_sizes[i] = self.store.write(
                    h, self.state_pool.as_bytes(job.state_data[i]), STATE_SUFFIX
                )
            except OSError as exc:
                job.error = f"{type(exc).__name__}: {exc}"
                break

    def _do_read(self, job: _Read) -> None:
        nbytes = self.pool.nbytes
        parts, blocks = [], []
        for block, h in zip(job.blocks, job.hashes, strict=True):
            try:
                buf = self.store.read(h, nbytes)
            except BadFile as exc:
                job.bad.append((h, str(exc)))
                job.ok += [False] * (len(job.blocks) - len(job.ok))  # a chain ends at its first miss
                break
            parts.append(self.pool.from_bytes(buf))
            blocks.append(block)
            job.ok.append(True)
        if parts:
            self.pool.scatter(blocks, torch.stack(parts))
        for h in reversed(job.hashes[: len(parts)]):  # used now, the chain's head last (for a restart)
            self.store.touch(h)
        if job.state is not None and len(parts) == len(job.blocks):  # states after a whole chain
            h, row = job.state
            assert self.state_pool is not None
            try:
                buf = self.store.read(h, self.state_pool.nbytes, STATE_SUFFIX)
            except BadFile as exc:
                job.bad_state = str(exc)
            else:
                self.state_pool.scatter([row], self.state_pool.from_bytes(buf)[None])
                job.state_ok = True
        if job.check is not None and len(parts) == len(job.blocks):
            try:
                job.check_data = self.pool.from_bytes(self.store.read(job.check, nbytes))
            except BadFile as exc:
                job.bad.append((job.check, str(exc)))
