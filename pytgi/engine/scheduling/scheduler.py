"""Continuous batching: which requests run in the next forward pass, how many tokens each, and
what their results do to them.

TGI router's `batching_task` as one `schedule()` call per step, then one `update_from_output()` with
what the runner computed. Every scheduled request gets `num_new_tokens` of its tokens computed
(`all_ids[num_computed:num_computed + n]`): a decode is n == 1, a prefill or a recompute after
preemption is the rest of its tokens, a chunk is a part of them. A request samples a token when its
chunk reaches the end of its tokens.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from pytgi.core import protocol as P
from pytgi.core.config import EngineInfo
from pytgi.engine.kv.blocks import BlockManager
from pytgi.engine.kv.disk_tier import DiskTier
from pytgi.engine.scheduling.request import FinishReason, Request, Status
from pytgi.engine.scheduling.step import ScheduledRequest, StepOutput
from pytgi.engine.speculation.ngram import MAX_STEP_ROWS, Drafter, Proposer


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_admitted: int = 0
    # recurrent states' rows to copy (source, destination), in order, before the forward: saves
    # into the prefix cache's checkpoints, then restores from them (BlockManager.state_copies)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_prompt(self) -> bool:
        """Whether the step computes prompt (or recompute) chunks, not only decodes."""
        return any(s.num_new_tokens > 1 or not s.samples for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: EngineInfo,
        block_manager: BlockManager,
        watermark: float = 0.01,
        drafter: Proposer | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        """`drafter`: the draft proposer (`pytgi.engine.speculation.draft_model.DraftModel`); None: n-gram
        drafts when `config.speculate`. `disk`: the prefix cache's disk tier (--prefix-cache-dir)."""
        self.config = config
        self.block_manager = block_manager
        self.disk = disk
        self.watermark = watermark  # fraction of blocks kept free when admitting, so decodes need not preempt
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the first preempted
        self.steps_since_admission = 0
        self.num_preemptions = 0
        if drafter is None and config.speculate > 0:
            drafter = Drafter(config.speculate)
        self.drafter = drafter
        self.spec_drafted = self.spec_accepted = 0  # draft tokens verified / accepted since start

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        """Remove a request (finished, aborted or failed) and free its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.block_manager.free(req)
        if self.drafter is not None:
            self.drafter.release(req)
        self.requests.pop(req.request_id, None)
        req.status = Status.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.disk is not None:
            self.disk.poll()  # blocks read from disk join the prefix cache
        if self.block_manager.pins:
            self.block_manager.expire_pins(time.monotonic())
        cfg = self.config
        budget = cfg.max_batch_prefill_tokens
        # Prompt tokens (continuing chunks and new prefills) are capped in a step that also decodes.
        cap = cfg.max_prefill_tokens_while_decoding
        if cap is None or not cfg.enable_chunked_prefill or all(r.num_uncomputed != 1 for r in self.running):
            cap = budget  # no decode runs: a prompt may take the whole step
        budget, prompt_budget = self._schedule_running(out, budget, cap)
        if self.drafter is not None and not out.preempted:
            budget = self._draft(out, budget, self.drafter)
        if not out.preempted:
            self._admit_waiting(out, min(budget, prompt_budget))
        if self.disk is not None:
            self.disk.drop_holds()
        if out.scheduled and self.block_manager.state_copies:
            # (with nothing scheduled no forward runs: the copies wait, the rows unchanged)
            out.state_copies = self.block_manager.take_state_copies()
        self.steps_since_admission = 1 if out.num_admitted else self.steps_since_admission + 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, prompt_budget: int) -> tuple[int, int]:
        """Decodes and continuing chunks; returns what is left of (budget, prompt_budget)."""
        for req in list(self.running):
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = req.num_uncomputed
            prompt = n > 1
            if prompt:  # an unfinished chunked prefill continues within the budgets
                n = min(n, budget, prompt_budget)
                if n <= 0:
                    continue
                n = whole_images(
                    req, req.num_computed_tokens, self._state_cut(req, req.num_computed_tokens, n)
                )
            bm = self.block_manager
            while not bm.allocate(req, n):
                if bm.yield_pins(bm.blocks_needed(req, n) - bm.num_free_blocks):
                    continue  # pins give way before a running request does
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
                if prompt:
                    prompt_budget -= n
        return budget, prompt_budget

    def _state_cut(self, req: Request, start: int, n: int) -> int:
        """A hybrid model's prefill chunk from `start`. It ends at the first checkpoint boundary past
        `start` where a later prompt may resume: the end of the prefix another prompt shared (the
        cached KV this one found), a client's pin (`cache_control`: a system prompt's end), the last
        boundary before the end of its tokens (a conversation's next turn). A chunk that stops short
        of the end stops on the recurrent kernel's chunk grid, where a cold prefill's state is the
        same bits (docs/prefix-cache.md)."""
        bm = self.block_manager
        if not bm.has_states:
            return n
        end = start + n
        if bm.checkpointing:
            stride = bm.checkpoint_stride
            ends = [req.shared_prefix, *(tokens for tokens, _ in req.params.cache_pins), req.num_tokens - 1]
            end = min([end, *(p // stride * stride for p in ends if start < p // stride * stride < end)])
        if end < req.num_tokens and (grid := end // bm.state_grid * bm.state_grid) > start:
            end = grid
        return end - start

    def _draft(self, out: SchedulerOutput, budget: int, drafter: Proposer) -> int:
        """Give this step's decodes drafts while the step stays small (MAX_STEP_ROWS: a big batch
        makes verification cost what it saves) and blocks are free; returns the budget left."""
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1 and s.samples and s.request.output_ids]
        spare = min(budget, MAX_STEP_ROWS - len(decodes))
        decodes = [s for s in decodes if s.request.speculative]
        if spare <= 0 or not decodes:
            return budget
        for s, draft in zip(decodes, drafter.propose_batch([s.request for s in decodes], spare)):
            if draft and self.block_manager.allocate(s.request, 1 + len(draft)):
                s.draft, s.num_new_tokens = draft, 1 + len(draft)
                budget -= len(draft)
        return budget

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free the request's blocks; it is recomputed from its tokens when readmitted (first)."""
        self.running.remove(req)
        self.block_manager.free(req)
        if self.drafter is not None:
            self.drafter.release(req)
        req.num_computed_tokens = 0
        req.partial_prompt_logprobs = []  # recomputed from the start
        req.status = Status.WAITING
        req.disk = ""  # its blocks may be on disk by now
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        plan = self._plan_admission(budget)
        batch_size = len(self.running)
        # TGI's rule: a running batch is only extended when enough requests can join it, until it
        # has waited max_waiting_tokens steps.
        recent = self.steps_since_admission < self.config.max_waiting_tokens
        if batch_size and recent and len(plan) < math.floor(batch_size * self.config.waiting_served_ratio):
            return
        bm = self.block_manager
        # The plan's cached blocks are held while it is admitted: a free cached block that a later
        # request of the plan claims must not be taken as a new block by an earlier one.
        held = [b for _, _, cached in plan for b in cached]
        for block in held:
            bm.hold(block)
        for req, n, cached in plan:
            ok = bm.allocate(req, n, cached)
            assert ok, "admission plan exceeded free blocks"
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.scheduled = req.scheduled or time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            out.num_admitted += 1
        for block in held:
            bm.release(block)

    def _plan_admission(self, budget: int) -> list[tuple[Request, int, list[int]]]:
        """Waiting requests that fit, FIFO, with their token counts and cached prefix blocks."""
        bm, cfg = self.block_manager, self.config
        free = bm.num_free_blocks
        if self.running:
            free -= int(self.watermark * bm.num_blocks)
        slots = cfg.max_batch_size - len(self.running)
        plan: list[tuple[Request, int, list[int]]] = []
        claimed: set[int] = set()
        for req in self.waiting:
            if len(plan) >= slots or budget <= 0:
                break
            cached = bm.cached_prefix(req)
            if self.disk is not None and not req.disk and not req.wants_prompt_logprobs:
                free -= self.disk.start_read(req, len(cached), free - len(cached), claimed.union(cached))
            if req.disk == "reading":
                break  # first come, first served: the requests behind it wait for its blocks too
            start = len(cached) * bm.block_size
            n = req.num_tokens - start
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            n = self._state_cut(req, start, n)
            if start + n < req.num_tokens:
                n = whole_images(req, start, n)
            need = bm.blocks_needed(req, n, cached)
            need -= sum(1 for b in cached if b in claimed and bm.ref_counts[b] == 0)
            if need > free and not plan and bm.pins:  # pins give way to the first in line
                before = bm.num_free_blocks
                bm.yield_pins(need - free)
                free += bm.num_free_blocks - before
                need = bm.blocks_needed(req, n, cached)  # its cached blocks may be free now
            if need > free:
                break
            claimed.update(cached)
            free -= need
            budget -= n
            plan.append((req, n, cached))
        return plan

    # -- after the forward ------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: StepOutput) -> list[P.TokenOut | P.PoolOut]:
        """Advance the scheduled requests by what the runner computed: their KV is now there (and
        their full blocks join the prefix cache), sampled tokens are appended and checked for a
        stop. Returns one update per request that got a token or its whole prompt's logprobs, and
        the answer of each pooling request whose prompt is done (it ends there)."""
        updates: list[P.TokenOut | P.PoolOut] = []
        for s in sched.scheduled:
            req = s.request
            if s.draft and req.request_id in out.samples:
                updates.extend(self._verified(s, out))
                continue
            req.num_computed_tokens += s.num_new_tokens
            if self.block_manager.has_states:
                self.block_manager.state_step(req, s.num_new_tokens)
            self._cache_full_blocks(req)
            if self.block_manager.has_states:
                h = self.block_manager.checkpoint(req)
                if h is not None and self.disk is not None:
                    self.disk.offer_state(req.state_slot, h)  # written behind beside its block
            if (pooled := out.pooled.get(req.request_id)) is not None:
                self.finish(req)
                updates.append(pooled)
                continue
            prompt_logprobs = self._prompt_logprobs(req, out.prompt_logprobs.get(req.request_id))
            update = out.samples.get(req.request_id)
            if update is not None:
                req.append_token(update.token_id)
                if len(req.output_ids) == 1:  # its first token: how long it waited to be scheduled
                    update.queue_time = max(req.scheduled - req.arrived, 0.0)
                update.error = out.errors.get(req.request_id)
                reason = FinishReason.ERROR if update.error else req.check_stop()
                if reason is None and req.request_id in out.complete:
                    reason = FinishReason.EOS  # the grammar allows nothing but the end now
                if reason is not None:
                    self.finish(req)
                    update.finish_reason = reason.value
                    update.num_skipped = req.num_accepted
            elif prompt_logprobs is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            else:
                update = P.TokenOut(req.request_id)
            update.prompt_logprobs, update.num_cached_tokens = prompt_logprobs, req.num_cached_tokens
            update.num_disk_tokens = min(req.num_disk_tokens, req.num_cached_tokens)
            updates.append(update)
        if self.disk is not None:
            self.disk.submit()
        return updates

    def _cache_full_blocks(self, req: Request) -> None:
        bm = self.block_manager
        added = bm.cache_full_blocks(req)
        if self.disk is not None and added:
            self.disk.offer(added)  # written behind
        pins = req.params.cache_pins
        limit = self.config.prefix_cache_max_pin_seconds
        while req.num_pinned < len(pins) and pins[req.num_pinned][0] <= req.num_computed_tokens:
            tokens, seconds = pins[req.num_pinned]
            req.num_pinned += 1
            if limit > 0 and bm.enable_prefix_caching:
                until = time.monotonic() + min(seconds, limit)
                bm.pin(bm.chain_hashes(req, tokens // bm.block_size), until)

    def _verified(self, s: ScheduledRequest, out: StepOutput) -> list[P.TokenOut]:
        """A decode with a draft: its tokens are the sample after its last token, then (when that
        confirmed the draft's first token) the next, and so on: each one is appended and checked
        for a stop in turn. The KV computed for rejected draft tokens is dropped, and their blocks."""
        req = s.request
        tokens = [out.samples[req.request_id], *out.more.get(req.request_id, ())]
        accepted = len(tokens) - 1
        assert self.drafter is not None, "a draft without a drafter"
        self.drafter.observe(req, len(s.draft), accepted)
        self.spec_drafted += len(s.draft)
        self.spec_accepted += accepted
        req.num_accepted += accepted
        req.num_computed_tokens += 1 + accepted  # the last token and the accepted drafts have KV now
        updates = []
        for update in tokens:
            req.append_token(update.token_id)
            update.error = out.errors.get(req.request_id)
            update.num_cached_tokens = req.num_cached_tokens
            update.num_disk_tokens = min(req.num_disk_tokens, req.num_cached_tokens)
            updates.append(update)
            reason = FinishReason.ERROR if update.error else req.check_stop()
            if reason is not None:
                self.finish(req)
                update.finish_reason = reason.value
                break
        if req.status is Status.FINISHED:
            updates[-1].num_skipped = req.num_accepted
        else:
            self._cache_full_blocks(req)
            self.block_manager.trim(req)
        return updates

    def fail(self, sched: SchedulerOutput, error: str) -> list[P.TokenOut]:
        """The step raised: its requests (and only they) end with the error."""
        if sched.state_copies:
            self.block_manager.drop_checkpoints(sched.state_copies)
        for s in sched.scheduled:
            self.finish(s.request)
        return [
            P.TokenOut(s.request.request_id, finish_reason=FinishReason.ERROR.value, error=error)
            for s in sched.scheduled
        ]

    @staticmethod
    def _prompt_logprobs(req: Request, chunk: list[float | None] | None) -> list[float | None] | None:
        """Gather a chunk's prompt logprobs; the whole list once the prompt is computed."""
        if chunk is None:
            return None
        req.partial_prompt_logprobs.extend(chunk)
        if req.num_computed_tokens < req.num_prompt_tokens:
            return None
        req.prompt_logprobs, req.partial_prompt_logprobs = req.partial_prompt_logprobs, []
        return req.prompt_logprobs


def whole_images(req: Request, start: int, n: int) -> int:
    """A prefill chunk of `n` tokens from `start`, moved so that it does not end inside an image whose
    positions attend to each other both ways (Gemma 3's): it ends before the image, or, when the
    image begins at or before `start` (a prefix-cache hit may end inside one), after it, over the
    budget by less than one image."""
    end = start + n
    if end >= req.num_tokens:
        return n
    for img in req.images:
        span = img.span
        if span is not None and span[0] < end < span[1]:
            end = span[0] if span[0] > start else span[1]
    return end - start
