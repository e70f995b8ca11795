"""The model runner: one flat batch per step in, sampled tokens (and logprobs) out."""

from __future__ import annotations

import logging
import os
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from pytgi import distributed as dist
from pytgi import protocol as P
from pytgi.config import EngineConfig
from pytgi.engine.sampler import Sampler, SamplingMetadata, row_stats
from pytgi.engine.scheduler import RunnerOutput, ScheduledRequest
from pytgi.engine.speculate import accepted_prefix
from pytgi.engine.structured import GrammarError, GrammarMatchers, StepMasks
from pytgi.engine.watermark import apply_watermark
from pytgi.models.attention import StepLayout
from pytgi.models.cpu import CpuKernels
from pytgi.models.loader import eos_token_ids, load_model, read_config, resolve_dtype

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 8 << 30


class ModelRunner:
    """Rank 0's runner executes steps and samples; with tensor parallelism it first broadcasts each
    step's inputs, and the workers (`pytgi.engine.worker`) run the same forward on their shards.

    `config.model` is the model's directory; with several shards `config.master_port` is set."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        assert config.model is not None, "the runner loads a resolved model directory"
        model_path = Path(config.model)
        self.device = resolve_device(config.device)
        self.rank = rank
        dist.init(rank, config.num_shard, config.master_addr, config.master_port or 0, self.device)
        hf_config = read_config(model_path)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        # On CPU this builds the C kernels now (about a second, once), not on the first request.
        cpu = CpuKernels.for_device(self.device, self.dtype, batch_invariant=config.batch_invariant)
        self.model = load_model(
            model_path,
            self.dtype,
            self.device,
            cpu,
            config.quantize,
            config.attention_backend,
            config.model_impl,
        )
        self.backend = self.model.attention  # builds each step's attention metadata
        self.config = self.model.config
        self.vocab_size = self.config.vocab_size
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids(model_path)
        # Structured output's matchers (rank 0 samples; nothing is built until a request asks).
        self.grammars = GrammarMatchers(model_path / "tokenizer.json", self.vocab_size, self.eos_token_ids)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0

    # -- KV cache ---------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        cfg, elt = self.config, torch.empty((), dtype=self.dtype).element_size()
        kv_heads = self.model.layers[0].self_attn.n_kv
        return cfg.num_hidden_layers * 2 * kv_heads * cfg.head_dim * elt

    def auto_num_tokens(self, cpu_cap_bytes: int, gpu_fraction: float) -> int:
        """KV slots that fit on every rank: on CUDA a fraction of free memory, on CPU up to a cap of
        available RAM."""
        if self.rank == 0 and dist.tp_size() > 1:
            dist.broadcast_command(dist.CMD_CAPACITY, cpu_cap_bytes, int(gpu_fraction * 1000))
        return dist.all_reduce_min(self._local_capacity(cpu_cap_bytes, gpu_fraction))

    def _local_capacity(self, cpu_cap_bytes: int, gpu_fraction: float) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * gpu_fraction) - (1 << 30)  # leave room for activations
        else:
            budget = min(cpu_cap_bytes, _available_memory_bytes() // 4)
        return max(budget, 0) // self.kv_bytes_per_token()

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        if self.rank == 0 and dist.tp_size() > 1:
            dist.broadcast_command(dist.CMD_ALLOC, num_blocks, block_size)
        attn = self.model.layers[0].self_attn
        shape = (2, num_blocks * block_size, attn.n_kv, attn.head_dim)
        self.block_size = block_size
        self.kv_caches = [
            tuple(torch.zeros(shape, dtype=self.dtype, device=self.device).unbind(0))  # type: ignore[misc]
            for _ in self.model.layers
        ]

    # -- one step ---------------------------------------------------------------------------------
    def _layout(self, batch: list[ScheduledRequest]) -> tuple[np.ndarray, np.ndarray, StepLayout]:
        reqs = [s.request for s in batch]
        q_lens = np.fromiter((s.num_new_tokens for s in batch), np.int64, len(batch))
        starts = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, len(batch))
        T = int(q_lens.sum())
        ids = np.fromiter(  # a decode with a draft: its last token, then the draft
            chain.from_iterable(
                r.all_ids[s : s + n] + b.draft if b.draft else r.all_ids[s : s + n]
                for b, r, s, n in zip(batch, reqs, starts, q_lens)
            ),
            np.int64,
            T,
        )
        cu = np.cumsum(q_lens)
        req_idx = np.repeat(np.arange(len(batch)), q_lens)
        positions = starts[req_idx] + np.arange(T) - (cu - q_lens)[req_idx]
        tables = np.zeros((len(batch), max(len(r.block_table) for r in reqs)), np.int64)
        for i, r in enumerate(reqs):
            tables[i, : len(r.block_table)] = r.block_table
        bs = self.block_size
        slots = tables[req_idx, positions // bs] * bs + positions % bs
        layout = StepLayout(q_lens, starts + q_lens, tables, slots, bs)
        return ids, positions, layout

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> RunnerOutput:
        ids, positions, layout = self._layout(batch)
        ends = np.cumsum(layout.query_lens) - 1
        # A sampled row per sampling request's last token, and one per draft token before it.
        sampling: list[tuple[ScheduledRequest, int]] = []
        sample_rows: list[int] = []
        for i, s in enumerate(batch):
            if s.samples:
                k = len(s.draft)
                sampling.extend((s, j) for j in range(k + 1))
                sample_rows.extend(range(int(ends[i]) - k, int(ends[i]) + 1))
        spans = self._prompt_logprob_spans(batch, ends)
        # Logits only where needed: the sampled rows, then prompt-logprob positions.
        rows = np.concatenate(
            [np.array(sample_rows, np.int64), *(np.arange(a, a + n) for _, a, n in spans)]
        ).astype(np.int64)
        # Structured output's masks are computed while the forward runs.
        masks = self.grammars.start_masks([s.request.request_id for s, _ in sampling]) if sampling else None
        if dist.tp_size() > 1:
            self._broadcast_step(ids, positions, layout, rows)
        logits = self._forward(ids, positions, layout, rows)
        out = RunnerOutput()
        if sampling:
            self._sample(logits[: len(sampling)], sampling, out, masks)
        offset = len(sampling)
        for i, _, n in spans:
            req = batch[i].request
            out.prompt_logprobs[req.request_id] = self._prompt_logprobs(logits[offset : offset + n], batch[i])
            offset += n
        return out

    def _forward(self, ids: np.ndarray, positions: np.ndarray, layout: StepLayout, rows: np.ndarray):  # type: ignore[no-untyped-def]
        meta = self.backend.prepare(layout, self.device)
        to = lambda a: torch.from_numpy(a).to(self.device)
        hidden = self.model(to(ids), to(positions), self.kv_caches, meta)
        return self.model.compute_logits(hidden[to(rows)]) if len(rows) else None

    # -- tensor parallelism ------------------------------------------------------------------------
    @staticmethod
    def _shapes(T: int, B: int, M: int, R: int) -> list[tuple[int, ...]]:
        return [(T,), (T,), (B,), (B,), (B, M), (T,), (R,)]

    def _broadcast_step(self, ids, positions, layout: StepLayout, rows) -> None:  # type: ignore[no-untyped-def]
        B, M = layout.block_tables.shape
        dist.broadcast_command(dist.CMD_STEP, len(ids), B, M, len(rows))
        dist.broadcast_arrays(
            [
                ids,
                positions,
                layout.query_lens,
                layout.context_lens,
                layout.block_tables,
                layout.slot_mapping,
                rows,
            ],
            self._shapes(len(ids), B, M, len(rows)),
        )

    @torch.inference_mode()
    def worker_step(self, T: int, B: int, M: int, R: int) -> None:
        """Ranks > 0: receive rank 0's step inputs and run this shard's forward."""
        ids, positions, q_lens, ctx, tables, slots, rows = dist.broadcast_arrays(
            None, self._shapes(T, B, M, R)
        )
        self._forward(ids, positions, StepLayout(q_lens, ctx, tables, slots, self.block_size), rows)

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

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[tuple[ScheduledRequest, int]],
        out: RunnerOutput,
        masks: StepMasks | None,
    ) -> None:
        """Sample each row: row (s, j) is s's output token number len(output) + j, after the first j
        tokens of its draft. A request with a draft keeps the draft tokens its rows confirm, and the
        row's token after them (`accepted_prefix`)."""
        reqs = [s.request for s, _ in rows]
        marked = [i for i, r in enumerate(reqs) if r.params.watermark]
        if marked:
            apply_watermark(logits, marked, [reqs[i].all_ids[-1] for i in marked])
        gens = [self._generator(r, len(r.output_ids) + j) for r, (_, j) in zip(reqs, rows)]
        meta = SamplingMetadata.build(
            [r.params for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids + s.draft[:j] if j else r.output_ids for r, (s, j) in zip(reqs, rows)],
            gens,
            self.vocab_size,
            self.device,
        )
        res = self.sampler(logits, meta, masks.result() if masks is not None else None)
        tokens, logprobs = res.token_ids.tolist(), res.logprobs.tolist()
        for i in masks.rows if masks is not None else ():
            rid = reqs[i].request_id
            try:
                if self.grammars.accept(rid, tokens[i]):
                    out.complete.add(rid)
            except GrammarError as e:
                out.errors[rid] = str(e)
        top_ids = res.top_ids.tolist() if res.top_ids is not None else None
        top_lps = res.top_logprobs.tolist() if res.top_logprobs is not None else None

        def token(i: int) -> P.TokenOut:
            r, top = reqs[i], []
            if top_ids is not None and r.params.top_n_tokens:
                n = r.params.top_n_tokens
                top = list(zip(top_ids[i][:n], top_lps[i][:n]))
            return P.TokenOut(r.request_id, tokens[i], logprobs[i], top)

        i = 0
        while i < len(rows):
            s = rows[i][0]
            keep = accepted_prefix(s.draft, tokens[i : i + len(s.draft) + 1]) if s.draft else 0
            out.samples[s.request.request_id] = token(i)
            if keep:
                out.more[s.request.request_id] = [token(i + j) for j in range(1, keep + 1)]
            i += len(s.draft) + 1

    def _generator(self, req, position: int) -> torch.Generator | None:  # type: ignore[no-untyped-def]
        """A seeded request's draw for its output token number `position`: seeded by (seed, position),
        so the token does not depend on how many draws came before it (a step verifying a draft
        draws for several positions at once, and drops the draws past a rejected token)."""
        if not req.params.sampling:
            return None
        return torch.Generator(self.device).manual_seed(_mix(req.params.seed, position))

    def release(self, request_id: str) -> None:
        self.grammars.remove(request_id)

    @staticmethod
    def _prompt_logprob_spans(batch: list[ScheduledRequest], ends: np.ndarray) -> list[tuple[int, int, int]]:
        """(batch index, first flat row, rows) whose logits predict prompt tokens this step."""
        spans = []
        for i, s in enumerate(batch):
            req = s.request
            if req.wants_prompt_logprobs:
                first = req.num_computed_tokens
                n = max(min(first + s.num_new_tokens, req.num_prompt_tokens - 1) - first, 0)
                spans.append((i, int(ends[i]) - s.num_new_tokens + 1, n))
        return spans

    def _prompt_logprobs(self, logits: torch.Tensor, s: ScheduledRequest) -> list[float | None]:
        """Logprob of each prompt token given the ones before it, for this chunk's positions."""
        req, first = s.request, s.request.num_computed_tokens
        lps: list[float | None] = [None] if first == 0 else []
        if len(logits):
            targets = torch.tensor(req.prompt_ids[first + 1 : first + 1 + len(logits)], device=self.device)
            # each row's logsumexp as the sampler's: a row's value must not change with the chunk's shape
            logits = logits.float()
            lps.extend((logits.gather(1, targets[:, None])[:, 0] - row_stats(logits, True)[1]).tolist())
        return lps


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): one well-spread 63-bit seed per output position."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) % (1 << 63)


def set_cpu_threads(local_ranks: int = 1) -> None:
    """Let the engine own the cores (shared evenly by the ranks on this machine) unless the user set
    OMP_NUM_THREADS: more threads than cores makes OpenMP's spinning threads slow everyone down."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
