"""The model runner: one step's scheduled requests in, sampled tokens (and logprobs) out.

Rank 0's runner lays the step out (`StepBatch`), picks the logit rows it needs (`SamplingStep.plan`),
runs the forward over the paged KV cache (`PagedModel`) and samples (`SamplingStep.run`). With tensor
parallelism it first broadcasts the step's arrays, and the other ranks' runners (`pytgi.engine.worker`)
run the same forward on their shards: the commands of that protocol are `pytgi.engine.distributed`'s CMD_*.
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
from pytgi.engine.batch import PagedModel, StepBatch, fp8_kv_refusal
from pytgi.engine.cuda_graphs import parse_sizes
from pytgi.engine.images import step_rows
from pytgi.engine.kv_sizing import check_fits, kv_capacity_tokens, local_engines
from pytgi.engine.models.attention import StepLayout
from pytgi.engine.models.cpu import CpuKernels
from pytgi.engine.models.decoder import DecoderModel, StepImages
from pytgi.engine.models.loader import (
    CausalLM,
    eos_token_ids,
    load_model,
    loaded_bytes,
    read_config,
    resolve_dtype,
    weight_bytes,
)
from pytgi.engine.models.lora import LoraAdapters
from pytgi.engine.sampling_step import SamplingStep
from pytgi.engine.step import ScheduledRequest, StepOutput
from pytgi.engine.structured import GrammarMatchers

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    """`config.model` is the model's directory; with several shards `config.master_port` is set."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        assert config.model is not None, "the runner loads a resolved model directory"
        model_path = Path(config.model)
        self.device = resolve_device(config.device)
        self.rank = rank
        dist.init(rank, config.num_shard, config.master_addr, config.master_port or 0, self.device)
        self.dtype = resolve_dtype(config.dtype, read_config(model_path), self.device)
        # On CPU this builds the C kernels now (about a second, once), not on the first request.
        cpu = CpuKernels.for_device(self.device, self.dtype, batch_invariant=config.batch_invariant)
        share = local_engines(dist.tp_size()) / dist.tp_size()  # of the whole model, on this machine
        need = weight_bytes(model_path, self.dtype, self.device, config.quantize)
        check_fits(int(need * share), self.device, f"the model ({model_path.name})")
        model = load_model(
            model_path,
            self.dtype,
            self.device,
            cpu,
            config.quantize,
            config.attention_backend,
            config.model_impl,
        )
        if config.kv_cache_dtype != "auto" and (why := fp8_kv_refusal(model, self.device)):
            raise ValueError(why)
        self.paged = PagedModel(model, self.dtype, self.device, kv_dtype=config.kv_cache_dtype)
        self.lora_config = config
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

    def adapters(self) -> LoraAdapters:
        """The model's LoRA adapters (the targeted linears are wrapped the first time)."""
        if self.lora is None:
            if not isinstance(self.model, DecoderModel):
                raise UnsupportedModel("LoRA adapters need pytgi's own implementation of the model")
            cfg = self.lora_config
            self.lora = LoraAdapters(
                self.model, cfg.max_lora_rank, self.dtype, self.device, cfg.max_cpu_loras
            )
        return self.lora

    def adapters_changed(self) -> None:
        """Rank 0, after adapters were loaded or unloaded: the other ranks mirror them."""
        if self.rank != 0 or dist.tp_size() == 1 or self.lora is None:
            return
        state = np.frombuffer(json.dumps(self.lora.state()).encode(), np.uint8).astype(np.int64)
        dist.broadcast_command(dist.CMD_LORA, len(state))
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
        """KV slots that fit on every rank (`pytgi.engine.kv_sizing`): `fraction` (None: the device's
        default) of the memory left now, shared by the ranks on this machine, at most `cap_bytes`."""
        if self.rank == 0 and dist.tp_size() > 1:
            f = -1 if fraction is None else int(fraction * 1_000_000)
            dist.broadcast_command(dist.CMD_CAPACITY, f, -1 if cap_bytes is None else cap_bytes)
        local = kv_capacity_tokens(
            self.device,
            self.paged.kv_bytes_per_token(),
            fraction,
            local_engines(dist.tp_size()) * self.lora_config.local_replicas,
            cap_bytes,
        )
        return dist.all_reduce_min(local)

    def weights_bytes(self) -> int:
        """The bytes this rank's model holds (packed weights, dense ones, tables)."""
        return loaded_bytes(self.model)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        if self.rank == 0 and dist.tp_size() > 1:
            dist.broadcast_command(dist.CMD_ALLOC, num_blocks, block_size)
        self.paged.allocate(num_blocks, block_size)
        if self.device.type == "cuda" and dist.tp_size() == 1:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """The decode step's CUDA graphs, at `--cuda-graphs`' batch sizes up to `--max-batch-size`."""
        cfg = self.lora_config
        cap = cfg.max_batch_size or 256
        sizes = tuple(s for s in parse_sizes(cfg.cuda_graphs) if s <= cap)
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
        return step

    @torch.inference_mode()  # the sampling step too: it edits the logits in place
    def execute(self, batch: list[ScheduledRequest]) -> StepOutput:
        step = self.layout(batch)
        plan = self.sampling.plan(batch, step.last_rows)
        slots = None
        if self.lora is not None:
            adapters = [s.request.params.adapter for s in batch]
            slots = self.lora.row_slots(adapters, step.layout.query_lens)
        images = self._image_rows(batch, step)  # the tower runs on rank 0; the others get its rows
        if dist.tp_size() > 1:
            self._broadcast_step(step, plan.rows, slots, images)
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
        return step_rows(self.paged.model, spans)

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

    # -- tensor parallelism ------------------------------------------------------------------------
    def _shapes(
        self, T: int, B: int, M: int, R: int, n: int = 0, n_rope: int = 0, n_spans: int = 0
    ) -> list[tuple[int, ...]]:
        lora = [(T,)] if self.lora is not None else []  # each row's adapter slot
        images = [(n,)] if n + n_rope else []  # the image rows' flat rows
        rope = [(n_rope,), (3, n_rope)] if n_rope else []  # M-RoPE's rows and their 3-D positions
        spans = [(n_spans, 3)] if n_spans else []  # positions attending both ways (StepLayout.spans)
        return [(T,), (T,), (B,), (B,), (B, M), (T,), (R,), *lora, *images, *rope, *spans]

    def _broadcast_step(
        self, step: StepBatch, rows: np.ndarray, slots: np.ndarray | None, images: StepImages | None
    ) -> None:
        layout = step.layout
        B, M = layout.block_tables.shape
        T, R = len(step.ids), len(rows)
        # a vision model's step says how many image rows, their width, and M-RoPE rows follow
        n, width, n_rope = 0, 0, 0
        if images is not None:
            n, width = images.values.shape if len(images.rows) else (0, 0)
            n_rope = 0 if images.rope_rows is None else len(images.rope_rows)
        n_spans = 0 if layout.spans is None else len(layout.spans)
        dist.broadcast_command(dist.CMD_STEP, T, B, M, R, n, width, n_rope, n_spans)
        arrays = [step.ids, step.positions, layout.query_lens, layout.context_lens, layout.block_tables]
        arrays += [layout.slot_mapping, rows]
        if self.lora is not None:
            arrays.append(slots if slots is not None else np.full(T, -1, np.int64))
        if images is not None and n + n_rope:
            arrays.append(images.rows.numpy())
            if n_rope:
                assert images.rope_rows is not None and images.rope_positions is not None
                arrays += [images.rope_rows.numpy(), images.rope_positions.numpy()]
        if layout.spans is not None:
            arrays.append(layout.spans)
        dist.broadcast_arrays(arrays, self._shapes(T, B, M, R, n, n_rope, n_spans))
        if n:
            dist.broadcast_tensor(images.values if images is not None else None, (n, width), self.dtype)

    @torch.inference_mode()
    def worker_step(
        self, T: int, B: int, M: int, R: int, n: int = 0, width: int = 0, n_rope: int = 0, n_spans: int = 0
    ) -> None:
        """Ranks > 0: receive rank 0's step arrays (and a vision model's image rows) and run this
        shard's forward."""
        ids, positions, q_lens, ctx, tables, slot_mapping, rows, *rest = dist.broadcast_arrays(
            None, self._shapes(T, B, M, R, n, n_rope, n_spans)
        )
        spans = rest.pop() if n_spans else None
        layout = StepLayout(q_lens, ctx, tables, slot_mapping, self.paged.block_size, spans)
        lora = rest.pop(0) if self.lora is not None else None
        slots = lora if lora is not None and (lora >= 0).any() else None
        images = None
        if n + n_rope:
            flat = torch.from_numpy(rest[0].copy())
            values = dist.broadcast_tensor(None, (n, width), self.dtype) if n else torch.zeros(0, 0)
            rope = (
                (torch.from_numpy(rest[1].copy()), torch.from_numpy(rest[2].copy()))
                if n_rope
                else (None, None)
            )
            images = StepImages(flat, values, *rope)
        self._forward(StepBatch(ids, positions, layout), rows, slots, images)

    def ping(self) -> None:
        """While idle, a no-op collective: a dead or stuck rank is noticed without waiting for traffic."""
        if self.rank == 0 and dist.tp_size() > 1:
            dist.broadcast_command(dist.CMD_NOOP)
            dist.barrier()

    def shutdown(self) -> None:
        self.grammars.shutdown()
        if self.rank == 0 and dist.tp_size() > 1:
            try:
                dist.broadcast_command(dist.CMD_SHUTDOWN)
            except dist.DistributedError:
                pass
        dist.shutdown()
