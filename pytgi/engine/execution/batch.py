"""A step's flat batch and the forward over a paged KV cache: used by the model and the draft model.

A step computes some tokens of several sequences at once. `StepBatch.build` lays them out flat
(token ids, positions, each token's KV slot, each sequence's block table) and `PagedModel.forward`
runs the model over them, writing their keys and values into the cache and returning the logits
of the rows asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from pytgi.core.families import Family
from pytgi.engine import distributed as dist
from pytgi.engine import kernels
from pytgi.engine.execution.cuda_graphs import DecodeGraphs
from pytgi.engine.models.attention import StepLayout
from pytgi.engine.models.causal_lm import CausalLM
from pytgi.engine.models.decoder import StepImages
from pytgi.engine.models.layers import dynamic_rope


class KVHeads(Protocol):
    """An attention layer's heads on this rank, which size the KV cache (`self_attn` of a layer)."""

    n_kv: int
    head_dim: int  # a key's (a value's too, unless the layer says `v_head_dim`: MLA's values are its keys)


@dataclass(slots=True)
class StepBatch:
    ids: np.ndarray  # [T] int64: the tokens computed, sequence after sequence
    positions: np.ndarray  # [T] int64: each token's position in its sequence
    layout: StepLayout  # what attention needs: per-sequence lengths, block tables, slots

    @classmethod
    def build(
        cls,
        tokens: Sequence[Sequence[int]],
        starts: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
    ) -> StepBatch:
        """`tokens[i]` follow the `starts[i]` tokens of sequence i already in its blocks
        (`block_tables[i]`, covering them all)."""
        B = len(tokens)
        q_lens = np.fromiter(map(len, tokens), np.int64, B)
        first = np.asarray(starts, np.int64)
        T = int(q_lens.sum())
        ids = np.fromiter(chain.from_iterable(tokens), np.int64, T)
        cu = np.cumsum(q_lens)
        seq = np.repeat(np.arange(B), q_lens)
        positions = first[seq] + np.arange(T) - (cu - q_lens)[seq]
        tables = np.zeros((B, max(map(len, block_tables))), np.int64)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        slots = tables[seq, positions // block_size] * block_size + positions % block_size
        return cls(ids, positions, StepLayout(q_lens, first + q_lens, tables, slots, block_size))

    @property
    def last_rows(self) -> np.ndarray:
        """Each sequence's last flat row (whose logits predict its next token)."""
        return np.cumsum(self.layout.query_lens) - 1


class PagedModel:
    """A loaded model and its paged KV cache (one K and one V tensor per layer, `num_blocks *
    block_size` slots). `unsharded`: the model is whole on this rank whatever the tensor-parallel
    group (the draft model)."""

    def __init__(
        self,
        model: CausalLM,
        dtype: torch.dtype,
        device: torch.device,
        unsharded: bool = False,
        kv_dtype: str = "auto",
        family: Family | None = None,
    ):
        """`kv_dtype`: "auto" or "bf16" (the cache in `dtype`), "fp8" or "int8" (`kv_dtype_refusal`
        says where they run); `family`: the model's (None: transformers' code runs it)."""
        self.model, self.dtype, self.device, self.unsharded = model, dtype, device, unsharded
        self.family = family
        self.fp8 = kv_dtype.startswith("fp8")
        self.int8 = kv_dtype == "int8"
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.block_size = self.num_blocks = 0
        self.graphs: DecodeGraphs | None = None  # CUDA: the captured decode steps

    def _attention(self) -> KVHeads:
        """The first attention layer's (its heads give the KV cache's shape; a hybrid model's linear
        layers have none)."""
        return next(a for layer in self.model.layers if (a := getattr(layer, "self_attn", None)) is not None)

    def _kv_layers(self) -> list[KVHeads]:
        """The attention layers that keep a cache of their own, each with its heads (Gemma 4's differ by
        layer, and its last layers read an earlier layer's cache: `kv_source`)."""
        attns = [getattr(layer, "self_attn", None) for layer in self.model.layers]
        return [a for a in attns if a is not None and getattr(a, "kv_source", None) is None]

    def _row(self, attn: KVHeads) -> tuple[int, torch.dtype]:
        """A cache row's values a head, and their dtype. FP8: each head's row of e4m3 bytes ends with its
        float32 scale (`pytgi.engine.kernels.gpu`); int8: with its bf16 scale (`pytgi.engine.kernels.kv8`)."""
        if self.fp8 or self.int8:
            return attn.head_dim + (4 if self.fp8 else 2), torch.uint8
        return attn.head_dim, self.dtype

    def _v_row(self, attn: KVHeads) -> int:
        """A value's row, as `_row`'s: MLA's has no values (its latent rows are keys and values both)."""
        return 0 if getattr(attn, "v_head_dim", attn.head_dim) == 0 else self._row(attn)[0]

    def kv_bytes_per_token(self) -> int:
        total = 0
        for attn in self._kv_layers():
            row, dtype = self._row(attn)
            total += attn.n_kv * (row + self._v_row(attn)) * torch.empty((), dtype=dtype).element_size()
        return total

    def state_bytes_per_request(self) -> int:
        """The recurrent state a request holds in the recurrent layers (0: the model has none), as each
        layer kind declares it (`StateSpec`)."""
        total = 0
        for layer in self.model.layers:
            if (mixer := getattr(layer, "linear_attn", None)) is not None:
                for spec in mixer.state_specs():
                    elt = torch.empty((), dtype=spec.dtype or self.dtype).element_size()
                    total += math.prod(spec.shape) * elt
        return total

    def state_grid(self) -> int:
        """The tokens on which every recurrent layer's prefill state is exact (the lcm of their kinds'
        `state_grid`, `RecurrentMixer`); 0 where a kind does not say (no checkpoints of its states)."""
        grid = 1
        for layer in self.model.layers:
            if (mixer := getattr(layer, "linear_attn", None)) is not None:
                kind = getattr(mixer, "state_grid", 0)
                if not kind:
                    return 0
                grid = math.lcm(grid, kind)
        return grid

    def allocate(self, num_blocks: int, block_size: int, state_slots: int = 0) -> None:
        """On CUDA one block more than asked: the scratch block of the decode graphs' padding rows.
        `state_slots`: requests whose states the recurrent layers keep (their entries in `kv_caches`
        are those states, one tensor per `StateSpec` the layer declares, not keys and values; where
        the layer attends too, Falcon-H1's, its keys and values come first)."""
        spare = int(self.device.type == "cuda")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_caches = []
        self.graphs = None
        for layer in self.model.layers:
            states: tuple[torch.Tensor, ...] = ()
            if (mixer := getattr(layer, "linear_attn", None)) is not None:
                states = tuple(
                    torch.zeros((state_slots, *s.shape), dtype=s.dtype or self.dtype, device=self.device)
                    for s in mixer.state_specs()
                )
            attn: KVHeads | None = getattr(layer, "self_attn", None)
            if attn is None:  # a recurrent layer (its states), or its MLP alone (Nemotron-H's: nothing)
                self.kv_caches.append(states)
                continue
            if (source := getattr(attn, "kv_source", None)) is not None:  # another layer's cache (Gemma 4)
                self.kv_caches.append(self.kv_caches[source])
                continue
            row, dtype = self._row(attn)
            v_row = self._v_row(attn)
            shape = (2, (num_blocks + spare) * block_size, attn.n_kv, row)
            if v_row == row:
                k, v = torch.zeros(shape, dtype=dtype, device=self.device).unbind(0)
            else:  # MLA: the keys' rows are the values, the value cache has no columns
                k = torch.zeros(shape[1:], dtype=dtype, device=self.device)
                v = torch.zeros((*shape[1:3], v_row), dtype=dtype, device=self.device)
            # Falcon-H1's layers attend and keep a Mamba-2 state both: keys, values, then the states
            self.kv_caches.append((k, v, *states))

    def state_tensors(self) -> list[torch.Tensor]:
        """Every recurrent layer's state tensors, in layer order, each [slots, *spec.shape]: a state is
        row `slot` of each. A layer that attends too (Falcon-H1) keeps its keys and values first: its
        states are its cache's last entries, one a `StateSpec`."""
        tensors: list[torch.Tensor] = []
        for layer, cache in zip(self.model.layers, self.kv_caches):
            if (mixer := getattr(layer, "linear_attn", None)) is not None:
                tensors += cache[len(cache) - len(mixer.state_specs()) :]
        return tensors

    def attention_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """The attention layers' (keys, values), a layer reading another's cache (Gemma 4) included:
        the KV blocks, without a hybrid's states."""
        return [
            cache[:2]
            for layer, cache in zip(self.model.layers, self.kv_caches)
            if getattr(layer, "self_attn", None) is not None
        ]

    @torch.inference_mode()
    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy recurrent states between pool rows, (source, destination) in order: a state is row
        `slot` of every state tensor of every recurrent layer (the prefix cache's checkpoints, saved
        and restored; a layer that attends too, Falcon-H1's, keeps its keys and values first, indexed by
        token, not slot: they are not copied)."""
        tensors = self.state_tensors()
        for src, dst in copies:
            for t in tensors:
                t[dst].copy_(t[src])

    def capture_graphs(self, sizes: tuple[int, ...], max_blocks: int) -> bool:
        """Capture the decode step at these batch sizes (`pytgi.engine.execution.cuda_graphs`), where the
        model allows it: CUDA, the Triton attention backend with plain causal layers, no mixture of experts.
        Whether it did."""
        cfg = getattr(self.model, "config", None)
        if (
            not sizes
            or self.device.type != "cuda"
            or self.family is None
            or not self.family.cuda_graphs
            or not self.model.attention.captures_decode
            or getattr(cfg, "moe", None) is not None
            or dynamic_rope(self.model) is not None  # its rows are computed per step, by length
        ):
            return False
        self.graphs = DecodeGraphs(self, sizes, min(max_blocks, self.num_blocks), self.num_blocks)
        self.graphs.capture()
        return True

    @torch.inference_mode()
    def forward(
        self, batch: StepBatch, rows: np.ndarray, image_rows: StepImages | None = None, hidden: bool = False
    ) -> torch.Tensor | None:
        """Run the step; the logits (float32) of the flat rows `rows` (None if there are none), or with
        `hidden` their last hidden states (a pooling model's). `image_rows`: flat rows whose embeddings
        are an image's rows (a vision model's)."""
        if self.graphs is not None and image_rows is None and not hidden and not self._lora_active():
            logits = self.graphs.run(batch, rows)
            if logits is not None:
                return logits
        meta = self.model.attention.prepare(batch.layout, self.device)
        ids = torch.from_numpy(batch.ids).to(self.device)
        positions = torch.from_numpy(batch.positions).to(self.device)
        with dist.unsharded() if self.unsharded else nullcontext():
            if image_rows is None:
                states = self.model(ids, positions, self.kv_caches, meta)
            else:
                states = self.model(ids, positions, self.kv_caches, meta, image_rows)
            if not len(rows):
                return None
            picked = states[torch.from_numpy(rows).to(self.device)]
            return picked if hidden else self.model.compute_logits(picked)

    def _lora_active(self) -> bool:
        ctx = getattr(self.model, "lora_ctx", None)
        return ctx is not None and ctx.active


def kv_dtype_refusal(
    model: CausalLM, device: torch.device, dtype: torch.dtype, kv_dtype: str, family: Family | None
) -> str | None:
    """Why `--kv-cache-dtype kv_dtype` cannot serve this model here (None: it can); `family`: the
    model's (None: transformers' code runs it)."""
    if kv_dtype == "bf16" and dtype != torch.bfloat16:
        return "--kv-cache-dtype bf16 holds the activations' dtype: it needs --dtype bfloat16"
    if kv_dtype == "int8":  # written and read by the C kernels (kv8.h), every CPU attention path
        if device.type != "cpu":
            return "--kv-cache-dtype int8 is the CPU's (its C kernels read it); on CUDA, fp8"
        if not (kernels.available() and kernels.supports(dtype)):
            return "--kv-cache-dtype int8 needs pytgi's C kernels (a C compiler, no PYTGI_NO_KERNELS)"
    if kv_dtype.startswith("fp8"):
        return fp8_kv_refusal(model, device, family)
    if family is not None and kv_dtype != "auto" and kv_dtype not in family.kv_dtypes:
        return f"--kv-cache-dtype {kv_dtype}: not for {family.name} ({', '.join(family.kv_dtypes)})"
    return None


def fp8_kv_refusal(model: CausalLM, device: torch.device, family: Family | None) -> str | None:
    """Why `--kv-cache-dtype fp8` cannot serve this model here (None: it can). The FP8 cache is read and
    written by the Triton kernels alone: a CUDA GPU, pytgi's own model code, plain causal attention
    (no sliding window, soft cap or image spans, which take the gather path): the family must list
    fp8, and this model's attention backend (its checkpoint may set a window) must read it."""
    if device.type != "cuda":
        return "--kv-cache-dtype fp8 needs a CUDA GPU (the CPU's kernels read bf16 or float32 caches)"
    if family is None or "fp8" not in family.kv_dtypes or not model.attention.fp8_cache:
        return (
            "--kv-cache-dtype fp8 needs plain causal attention in pytgi's Triton kernels: this model's "
            "sliding windows, soft-capped scores, image spans or model code read the cache otherwise"
        )
    return None
