"""The engine: requests in, per-step token updates out (TGI's batching_task, one step a call).

Single-threaded and synchronous: the caller (the offline `LLM`, or the engine process's loop)
adds and aborts requests between steps and calls `step()` while `has_unfinished()`. A step is
schedule → execute → update; the scheduler keeps the books, the runner computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from pytgi.core import grammar as structured
from pytgi.core import protocol as P
from pytgi.core.adapters import AdapterError
from pytgi.core.config import EngineConfig
from pytgi.core.cpus import process_cpus
from pytgi.core.errors import ConfigError, DistributedError, InvalidRequest, UnsupportedModel
from pytgi.core.image_geometry import image_places
from pytgi.core.model_files import ResolvedModel, resolve_adapters, resolve_model
from pytgi.core.paths import files_stamp
from pytgi.core.pooling import (
    DECODER_CLASSIFIERS,
    PoolingInfo,
    architecture,
    check_pool_request,
    is_encoder,
    model_task,
    read_labels,
    read_pooling,
    token_labels,
)
from pytgi.core.sampling_params import SamplingParams, check_logit_bias, check_prompt
from pytgi.engine.adapter_registry import AdapterRegistry
from pytgi.engine.distributed.local_ranks import ShardGroup, set_cpu_threads
from pytgi.engine.execution.images import ImageInputs, PromptImage
from pytgi.engine.execution.runner import ModelRunner
from pytgi.engine.execution.threads import ThreadGovernor
from pytgi.engine.kv.blocks import BlockManager
from pytgi.engine.kv.disk_tier import DiskTier, fingerprint
from pytgi.engine.kv.sizing import GIB, free_bytes
from pytgi.engine.loading.checkpoints import file_quantization
from pytgi.engine.loading.model import read_config
from pytgi.engine.models.decoder import DecoderConfig
from pytgi.engine.models.layers import dynamic_rope, long_rope
from pytgi.engine.pooling.head import PoolHead
from pytgi.engine.scheduling.request import Request
from pytgi.engine.scheduling.scheduler import Scheduler

if TYPE_CHECKING:
    from pytgi.engine.speculation.draft_model import DraftModel

log = logging.getLogger(__name__)


class LLMEngine:
    """`runner_cls` builds rank 0's runner from the placed config (tests pass a subclass that
    fails on purpose)."""

    def __init__(
        self,
        config: EngineConfig,
        runner_cls: type[ModelRunner] = ModelRunner,
        model: ResolvedModel | None = None,
    ) -> None:
        """`model`: `config.model` resolved already (`start_engine` resolves it once)."""
        config.validate()
        if model is None:
            model = resolve_model(config.model, progress=config.progress, revision=config.revision)
        model_path, model_id = model.path, model.model_id
        task = model_task(model_path, config.task)
        if task != "generate" and is_encoder(model_path):  # pytgi.engine.pooling.encoder_engine's
            what = "an embedding model" if task == "embed" else "a cross-encoder"
            raise UnsupportedModel(
                f"{model_id} is {what}: `pytgi serve` serves it on its own routes (docs/embeddings.md); it "
                "does not generate text"
            )
        if task != "generate":  # a causal LM's pooling: its prompt only, then its last token's state
            check_decoder_pooling(config)
            if read_config(model_path).get("is_causal") is False:
                raise UnsupportedModel(
                    f"{model_id}: config.json says is_causal false (the model attends both ways), and "
                    "pytgi's paged engine attends causally: its vectors would not be the model's "
                    "(docs/embeddings.md)"
                )
            if (
                task == "classify"
                and not config.classifier_tokens
                and architecture(model_path) not in DECODER_CLASSIFIERS
            ):
                raise ConfigError(
                    f"{model_id} is a causal LM: --task classify needs --classifier-tokens, the negative "
                    "and the positive token whose logits score a pair (Qwen3-Reranker: no,yes)"
                )
            config = dataclasses.replace(config, task=task, enable_prefix_caching=False)
        adapters = resolve_adapters(config.lora_adapters, config.progress)
        if model_id in adapters:
            raise AdapterError(
                f"--lora-adapters: {model_id!r} names the base model; name the adapter otherwise"
            )
        config = dataclasses.replace(config, lora_adapters=tuple(f"{n}={p}" for n, p in adapters.items()))
        self.config = config
        # One cleanup path: whatever has started (the ranks, rank 0's runner) is stopped, in the
        # reverse order, if a later part of the start fails.
        with contextlib.ExitStack() as started:
            self._start(config, runner_cls, task, model_id, model_path, adapters, started)
            started.pop_all()

    def _start(
        self,
        config: EngineConfig,
        runner_cls: type[ModelRunner],
        task: str,
        model_id: str,
        model_path: Path,
        adapters: dict[str, Path],
        started: contextlib.ExitStack,
    ) -> None:
        """The engine's parts, each registered in `started` to be stopped if a later one fails: the
        ranks and rank 0's runner (the model and its KV cache, a recurrent model's state pool, a pooling
        model's head), the block manager, the images, a draft model, the disk tier, the scheduler and
        the adapters."""
        t0 = time.perf_counter()
        self.shards = ShardGroup(dataclasses.replace(config, model=str(model_path)))
        started.callback(self.shards.stop)
        threads = set_cpu_threads(self.shards.local_ranks, config.threads)
        self.runner = runner = runner_cls(self.shards.config, rank=0)
        started.callback(runner.shutdown)
        # fewer threads while other processes take the CPUs: where the count is pytgi's choice, alone
        self.governor: ThreadGovernor | None = None
        own_choice = config.threads is None and "OMP_NUM_THREADS" not in os.environ
        if own_choice and runner.device.type == "cpu" and self.shards.world_size == 1 and threads > 1:
            self.governor = ThreadGovernor(threads, process_cpus().usable, torch.set_num_threads)
        load_seconds = time.perf_counter() - t0
        self.eos_token_ids = runner.eos_token_ids
        placed, kv_capacity = (
            self.shards.config,
            lambda: runner.auto_num_tokens(config.kv_cache_memory_fraction, config.kv_cache_cpu_bytes),
        )
        if runner.state_bytes and task != "generate":
            raise UnsupportedModel(f"{model_id}: a model with recurrent layers is not served for pooling")
        checkpoints = 0
        if runner.state_bytes:  # linear attention, Mamba-2...: a recurrent state per running request
            placed, kv_capacity, checkpoints = _with_states(placed, runner, kv_capacity)
        pooling = None
        if task != "generate":
            pooling = self._pooling(task, model_id, model_path, runner)
            placed = pooling_sizes(placed, pooling, runner.config.max_position_embeddings, runner.device.type)
        self.info = placed.resolve(
            model_id=model_id,
            model_path=str(model_path),
            dtype=str(runner.dtype).removeprefix("torch."),
            device_type=runner.device.type,
            vocab_size=runner.vocab_size,
            max_positions=runner.config.max_position_embeddings,
            quantization=file_quantization(model_path),
            kv_capacity=kv_capacity,
        )
        if pooling is not None:
            self.info = msgspec.structs.replace(self.info, task=task, pooling=pooling)
            runner.pool_head = PoolHead(runner.model, pooling, task)
        slots = self.info.max_batch_size if runner.state_bytes else 0
        self.block_manager = BlockManager(
            self.info.num_blocks,
            config.block_size,
            self.info.enable_prefix_caching,
            slots,
            checkpoints,
            runner.state_grid or 1,
        )
        runner.allocate_kv_cache(self.info.num_blocks, config.block_size, slots + checkpoints)
        self.images: ImageInputs | None = None
        image_processor = getattr(runner.model, "image_processor", None)  # a vision model's
        if image_processor is not None:
            self.images = ImageInputs(image_processor(model_path), config.mm_cache_size)
            self.info = msgspec.structs.replace(self.info, image_layout=self.images.layout)
        drafter = self._draft_model(config, model_path) if config.draft_model else None
        self.disk = None
        if config.prefix_cache_dir and self.info.enable_prefix_caching:
            self.disk = self._disk_tier(config, model_path)
        elif config.prefix_cache_dir:  # a recurrent model without checkpoints (`_with_states`)
            log.warning("--prefix-cache-dir: off, as is the prefix cache (no state checkpoints)")
        self.scheduler = Scheduler(self.info, self.block_manager, drafter=drafter, disk=self.disk)
        self.num_failed_steps = 0
        self.adapters = AdapterRegistry(
            runner,
            {name: str(path) for name, path in adapters.items()},
            model_id,
            config.progress,
            self._adapters_in_use,
        )
        self.last_step = P.StepInfo()  # what the last step did, for the metrics
        kv_bytes = self.info.max_batch_total_tokens * runner.paged.kv_bytes_per_token()
        log.info(
            "engine ready: %s on %s (%s): weights %.2f GiB, KV cache %d tokens (%.2f GiB), "
            "%.1f GiB left available; load %.1fs",
            model_id,
            runner.device,
            runner.dtype,
            runner.weights_bytes() / GIB,
            self.info.max_batch_total_tokens,
            kv_bytes / GIB,
            free_bytes(runner.device) / GIB,
            load_seconds,
        )

    def _pooling(self, task: str, model_id: str, model_path: Path, runner: ModelRunner) -> PoolingInfo:
        """A causal LM's pooling: its sentence-transformers files' (an embedder), its classifier's labels
        (a `*ForSequenceClassification`), or --classifier-tokens' (a causal LM as a reranker)."""
        if task == "embed":
            config = runner.config
            assert isinstance(config, DecoderConfig), "a pooling model runs on pytgi's own code"
            return read_pooling(model_path, config.hidden_size, decoder=True)
        names = self.config.classifier_tokens
        if not names:  # a `*ForSequenceClassification` (checked before loading)
            return read_labels(model_path)
        from pytgi.core.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(model_path)
        ids = []
        for name in names:
            one = tok.encode(name, add_special_tokens=False)
            if len(one) != 1:
                raise ConfigError(
                    f"--classifier-tokens: {name!r} is {len(one)} tokens of this model, not one"
                )
            ids.append(one[0])
        return token_labels(model_path, tuple(ids), names)

    def _draft_model(self, config: EngineConfig, model_path: Path) -> DraftModel:
        from pytgi.engine.speculation.draft_model import DraftModel

        assert config.draft_model is not None
        runner = self.runner
        return DraftModel(
            config.draft_model,
            self.info.speculate,
            model_path,
            runner.vocab_size,
            runner.device,
            config.block_size,
            self.info.num_blocks,
            self.eos_token_ids,
            config.batch_invariant,
            config.progress,
        )

    def _disk_tier(self, config: EngineConfig, model_path: Path) -> DiskTier:
        """The prefix cache's disk tier, its files named by everything the KV bits (and a hybrid
        model's states) depend on."""
        import torch

        model_files = files_stamp(model_path)
        parts = model_path / "gguf.json"  # a GGUF file's converted directory: the file itself
        if parts.is_file():
            model_files += [s for p in json.loads(parts.read_text())["parts"] for s in files_stamp(Path(p))]
        runner = self.runner
        caches = runner.paged.attention_caches()  # (a hybrid's states are not KV blocks)
        states = runner.paged.state_tensors() if self.block_manager.checkpointing else []
        fp = fingerprint(
            model=self.info.model_id,
            revision=config.revision,
            files=model_files,
            quantize=config.quantize,
            dtype=str(runner.dtype),
            kv=(config.kv_cache_dtype, str(caches[0][0].dtype), tuple(caches[0][0].shape[1:]), len(caches)),
            block_size=config.block_size,
            batch_invariant=config.batch_invariant,
            device=runner.device.type,
            torch=torch.__version__,
            states=[(tuple(t.shape[1:]), str(t.dtype)) for t in states],
            state_grid=runner.state_grid if states else None,
        )
        assert config.prefix_cache_dir is not None
        return DiskTier(
            config.prefix_cache_dir,
            config.prefix_cache_disk_bytes,
            fp,
            self.block_manager,
            caches,
            config.prefix_cache_verify_rate,
            states,
        )

    @property
    def model_path(self) -> Path:
        return Path(self.info.model_path)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, images: Sequence[bytes] = ()
    ) -> None:
        """`images`: the encoded images (PNG, JPEG, ...) of the prompt's image tokens, in order (a
        vision model's; pytgi.engine.execution.images)."""
        if request_id in self.scheduler.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        info = self.info
        if info.task != "generate":
            raise InvalidRequest(
                f"the model `{info.model_id}` computes embeddings; it does not generate text"
            )
        params.validate()
        placed: list[PromptImage] = []
        if self.images is not None:  # its image tokens and its images must agree, none included
            prompt_ids, placed = self.images.prepare(prompt_ids, images)
        else:
            image_places(prompt_ids, None, len(images), "images")
        adapter = params.adapter
        if adapter is not None:
            self.adapters.check(adapter)  # its weights are made resident by the step that runs it
        check_logit_bias(params.logit_bias, info.vocab_size)
        check_prompt(
            prompt_ids, params.max_new_tokens, info.max_input_tokens, info.max_total_tokens, info.vocab_size
        )
        grammar = structured.check(params)  # cached per grammar: the API process checked it already
        self.scheduler.add(
            Request(
                request_id,
                list(prompt_ids),
                params,
                self.eos_token_ids,
                speculative=grammar is None and not params.watermark,
                cache_root=self._cache_root(adapter, placed, prompt_ids),
                images=placed,
            )
        )
        if grammar is not None:
            self.runner.grammars.add(request_id, grammar, params.ignore_eos)

    def _cache_root(
        self, adapter: str | None, images: list[PromptImage], prompt_ids: Sequence[int]
    ) -> object:
        """Where the request's prefix-cache chain starts: blocks are shared only among requests for
        the same adapter load and the same images (by content)."""
        root: object = None if adapter is None else self.adapters.cache_root(adapter)
        if images:
            root = (root, tuple(img.digest for img in images))
        rope = long_rope(self.runner.model)
        if rope is not None and len(prompt_ids) > rope[0]:
            root = ("long rope", root)  # its keys are made with the long table from the start
        original = dynamic_rope(self.runner.model)
        if original is not None and len(prompt_ids) > original:
            root = ("dynamic rope", len(prompt_ids), root)  # its prompt's frequencies are its length's
        return root

    # -- LoRA adapters at run time -------------------------------------------------------------------
    def _adapters_in_use(self) -> set[str | None]:
        return {r.params.adapter for r in self.scheduler.requests.values()}

    def submit(self, msg: P.Submit) -> None:
        """A request from the API process: a generation, or a pooling model's (`msg.pool`)."""
        if msg.pool is not None:
            self.add_pool_request(msg.request_id, msg.prompt_ids, msg.pool)
        else:
            self.add_request(msg.request_id, msg.prompt_ids, msg.params, msg.images)

    def add_pool_request(self, request_id: str, prompt_ids: list[int], params: P.PoolParams) -> None:
        """A pooling model's request: its prompt computed (in chunks, with the running batch), then its
        last token's state is its answer (`PoolHead`)."""
        if self.info.task == "generate":
            raise InvalidRequest(
                f"the model `{self.info.model_id}` generates text; it computes no embeddings"
            )
        if request_id in self.scheduler.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        check_pool_request(self.info, prompt_ids, params)
        self.scheduler.add(
            Request(
                request_id,
                list(prompt_ids),
                POOL_SAMPLING,
                self.eos_token_ids,
                speculative=False,
                pool=params,
            )
        )

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req)
        self.runner.release(request_id)
        if self.adapters.unloading:
            self.adapters.settle()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[P.TokenOut | P.PoolOut]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.last_step = P.StepInfo()
            if self.disk is not None and self.disk.reads:
                self.disk.wait(0.05)  # a request waits for its blocks from disk
            return []
        if self.governor is not None:
            self.governor.step()
        t0 = time.monotonic()
        failed = False
        try:
            self.adapters.prepare([s.request.params.adapter for s in sched.scheduled])
            if sched.state_copies:
                self.runner.copy_states(sched.state_copies)
            updates = self.scheduler.update_from_output(sched, self.runner.execute(sched.scheduled))
        except DistributedError:
            raise  # a lost rank is not this step's fault: the engine cannot go on
        except Exception as exc:  # a failing step fails exactly its own requests
            log.exception("step failed for %d requests", len(sched.scheduled))
            self.num_failed_steps += 1
            failed, updates = True, [*self.scheduler.fail(sched, f"{type(exc).__name__}: {exc}")]
        self.last_step = P.StepInfo(
            time.monotonic() - t0,
            len(sched.scheduled),
            sched.num_tokens,
            "prefill" if sched.has_prompt else "decode",
            failed,
        )
        for u in updates:
            if not isinstance(u, P.TokenOut) or u.finish_reason is not None:
                self.runner.release(u.request_id)
        if self.adapters.unloading:
            self.adapters.settle()
        return updates

    def check_alive(self) -> None:
        """Raise DistributedError if a shard is gone (called while idle)."""
        self.shards.check()
        self.runner.ping()

    def shutdown(self) -> None:
        disk = self.disk
        if disk is not None:
            disk.drain()  # the writes in flight land: a restart finds them
            disk.close()
        self.runner.shutdown()
        self.shards.stop()

    def stats(self) -> P.EngineStatsFields:
        waiting_adapters = {r.params.adapter for r in self.scheduler.waiting if r.params.adapter}
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.block_manager.usage,
            "prefix_cache_hit_rate": self.block_manager.hit_rate,
            "preemptions": self.scheduler.num_preemptions,
            "failed_steps": self.num_failed_steps,
            "spec_drafted": self.scheduler.spec_drafted,
            "spec_accepted": self.scheduler.spec_accepted,
            "waiting_adapters": sorted(waiting_adapters),
            "disk": None if self.disk is None else msgspec.structs.replace(self.disk.stats),
            "pinned_blocks": len(self.block_manager.pins),
            "state_checkpoints": len(self.block_manager.checkpoints),
        }


POOL_SAMPLING = SamplingParams(max_new_tokens=1)  # a pooling request's: it samples nothing
POOL_MAX_INPUT = 8192  # a pooling model's longest input by default, where its files set none


def pooling_sizes(config: EngineConfig, pooling: PoolingInfo, positions: int, device: str) -> EngineConfig:
    """A causal LM served for pooling: its longest input by default its sentence-transformers
    `max_seq_length` (else 8192 tokens, at most its positions), and its KV cache by default only what
    its prompts in flight need, not a generator's share of memory: a request's KV lives until its
    prompt's last chunk, so the longest input and four steps' worth of chunks beside it."""
    limit = min(pooling.max_seq_length or POOL_MAX_INPUT, positions - 1)
    max_input = config.max_input_tokens or (
        min(config.max_total_tokens - 1, limit) if config.max_total_tokens else limit
    )
    prefill = config.max_batch_prefill_tokens or (4096 if device == "cuda" else 1024)
    return dataclasses.replace(
        config,
        max_input_tokens=max_input,
        max_total_tokens=config.max_total_tokens or max_input + 1,
        max_batch_total_tokens=config.max_batch_total_tokens or max_input + 1 + 4 * prefill,
    )


def check_decoder_pooling(config: EngineConfig) -> None:
    """Settings a causal LM served for pooling cannot take, refused at start in one line."""
    asked = config.pooling_refusals()
    if asked:
        raise ConfigError(
            f"{', '.join(asked)}: not with a causal LM served for pooling (embeddings, scores), which runs "
            "on one rank without adapters (docs/embeddings.md)"
        )


def _states_alone(
    config: EngineConfig, runner: ModelRunner, kv_capacity: Callable[[], int]
) -> tuple[EngineConfig, Callable[[], int], int]:
    """A model whose every layer keeps a state and none keys and values (Mamba, FalconMamba): the
    memory budget (`kv_capacity()` gives bytes for such a model) holds --max-batch-size states, by
    default as many as fit, at most 256, and the prefix cache's checkpoints: by default one a running
    state (the budget then split in halves), or `--prefix-cache-state-bytes`. Its KV blocks cost
    nothing: they only count positions (and name the prefixes the checkpoints end at), so the cache
    holds each running request's positions (`--max-batch-total-tokens` where given). Returns the
    config, the positions and the checkpoints."""
    state = runner.state_bytes
    caching = config.enable_prefix_caching and bool(runner.state_grid)
    asked = config.prefix_cache_state_bytes if caching else 0  # None: one a running state
    slots = config.max_batch_size
    if slots is None:
        budget = kv_capacity()
        slots = max(1, min(256, budget // (2 * state) if asked is None else (budget - asked) // state))
    checkpoints = slots if asked is None else asked // state
    log.info(
        "recurrent states for %d running requests (%.2f GiB) and %d checkpoints (%.2f GiB); no attention "
        "layer: no KV cache",
        slots,
        slots * state / 2**30,
        checkpoints,
        checkpoints * state / 2**30,
    )
    if config.enable_prefix_caching and not runner.state_grid:
        log.info("prefix caching is off: a recurrent layer kind of this model says no state grid")
    # (at most 2M positions: the block manager's bookkeeping grows with them, and 2M are 8192 a request
    # for 256 requests)
    positions = min(slots * runner.config.max_position_embeddings, 1 << 21)
    return (
        dataclasses.replace(config, max_batch_size=slots, enable_prefix_caching=checkpoints > 0),
        lambda: positions,
        checkpoints,
    )


def _with_states(
    config: EngineConfig, runner: ModelRunner, kv_capacity: Callable[[], int]
) -> tuple[EngineConfig, Callable[[], int], int]:
    """A model with recurrent layers (Qwen3-Next's and Qwen3.5's linear attention, the Mamba-2
    hybrids', LFM2's convolutions...): each running request holds a recurrent state beside its KV
    blocks. The states cannot take back rejected drafts, so speculation is refused.
    --max-batch-size states are allocated (by default as many as a quarter of the KV cache's memory
    holds, at most 256), then the prefix cache's checkpoints (`--prefix-cache-state-bytes`, by default
    an eighth of that memory and at least one a running request; only for models whose every
    recurrent kind declares the positions its states are exact at), and the KV cache gets what is
    left. With `--prefix-cache-dir` the disk tier keeps each checkpoint's states beside the block it
    ends at, within the same byte bound (docs/prefix-cache.md); where there are no checkpoints, the
    disk tier is off too. Returns the config, the KV cache's capacity and the checkpoints."""
    if config.draft_tokens > 0:
        raise ConfigError(
            "--speculate / --draft-model-id: not with a model with recurrent layers (linear attention, "
            "Mamba, short convolutions): a verify step advances each request's state through all of its "
            "draft tokens in place, and a state keeps no positions to drop the rejected ones from, as the "
            'KV cache does (docs/models.md, "Speculation on hybrids")'
        )
    state, per_token = runner.state_bytes, runner.paged.kv_bytes_per_token()
    if not per_token:  # no attention layer (Mamba): the states and checkpoints take the whole budget
        return _states_alone(config, runner, kv_capacity)
    measured: int | None = None

    def memory_tokens() -> int:  # the KV cache's tokens before the states take their share
        nonlocal measured
        if config.max_batch_total_tokens is not None:
            return config.max_batch_total_tokens
        if measured is None:
            measured = kv_capacity()  # measured once: the KV cache is sized from the same figure
        return measured

    slots = config.max_batch_size
    if slots is None:
        tokens = memory_tokens()
        slots = max(1, min(256, tokens * per_token // 4 // state))
        if slots < 16:  # a small --max-batch-total-tokens leaves few: requests past them wait their turn
            log.warning(
                "recurrent states for %d running requests only (a quarter of a %d-token KV cache's "
                "memory); --max-batch-size N keeps N",
                slots,
                tokens,
            )
    log.info("recurrent states for %d running requests (%.2f GiB)", slots, slots * state / 2**30)
    checkpoints = 0
    if config.enable_prefix_caching and not runner.state_grid:
        log.info("prefix caching is off: a recurrent layer kind of this model says no state grid")
    elif config.enable_prefix_caching:
        budget = config.prefix_cache_state_bytes
        if budget is None:  # an eighth of the KV cache's memory, and at least a checkpoint a running
            # request (a KV cache held small by --max-batch-total-tokens would otherwise leave none)
            budget = max(memory_tokens() * per_token // 8, slots * state)
        checkpoints = budget // state
        if checkpoints:
            log.info(
                "prefix cache: %d checkpoints of the recurrent states (%.2f GiB)",
                checkpoints,
                checkpoints * state / 2**30,
            )
        else:
            log.info(
                "prefix caching is off: --prefix-cache-state-bytes holds no recurrent state (%d bytes)", state
            )
    taken = -(-(slots + checkpoints) * state // per_token)  # the states' memory, in KV tokens
    return (
        dataclasses.replace(config, max_batch_size=slots, enable_prefix_caching=checkpoints > 0),
        lambda: max((kv_capacity() if measured is None else measured) - taken, 0),
        checkpoints,
    )
