"""LoRA adapters in the step: many adapters on one base model, mixed in one batch.

Each targeted linear of the base model is wrapped (`LoraLinear`) once, when the first adapter is
registered. A step tells the wrappers which of its flat rows use which adapter (`LoraContext`, set
by the runner around the forward); each wrapper then adds `x Aᵀ (scaling·B)ᵀ` to the rows of each
adapter in the step, gathered per adapter as punica's SGMV does (the rows of another adapter, or of
none, are untouched). A step in which no row uses an adapter runs exactly the code it ran before:
the wrappers pass straight through and the C decoder loop stays in use.

The fused layers (q|k|v, gate|up) hold one A and one B per adapter: A stacks the parts' A matrices
(rank rows each), and B puts each part's columns in that part's output rows, zeros elsewhere, so a
fused layer costs two small products however many of its parts the adapter targets. A hybrid's
recurrent mixer (gated DeltaNet, Mamba, short convolutions: `linear_attn`) and an ungated MLP's
linears are targets of their own, named as the family's checkpoints name them (`in_proj_qkv`,
Nemotron-H's `mixer.in_proj`, LFM2's `feed_forward.w1`): an adapter's keys go through the model's
own checkpoint renames (`DecoderConfig.weight_renames`), so they find the modules its weights do.
A state made under an adapter is that adapter's: the prefix cache's checkpoints of recurrent states
are keyed by block hashes, which start from the adapter's root as the KV blocks' do. A and B are
kept in float32 whatever the model's dtype (they are small); with tensor parallelism B is split as
a column-parallel weight's rows are, A as a row-parallel weight's columns are, and a row-parallel
layer's partial products are summed by the layer's own all-reduce.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pytgi.core.adapters import TARGETS, WEIGHTS_FILE, AdapterConfig, AdapterError, read_config
from pytgi.engine import kernels
from pytgi.engine.distributed import tp_size
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear, rotate_half_rows, scaled_rows
from pytgi.engine.models.mla import _KVB
from pytgi.engine.models.quant import QuantizedLinear

# the part of a fused module (in a decoder layer) that holds each of these targets
FUSED_PART = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
WHOLE = -1  # a target that is the whole module (its every shard), not one part of a fused one
LOOP_ORDER = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # decoder.c's
# the modules wrapped in every decoder layer: the attention's and the MLP's (gated or not), and every
# linear of a recurrent mixer (`linear_attn`)
# latent attention's own projections (`MLAttention`; its kv_b_proj, absorbed at load, is `LoraKVB`'s)
MLA_TARGETS = tuple(f"self_attn.{n}" for n in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"))
TARGETED = (*LOOP_ORDER, "mlp.up_proj", *MLA_TARGETS)
MIXER = "linear_attn"
TABLE_ROWS = 4  # lora.c's table: A's and Bᵀ's addresses, the ranks, the column spans (by slot)
LOOP_FIELDS = TABLE_ROWS * len(LOOP_ORDER)  # decoder.c's LORA_FIELDS, per layer
_KEY = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.weight")


@dataclass
class LoraContext:
    """Each row's adapter slot in the step; empty outside a step that uses adapters. `c_kernel`: the
    products run in lora.c (CPU, float32 or bfloat16), else in PyTorch, gathered per adapter (`groups`)."""

    c_kernel: bool = False
    dtype: torch.dtype = torch.float32  # the activations' (lora.c keeps the weights in it)
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    row_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # the C decoder loop's view: per layer, lora.c's table addresses for qkv, o, gate_up, down (decoder.c)
    loop_table: np.ndarray = field(default_factory=lambda: np.zeros((0, LOOP_FIELDS), np.int64))
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _groups: list[tuple[int, slice | torch.Tensor]] | None = None

    @property
    def active(self) -> bool:
        return len(self.row_slots) > 0

    def set(self, row_slots: np.ndarray, device: torch.device) -> None:
        """`row_slots[t]`: the slot of flat row t's adapter, -1 for the base model (some row has one)."""
        self.row_slots = np.ascontiguousarray(row_slots, dtype=np.int64)
        self.device, self._groups = device, None
        self.groups = [] if self.c_kernel else self.slot_rows()  # lora.c reads row_slots itself

    def slot_rows(self) -> list[tuple[int, slice | torch.Tensor]]:
        """(slot, its rows) for each adapter in the step: a slice where the rows are one run."""
        if self._groups is None:
            self._groups = []
            for slot in np.unique(self.row_slots[self.row_slots >= 0]).tolist():
                (rows,) = np.nonzero(self.row_slots == slot)
                if rows[-1] - rows[0] + 1 == len(rows):  # one run of rows: a view, no gather
                    self._groups.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
                else:
                    self._groups.append((slot, torch.from_numpy(rows).to(self.device)))
        return self._groups

    def clear(self) -> None:
        self.row_slots, self.groups, self._groups = self.row_slots[:0], [], None


Linear = ColumnParallelLinear | RowParallelLinear | QuantizedLinear


def _base(inner: Linear) -> ColumnParallelLinear | RowParallelLinear:
    layer = inner.layer if isinstance(inner, QuantizedLinear) else inner
    assert isinstance(layer, (ColumnParallelLinear, RowParallelLinear))
    return layer


def _shape(inner: Linear) -> tuple[int, int]:
    """(out, in) features on this rank (a quantized layer may keep no float weight)."""
    if isinstance(inner, QuantizedLinear):
        return inner.quant.shape
    n, k = inner.weight.shape
    return n, k


class LoraLinear(nn.Module):
    """A targeted linear (plain or quantized) plus its adapters' low-rank products."""

    def __init__(self, inner: Linear, ctx: LoraContext) -> None:
        super().__init__()
        self.inner, self.ctx = inner, ctx
        # slot → (A [R, K], Bᵀ, the column span of each of Bᵀ's rows (lora.c) or None (PyTorch: dense))
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray | None]] = {}
        # for lora.c, by slot: A's and Bᵀ's addresses, the rank (0: the slot's adapter skips this layer),
        # the spans' address
        self.table = np.zeros((TABLE_ROWS, 0), np.int64)

    def refresh(self, capacity: int) -> None:
        """Rebuild the kernel's table for slots 0 .. capacity - 1 (after any slot changed)."""
        self.table = np.zeros((TABLE_ROWS, capacity), np.int64)
        for slot, (a, bt, cols) in self.weights.items():
            if cols is not None:
                self.table[:, slot] = a.data_ptr(), bt.data_ptr(), a.shape[0], cols.ctypes.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ctx.active or not self.weights:
            return self.inner(x)
        y = self.inner.product(x)
        if self.ctx.c_kernel:
            kernels.lora_add(y, x.contiguous(), self.ctx.row_slots, self.table)
            return self.inner.finish(y)
        for slot, rows in self.ctx.groups:
            w = self.weights.get(slot)
            if w is not None:
                a, bt, _ = w
                delta = ((x[rows].float() @ a.T) @ bt).to(y.dtype)
                if isinstance(rows, slice):
                    y[rows] += delta
                else:
                    y.index_add_(0, rows, delta)
        return self.inner.finish(y)

    def put(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Slot `slot`'s weights from the checkpoint's whole A and B of each targeted part (`WHOLE`: of
        the module, B's rows of every shard): for lora.c, A and each part's Bᵀ over its own output
        columns only, in the activations' dtype; for PyTorch, A and a dense Bᵀ in float32."""
        base = _base(self.inner)
        n_local = _shape(self.inner)[0]
        a_rows, b_blocks, spans = [], [], []  # each part's A (this rank's), its Bᵀ block and its columns
        for part, (a, b) in sorted(parts.items()):
            b = b.float() * scaling
            if isinstance(base, RowParallelLinear):
                a_rows.append(a.float().narrow(1, base.in_start, base.local_in))
                b_blocks.append(b.T)
                spans.append((0, n_local))
                continue
            a_rows.append(a.float())
            if part == WHOLE:
                b_blocks.append(torch.cat([b.narrow(0, start, size) for start, size in base.shards]).T)
                spans.append((0, n_local))
                continue
            start, size = base.shards[part]
            b_blocks.append(b.narrow(0, start, size).T)
            spans.append((sum(s for _, s in base.shards[:part]), size))
        device, a = base.weight.device, torch.cat(a_rows)
        if self.ctx.c_kernel:
            bt = torch.cat([blk.reshape(-1) for blk in b_blocks])
            cols = np.array(
                [span for blk, span in zip(b_blocks, spans) for _ in range(blk.shape[0])], np.int64
            )
            dtype = self.ctx.dtype
            self.weights[slot] = (a.to(device, dtype).contiguous(), bt.to(device, dtype), cols)
            return
        dense = torch.zeros(a.shape[0], n_local)
        r = 0
        for blk, (c0, n) in zip(b_blocks, spans):
            dense[r : r + blk.shape[0], c0 : c0 + n] = blk
            r += blk.shape[0]
        self.weights[slot] = (a.to(device), dense.to(device), None)

    def drop(self, slot: int) -> None:
        self.weights.pop(slot, None)


class LoraKVB:
    """Latent attention's kv_b_proj adapters (`MLAttention`, whose kv_b_proj is absorbed at load:
    `_KVB`, per head W_UK and W_UV). An adapter's ΔW = scaling·B·A, B's rows per head the keys' `nope`
    then the values' `v`, enters the two absorbed products as low-rank terms: a query's latent gains
    ((q_nope·B_k)·A) and a head's output ((out_latent·Aᵀ)·B_vᵀ), for the rows of each adapter in the
    step, in float32 (as LoraLinear's PyTorch path). Kept on the layer's `_KVB` as `lora`; the layer
    adds the terms and keeps mla.c out of a step that uses them."""

    def __init__(self, inner: _KVB, ctx: LoraContext) -> None:
        self.inner, self.ctx = inner, ctx
        # slot → (A [R, latent], B_k [H, nope, R], B_v [H, v, R]), this rank's heads, scaled
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def active(self) -> bool:
        return self.ctx.active and bool(self.weights)

    def check(self, path: Path, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        kvb = self.inner
        if (
            a.shape[1] != kvb.latent
            or b.shape[0] % (kvb.nope + kvb.v)
            or b.shape[0] < (kvb.first + kvb.heads) * (kvb.nope + kvb.v)
        ):
            raise AdapterError(
                f"{path}: {name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base model"
            )

    def put(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        ((a, b),) = parts.values()
        kvb, device = self.inner, self.inner.weight.device
        b = (b.float() * scaling).view(-1, kvb.nope + kvb.v, b.shape[1])[kvb.first : kvb.first + kvb.heads]
        self.weights[slot] = (
            a.float().to(device),
            b[:, : kvb.nope].contiguous().to(device),
            b[:, kvb.nope :].contiguous().to(device),
        )

    def add_q(self, q_nope: torch.Tensor, q_lat: torch.Tensor) -> None:
        """q_lat [T, H, latent] (a view may be) += each adapter row's (q_nope·B_k)·A."""
        for slot, rows in self.ctx.slot_rows():
            if (w := self.weights.get(slot)) is not None:
                a, b_k, _ = w
                delta = (torch.einsum("thn,hnr->thr", q_nope[rows].float(), b_k) @ a).to(q_lat.dtype)
                _add_rows(q_lat, rows, delta)

    def add_o(self, out_lat: torch.Tensor, o: torch.Tensor) -> None:
        """o [T, H, v] += each adapter row's (out_latent·Aᵀ)·B_vᵀ."""
        for slot, rows in self.ctx.slot_rows():
            if (w := self.weights.get(slot)) is not None:
                a, _, b_v = w
                delta = torch.einsum("thr,hvr->thv", out_lat[rows].float() @ a.T, b_v).to(o.dtype)
                _add_rows(o, rows, delta)

    def refresh(self, capacity: int) -> None:
        """(lora.c has no part in it)"""

    def drop(self, slot: int) -> None:
        self.weights.pop(slot, None)


def _add_rows(y: torch.Tensor, rows: slice | torch.Tensor, delta: torch.Tensor) -> None:
    if isinstance(rows, slice):
        y[rows] += delta
    else:
        y.index_add_(0, rows, delta)


Wrapped = LoraLinear | LoraKVB


def wrap_model(model: nn.Module, ctx: LoraContext) -> dict[tuple[int, str], Wrapped]:
    """Wrap every targetable linear of the model's decoder layers; (layer, module path) → wrapper."""
    wrapped: dict[tuple[int, str], Wrapped] = {}
    for i, layer in enumerate(model.layers):  # type: ignore[arg-type]
        kvb = getattr(getattr(layer, "self_attn", None), "kv_b_proj", None)
        if isinstance(kvb, _KVB):
            kvb.lora = kvb.lora or LoraKVB(kvb, ctx)
            wrapped[i, "self_attn.kv_b_proj"] = kvb.lora
        mixer = getattr(layer, MIXER, None)
        paths = [*TARGETED, *(f"{MIXER}.{name}" for name, _ in mixer.named_children())] if mixer else TARGETED
        for path in paths:
            parent_path, attr = path.rsplit(".", 1)
            parent = getattr(layer, parent_path, None)
            inner = getattr(parent, attr, None)
            if isinstance(inner, LoraLinear):
                wrapped[i, path] = inner
                continue
            if not isinstance(inner, (ColumnParallelLinear, RowParallelLinear, QuantizedLinear)):
                continue  # e.g. a mixture of experts' MLP: not targetable
            w = LoraLinear(inner, ctx)
            setattr(parent, attr, w)
            wrapped[i, path] = w
    return wrapped


def checkpoint_name(key: str, config: object) -> tuple[str, tuple[tuple[int, float], ...]]:
    """An adapter's module (`model.layers.3.mixer.in_proj`) as the model names its weight
    (`layers.3.linear_attn.in_proj`), through the checkpoint's renames as `DecoderModel.load_weights`
    makes them; and the row factors the model folds into that weight at load (Falcon-H1's µP
    multipliers, `weight_scales`), which B's rows take too: they scale the same outputs."""
    name = f"{key}.weight"
    for pattern, replacement in getattr(config, "weight_renames", ()):
        name = re.sub(pattern, replacement, name)
    scales = next((parts for p, parts in getattr(config, "weight_scales", ()) if re.search(p, name)), ())
    name = name.removeprefix("model.").removeprefix("language_model.")
    return name.replace(".block_sparse_moe.", ".mlp.").removesuffix(".weight"), scales


def read_weights(path: Path, config: AdapterConfig) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(module, A, B) for each linear the adapter targets, as its keys name it, checked for rank."""
    from safetensors.torch import load_file

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path / WEIGHTS_FILE)).items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError(f"{path}: {key}: not a LoRA weight")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    if not pairs:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "A" if "A" not in ab else "B"
            raise AdapterError(f"{path}: {module} has no lora_{missing}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise AdapterError(
                f"{path}: {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not have rank {config.rank}"
            )
        yield module, a, b


class LoraAdapters:
    """The adapters served on one model (one rank's shard of it). Each registered adapter has a
    directory; at most `capacity` of them have their weights in memory (a slot), the least recently
    used without a running request going first; one that is asked for again is loaded back."""

    def __init__(
        self,
        model: nn.Module,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int | None = None,
    ) -> None:
        self.max_rank, self.capacity = max_rank, capacity
        self.config = getattr(model, "config", None)  # (a decoder's `DecoderConfig`)
        self.ctx = LoraContext(c_kernel=device.type == "cpu" and kernels.supports(dtype), dtype=dtype)
        self.wrapped = wrap_model(model, self.ctx)
        model.lora_ctx = self.ctx  # type: ignore[assignment]  # the decoder keeps its C loop out of adapter steps
        self.paths: dict[str, Path] = {}  # every adapter served
        self.slots: dict[str, int] = {}  # those in memory, least recently used first

    def register(self, name: str, path: Path, in_use: Collection[str | None] = ()) -> None:
        """Serve the adapter at `path` as `name` (its weights loaded and checked now)."""
        self.load(name, path)
        self.paths[name] = path
        self._evict({*in_use, name})

    def remove(self, name: str) -> None:
        self.unload(name)
        self.paths.pop(name, None)

    def ensure(self, name: str, in_use: Collection[str | None] = ()) -> bool:
        """A request is about to use `name`: load it back if it was evicted, mark it used. True when
        adapters were loaded or unloaded."""
        if name in self.slots:
            self.slots[name] = self.slots.pop(name)  # the most recently used now
            return False
        self.load(name, self.paths[name])
        self._evict({*in_use, name})
        return True

    def state(self) -> list[tuple[str, str, int]]:
        """The adapters in memory, as (name, directory, slot): what the other ranks mirror."""
        return [(name, str(self.paths.get(name, "")), slot) for name, slot in self.slots.items()]

    def mirror(self, state: list[tuple[str, str, int]]) -> None:
        """Make this rank's adapters in memory rank 0's `state`, slot for slot."""
        want = {name: (Path(path), slot) for name, path, slot in state}
        for name in [n for n, s in self.slots.items() if want.get(n, (None, -1))[1] != s]:
            self.unload(name)
        for name, (path, slot) in want.items():
            if name not in self.slots:
                self.load(name, path, slot)
            self.paths[name] = path

    def _evict(self, keep: set[str | None]) -> None:
        """Unload the least recently used adapters that no request uses, down to `capacity`."""
        if self.capacity is None:
            return
        for name in [n for n in self.slots if n not in keep][: max(0, len(self.slots) - self.capacity)]:
            self.unload(name)

    def load(self, name: str, path: Path, slot: int | None = None) -> None:
        """Put the adapter's weights in a slot (`slot`, or the first free one)."""
        config = read_config(path, self.max_rank)
        num_layers = 1 + max(i for i, _ in self.wrapped)
        by_module: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for key, a, b in read_weights(path, config):
            layer, module, part, target = self._locate(path, key, num_layers)
            module_name, scales = checkpoint_name(key, self.config)
            b = self._rows(target, b)
            if scales:
                b = scaled_rows(b, scales)
            w = self.wrapped[layer, module]
            for piece, b_piece in self._parts(module, part, b):
                if isinstance(w, LoraKVB):
                    w.check(path, module_name, a, b_piece)
                else:
                    self._check(path, module_name, w.inner, piece, a, b_piece)
                by_module.setdefault((layer, module), {})[piece] = (a, b_piece)
        self.unload(name)
        if slot is None:
            slot = next(i for i in range(len(self.slots) + 1) if i not in self.slots.values())
        for where, parts in by_module.items():
            self.wrapped[where].put(slot, parts, config.scaling)
        self.slots[name] = slot
        self._refresh()

    def _parts(self, module: str, part: int, b: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """A target that is a whole fused module (Granite-4.0-H's `input_linear`, gate | up; Phi-3's
        `qkv_proj`) split as `DecoderModel` splits its weight: one B a part, the parts' A the same."""
        fused = module.rpartition(".")[2]
        if part != WHOLE or fused not in ("qkv_proj", "gate_up_proj"):
            return [(part, b)]
        if fused == "gate_up_proj":
            return list(enumerate(b.chunk(2)))
        cfg = self.config
        q = cfg.num_attention_heads * cfg.head_dim  # type: ignore[union-attr]
        kv = cfg.num_key_value_heads * cfg.head_dim  # type: ignore[union-attr]
        return list(enumerate(b.split([q, kv, kv])))

    @staticmethod
    def _check(path: Path, name: str, inner: Linear, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A and B have the shapes of the targeted weight (or part), whole (every rank reads its rows)."""
        base = _base(inner)
        out, k = _shape(inner)
        if isinstance(base, ColumnParallelLinear):
            shards = base.shards if part == WHOLE else [base.shards[part]]
            end = max(start + size for start, size in shards)
            whole = b.shape[0] == sum(n for _, n in shards) if tp_size() == 1 else b.shape[0] >= end
            fits = a.shape[1] == k and whole
        else:
            whole = a.shape[1] == k if tp_size() == 1 else a.shape[1] >= base.in_start + k
            fits = b.shape[0] == out and whole
        if not fits:
            raise AdapterError(
                f"{path}: {name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base model"
            )

    def _locate(self, path: Path, key: str, num_layers: int) -> tuple[int, str, int, str]:
        """The (layer, wrapped module, part, target) an adapter's module names: the part of a fused
        module (q_proj of qkv_proj) where the layer has one, else a module of its own (`WHOLE`)."""
        name, _ = checkpoint_name(key, self.config)
        m = _LAYER.fullmatch(f"{name}.weight")
        if m is None:
            raise AdapterError(
                f"{path}: {key}: pytgi applies LoRA to the decoder layers' attention, MLP and recurrent "
                f"mixer linears ({', '.join(TARGETS)}, ...) only"
            )
        layer, module = int(m.group(1)), m.group(2)
        if layer >= num_layers:
            raise AdapterError(f"{path}: {key}: the base model has {num_layers} layers")
        parent, _, target = module.rpartition(".")
        if target in FUSED_PART:
            fused, part = FUSED_PART[target]
            if (layer, f"{parent}.{fused}") in self.wrapped:
                return layer, f"{parent}.{fused}", part, target
        if (layer, module) not in self.wrapped:
            raise AdapterError(f"{path}: layer {layer} has no {module} that LoRA can target ({key})")
        return layer, module, WHOLE, target

    def _rows(self, target: str, b: torch.Tensor) -> torch.Tensor:
        """B's rows in the order the model keeps its weight's: a q/k adapter of a model whose rotary
        pairs are reordered at load (Cohere 2: `rope_interleaved`) is reordered the same way."""
        cfg = self.config
        if target not in ("q_proj", "k_proj") or cfg is None or not getattr(cfg, "rope_interleaved", False):
            return b
        heads = cfg.num_attention_heads if target == "q_proj" else cfg.num_key_value_heads
        return b[rotate_half_rows(len(b), heads)]

    def unload(self, name: str) -> None:
        slot = self.slots.pop(name, None)
        if slot is not None:
            for w in self.wrapped.values():
                w.drop(slot)
            self._refresh()

    def _refresh(self) -> None:
        capacity = 1 + max(self.slots.values(), default=-1)
        for w in self.wrapped.values():
            w.refresh(capacity)
        num_layers = 1 + max(i for i, _ in self.wrapped)
        table = np.zeros((num_layers, len(LOOP_ORDER), TABLE_ROWS), np.int64)
        for (layer, path), w in self.wrapped.items():
            if w.weights and path in LOOP_ORDER:
                assert isinstance(w, LoraLinear)
                table[layer, LOOP_ORDER.index(path)] = [row.ctypes.data for row in w.table]
        self.ctx.loop_table = table.reshape(num_layers, LOOP_FIELDS)

    def row_slots(self, adapters: list[str | None], query_lens: np.ndarray) -> np.ndarray | None:
        """Each flat row's slot (-1: the base model); None when no request uses an adapter."""
        if not any(adapters):
            return None
        slots = np.fromiter((-1 if a is None else self.slots[a] for a in adapters), np.int64, len(adapters))
        return np.repeat(slots, query_lens)
