"""The engine of a pooling model (embeddings): requests in, one vector (or every token's state) out.

It has `LLMEngine`'s face as the engine process's loop uses it (add, abort, step, stats), and a
smaller inside: a pooling request is computed whole (an encoder attends both ways, so its prompt
cannot be chunked) and never decodes, so there is no KV cache, no preemption and no prefix cache.

Each prompt is computed by one worker thread alone, one worker per core, each with one intra-op
thread. An encoder's prompts are independent (every linear and attention runs per prompt), so this
is the parallelism that needs no barrier: on two cores OpenMP's intra-op threads over small
per-prompt GEMMs did 62–78 sentences/s where two one-thread workers did 83–98 (all-MiniLM-L6-v2,
bf16, in-process). And it keeps batch invariance whole: a prompt's vector is computed by one thread
from its own rows, whatever else is in flight.

The workers are fed continuously, not step by step: `step` hands every waiting request to the
workers' queue (first come, first served, while the prompts in flight stay within
`--max-batch-prefill-tokens` tokens and `--max-batch-size` requests: TEI's max_batch_tokens and
max_batch_requests), then returns what has finished, waiting for at least one. So a worker never
idles while a request waits, and the engine loop reads new requests while the workers compute
(a whole step at a time, the requests arriving during a step waited for it to end and the next
step's first few prompts left a core idle). docs/embeddings.md.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig, EngineInfo
from pytgi.core.errors import ConfigError, InvalidRequest
from pytgi.core.model_files import ResolvedModel
from pytgi.core.pooling import check_pool_request, model_task, read_labels, read_pooling
from pytgi.engine.distributed.local_ranks import set_cpu_threads
from pytgi.engine.models.encoder import embedding, pool
from pytgi.engine.models.encoders import load_encoder

log = logging.getLogger(__name__)
DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


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
    """An encoder's engine (one `process.Engine`): whole prompts, no KV cache, no adapters."""

    adapters = None  # it serves no LoRA adapters

    def __init__(self, config: EngineConfig, model: ResolvedModel) -> None:
        config.validate()
        check_pooling_config(config)
        self.config = config
        t0 = time.perf_counter()
        set_cpu_threads(1, config.threads)
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
        self.waiting: dict[str, PoolRequest] = {}  # by id, in arrival order
        self.flight: dict[Future[P.PoolOut | P.TokenOut], PoolRequest] = {}  # handed to the workers
        self.flight_tokens = 0
        self.aborted: set[str] = set()  # in flight when aborted: their results are dropped
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
    def submit(self, msg: P.Submit) -> None:
        """A request from the API process: an embedding model computes pooling requests only."""
        if msg.pool is None:
            raise InvalidRequest(
                f"the model `{self.info.model_id}` computes embeddings; it does not generate text"
            )
        self.add_pool_request(msg.request_id, msg.prompt_ids, msg.pool)

    def add_pool_request(self, request_id: str, prompt_ids: list[int], params: P.PoolParams) -> None:
        if request_id in self.waiting or any(r.request_id == request_id for r in self.flight.values()):
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        check_pool_request(self.info, prompt_ids, params)
        self.waiting[request_id] = PoolRequest(request_id, list(prompt_ids), params, time.monotonic())

    def abort_request(self, request_id: str) -> bool:
        if self.waiting.pop(request_id, None) is not None:
            return True
        for f, r in self.flight.items():
            if r.request_id == request_id:
                if not f.cancel():  # running: its result is dropped
                    self.aborted.add(request_id)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.flight)

    # -- one step ---------------------------------------------------------------------------------
    def _submit(self) -> None:
        """Waiting requests to the workers, first come first served, within the budgets in flight."""
        info = self.info
        for r in list(self.waiting.values()):
            n = len(r.prompt_ids)
            if self.flight and (
                len(self.flight) == info.max_batch_size
                or self.flight_tokens + n > info.max_batch_prefill_tokens
            ):
                break
            del self.waiting[r.request_id]
            self.flight[self.workers.submit(self._compute, r)] = r
            self.flight_tokens += n

    def step(self) -> list[P.PoolOut | P.TokenOut]:
        """Hand the waiting requests to the workers, then return the results of those that finished
        (waiting for the first one if none has)."""
        self._submit()
        if not self.flight:
            self.last_step = P.StepInfo()
            return []
        t0 = time.monotonic()
        done, _ = wait(self.flight, return_when=FIRST_COMPLETED)
        out: list[P.PoolOut | P.TokenOut] = []
        failed = False
        tokens = 0
        for f in done:
            r = self.flight.pop(f)
            self.flight_tokens -= len(r.prompt_ids)
            tokens += len(r.prompt_ids)
            if f.cancelled() or r.request_id in self.aborted:
                self.aborted.discard(r.request_id)
                continue
            o = f.result()
            failed |= isinstance(o, P.TokenOut)
            out.append(o)
        self.num_failed_steps += failed
        self.last_step = P.StepInfo(time.monotonic() - t0, len(done), tokens, "prefill", failed)
        return out

    def _compute(self, r: PoolRequest) -> P.PoolOut | P.TokenOut:
        """One request's vector (on a worker thread); a failure fails this request alone."""
        try:
            return self._pooled(r)
        except Exception as exc:  # a failing prompt fails exactly its own request
            log.exception("pooling failed for %s", r.request_id)
            return P.TokenOut(r.request_id, finish_reason="error", error=f"{type(exc).__name__}: {exc}")

    def _pooled(self, r: PoolRequest) -> P.PoolOut:
        n = len(r.prompt_ids)
        started = time.monotonic()
        hidden = self.model(torch.tensor(r.prompt_ids), [n], self._types([r], [n]))
        p = r.params
        if self.info.task == "classify":  # the labels' logits: the API applies sigmoid or softmax
            vec = self.model.classify(hidden, [n])[0]
        elif p.tokens:
            vec = hidden.float()
        else:
            vec = embedding(pool(hidden, [n], self.pooling)[0], self.pooling, p)
        data = vec.contiguous().numpy().tobytes()
        return P.PoolOut(r.request_id, data, vec.shape[0] if p.tokens else 1, n, started - r.arrived)

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
        self.workers.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> P.EngineStatsFields:
        return {
            "running": len(self.flight),
            "waiting": len(self.waiting),
            "kv_cache_usage": 0.0,
            "prefix_cache_hit_rate": 0.0,
            "preemptions": 0,
            "failed_steps": self.num_failed_steps,
        }
