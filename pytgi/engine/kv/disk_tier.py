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

One engine process per directory and model; replicas may share one (each keeps its own view of the
bound). Tensor-parallel ranks each hold a part of a block's KV: the tier runs on one rank only.
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

    def path(self, h: int) -> Path:
        name = h.to_bytes(16, "little").hex()
        return self.dir / name[:2] / (name + SUFFIX)

    def scan(self) -> list[tuple[int, int]]:
        """(hash, bytes) of the files here, least recently used first; temporary files left by a
        crash are deleted."""
        found = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    if time.time() - entry.stat().st_mtime > 600:  # not a write in progress
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    h = int.from_bytes(bytes.fromhex(entry.name[: -len(SUFFIX)]), "little")
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, h, st.st_size))
        return [(h, size) for _, h, size in sorted(found)]

    def write(self, h: int, payload: memoryview) -> int:
        """Write one block's file (atomically: a temporary file renamed); its size."""
        path = self.path(h)
        path.parent.mkdir(exist_ok=True)
        hb = h.to_bytes(16, "little")
        header = HEADER.pack(MAGIC, FORMAT, self.fp, hb, payload.nbytes, zlib.crc32(payload))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        return HEADER.size + payload.nbytes

    def read(self, h: int, nbytes: int) -> bytearray:
        """One block's payload of `nbytes`, checked (`BadFile` if any check fails)."""
        path = self.path(h)
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
        if magic != MAGIC or fmt != FORMAT or length != nbytes:
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

    def delete(self, h: int) -> None:
        self.path(h).unlink(missing_ok=True)


class PoolBlocks:
    """Copies whole blocks between the KV pool (one K and one V tensor per layer, `block_size` slots a
    block) and CPU tensors of shape (blocks, bytes): a block's bytes in each tensor, one tensor after
    another in layer order. Each tensor once: a layer reading another layer's cache (Gemma 4) adds
    none, and the layers' heads may differ; a value cache without columns (MLA's: its values are its
    keys' rows) holds nothing to copy."""

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, ...]], block_size: int) -> None:
        distinct = {t.data_ptr(): t for kv in kv_caches for t in kv if t.numel()}
        self.tensors = [t.view(-1, block_size, *t.shape[1:]) for t in distinct.values()]
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


@dataclass(eq=False)
class _Read:
    """One request's read: the blocks it took, the files' hashes, the last file kept aside to check."""

    request: Request
    blocks: list[int]
    hashes: list[int]
    check: int | None = None  # the hash of a file to compare with its block once recomputed
    ok: list[bool] = field(default_factory=list)
    check_data: torch.Tensor | None = None
    bad: list[tuple[int, str]] = field(default_factory=list)


@dataclass(eq=False)
class _Write:
    hashes: list[int]
    data: torch.Tensor  # the blocks' copies, in the pool's layout
    sizes: list[int] = field(default_factory=list)  # 0: not written
    error: str | None = None


# a thread's jobs: a read, a write, a file to delete (its hash), a barrier to set, None to stop
_Job = _Read | _Write | int | threading.Event | None


class DiskTier:
    def __init__(
        self,
        root: str | Path,
        max_bytes: int,
        fp: bytes,
        block_manager: BlockManager,
        kv_caches: Sequence[tuple[torch.Tensor, ...]],
        verify_rate: float = 0.0,
    ) -> None:
        self.store = DiskStore(Path(root), fp)
        self.bm = block_manager
        self.pool = PoolBlocks(kv_caches, block_manager.block_size)
        self.max_bytes = max_bytes
        self.verify_rate = verify_rate
        self.rng = random.Random(0)
        self.files: OrderedDict[int, int] = OrderedDict()  # hash → bytes, least recently used first
        self.bytes = 0
        for h, size in self.store.scan():
            self.files[h] = size
            self.bytes += size
        self.writing: set[int] = set()  # hashes being written
        self.queued_bytes = 0  # of the copies waiting for the writer
        self.to_write: list[tuple[int, int]] = []  # this step's new (block, hash), copied by `submit`
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
            "prefix cache on disk: %s, %d blocks (%.2f GiB of %.2f GiB)",
            self.store.dir,
            len(self.files),
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

    def submit(self) -> None:
        """Copy this step's new blocks out of the pool for the writer (before a step may reuse them)."""
        if self.to_write:
            blocks, hashes = zip(*self.to_write, strict=True)
            self._jobs["write"].put(_Write(list(hashes), self.pool.gather(blocks)))
            self.to_write = []

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
        for h, why in job.bad:
            self._drop(h, why)
        self.stats.read_blocks += good
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
        self._jobs["write"].put(h)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self.files:
            h, size = self.files.popitem(last=False)
            self.bytes -= size
            self.stats.evicted_files += 1
            self._jobs["write"].put(h)  # deleted by the writer thread, in order with the writes
        self.stats.bytes, self.stats.files = self.bytes, len(self.files)

    # -- the I/O threads ----------------------------------------------------------------------------
    def _serve(self, jobs: queue.Queue[_Job]) -> None:
        while (job := jobs.get()) is not None:
            if isinstance(job, int):
                with contextlib.suppress(OSError):
                    self.store.delete(job)
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
                    job.error, job.sizes = f"{type(exc).__name__}: {exc}", []
                else:
                    job.ok = [False] * len(job.blocks)
            self._done.put(job)
            self._finished.set()

    def _do_write(self, job: _Write) -> None:
        data = job.data
        sizes = [0] * len(job.hashes)
        for i in reversed(range(len(job.hashes))):  # a chain's tail first: its head is the newest file
            try:
                sizes[i] = self.store.write(job.hashes[i], self.pool.as_bytes(data[i]))
            except OSError as exc:  # a full disk: the rest is not written either
                job.error = f"{type(exc).__name__}: {exc}"
                break
        job.sizes = sizes

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
        if job.check is not None and len(parts) == len(job.blocks):
            try:
                job.check_data = self.pool.from_bytes(self.store.read(job.check, nbytes))
            except BadFile as exc:
                job.bad.append((job.check, str(exc)))
