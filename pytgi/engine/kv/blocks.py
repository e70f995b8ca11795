"""Paged KV-cache bookkeeping: blocks with refcounts, block tables, and the prefix cache.

This module owns no tensors; the runner allocates the K/V tensors with `num_blocks` blocks.
A full block is identified by a chained hash (BLAKE2b of the previous block's hash and this block's
token ids, 128 bits), so equal prefixes map to equal hash chains, in every process: the disk tier
(`pytgi.engine.kv.disk_tier`) names its files by them. Blocks whose refcount drops to zero keep their hash
and stay reusable until they are evicted, least recently freed first.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Collection, Sequence
from itertools import islice
from typing import Protocol

from pytgi.engine.scheduling.request import Request


class BlockSeq(Protocol):
    """What the block manager reads and sets of a sequence: a `Request`, or the draft model's view of
    one (`pytgi.engine.speculation.draft_model`). The prefix cache takes requests only."""

    block_table: list[int]
    num_computed_tokens: int  # tokens whose KV is in the blocks
    num_cached_tokens: int  # of them, found in the prefix cache at the first allocation
    num_preemptions: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        state_slots: int = 0,
        checkpoint_slots: int = 0,
        state_grid: int = 64,
    ) -> None:
        """`state_slots`: a model with linear-attention layers keeps a recurrent state per running
        request (`pytgi.engine.models.linear_attention`): a request takes a slot with its first blocks
        and gives it back with them (preempted, it is recomputed from its tokens, as its blocks are).

        `checkpoint_slots`: the state pool's rows past the running ones, which keep states at block
        boundaries for the prefix cache (docs/prefix-cache.md). `state_grid`: where the recurrent
        layers' prefill states are exact (`PagedModel.state_grid`, the lcm of their kinds' grids: gated
        DeltaNet's and Mamba-2's 64-token chunks, KDA's 32, Mamba-1's and convolutions' 1); a
        state is a cold prefill's bits only where every chunk so far started on that grid, so
        checkpoints are taken every lcm(block_size, state_grid) tokens."""
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks in eviction order: the first is evicted first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found cached
        # Pins (Anthropic's cache_control): block → until when (time.monotonic()); each holds one
        # reference, so a pinned block is never evicted. At most half the pool, and pins give way
        # when a request could not run otherwise (`yield_pins`).
        self.pins: dict[int, float] = {}
        self.max_pinned = num_blocks // 2
        self.next_expiry = math.inf  # no pin ends before this
        self.free_states = list(range(state_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.has_states = state_slots > 0
        # Checkpoints: block hash → the pool row holding the state after that block, least recently
        # used first. A checkpoint lives while its hash names a cached block (`_forget` drops it).
        self.checkpointing = self.has_states and enable_prefix_caching and checkpoint_slots > 0
        self.state_grid = state_grid
        self.checkpoint_stride = math.lcm(block_size, state_grid)  # tokens between checkpoints
        self.checkpoints: OrderedDict[int, int] = OrderedDict()
        self.free_checkpoints = list(range(state_slots + checkpoint_slots - 1, state_slots - 1, -1))
        # Row copies (source, destination) the next forward makes first, in this order: the saves
        # into checkpoints (queued after the step that computed them), then the restores of admitted
        # requests (queued at admission). Saves first: a slot freed since may be restored into.
        self.state_copies: list[tuple[int, int]] = []
        self.state_restores = 0  # requests that resumed from a checkpoint

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chain_hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """The request's block hashes up to `num_full_blocks`, extending the memo on the request."""
        hashes, bs, ids = req.block_hashes, self.block_size, req.all_ids
        for i in range(len(hashes), num_full_blocks):
            # an adapter's or an image's blocks are their own: the chain starts at their root
            parent = hashes[i - 1] if i else root_hash(req.cache_root)
            hashes.append(block_hash(parent, ids[i * bs : (i + 1) * bs]))
        return hashes[:num_full_blocks]

    def cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding the longest prefix of the request's tokens (not yet claimed).

        At least one token is left to compute: the last one's logits give the next token."""
        if not self.enable_prefix_caching or req.wants_prompt_logprobs:
            return []
        if self.has_states and not self.checkpointing:
            return []
        blocks: list[int] = []
        hashes = self.chain_hashes(req, (req.num_tokens - 1) // self.block_size)
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        if self.has_states:  # the recurrent state is known only where a checkpoint was kept
            # where the cached prefix (KV) ends, another prompt shares this one's prefix: a
            # checkpoint there serves the next prompt that shares it (Scheduler._state_cut)
            req.shared_prefix = len(blocks) * self.block_size
            while blocks and hashes[len(blocks) - 1] not in self.checkpoints:
                blocks.pop()
        return blocks

    def blocks_needed(self, req: BlockSeq, num_new_tokens: int, cached: Sequence[int] = ()) -> int:
        """Free blocks that scheduling `num_new_tokens` more tokens of `req` would take."""
        have = len(req.block_table) or len(cached)
        start = req.num_computed_tokens or len(cached) * self.block_size
        new = max(0, self.blocks_for(start + num_new_tokens) - have)
        return new + sum(1 for b in cached if self.ref_counts[b] == 0)  # claiming a free cached block

    # -- changes ---------------------------------------------------------------------------------
    def allocate(self, req: BlockSeq, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens (claiming `cached` first, for a new
        request); False, with nothing changed, if there are not enough free blocks."""
        if self.blocks_needed(req, num_new_tokens, cached) > self.num_free_blocks:
            return False
        # (a draft model's view of a request has no state slot: its model keeps no recurrent state)
        if self.has_states and getattr(req, "state_slot", 0) < 0:
            if not self.free_states:
                return False
            req.state_slot = self.free_states.pop()  # type: ignore[attr-defined]
        if not req.block_table and req.num_computed_tokens == 0:
            if not req.num_preemptions:  # hit rate over first admissions only
                self.prefix_queries += req.num_prompt_tokens
                self.prefix_hits += len(cached) * self.block_size
            for block in cached:
                self._claim(block)
            req.block_table = list(cached)
            req.num_computed_tokens = req.num_cached_tokens = len(cached) * self.block_size
            if self.has_states:
                self._restore(req, cached)
        total = self.blocks_for(req.num_computed_tokens + num_new_tokens)
        while len(req.block_table) < total:
            req.block_table.append(self._pop_free())
        return True

    def trim(self, req: BlockSeq) -> None:
        """Release the blocks past what the request's tokens need (those taken for a rejected draft)."""
        keep = self.blocks_for(req.num_tokens)
        while len(req.block_table) > keep:
            self.release(req.block_table.pop())

    def cache_full_blocks(self, req: Request) -> list[tuple[int, int]]:
        """Register the request's newly computed full blocks in the prefix cache; the (block, hash)
        pairs it added (those the disk tier has not seen)."""
        if not self.enable_prefix_caching or (self.has_states and not req.state_on_grid):
            return []  # (a hybrid's blocks past its state's leaving the grid: `state_step`)
        num_full = req.num_computed_tokens // self.block_size
        added = []
        for i, h in enumerate(self.chain_hashes(req, num_full)):
            block = req.block_table[i]
            if self.register(block, h):
                added.append((block, h))
        return added

    # -- recurrent states' checkpoints -------------------------------------------------------------
    def _restore(self, req: BlockSeq, cached: Sequence[int]) -> None:
        """A request starting on its cached blocks starts from the checkpoint at their end (copied
        into its own slot before the step); with none, from zero."""
        req.state_on_grid = True  # type: ignore[attr-defined]
        if not cached:
            return
        h = self.block_hash[cached[-1]]
        assert h is not None and h in self.checkpoints, "a hybrid's cached prefix ends at a checkpoint"
        self.checkpoints.move_to_end(h)
        self.state_copies.append((self.checkpoints[h], req.state_slot))  # type: ignore[attr-defined]
        self.state_restores += 1

    def state_step(self, req: Request, num_new_tokens: int) -> None:
        """After a step computed `num_new_tokens` of the request, before its blocks are registered:
        whether its state (and so the KV of the blocks it completes) is still a cold prefill's bits.
        A one-token step runs the recurrence token by token, a chunk off the grid other chunks than a
        prefill from zero would: the numbers are right, the bits are not a cold prefill's. The
        recurrent layers' outputs feed the attention layers, so a block a decode filled holds KV a
        cold prefill would not compute either: such blocks are not cached (`cache_full_blocks`)."""
        start = req.num_computed_tokens - num_new_tokens
        if num_new_tokens == 1 or start % self.state_grid:
            req.state_on_grid = False

    def checkpoint(self, req: Request) -> int | None:
        """After a step (its full blocks registered): keep the request's state if the step ended on a
        checkpoint boundary and the state is exact there. The hash of the block it ends at when it
        did (the state is in the request's row until the next step: the disk tier's copy)."""
        end = req.num_computed_tokens
        if not (self.checkpointing and req.state_on_grid) or end % self.checkpoint_stride:
            return None
        h = self.chain_hashes(req, end // self.block_size)[-1]
        if h not in self.hash_to_block:
            return None
        if h in self.checkpoints:  # another request kept this prefix's state already
            self.checkpoints.move_to_end(h)
            return h
        if self.free_checkpoints:
            slot = self.free_checkpoints.pop()
        else:  # the least recently used checkpoint gives way
            _, slot = self.checkpoints.popitem(last=False)
        self.checkpoints[h] = slot
        self.state_copies.append((req.state_slot, slot))
        return h

    def spare_checkpoint_row(self, keep: Collection[int]) -> int | None:
        """A checkpoint row for states read from disk, taken out of the books until the read is done:
        a free one, else the least recently used checkpoint's. Never a row a queued copy reads or
        writes, nor the checkpoint after a block hash in `keep` (requests being admitted restore from
        those); None if every row is such."""
        busy = {row for copy in self.state_copies for row in copy}
        for i in range(len(self.free_checkpoints) - 1, -1, -1):
            if self.free_checkpoints[i] not in busy:
                return self.free_checkpoints.pop(i)
        for h, row in self.checkpoints.items():
            if row not in busy and h not in keep:
                del self.checkpoints[h]
                return row
        return None

    def take_state_copies(self) -> list[tuple[int, int]]:
        copies, self.state_copies = self.state_copies, []
        return copies

    def drop_checkpoints(self, copies: Sequence[tuple[int, int]]) -> None:
        """A step failed, so its copies may not have been made: the checkpoints they were saving
        into are dropped (a restore from one would read whatever the row held)."""
        rows = {dst for _, dst in copies}
        for h, slot in list(self.checkpoints.items()):
            if slot in rows:
                del self.checkpoints[h]
                self.free_checkpoints.append(slot)

    def register(self, block: int, h: int) -> bool:
        """Name a block holding computed KV by its hash, unless the hash (or the block) is named."""
        if self.block_hash[block] is not None or h in self.hash_to_block:
            return False
        self.block_hash[block] = h
        self.hash_to_block[h] = block
        return True

    def hold(self, block: int) -> None:
        """One more hold on a block (free or not): it is not evicted until `release`."""
        self._claim(block)

    def release(self, block: int) -> None:
        """Drop one hold on a block (a request's, or the disk tier's read); free at none."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def take_free(self, n: int, keep: Collection[int] = ()) -> list[int]:
        """Up to `n` free blocks, held (refcount 1, no hash), the least recently freed first, none of
        `keep` (the cached blocks a request about to be admitted will claim)."""
        taken = list(islice((b for b in self.free_blocks if b not in keep), n))
        for block in taken:
            del self.free_blocks[block]
            self._forget(block)
            self.ref_counts[block] = 1
        return taken

    # -- pins ------------------------------------------------------------------------------------
    def pin(self, hashes: Sequence[int], until: float) -> int:
        """Hold the cached blocks of a chain's first hashes until `until` (a pin already there is
        extended, never shortened); returns how many blocks are pinned. Past the cap, pins that end
        sooner give way; the chain stops at a block the cache lacks or the cap cannot take."""
        chain = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            chain.append(block)
        new = sum(1 for block in chain if block not in self.pins)
        if len(self.pins) + new > self.max_pinned:
            ours = set(chain)
            for block in self._pins_by_end():
                if len(self.pins) + new <= self.max_pinned or self.pins[block] >= until:
                    break
                if block not in ours:
                    self._unpin(block)
        n = 0
        for block in chain:
            if block in self.pins:
                self.pins[block] = max(self.pins[block], until)
            elif len(self.pins) < self.max_pinned:
                self._claim(block)
                self.pins[block] = until
                self.next_expiry = min(self.next_expiry, until)
            else:
                break
            n += 1
        return n

    def expire_pins(self, now: float) -> None:
        if now < self.next_expiry:  # (a step looks at the pins only when one may have ended)
            return
        for block in [b for b, until in self.pins.items() if until <= now]:
            self._unpin(block)
        self.next_expiry = min(self.pins.values(), default=math.inf)

    def yield_pins(self, need: int) -> bool:
        """Release pins, those that end soonest first (a chain's tail before its head), until `need`
        more blocks are free; False if no pin was released."""
        if not self.pins:
            return False
        target = self.num_free_blocks + need
        for block in self._pins_by_end():
            if self.num_free_blocks >= target:
                break
            self._unpin(block)
        return True

    def _pins_by_end(self) -> list[int]:
        """The pinned blocks, those that end soonest first, a chain's tail before its head."""
        newest_first = list(self.pins.items())[::-1]  # the sort is stable
        return [block for block, _ in sorted(newest_first, key=lambda pin: pin[1])]

    def _unpin(self, block: int) -> None:
        del self.pins[block]
        self.release(block)

    def free(self, req: BlockSeq) -> None:
        """Release the request's blocks; tail blocks first, so they are evicted before shared prefixes."""
        for block in reversed(req.block_table):
            self.release(block)
        req.block_table = []
        if getattr(req, "state_slot", -1) >= 0:
            self.free_states.append(req.state_slot)  # type: ignore[attr-defined]
            req.state_slot = -1  # type: ignore[attr-defined]

    def _claim(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        self._forget(block)
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
                slot = self.checkpoints.pop(h, None)
                if slot is not None:  # the state after a block goes with the block
                    self.free_checkpoints.append(slot)
            self.block_hash[block] = None


def root_hash(root: object) -> int:
    """Where a chain starts: the cache root (None, an adapter's name and files, image digests) by its
    repr, which is the same in every process (unlike `hash` of a string)."""
    digest = hashlib.blake2b(repr(root).encode(), digest_size=16).digest()
    return int.from_bytes(digest, "little")


def block_hash(parent: int, ids: Sequence[int]) -> int:
    h = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    h.update(array("q", ids).tobytes())
    return int.from_bytes(h.digest(), "little")
