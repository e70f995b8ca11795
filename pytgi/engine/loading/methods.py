"""Quantization methods: how one linear's tensors from a weight source become its kernel layout.

A source (`pytgi.engine.loading.sources`) yields a model's named tensors with their storage type; a
method turns them into the model's parameters and packed linears:

- float: the tensors as they are, cast to the model's dtype (`DecoderModel.load_weights`);
- `--quantize int8 | int4 | bf16 | fp8`: float weights re-laid out or re-quantized once loaded
  (`DecoderModel.quantize`, `pytgi.engine.models.quant`);
- GGUF grids (`load_gguf`): each planned linear packed from its blocks' own levels and grids, never
  through a float copy, the rest dequantized;
- pre-quantized checkpoints (`load_quantized_checkpoint`): GPTQ / AWQ / compressed-tensors levels and
  FP8 moved into the same layouts as published;
- MXFP4 experts: kept as their codes by the source (`checkpoints.mxfp4_tensors`), packed by the
  experts' own loader.

The model classes hold no loading code beyond mapping checkpoint names onto their parameters
(`load_weights`) and naming their linears (`planned`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pytgi.engine.loading.checkpoints import QuantizedCheckpoint, fp8_rows, grid_of, linear_levels
from pytgi.engine.loading.gguf import DECODERS, ROWS_PER_SLICE, GGUFWeights
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.decoder import EMBED, DecoderModel
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pytgi.engine.models.moe import SparseMoE
from pytgi.engine.models.quant import (
    GROUP,
    HEAD_KIND,
    Fp8Rows,
    Layout,
    LayoutRows,
    QuantizedLinear,
    QuantizedWeight,
    five_bit,
    float_kind,
    float_rows,
    grid_layout,
    kind_for_gguf_type,
    merged_kind,
    six_bit,
)


def load_gguf(
    model: DecoderModel, weights: GGUFWeights, plan: dict[str, str], act_dtype: torch.dtype
) -> None:
    """Load a GGUF file's tensors one at a time: the planned linears packed from their blocks' levels
    and grids (no float copy), the rest dequantized to this model's dtype. Build the model with
    `torch.empty` weights (untouched pages cost no memory): the packed linears' are never written."""
    packed: dict[nn.Module, tuple[str, list[str]]] = {}
    for mod, (kind, names) in model.planned(plan).items():
        if kind != "bf16" and _packable(weights, mod, kind, names):
            packed[mod] = (kind, names)
    own = {id(m): n for n, m in model.named_modules()}
    experts: dict[SparseMoE, list[str]] = {}
    for name, mod in model.named_modules():
        parts = [f"model.{name}.experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        fused = f"model.{name}.experts.gate_up_proj"
        if isinstance(mod, SparseMoE) and not mod.gated:  # Nemotron-H's relu² experts: up and down alone
            parts = [parts[1], parts[1], parts[2]]
        elif parts[0] not in plan and fused in plan:  # Mistral 4's gate|up stacked whole (`ffn_gate_up_exps`)
            parts = [fused, fused, parts[2]]
        elif parts[0] not in plan:  # gpt-oss's, beside their biases: `...experts.gate_proj.weight`
            parts = [f"{p}.weight" for p in parts]
        if name.endswith(".moe"):  # Gemma 4's, beside the layer's MLP: gate and up in one tensor
            stem = f"model.{name.removesuffix('.moe')}.experts."
            parts = [f"{stem}{p}" for p in ("gate_proj", "up_proj", "down_proj")]
            if f"{stem}gate_up_proj" in plan:
                parts[:2] = [f"{stem}gate_up_proj"] * 2
        if (
            isinstance(mod, SparseMoE)
            and not model.kernels.triton  # a GPU's experts are dequantized (not packed yet)
            and mod.local % GROUP == 0
            and mod.start % GROUP == 0
            and all(p in plan and weights.type_name(p) in DECODERS for p in parts)
        ):
            experts[mod] = parts
    # the embedding table too: rows read from a packed weight (the tied head's, or its own)
    rows = model.kernels.vnni and act_dtype == torch.bfloat16
    table = rows and weights.type_name(EMBED) in DECODERS
    # Gemma 4's per-layer input table (as big as the rest of a small model): packed rows where it can
    per_layer = model.embed_tokens_per_layer
    ple = rows and per_layer is not None and PER_LAYER in plan and weights.type_name(PER_LAYER) in DECODERS
    skip = {n for _, names in packed.values() for n in names}
    skip |= {n for names in experts.values() for n in names}
    skip.discard(EMBED)  # a tied head's tensor is the table's too: read dense, unless packed rows serve
    if table:
        skip.add(EMBED)
    if ple:
        skip.add(PER_LAYER)
    model.load_weights(
        weights.dense_tensors(act_dtype, frozenset(skip)),
        expect_missing={f"{own[id(mod)]}.weight" for mod in packed}
        | {f"{own[id(mod)]}.{p}" for mod in experts for p in ("gate_up", "down")}
        | ({"embed_tokens.weight"} if table else set())
        | ({"embed_tokens_per_layer.weight"} if ple else set()),
    )
    for mod, (gate, up, down) in experts.items():
        kinds = (merged_kind({plan[gate], plan[up]}) or "int8", plan[down])
        mod.pack_experts(weights, [gate, up, down], kinds, act_dtype, model.kernels)
    plan_now = {name: plan[name] for _, names in packed.values() for name in names}
    if (dense := float_kind(act_dtype, model.kernels.triton)) is not None:
        # the file's float linears (F32 / F16 / BF16: gpt-oss's attention and head as ggml-org ships
        # them) on the CPU's bf16 kernel, as a bf16 Hugging Face model's: PyTorch's matmul read them
        # at half the memory's speed in a decode step
        for mod, (_, names) in model.planned(dense).items():
            floats = all(n in weights.tensors and weights.type_name(n) in FLOAT_TYPES for n in names)
            if mod not in packed and floats:
                plan_now |= {n: dense for n in names}
    model.quantize(
        plan_now,
        act_dtype,
        {mod: functools.partial(_grid_layout, weights, mod, names) for mod, (_, names) in packed.items()},
    )
    if table:
        _packed_table(model, weights, act_dtype)
    if ple and per_layer is not None:
        _packed_rows(per_layer, weights, PER_LAYER, act_dtype, model.kernels)


def load_quantized_checkpoint(model: DecoderModel, ckpt: QuantizedCheckpoint, act_dtype: torch.dtype) -> None:
    """Load a pre-quantized checkpoint (`pytgi.engine.loading.checkpoints`): its quantized linears
    packed from their levels (`CheckpointQuant.kind`, no float copy), the rest as they are; a linear whose
    shard does not fall on whole groups, or FP8 on CPU, is dequantized instead. On CPU the float
    linears then take the bf16 kernel, and the LM head `HEAD_KIND` (docs/models.md)."""
    kind = ckpt.quant.kind
    packed: dict[nn.Module, list[str]] = {}
    perms: dict[nn.Module, torch.Tensor] = {}  # GPTQ desc_act: the inputs' order
    keep = kind != "fp8" or model.kernels.triton  # e4m3 stays e4m3 on CUDA only
    for mod, (_, names) in model.planned(kind).items() if keep else ():
        modules = [n.removesuffix(".weight") for n in names]
        if mod is model.lm_head or not all(m in ckpt.linears for m in modules):
            continue
        group = (ckpt.quant.block[1] or 1) if ckpt.quant.float8 else _group(ckpt, modules[0])
        if isinstance(mod, RowParallelLinear) and mod.in_start % group:
            continue  # a shard across groups: dequantized
        order = [ckpt.perm(m) for m in modules]
        first = order[0]
        if any(p is not None for p in order):
            # the parts of a fused linear share one input: one order for all, and a whole input
            if first is None or not all(p is not None and torch.equal(p, first) for p in order):
                continue
            if isinstance(mod, RowParallelLinear) and mod.local_in != len(first):
                continue
            perms[mod] = first
        packed[mod] = names
    own = {id(m): n for n, m in model.named_modules()}
    skip = frozenset(n.removesuffix(".weight") for names in packed.values() for n in names)
    model.load_weights(ckpt.dense_tensors(skip), expect_missing={f"{own[id(mod)]}.weight" for mod in packed})
    plan = {name: kind for names in packed.values() for name in names}
    head = model.head_name
    if (dense := float_kind(act_dtype, model.kernels.triton)) is not None:
        # the checkpoint's float linears (the LM head, its `ignore` list) on the CPU's own kernels
        planned = model.planned(dense).items()
        plan |= {n: dense for mod, (_, names) in planned if mod not in packed for n in names}
        plan[head] = HEAD_KIND
    layouts: dict[nn.Module, Callable[[str], LayoutRows | Fp8Rows]] = {
        mod: functools.partial(_checkpoint_layout, ckpt, mod, names) for mod, names in packed.items()
    }
    if plan.get(head) not in (None, "bf16"):  # quantized a slice of rows at a time
        layouts[model.lm_head] = functools.partial(float_rows, model.lm_head.weight.data)
    model.quantize(plan, act_dtype, layouts, perms)


def _packed_table(model: DecoderModel, weights: GGUFWeights, act_dtype: torch.dtype) -> None:
    """The embedding table as a packed weight's rows: the tied head's, or its own from the file's
    blocks; dequantized into `weight` where the packed layout cannot hold it."""
    head = model.lm_head.quant if isinstance(model.lm_head, QuantizedLinear) else None
    if not (model.config.tie_word_embeddings and head is not None and head.vnni):
        kind = kind_for_gguf_type(weights.type_name(EMBED)) or "int8"
        head = QuantizedWeight(
            kind, _grid_layout(weights, model.embed_tokens, [EMBED], kind), act_dtype, model.kernels
        )
        head.dequantized = torch.empty(0)
    if head.vnni:
        assert isinstance(head, QuantizedWeight), "the CPU's packed layout has rows to read"
        model.embed_tokens.packed = head
        model.embed_tokens.weight = nn.Parameter(torch.empty(0, dtype=act_dtype), requires_grad=False)
    else:
        model.embed_tokens.load_weight(model.embed_tokens.weight, weights.dense(EMBED, act_dtype))


def _packed_rows(
    table: VocabParallelEmbedding, weights: GGUFWeights, name: str, act_dtype: torch.dtype, cpu: Kernels
) -> None:
    """An embedding table of its own (Gemma 4's per-layer inputs) as a packed weight's rows, from the
    file's blocks; dequantized into `weight` where the packed layout cannot hold it."""
    kind = kind_for_gguf_type(weights.type_name(name)) or "int8"
    quant = QuantizedWeight(kind, _grid_layout(weights, table, [name], kind), act_dtype, cpu)
    quant.dequantized = torch.empty(0)
    if quant.vnni:
        table.packed = quant
        table.weight = nn.Parameter(torch.empty(0, dtype=act_dtype), requires_grad=False)
    else:
        table.load_weight(table.weight, weights.dense(name, act_dtype))


PER_LAYER = "model.embed_tokens_per_layer.weight"  # Gemma 4's per-layer input table
FLOAT_TYPES = {"F32", "F16", "BF16"}  # GGUF's float tensor types


def _packable(weights: GGUFWeights, mod: nn.Module, kind: str, names: list[str]) -> bool:
    """Whether a planned linear's parts can be packed from their levels and grids as they are: every
    part of a type with a decoder, a row-parallel shard on whole groups."""
    if not all(weights.type_name(n) in DECODERS for n in names):
        return False
    if isinstance(mod, RowParallelLinear):
        return mod.in_start % GROUP == 0 and mod.local_in % GROUP == 0
    return True


def _in_out(ckpt: QuantizedCheckpoint, module: str) -> tuple[int, int]:
    """A quantized linear's (inputs, outputs), from the checkpoint's shapes."""
    if ckpt.quant.parts[0] == "weight":  # one value per element
        N, K = ckpt.shapes[f"{module}.weight"]
        return K, N
    if ckpt.quant.method == "compressed-tensors":
        packed = ckpt.shapes[f"{module}.weight_packed"]
        return packed[1] * (32 // ckpt.quant.bits), packed[0]
    qw = ckpt.shapes[f"{module}.qweight"]
    K = qw[0] * (32 // ckpt.quant.bits) if ckpt.quant.method == "gptq" else qw[0]
    return K, ckpt.shapes[f"{module}.scales"][1]


def _group(ckpt: QuantizedCheckpoint, module: str) -> int:
    """A quantized linear's group of inputs in the checkpoint (its whole row for group_size -1)."""
    if ckpt.quant.method == "compressed-tensors":
        scale = ckpt.shapes[f"{module}.weight_scale"]
        return _in_out(ckpt, module)[0] // (scale[1] if len(scale) == 2 else 1)
    return _in_out(ckpt, module)[0] // ckpt.shapes[f"{module}.scales"][0]


def _checkpoint_layout(
    ckpt: QuantizedCheckpoint, mod: nn.Module, names: list[str], kind: str
) -> LayoutRows | Fp8Rows:
    """This rank's part of a quantized checkpoint's linear, in `kind`'s layout, a part at a time."""
    modules = [n.removesuffix(".weight") for n in names]

    if ckpt.quant.float8:
        return _fp8_layout(ckpt, mod, modules)

    def slices() -> Iterator[Layout]:
        for i, module in enumerate(modules):
            rows = mod.shards[i] if isinstance(mod, ColumnParallelLinear) else None
            levels, zeros, scales, _ = linear_levels(
                ckpt.quant, ckpt.parts(module), None if rows is None else (rows[0], rows[0] + rows[1])
            )
            if isinstance(mod, RowParallelLinear):
                group = _group(ckpt, module)
                cols = slice(mod.in_start, mod.in_start + mod.local_in)
                levels = levels[:, cols]
                zeros, scales = (t[:, cols.start // group : cols.stop // group] for t in (zeros, scales))
            yield grid_of(ckpt.quant, levels, zeros, scales, kind)

    K, N = _in_out(ckpt, modules[0])
    if isinstance(mod, ColumnParallelLinear):
        return LayoutRows((sum(mod.shards[i][1] for i in range(len(modules))), K), slices)
    return LayoutRows((N, mod.local_in if isinstance(mod, RowParallelLinear) else K), slices)


def _fp8_layout(ckpt: QuantizedCheckpoint, mod: nn.Module, modules: list[str]) -> Fp8Rows:
    """This rank's part of an FP8 checkpoint's linear: its parts' rows (and shard) joined."""
    data, scales = [], []
    block_k = 0
    for i, module in enumerate(modules):
        q, s, block_k = fp8_rows(ckpt.quant, ckpt.parts(module))
        if isinstance(mod, ColumnParallelLinear):
            start, size = mod.shards[i]
            q, s = q[start : start + size], s[start : start + size]
        elif isinstance(mod, RowParallelLinear):
            q = q[:, mod.in_start : mod.in_start + mod.local_in]
            s = s[:, mod.in_start // block_k : -(-(mod.in_start + mod.local_in) // block_k)]
        data.append(q)
        scales.append(s)
    return Fp8Rows(torch.cat(data).contiguous(), torch.cat(scales).contiguous(), block_k)


def _grid_layout(weights: GGUFWeights, mod: nn.Module, names: list[str], kind: str) -> LayoutRows:
    """This rank's part of a linear's weight, read from its parts' blocks a slice of rows at a time,
    in `kind`'s layout."""
    ranges: list[tuple[str, int, int, tuple[int, int] | None]] = []  # per part: its rows here, its columns
    if isinstance(mod, ColumnParallelLinear) and len(names) == 1 < len(mod.shards):
        names = names * len(mod.shards)  # one tensor holding every part (a linear layer's q | k | v)
    for i, name in enumerate(names):
        rows = weights.shape(name)[0]
        if isinstance(mod, ColumnParallelLinear):
            start, size = mod.shards[i]
            ranges.append((name, start, start + size, None))
        elif isinstance(mod, RowParallelLinear):
            ranges.append((name, 0, rows, (mod.in_start, mod.local_in)))
        elif isinstance(mod, VocabParallelEmbedding):  # an LM head, or the table itself
            ranges.append((name, mod.start, min(mod.start + mod.local_vocab, rows), None))
        else:
            ranges.append((name, 0, rows, None))
    total = sum(stop - start for _, start, stop, _ in ranges)
    pad = mod.local_vocab - total if isinstance(mod, VocabParallelEmbedding) else 0

    def slices() -> Iterator[Layout]:
        for name, start, stop, cols in ranges:
            for at in range(start, stop, ROWS_PER_SLICE):
                grid = weights.grid(name, at, min(at + ROWS_PER_SLICE, stop))
                assert grid is not None, name
                yield grid_layout(grid if cols is None else grid.cols(*cols), kind)
        if pad > 0:  # the last rank's rows past the vocabulary: zero
            first = weights.grid(names[-1], 0, 1)
            assert first is not None
            u, d, _ = grid_layout(first, kind)
            yield (
                u.new_full((pad, u.shape[1]), 128),
                d.new_zeros(pad, d.shape[1]),
                d.new_zeros(pad, d.shape[1]),
            )

    width = mod.local_in if isinstance(mod, RowParallelLinear) else weights.shape(names[0])[-1]
    types = [weights.type_name(n) for n in names]
    six = kind in ("int8", "int8x16") and six_bit(types)
    return LayoutRows((total + pad, width), slices, six, five=kind == "int8" and five_bit(types))
