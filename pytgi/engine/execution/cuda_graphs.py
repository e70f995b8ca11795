"""CUDA graphs of decode steps: one launch per step instead of a few hundred.

A decode step of a Llama-3-8B runs some three hundred kernels, each a few microseconds of GPU
work at batch 1; launched one by one from Python, the launches take longer than the work. So after
the KV cache is allocated, the decode step (embedding, every layer, the logits) is captured once
per batch size in `sizes` (TGI's `--cuda-graphs`), and a decode step of B requests replays the
smallest graph of at least B rows, its inputs copied into the graph's fixed buffers first. The rows
past B compute a throwaway token: their key and value go to a scratch block that no request owns,
and with no context they attend to nothing.

What a graph cannot replay runs eagerly, as before: prefill chunks, verified drafts, image rows,
LoRA adapters, more requests than the largest size, and models whose step needs the host mid-way
(mixtures of experts, sliding windows: only the Triton backend's plain causal layers are captured).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def parse_sizes(text: str | None) -> tuple[int, ...]:
    """`--cuda-graphs`: comma-separated batch sizes; None: the defaults; "0": none."""
    if text is None:
        return DEFAULT_SIZES
    sizes = sorted({int(p) for p in text.split(",") if p.strip()})
    if any(s < 0 for s in sizes):
        raise ValueError(f"--cuda-graphs takes batch sizes >= 0, got {text!r}")
    return tuple(s for s in sizes if s > 0)


class DecodeGraphs:
    """The captured decode steps of one `PagedModel` (its KV cache allocated with one spare block,
    `scratch_block`, past those the block manager hands out)."""

    def __init__(self, paged, sizes: tuple[int, ...], max_blocks: int, scratch_block: int) -> None:
        from pytgi.engine.kernels.gpu import decode_splits, head_parts, query_block
        from pytgi.engine.models.triton_backend import TritonMetadata, multiprocessors

        self.paged, self.sizes = paged, sorted(sizes)
        n, dev = self.sizes[-1], paged.device
        self.scratch_slot = scratch_block * paged.block_size
        # the inputs: token ids, positions, cache slots; context lengths; block tables
        self.ints = torch.zeros(3, n, dtype=torch.int64, device=dev)
        self.ctx = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.ints[2].fill_(self.scratch_slot)
        q_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        programs = torch.stack([q_start[:n], torch.zeros_like(q_start[:n])], dim=1).contiguous()
        attention = paged.model.attention
        block_m = query_block(1, attention.group, attention.head_dim)
        programs_per_request = attention.kv_heads * head_parts(attention.group, attention.head_dim)
        sms = multiprocessors(dev)
        # host staging (pinned: the copies do not wait for the GPU to go idle)
        pin = torch.cuda.is_available()
        self.host_ints = (
            torch.zeros(3, n, dtype=torch.int64).pin_memory() if pin else torch.zeros(3, n, dtype=torch.int64)
        )
        self.host_ctx = (
            torch.zeros(n, dtype=torch.int32).pin_memory() if pin else torch.zeros(n, dtype=torch.int32)
        )
        self.metas = {
            s: TritonMetadata(
                self.ints[2, :s],
                programs[:s],
                q_start[: s + 1],
                self.ctx[:s],
                self.tables[:s],
                block_m,
                paged.block_size,
                decode_splits(s, programs_per_request, sms),
            )
            for s in self.sizes
        }
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _step(self, size: int) -> torch.Tensor:
        model = self.paged.model
        hidden = model(self.ints[0, :size], self.ints[1, :size], self.paged.kv_caches, self.metas[size])
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, the largest first (the others reuse its memory pool)."""
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._step(size)  # once eagerly: kernels compiled, workspaces allocated
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._step(size)
                pool = graph.pool()
                self.graphs[size] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, batch, rows: np.ndarray) -> torch.Tensor | None:
        """The logits of `rows` of a decode step, replayed; None: this step runs eagerly."""
        layout = batch.layout
        B = len(layout.query_lens)
        if (
            B > self.sizes[-1]
            or layout.spans is not None
            or layout.block_tables.shape[1] > self.tables.shape[1]
            or not (layout.query_lens == 1).all()
        ):
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, B)]
        ints, ctx = self.host_ints[:, :size].numpy(), self.host_ctx[:size].numpy()
        ints[0, :B], ints[1, :B], ints[2, :B] = batch.ids, batch.positions, layout.slot_mapping
        ints[:2, B:], ints[2, B:] = 0, self.scratch_slot
        ctx[:B], ctx[B:] = layout.context_lens, 0
        self.ints[:, :size].copy_(self.host_ints[:, :size], non_blocking=True)
        self.ctx[:size].copy_(self.host_ctx[:size], non_blocking=True)
        tables = layout.block_tables
        self.tables[:B, : tables.shape[1]].copy_(torch.from_numpy(tables.astype(np.int32)), non_blocking=True)
        graph, out = self.graphs[size]
        graph.replay()
        if len(rows) == B and (rows == np.arange(B)).all():
            return out[:B]
        return out[torch.from_numpy(rows).to(out.device)]
