"""The model runner: one step's scheduled requests in, sampled tokens (and logprobs) out.

Rank 0's runner lays the step out (`StepBatch`), picks the logit rows it needs (`SamplingStep.plan`),
runs the forward over the paged KV cache (`PagedModel`) and samples (`SamplingStep.run`). With tensor
parallelism it first broadcasts the step's arrays, and the other ranks' runners
(`pytgi.engine.distributed.worker`) run the same forward on their shards: the commands of that protocol are
`pytgi.engine.distributed.commands`'.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from pytgi.core.adapters import parse_specs
from pytgi.core.config import EngineConfig
from pytgi.core.errors import UnsupportedModel
from pytgi.engine import distributed as dist
from pytgi.engine.distributed import commands
from pytgi.engine.distributed.step_message import StepMessage
from pytgi.engine.execution.batch import StepBatch
from pytgi.engine.execution.cuda_graphs import parse_sizes
from pytgi.engine.execution.images import step_rows
from pytgi.engine.kv.sizing import kv_tokens_on_every_rank
from pytgi.engine.loading.model import eos_token_ids
from pytgi.engine.loading.rank import load_paged_model, resolve_device
from pytgi.engine.loading.sizes import loaded_bytes
from pytgi.engine.models.causal_lm import CausalLM
from pytgi.engine.models.decoder import DecoderModel, StepImages
from pytgi.engine.models.layers import DYNAMIC_SHIFT, dynamic_rope, long_rope
from pytgi.engine.models.lora import LoraAdapters
from pytgi.engine.models.vision import VisionLanguageModel
from pytgi.engine.pooling.head import PoolHead
from pytgi.engine.sampling.grammars import GrammarMatchers
from pytgi.engine.sampling.step import SamplingStep
from pytgi.engine.scheduling.step import ScheduledRequest, StepOutput

log = logging.getLogger(__name__)


class ModelRunner:
    """`config.model` is the model's directory; with several shards `config.master_port` is set."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        assert config.model is not None, "the runner loads a resolved model directory"
        model_path = Path(config.model)
        self.device = resolve_device(config.device)
        self.rank = rank
        dist.init(rank, config.num_shard, config.master_addr, config.master_port or 0, self.device)
        try:
            self.paged = load_paged_model(config, self.device)
        except BaseException:  # a refused model leaves no process group behind (an engine in-process)
            dist.shutdown()
            raise
        self.dtype = self.paged.dtype
        self.state_bytes = self.paged.state_bytes_per_request()  # per running request (linear attention)
        self.state_grid = self.paged.state_grid()  # where those states are exact (0: unknown)
        model = self.paged.model
        # what the runner keeps of the engine's settings
        self.max_lora_rank, self.max_cpu_loras = config.max_lora_rank, config.max_cpu_loras
        self.local_replicas = config.local_replicas
        self.graph_sizes = tuple(
            s for s in parse_sizes(config.cuda_graphs) if s <= (config.max_batch_size or 256)
        )
        self.lora: LoraAdapters | None = None
        if config.lora_adapters:
            self.lora = self.adapters()
            for spec in parse_specs(config.lora_adapters):
                self.lora.register(spec.name, Path(spec.source))
        self.config = model.config
        self.vocab_size = self.config.vocab_size
        self.eos_token_ids = eos_token_ids(model_path)
        # Structured output's matchers (rank 0 samples; nothing is built until a request asks).
        self.grammars = GrammarMatchers(model_path / "tokenizer.json", self.vocab_size, self.eos_token_ids)
        self.sampling = SamplingStep(self.vocab_size, self.device, self.grammars)
        self.pool_head: PoolHead | None = None  # a pooling model's (set by the engine once it knows)

    def adapters(self) -> LoraAdapters:
        """The model's LoRA adapters (the targeted linears are wrapped the first time)."""
        if self.lora is None:
            family = self.paged.family
            if family is None:
                raise UnsupportedModel("LoRA adapters need pytgi's own implementation of the model")
            if not family.lora:
                raise UnsupportedModel(f"LoRA adapters on {family.name} are not supported (docs/models.md)")
            assert isinstance(self.model, DecoderModel), "a family with LoRA runs on DecoderModel"
            self.lora = LoraAdapters(
                self.model, self.max_lora_rank, self.dtype, self.device, self.max_cpu_loras
            )
        return self.lora

    def adapters_changed(self) -> None:
        """Rank 0, after adapters were loaded or unloaded: the other ranks mirror them."""
        if self.rank != 0 or dist.tp_size() == 1 or self.lora is None:
            return
        state = np.frombuffer(json.dumps(self.lora.state()).encode(), np.uint8).astype(np.int64)
        commands.send(commands.Adapters(len(state)))
        dist.broadcast_arrays([state], [(len(state),)])

    def worker_adapters(self, n: int) -> None:
        """Ranks > 0: load and unload adapters as rank 0 did."""
        (state,) = dist.broadcast_arrays(None, [(n,)])
        self.adapters().mirror(json.loads(state.astype(np.uint8).tobytes()))

    @property
    def model(self) -> CausalLM:
        return self.paged.model

    @model.setter
    def model(self, model: CausalLM) -> None:  # tests swap in a model on other kernels
        self.paged.model = model

    # -- KV cache ---------------------------------------------------------------------------------
    def auto_num_tokens(self, fraction: float | None, cap_bytes: int | None) -> int:
        """KV slots that fit on every rank (`pytgi.engine.kv.sizing`): `fraction` (None: the device's
        default) of the memory left now, shared by the ranks on this machine, at most `cap_bytes`."""
        if self.rank == 0 and dist.tp_size() > 1:
            commands.send(commands.Capacity(fraction, cap_bytes))
        # a model without attention layers (Mamba) keeps no keys: its budget comes back in bytes,
        # which `_with_states` gives to the recurrent states
        per_token = self.paged.kv_bytes_per_token() or 1
        return kv_tokens_on_every_rank(self.device, per_token, fraction, self.local_replicas, cap_bytes)

    def weights_bytes(self) -> int:
        """The bytes this rank's model holds (packed weights, dense ones, tables)."""
        return loaded_bytes(self.model)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, state_slots: int = 0) -> None:
        """`state_slots`: recurrent states for that many running requests (a model with linear attention)."""
        if self.rank == 0 and dist.tp_size() > 1:
            commands.send(commands.Allocate(num_blocks, block_size, state_slots))
        self.paged.allocate(num_blocks, block_size, state_slots)
        if self.device.type == "cuda" and dist.tp_size() == 1:
            self._capture_graphs()

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Before a step: copy recurrent states between pool rows (the prefix cache's checkpoints
        saved and restored), on every rank."""
        if self.rank == 0 and dist.tp_size() > 1:
            commands.send(commands.CopyStates(len(copies)))
            dist.broadcast_arrays([np.array(copies, dtype=np.int64).reshape(-1)], [(2 * len(copies),)])
        self.paged.copy_states(copies)

    def worker_copy_states(self, count: int) -> None:
        """Ranks > 0: the copies rank 0 makes."""
        (flat,) = dist.broadcast_arrays(None, [(2 * count,)])
        self.paged.copy_states([(int(a), int(b)) for a, b in flat.reshape(-1, 2)])

    def _capture_graphs(self) -> None:
        """The decode step's CUDA graphs, at `--cuda-graphs`' batch sizes up to `--max-batch-size`."""
        sizes = self.graph_sizes
        max_pos = (
            getattr(self.config, "max_position_embeddings", None)
            or self.paged.num_blocks * self.paged.block_size
        )
        start = time.perf_counter()
        if self.paged.capture_graphs(sizes, -(-max_pos // self.paged.block_size)):
            log.info(
                "captured the decode step as CUDA graphs for batch sizes %s in %.1f s",
                ",".join(map(str, sizes)),
                time.perf_counter() - start,
            )

    # -- one step ---------------------------------------------------------------------------------
    def layout(self, batch: list[ScheduledRequest]) -> StepBatch:
        reqs = [s.request for s in batch]
        step = StepBatch.build(
            [s.tokens for s in batch],
            [r.num_computed_tokens for r in reqs],
            [r.block_table for r in reqs],
            self.paged.block_size,
        )
        spans = [  # the images this step computes whose positions attend to each other both ways
            (i, *img.span)
            for i, r in enumerate(reqs)
            for img in r.images
            if img.span is not None
            and img.span[0] < r.num_computed_tokens + batch[i].num_new_tokens
            and img.span[1] > r.num_computed_tokens
        ]
        if spans:
            step.layout.spans = np.array(spans, dtype=np.int64)
        if self.state_bytes:
            step.layout.state_slots = np.array([r.state_slot for r in reqs], dtype=np.int64)
        if (rope := long_rope(self.model)) is not None:  # LongRoPE: long sequences' table
            after, offset = rope
            long = [
                max(len(r.prompt_ids), r.num_computed_tokens + s.num_new_tokens) > after
                for r, s in zip(reqs, batch)
            ]
            if any(long):
                step.positions = step.positions + np.repeat(
                    np.array(long, dtype=np.int64) * offset, step.layout.query_lens
                )
        if (original := dynamic_rope(self.model)) is not None:  # dynamic NTK: each token's length
            prompts = np.repeat(np.array([len(r.prompt_ids) for r in reqs], np.int64), step.layout.query_lens)
            length = np.maximum(prompts, step.positions + 1)
            step.positions = np.where(
                length > original, step.positions | (length << DYNAMIC_SHIFT), step.positions
            )
        return step

    @torch.inference_mode()  # the sampling step too: it edits the logits in place
    def execute(self, batch: list[ScheduledRequest]) -> StepOutput:
        step = self.layout(batch)
        if self.pool_head is not None:  # a pooling model (one rank, no adapters, no images)
            return self.pool_head.step(self.paged, batch, step)
        plan = self.sampling.plan(batch, step.last_rows)
        slots = None
        if self.lora is not None:
            adapters = [s.request.params.adapter for s in batch]
            slots = self.lora.row_slots(adapters, step.layout.query_lens)
        images = self._image_rows(batch, step)  # the tower runs on rank 0; the others get its rows
        if dist.tp_size() > 1:
            StepMessage.of(step, plan.rows, slots, images).send(self.dtype)
        return self.sampling.run(self._forward(step, plan.rows, slots, images), plan)

    def _image_rows(self, batch: list[ScheduledRequest], step: StepBatch) -> StepImages | None:
        """The step's rows at image positions and their image rows (computed now where not yet)."""
        if not any(s.request.images for s in batch):
            return None
        firsts = np.cumsum(step.layout.query_lens) - step.layout.query_lens
        spans = [
            (
                int(first),
                s.request.num_computed_tokens,
                s.num_new_tokens - len(s.draft),
                int(n),
                s.request.images,
            )
            for s, first, n in zip(batch, firsts, step.layout.query_lens)
            if s.request.images
        ]
        model = self.paged.model
        assert isinstance(model, VisionLanguageModel), "a request with images runs on a vision model"
        return step_rows(model, spans)

    def _forward(
        self,
        step: StepBatch,
        rows: np.ndarray,
        slots: np.ndarray | None,
        image_rows: StepImages | None = None,
    ) -> torch.Tensor | None:
        """The forward, with each row's LoRA adapter (`slots`, None: no row has one)."""
        if slots is None or self.lora is None:
            return self.paged.forward(step, rows, image_rows)
        self.lora.ctx.set(slots, self.device)
        try:
            return self.paged.forward(step, rows, image_rows)
        finally:
            self.lora.ctx.clear()

    def release(self, request_id: str) -> None:
        self.grammars.remove(request_id)
        if self.pool_head is not None:
            self.pool_head.drop(request_id)

    # -- tensor parallelism ------------------------------------------------------------------------
    @torch.inference_mode()
    def worker_step(self, header: tuple[int, ...]) -> None:
        """Ranks > 0: receive rank 0's step (`StepMessage`, whose command arguments are `header`) and
        run this shard's forward."""
        msg = StepMessage.receive(header, self.dtype)
        self._forward(*msg.parts(self.paged.block_size))

    def ping(self) -> None:
        """While idle, a no-op collective: a dead or stuck rank is noticed without waiting for traffic."""
        if self.rank == 0 and dist.tp_size() > 1:
            commands.send(commands.Ping())
            dist.barrier()

    def shutdown(self) -> None:
        self.grammars.shutdown()
        if self.rank == 0 and dist.tp_size() > 1:
            try:
                commands.send(commands.Shutdown())
            except dist.DistributedError:
                pass
        dist.shutdown()
