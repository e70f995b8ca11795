"""The engine of a pooling model (embeddings): requests in, one vector (or every token's state) out.

It has `LLMEngine`'s face as the engine process's loop uses it (add, abort, step, stats), and a
smaller inside: a pooling request is computed whole in one step (an encoder attends both ways, so
its prompt cannot be chunked) and never decodes, so there is no KV cache, no preemption and no
prefix cache. A step takes waiting requests first come, first served, while the step's tokens stay
within `--max-batch-prefill-tokens` and its requests within `--max-batch-size` (TEI's
max_batch_tokens and max_batch_requests).

A step's prompts are split over one worker thread per core, each running its share with one intra-op
thread (`_groups`: balanced by tokens). An encoder's prompts are independent (every linear and
attention runs per prompt), so this is the parallelism that needs no barrier: on two cores OpenMP's
intra-op threads over small per-prompt GEMMs did 62–78 sentences/s where two one-thread workers did
83–98 (all-MiniLM-L6-v2, bf16, in-process). It keeps batch invariance whole: every prompt is always
computed by one thread, alone or batched. docs/embeddings.md.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig, EngineInfo
from pytgi.core.errors import ConfigError, InvalidRequest
from pytgi.core.model_files import ResolvedModel
from pytgi.core.pooling import check_pool_request, model_task, read_labels, read_pooling
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.models.encoder import embedding, pool
from pytgi.engine.models.encoders import load_encoder
from pytgi.engine.shards import set_cpu_threads

log = logging.getLogger(__name__)
DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


class NoAdapters:
    """A pooling model serves no LoRA adapters (the engine loop's view of the registry)."""

    def __init__(self) -> None:
        self.version = 0
        self.served: dict[str, str] = {}
        self.unloading: set[str] = set()

    def snapshot(self) -> P.AdapterSnapshot:
        return P.AdapterSnapshot(0)


@dataclass(slots=True)
class PoolRequest:
    request_id: str
    prompt_ids: list[int]
    params: P.PoolParams
    arrived: float


def check_pooling_config(config: EngineConfig) -> None:
    """Settings a pooling model cannot take, refused at start in one line."""
    asked = config.pooling_refusals() + [
        flag
        for flag, on in (
            (f"--quantize {config.quantize}", config.quantize not in ("auto", "none")),
            (f"--dtype {config.dtype}", config.dtype not in DTYPES),
            (f"--device {config.device}", config.device not in ("auto", "cpu")),
        )
        if on
    ]
    if asked:
        raise ConfigError(
            f"{', '.join(asked)}: not with an embedding model, which runs whole prompts on one CPU process "
            "(--dtype float32 or bfloat16; docs/embeddings.md)"
        )


class PoolingEngine:
    def __init__(self, config: EngineConfig, model: ResolvedModel) -> None:
        config.validate()
        check_pooling_config(config)
        self.config = config
        t0 = time.perf_counter()
        set_cpu_threads(1)
        # one worker per core (the engine's threads), each computing its prompts on one thread
        self.workers_count = torch.get_num_threads()
        self.workers = ThreadPoolExecutor(
            self.workers_count, thread_name_prefix="pool", initializer=torch.set_num_threads, initargs=(1,)
        )
        dtype = DTYPES[config.dtype]
        self.model = load_encoder(model.path, dtype)
        task = model_task(model.path, config.task)
        self.pooling = (
            read_labels(model.path)
            if task == "classify"
            else read_pooling(model.path, self.model.hidden_size)
        )
        positions = self.model.max_positions
        max_input = config.max_input_tokens or min(self.pooling.max_seq_length or positions, positions)
        if max_input > positions:
            raise ConfigError(f"max_input_tokens ({max_input}) exceeds the model's {positions} positions")
        budget = config.max_batch_prefill_tokens or max(2048, max_input)
        if budget < max_input:
            raise ConfigError(
                f"max_batch_prefill_tokens ({budget}) must be >= max_input_tokens ({max_input}): an "
                "embedding model's prompt is computed in one step"
            )
        self.info = EngineInfo(
            model_id=model.model_id,
            model_path=str(model.path),
            model_dtype=str(dtype).removeprefix("torch."),
            model_device_type="cpu",
            vocab_size=self.model.word.num_embeddings,
            num_shard=1,
            max_input_tokens=max_input,
            max_total_tokens=max_input + 1,
            max_batch_prefill_tokens=budget,
            max_prefill_tokens_while_decoding=None,
            max_batch_total_tokens=budget,
            max_batch_size=config.max_batch_size or 256,
            waiting_served_ratio=config.waiting_served_ratio,
            max_waiting_tokens=config.max_waiting_tokens,
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
            block_size=config.block_size,
            num_blocks=0,
            task=task,
            pooling=self.pooling,
        )
        self.adapters = NoAdapters()
        self.waiting: dict[str, PoolRequest] = {}  # by id, in arrival order
        self.num_failed_steps = 0
        self.last_step = P.StepInfo()
        pooling = self.pooling
        what = (
            f"a cross-encoder, labels {', '.join(pooling.labels)}"
            if task == "classify"
            else f"embeddings, {pooling.method} pooling{', normalized' if pooling.normalize else ''}, "
            f"{pooling.dimensions} dimensions"
        )
        log.info(
            "engine ready: %s (%s) on cpu (%s); load %.1fs",
            model.model_id,
            what,
            self.info.model_dtype,
            time.perf_counter() - t0,
        )

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *_: Any) -> None:
        raise InvalidRequest(
            f"the model `{self.info.model_id}` computes embeddings; it does not generate text"
        )

    def add_pool_request(self, request_id: str, prompt_ids: list[int], params: P.PoolParams) -> None:
        if request_id in self.waiting:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        check_pool_request(self.info, prompt_ids, params)
        self.waiting[request_id] = PoolRequest(request_id, list(prompt_ids), params, time.monotonic())

    def abort_request(self, request_id: str) -> bool:
        return self.waiting.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def load_adapter(self, name: str, source: str) -> None:
        raise ConfigError("an embedding model serves no LoRA adapters")

    def unload_adapter(self, name: str) -> bool:
        raise ConfigError("an embedding model serves no LoRA adapters")

    # -- one step ---------------------------------------------------------------------------------
    def _schedule(self) -> list[PoolRequest]:
        batch: list[PoolRequest] = []
        tokens = 0
        info = self.info
        for r in self.waiting.values():
            n = len(r.prompt_ids)
            if len(batch) == info.max_batch_size or tokens + n > info.max_batch_prefill_tokens:
                break
            batch.append(r)
            tokens += n
        for r in batch:
            del self.waiting[r.request_id]
        return batch

    def step(self) -> list[P.PoolOut | P.TokenOut]:
        batch = self._schedule()
        if not batch:
            self.last_step = P.StepInfo()
            return []
        t0 = time.monotonic()
        lens = [len(r.prompt_ids) for r in batch]
        failed = False
        out: list[P.PoolOut | P.TokenOut]
        try:
            out = self._run(batch, lens, t0)
        except Exception as exc:  # a failing step fails exactly its own requests
            log.exception("step failed for %d requests", len(batch))
            self.num_failed_steps += 1
            failed = True
            error = f"{type(exc).__name__}: {exc}"
            out = [P.TokenOut(r.request_id, finish_reason="error", error=error) for r in batch]
        self.last_step = P.StepInfo(time.monotonic() - t0, len(batch), sum(lens), "prefill", failed)
        return out

    def _run(self, batch: list[PoolRequest], lens: list[int], t0: float) -> list[P.PoolOut | P.TokenOut]:
        """The step's prompts on the worker threads, a balanced share each (`_groups`)."""
        groups = _groups(lens, self.workers_count)
        parts = self.workers.map(
            lambda g: self._run_group([batch[i] for i in g], [lens[i] for i in g], t0), groups
        )
        return [o for part in parts for o in part]

    def _run_group(
        self, batch: list[PoolRequest], lens: list[int], t0: float
    ) -> list[P.PoolOut | P.TokenOut]:
        ids = torch.tensor([t for r in batch for t in r.prompt_ids])
        hidden = self.model(ids, lens, self._types(batch, lens))
        classify = self.info.task == "classify"
        pooled = self.model.classify(hidden, lens) if classify else pool(hidden, lens, self.pooling)
        out: list[P.PoolOut | P.TokenOut] = []
        for r, rows, v, n in zip(batch, hidden.split(lens), pooled, lens, strict=True):
            p = r.params
            if classify:
                vec = v  # the labels' logits, as they are: the API applies sigmoid or softmax
            elif p.tokens:
                vec = rows.float()
            else:
                vec = embedding(v, self.pooling, p)
            data = vec.contiguous().numpy().tobytes()
            out.append(P.PoolOut(r.request_id, data, vec.shape[0] if p.tokens else 1, n, t0 - r.arrived))
        return out

    def _types(self, batch: list[PoolRequest], lens: list[int]) -> torch.Tensor | None:
        """Each token's segment where a pair's second text has its own (BERT's token types), else None."""
        if self.model.segments < 2 or all(r.params.pair_at is None for r in batch):
            return None
        types = torch.zeros(sum(lens), dtype=torch.long)
        at = 0
        for r, n in zip(batch, lens, strict=True):
            if r.params.pair_at is not None:
                types[at + r.params.pair_at : at + n] = 1
            at += n
        return types

    def check_alive(self) -> None:
        pass

    def shutdown(self) -> None:
        self.workers.shutdown(wait=False)

    def stats(self) -> dict[str, Any]:
        return {
            "running": 0,
            "waiting": len(self.waiting),
            "kv_cache_usage": 0.0,
            "prefix_cache_hit_rate": 0.0,
            "preemptions": 0,
            "failed_steps": self.num_failed_steps,
        }


def _groups(lens: list[int], workers: int) -> list[list[int]]:
    """The prompts' indices in at most `workers` groups of about as many tokens each (longest first,
    each to the lightest group so far), each group in the step's order."""
    groups: list[list[int]] = [[] for _ in range(min(workers, len(lens)))]
    tokens = [0] * len(groups)
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        k = tokens.index(min(tokens))
        groups[k].append(i)
        tokens[k] += lens[i]
    return [sorted(g) for g in groups if g]
