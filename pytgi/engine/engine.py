"""The engine: requests in, per-step token updates out (the seed's batching_task, one step a call).

Single-threaded and synchronous: the caller (the offline `LLM`, or the engine process's loop)
adds and aborts requests between steps and calls `step()` while `has_unfinished()`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pytgi.config import EngineConfig
from pytgi.distributed import DistributedError
from pytgi.engine.kv_cache import BlockManager
from pytgi.engine.request import FinishReason, Request, Status
from pytgi.engine.runner import ModelRunner, TokenSample, set_cpu_threads
from pytgi.engine.shards import ShardGroup
from pytgi.engine.scheduler import Scheduler, SchedulerConfig
from pytgi.models.registry import resolve_model
from pytgi.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestUpdate:
    """What one step produced for one request."""

    request_id: str
    token: TokenSample | None = None  # None: a prefill chunk that did not reach the end yet
    finish_reason: str | None = None  # set on the request's last update
    error: str | None = None  # the step failed; the request is finished
    prompt_logprobs: list[float | None] | None = None  # once, when the prompt is fully computed
    num_cached_tokens: int = 0


@dataclass(slots=True)
class StepInfo:
    batch_size: int = 0
    num_tokens: int = 0
    prefill: bool = False  # the step computed prompt (or recompute) chunks, not only decodes
    failed: bool = False
    seconds: float = 0.0


def _eos_ids(path: Path) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_path, self.model_id = resolve_model(config.model, progress=config.progress)
        t0 = time.perf_counter()
        self.shards = ShardGroup(config, self.model_path)
        set_cpu_threads(self.shards.local_ranks)
        try:
            self.runner = ModelRunner(self.model_path, config.dtype, config.device, config.attention_backend,
                                      0, config.num_shard, self.shards.master_addr, self.shards.master_port,
                                      quantize=config.quantize)
        except BaseException:
            self.shards.stop()
            raise
        self.load_seconds = time.perf_counter() - t0
        self.eos_token_ids = _eos_ids(self.model_path)
        self._resolve_limits()
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner.allocate_kv_cache(self.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch_size=self.max_batch_size,
                max_batch_prefill_tokens=self.max_batch_prefill_tokens,
                max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
                waiting_served_ratio=config.waiting_served_ratio,
                max_waiting_tokens=config.max_waiting_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
        )
        self.requests: dict[str, Request] = {}
        self._prompt_lps: dict[str, list[float | None]] = {}
        self.num_failed_steps = 0
        self.last_step = StepInfo()
        log.info(
            "engine ready: %s on %s (%s), %d KV blocks x %d, load %.1fs",
            self.model_id, self.runner.device, self.runner.dtype, self.num_blocks, config.block_size,
            self.load_seconds,
        )

    def _resolve_limits(self) -> None:
        c, positions = self.config, self.runner.config.max_position_embeddings
        self.max_total_tokens = c.max_total_tokens or positions
        if self.max_total_tokens > positions:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) exceeds the model's {positions} positions")
        self.max_input_tokens = c.max_input_tokens or self.max_total_tokens - 1
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(
                f"max_input_tokens ({self.max_input_tokens}) must be < max_total_tokens ({self.max_total_tokens})"
            )
        on_gpu = self.runner.device.type == "cuda"
        self.max_batch_prefill_tokens = c.max_batch_prefill_tokens or (4096 if on_gpu else 1024)
        # Off by default: capping prompt tokens while others decode bounds the worst stall a long prompt
        # causes, but throttles prefill under load (docs/benchmarks.md measures both sides).
        cap = c.max_prefill_tokens_while_decoding or 0
        if cap < 0:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 0, got {cap}")
        self.max_prefill_tokens_while_decoding = min(cap, self.max_batch_prefill_tokens) or None
        if not c.enable_chunked_prefill and self.max_input_tokens > self.max_batch_prefill_tokens:
            raise ValueError("without chunked prefill, max_input_tokens must be <= max_batch_prefill_tokens")
        self.max_batch_size = c.max_batch_size or 256
        tokens = c.max_batch_total_tokens or self.runner.auto_num_tokens(
            c.kv_cache_cpu_bytes, c.kv_cache_memory_fraction
        )
        self.num_blocks = tokens // c.block_size
        self.max_batch_total_tokens = self.num_blocks * c.block_size
        if self.max_batch_total_tokens < self.max_total_tokens:
            raise ValueError(
                f"the KV cache holds {self.max_batch_total_tokens} tokens, fewer than max_total_tokens "
                f"({self.max_total_tokens}): raise max_batch_total_tokens or lower max_total_tokens"
            )

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty: give at least one token")
        if n > self.max_input_tokens:
            raise InvalidRequest(
                f"the prompt has {n} tokens; at most {self.max_input_tokens} are accepted (max_input_tokens)"
            )
        if n + params.max_new_tokens > self.max_total_tokens:
            raise InvalidRequest(
                f"prompt tokens + max_new_tokens must be <= {self.max_total_tokens}: "
                f"given {n} prompt tokens and {params.max_new_tokens} max_new_tokens"
            )
        vocab = self.runner.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        params.validate()
        req = Request(request_id, list(prompt_ids), params, self.eos_token_ids)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        req.finish_reason = FinishReason.ABORT
        self._release(req)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _release(self, req: Request) -> None:
        self.scheduler.finish(req)
        self.runner.release(req.request_id)
        self._prompt_lps.pop(req.request_id, None)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestUpdate]:
        sched = self.scheduler.schedule()
        for req in sched.preempted:
            self._prompt_lps.pop(req.request_id, None)  # recomputed from the start
        if sched.is_empty:
            return []
        now = time.monotonic()
        for s in sched.scheduled:
            s.request.first_scheduled_time = s.request.first_scheduled_time or now
        info = self.last_step = StepInfo(
            len(sched.scheduled), sched.num_tokens, any(s.num_new_tokens > 1 or not s.samples for s in sched.scheduled)
        )
        try:
            result = self.runner.execute(sched.scheduled)
        except DistributedError:
            raise  # a lost rank is not this step's fault: the engine cannot go on
        except Exception as exc:  # a failing step fails exactly its own requests
            self.num_failed_steps += 1
            info.failed, info.seconds = True, time.monotonic() - now
            log.exception("step failed for %d requests", len(sched.scheduled))
            return [self._fail(s.request, exc) for s in sched.scheduled]
        info.seconds = time.monotonic() - now
        updates = []
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            update = RequestUpdate(req.request_id, num_cached_tokens=req.num_cached_tokens)
            if req.request_id in result.prompt_logprobs:
                update.prompt_logprobs = self._collect_prompt_logprobs(req, result.prompt_logprobs)
            sample = result.samples.get(req.request_id)
            if sample is not None:
                req.append_token(sample.token_id)
                update.token = sample
                reason = req.check_stop()
                if reason is not None:
                    req.finish_reason = reason
                    update.finish_reason = reason.value
                    self.requests.pop(req.request_id, None)
                    self._release(req)
            if update.token is not None or update.prompt_logprobs is not None:
                updates.append(update)
        return updates

    def _collect_prompt_logprobs(self, req: Request, chunks: dict[str, list[float | None]]) -> list | None:
        acc = self._prompt_lps.setdefault(req.request_id, [])
        acc.extend(chunks[req.request_id])
        if req.num_computed_tokens < req.num_prompt_tokens:
            return None
        req.prompt_logprobs = self._prompt_lps.pop(req.request_id)
        return req.prompt_logprobs

    def _fail(self, req: Request, exc: Exception) -> RequestUpdate:
        req.finish_reason = FinishReason.ERROR
        self.requests.pop(req.request_id, None)
        if req.status is not Status.FINISHED:
            self._release(req)
        return RequestUpdate(req.request_id, finish_reason=FinishReason.ERROR.value, error=f"{type(exc).__name__}: {exc}")

    def check_alive(self) -> None:
        """Raise DistributedError if a shard is gone (called while idle)."""
        self.shards.check()
        self.runner.ping()

    def shutdown(self) -> None:
        self.runner.shutdown()
        self.shards.stop()

    def stats(self) -> dict[str, float]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.block_manager.usage,
            "prefix_cache_hit_rate": self.block_manager.hit_rate,
            "preemptions": self.scheduler.num_preemptions,
            "failed_steps": self.num_failed_steps,
        }
