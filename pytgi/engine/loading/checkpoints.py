"""Pre-quantized Hugging Face checkpoints: their `quantization_config`, read and served as published.

A checkpoint quantized by GPTQ (AutoGPTQ, GPTQModel) or AWQ (AutoAWQ's GEMM packing) stores each
linear as packed integer levels with a scale and a zero point per group of inputs. Those are exactly
the grids pytgi's low-bit layouts hold (`pytgi.engine.models.quant.grid_layout`'s w = d·u + m per group
of 32), so the levels are moved, never rounded again:

- 4-bit, symmetric (GPTQ's `sym`, zero 8): int4 with u = q, d = scale, m = −8·scale (exact in fp16);
- 4-bit with zero points (GPTQ asymmetric, AWQ): int4 with m = −zero·scale, the one product rounded to
  fp16 (half an fp16 step of zero·scale at most), or, with `exact`, int8 (u = q − zero + 128,
  m = −128·scale: exact, at twice the bytes);
- 8-bit: int8 with u = q − zero + 128, m = −128·scale (exact); an asymmetric group whose levels lie
  more than 127 steps from its zero: u = q − lowest + 1, m = (lowest − 1 − zero)·scale rounded to fp16
  (a group using all 256 levels loses its top one: 255 is the layout's highest).

A checkpoint's group of 32, 64 or 128 inputs (or one group for the whole row, `group_size: -1`) is its
grid repeated for each 32 inputs. GPTQ's `desc_act` groups inputs by `g_idx` rather than by position:
the levels are stored in group order and the layer reorders its activations alike (`QuantizedLinear.perm`).
HF's `fp8` checkpoints (e4m3 weights, a scale per 128 x 128 block) and compressed-tensors' float-quantized
ones (a scale per tensor, channel or block) go to the CUDA FP8 kernels as they are, and are dequantized to
bf16 on CPU. compressed-tensors' int formats store levels either packed in int32 words
(`pack-quantized`) or one signed int8 per value (`int-quantized`, W8A8; `naive-quantized`), both
offset by 2^(bits-1). Formats still to come (bitsandbytes, EXL2, NVFP4, ...) are refused at start with
the list of what is served, never loaded as if they were float weights.

The layouts (GPTQ's v1 format, as AutoGPTQ writes it):
- GPTQ: `qweight` int32 [K / (32 / bits), N], input k's level in bits (k mod (32 / bits))·bits of row
  k / (32 / bits); `qzeros` int32 [groups, N / (32 / bits)], output n's zero likewise along the row, stored
  minus one ("v1"; `checkpoint_format: gptq_v2` stores it as it is); `scales` fp16 [groups, N]; `g_idx`
  int32 [K], input k's group (k / group_size unless `desc_act` reordered them).
- AWQ (GEMM): `qweight` int32 [K, N / 8], the 8 outputs of an int32 in the nibble order 0, 2, 4, 6, 1,
  3, 5, 7 (output c of the 8 in nibble (c mod 2)·4 + c / 2); `qzeros` int32 [groups, N / 8] likewise;
  `scales` fp16 [groups, N]; w = (q − zero)·scale.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.loading.gguf import Grid
from pytgi.engine.loading.safetensors_dir import iter_safetensors
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.quant import GROUP, _fp16

SERVED = (
    "gptq (bits 4 or 8, any group size, sym or not, desc_act too)",
    "awq (gemm, 4 bits)",
    "fp8 (e4m3 weights with weight_block_size scales, DeepSeek's and Qwen3-FP8's)",
    "compressed-tensors pack-quantized (W4A16 / W8A16: int weights, group or channel scales, sym or not)",
    "compressed-tensors int- and naive-quantized (W8A8 / W4A16 int weights, tensor, channel or group scales)",
    "compressed-tensors float-quantized (FP8 W8A8 / W8A16: e4m3 weights, tensor, channel or block scales)",
    "mxfp4 (gpt-oss's experts: kept in 4 bits on CPU, dequantized elsewhere)",
)
CT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
CT_PLAIN = ("weight", "weight_scale", "weight_zero_point")  # int-, naive- and float-quantized
# static activation and KV-cache scales: not used (activations are scaled per token as they come; the KV
# cache keeps pytgi's own dtype)
UNUSED = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale", "q_scale")
PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized linear's tensors, beside its bias
FP8_SCALE = "weight_scale_inv"  # HF fp8: the block scale a weight is multiplied by


class UnsupportedQuantization(UnsupportedModel):
    pass


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization, as far as pytgi serves it."""

    method: str  # "gptq" | "awq" | "fp8" | "compressed-tensors"
    bits: int
    group_size: int  # -1: one group per row
    sym: bool
    zeros_v1: bool  # GPTQ v1: stored zeros are the zero minus one
    block: tuple[int, int] = (0, 0)  # e4m3: the (rows, inputs) each scale covers, 0 for all of them
    stored: str = "packed"  # compressed-tensors: "packed" (int32 words) | "int" (int8) | "float" (e4m3)

    @property
    def kind(self) -> str:
        """The packed layout that holds the levels (see the module docstring); FP8 is kept as e4m3 on
        CUDA and dequantized to bf16 on CPU (its values lie on no uniform grid an int8 layout holds)."""
        return "fp8" if self.float8 else "int4" if self.bits == 4 else "int8"

    @property
    def float8(self) -> bool:
        return self.method == "fp8" or self.stored == "float"

    @property
    def parts(self) -> tuple[str, ...]:
        """A quantized linear's tensors in this format (the first two mark it)."""
        if self.method == "fp8":
            return ("weight", FP8_SCALE)
        if self.method == "compressed-tensors":
            return CT_PARTS if self.stored == "packed" else CT_PLAIN
        return PARTS


# e2m1 (FP4) codes → values; an MXFP4 block is 32 of them (two a byte, the low nibble first) and a
# shared power of two (an e8m0 byte, bias 127): the OCP microscaling format gpt-oss's experts use
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss's stacked experts: blocks [E, out, G, 16] bytes and scales [E, out, G] → the float tensor
    [E, G·32, out] (inputs by outputs, as its float checkpoints store `gate_up_proj` / `down_proj`).
    One expert at a time, so the float temporaries stay one expert's size. Exact: every value is
    an e2m1 code times a power of two."""
    lut = torch.tensor(FP4, dtype=torch.float32)
    e, out, g, _ = blocks.shape
    result = torch.empty(e, g * 32, out, dtype=dtype)
    for i in range(e):
        b = blocks[i].to(torch.int64)  # [out, G, 16]
        values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).reshape(out, g, 32)
        values = torch.ldexp(values, scales[i].to(torch.int32)[..., None] - 127)
        result[i] = values.reshape(out, g * 32).t().to(dtype)
    return result


@dataclass
class Mxfp4:
    """A stacked MXFP4 tensor as the checkpoint holds it: blocks [E, out, G, 16] (two e2m1 codes a byte)
    and exponents [E, out, G] (e8m0); `pack`: the activations' dtype and the kernels its experts are
    packed for (as codes), or None: dequantized by the experts' loader."""

    blocks: torch.Tensor
    scales: torch.Tensor
    pack: tuple[torch.dtype, Kernels] | None = None


class Mxfp4Experts:
    """gpt-oss's stacked MXFP4 experts read as `SparseMoE.pack_experts` reads a GGUF file's: tensors
    "gate" and "up" ([E·I, H]: the even and odd rows of `gate_up_proj`, where the checkpoint interleaves
    them) and "down" ([E·H, I]), each a slice of rows at a time as levels and grids (`Grid`), the
    codes never turned into floats."""

    def __init__(self, gate_up: Mxfp4, down: Mxfp4) -> None:
        self.gate_up, self.down = gate_up, down

    def shape(self, name: str) -> tuple[int, int, int]:
        t = self.down if name == "down" else self.gate_up
        e, rows, g, _ = t.blocks.shape
        return (e, rows // (2 if name != "down" else 1), g * 32)

    def grid(self, name: str, start: int, stop: int) -> Grid:
        from pytgi.engine import kernels

        t = self.down if name == "down" else self.gate_up
        rows = t.blocks.shape[1] // (2 if name != "down" else 1)
        e, r0, r1 = start // rows, start % rows, stop - (start // rows) * rows
        assert r1 <= rows, "rows of one expert at a time"
        pick = slice(r0, r1)
        if name != "down":  # gate | up interleaved: gate on even rows, up on odd ones
            first = 0 if name == "gate" else 1
            pick = slice(2 * r0 + first, 2 * r1 + first - 1, 2)
        blocks, scales = t.blocks[e, pick], t.scales[e, pick]
        n, g = scales.shape
        q = torch.empty(n, g * 32, dtype=torch.uint8)
        d = torch.empty(n, g)
        kernels.mxfp4_decode(blocks, scales, q, d)  # (kept 4-bit only where the kernels are built)
        return Grid(q, d, None, GROUP, 12, 25)


def mxfp4_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    keep: tuple[torch.dtype, Kernels] | None = None,
) -> Iterator[tuple[str, torch.Tensor | Mxfp4]]:
    """A checkpoint's tensors with each `X_blocks` / `X_scales` pair replaced by `X` dequantized
    (`dequantize_mxfp4`), or with `keep` (the activations' dtype and the kernels) by the pair as it is
    (`Mxfp4`: the experts then pack their codes, `SparseMoE`); the first of a pair waits for the other
    (they are neighbours in the files)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        base, _, part = name.rpartition("_")
        if part not in ("blocks", "scales"):
            yield name, tensor
            continue
        pair = pending.setdefault(base, {})
        pair[part] = tensor
        if len(pair) == 2:
            del pending[base]
            if keep is not None:
                yield base, Mxfp4(pair["blocks"], pair["scales"], keep)
            else:
                yield base, dequantize_mxfp4(pair["blocks"], pair["scales"], dtype)
    if pending:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {sorted(pending)[:3]}")


def read_quantization(model_dir: Path) -> CheckpointQuant | None:
    """The checkpoint's quantization (None: float weights). Raises UnsupportedQuantization, with what
    is served, for any other method or option."""
    config = Path(model_dir) / "config.json"
    cfg = json.loads(config.read_text()) if config.is_file() else {}
    qc: dict[str, Any] | None = cfg.get("quantization_config")
    if qc is None and (Path(model_dir) / "quantize_config.json").is_file():  # AutoGPTQ's own file
        qc = {"quant_method": "gptq", **json.loads((Path(model_dir) / "quantize_config.json").read_text())}
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()

    def refuse(why: str) -> UnsupportedQuantization:
        return UnsupportedQuantization(
            f"{Path(model_dir).name}: {why}; pytgi serves pre-quantized checkpoints of: {'; '.join(SERVED)} "
            "(and GGUF files of every type llama.cpp writes)"
        )

    if method == "mxfp4":  # gpt-oss's experts: the loader dequantizes them (`mxfp4_tensors`)
        if (cfg.get("architectures") or [None])[0] != "GptOssForCausalLM":
            raise refuse("mxfp4 is served for gpt-oss's experts only")
        return None
    if method == "gptq":
        bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
        if bits not in (4, 8):
            raise refuse(f"GPTQ with {bits} bits is not served")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse(f"GPTQ checkpoint_format {fmt!r} is not served")
        q = CheckpointQuant("gptq", bits, group, bool(qc.get("sym", True)), fmt == "gptq")
    elif method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if version != "gemm" or bits != 4:
            raise refuse(f"AWQ {version} with {bits} bits is not served")
        if not qc.get("zero_point", True):
            raise refuse("AWQ without zero points is not served")
        q = CheckpointQuant("awq", 4, group, False, False)
    elif method == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise refuse("fp8 with static activation scales is not served")
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise refuse("fp8 without weight_block_size is not served")
        return CheckpointQuant("fp8", 8, -1, True, False, (int(block[0]), int(block[1])))
    elif method == "compressed-tensors":
        q = _compressed_tensors(qc, refuse)
    else:
        raise refuse(f"quantization method {method or '(none)'!r} is not served")
    if q.group_size != -1 and (q.group_size <= 0 or q.group_size % 32):
        raise refuse(f"a group size of {q.group_size} (not a multiple of 32) is not served")
    return q


def _compressed_tensors(
    qc: dict[str, Any], refuse: Callable[[str], UnsupportedQuantization]
) -> CheckpointQuant:
    """compressed-tensors (llm-compressor's format): one config group of weights, int (packed in int32
    words, or one int8 per value) or e4m3. Activation schemes (W8A8's dynamic or static input scales)
    are read but not needed: activations stay in the model's dtype on CPU, and the CUDA FP8 kernel
    scales them per token itself."""
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise refuse(f"compressed-tensors with {len(groups)} config groups is not served")
    g = groups[0]
    fmt = str(g.get("format") or qc.get("format"))
    w = g.get("weights") or {}
    kind, bits, strategy = w.get("type"), int(w.get("num_bits", 0)), w.get("strategy")
    stored = {"pack-quantized": "packed", "int-quantized": "int", "naive-quantized": "int"}.get(fmt)
    if fmt == "float-quantized" or (fmt == "naive-quantized" and kind == "float"):
        stored = "float"
    if stored is None or (kind == "float") != (stored == "float") or kind not in ("int", "float"):
        raise refuse(f"compressed-tensors {fmt} ({kind} weights) is not served")
    if w.get("actorder") or w.get("dynamic"):
        raise refuse(f"compressed-tensors weights with actorder {w.get('actorder')} are not served")
    if stored == "float":
        if bits != 8 or strategy not in ("tensor", "channel", "block"):
            raise refuse(f"compressed-tensors {bits}-bit {strategy} float weights are not served")
        block = {"tensor": (0, 0), "channel": (1, 0)}.get(strategy) or tuple(w.get("block_structure") or ())
        if len(block) != 2 or min(block) < 0:
            raise refuse(f"compressed-tensors block weights with block_structure {block} are not served")
        return CheckpointQuant(
            "compressed-tensors", 8, -1, True, False, (int(block[0]), int(block[1])), "float"
        )
    if bits not in (4, 8) or strategy not in ("group", "channel", "tensor"):
        raise refuse(f"compressed-tensors {bits}-bit {strategy} int weights are not served")
    group = int(w["group_size"]) if strategy == "group" else -1
    # (its `ignore` list needs no reading: the linears it names have no scales and load as floats)
    return CheckpointQuant(
        "compressed-tensors", bits, group, bool(w.get("symmetric", True)), False, stored=stored
    )


def _bytes_values(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] → uint8 [R, C, 32 / bits]: each int32's values, lowest bits first (byte by byte,
    on a little-endian host: a quarter of the traffic of shifting int32s)."""
    b = packed.contiguous().view(torch.uint8).view(*packed.shape, 4)
    if bits == 8:
        return b
    return torch.stack([b & 15, b >> 4], dim=-1).view(*packed.shape, 8)


def _unpack_rows_t(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] packed along the rows (GPTQ's qweight [K / per, N]) → uint8 levels [C, R · per],
    already transposed to nn.Linear's [N, K]."""
    vals = _bytes_values(packed, bits)  # [R, C, per]: row r·per + i of column c
    return vals.permute(1, 0, 2).reshape(packed.shape[1], -1)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] → uint8 levels [R · per, C]: packed along the rows (a zero point's outputs)."""
    return _unpack_rows_t(packed, bits).t()


def _unpack_cols(packed: torch.Tensor, bits: int, awq: bool) -> torch.Tensor:
    """int32 [R, C] → uint8 levels [R, C · per]: packed along the columns (qzeros; AWQ's qweight, in
    its nibble order)."""
    vals = _bytes_values(packed, bits)
    if awq:  # output c of each 8 sits in nibble (c % 2) * 4 + c // 2
        c = torch.arange(8)
        vals = vals[:, :, (c % 2) * 4 + c // 2]
    return vals.reshape(packed.shape[0], -1)


def _per_row(t: torch.Tensor, N: int) -> torch.Tensor:
    """A scale or zero point per tensor, output channel or group, as [N, groups]."""
    return t.reshape(1, 1).expand(N, 1) if t.numel() == 1 else t.reshape(N, -1)


def linear_levels(
    q: CheckpointQuant, parts: dict[str, torch.Tensor], rows: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One linear's levels, zeros and scales in nn.Linear's orientation: (q uint8 [N, K], zero int32
    [N, groups], scale float32 [N, groups], perm), for output rows `rows` (start, end) or all. A GPTQ
    checkpoint quantized with `desc_act` groups its inputs by `g_idx`, not by position: the levels come
    back with their inputs reordered so that each group's are contiguous, and `perm` is that order (the
    activations must be reordered alike: x[:, perm]); None when the inputs are in order."""
    perm = None
    if q.method == "gptq":
        levels = _unpack_rows_t(parts["qweight"], q.bits)  # [N, K]
        zeros = _unpack_cols(parts["qzeros"], q.bits, awq=False).t().to(torch.int32) + int(q.zeros_v1)
        g_idx = parts.get("g_idx")
        K = levels.shape[1]
        group = K if q.group_size == -1 else q.group_size
        if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(K) // group):
            perm = torch.argsort(g_idx.to(torch.int64), stable=True)
            if not torch.equal(g_idx.to(torch.int64)[perm], torch.arange(K) // group):
                raise UnsupportedQuantization(
                    "a GPTQ linear's g_idx gives groups of unequal sizes: not served"
                )
            levels = levels[:, perm]
    elif q.method == "compressed-tensors" and q.stored == "int":  # int8 [N, K], signed; zeros likewise
        half = 1 << (q.bits - 1)
        levels = (parts["weight"].to(torch.int16) + half).to(torch.uint8)
        N = levels.shape[0]
        scales = _per_row(parts["weight_scale"].float(), N)
        zp = parts.get("weight_zero_point")
        zeros = half + (torch.zeros(scales.shape, dtype=torch.int32) if zp is None else _per_row(zp, N).int())
    elif q.method == "compressed-tensors":  # [N, K / per], values stored plus 2^(bits-1), low bits first
        levels = _unpack_cols(parts["weight_packed"], q.bits, awq=False)
        scales = parts["weight_scale"].float()
        if "weight_zero_point" in parts:  # packed along the outputs, offset alike
            zeros = _unpack_rows(parts["weight_zero_point"], q.bits)[: scales.shape[0]].to(torch.int32)
        else:
            zeros = torch.full(scales.shape, 1 << (q.bits - 1), dtype=torch.int32)
        K = int(parts["weight_shape"][1]) if "weight_shape" in parts else levels.shape[1]
        levels = levels[:, :K]
    else:
        levels = _unpack_cols(parts["qweight"], 4, awq=True).t()
        zeros = _unpack_cols(parts["qzeros"], 4, awq=True).t().to(torch.int32)
    if q.method != "compressed-tensors":
        scales = parts["scales"].float().t()
    N = scales.shape[0]
    levels, zeros = levels[:N], zeros[:N]  # (packing pads the outputs to whole int32s)
    if rows is not None:
        levels, zeros, scales = levels[rows[0] : rows[1]], zeros[rows[0] : rows[1]], scales[rows[0] : rows[1]]
    return levels.contiguous(), zeros.contiguous(), scales.contiguous(), perm


def dequantize(q: CheckpointQuant, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight [N, K] the checkpoint means: scale · (q − zero) of each input's group."""
    levels, zeros, scales, perm = linear_levels(q, parts)
    groups = scales.shape[1]
    per = levels.shape[1] // groups
    w = ((levels.view(levels.shape[0], groups, per) - zeros[..., None]).float() * scales[..., None]).view(
        levels.shape
    )
    if perm is not None:  # back to the inputs' own order
        w = w[:, torch.argsort(perm)]
    return w


def grid_of(q: CheckpointQuant, levels: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, kind: str):
    """(u, d, m) in `kind`'s terms (per 32 inputs) for these levels: see the module docstring."""
    N, K = levels.shape
    per32 = K // scales.shape[1] // GROUP  # the checkpoint's group in 32s
    d = _fp16(scales).repeat_interleave(per32, dim=1)
    z = zeros.repeat_interleave(per32, dim=1)
    if kind == "int4":
        return levels.to(torch.uint8), d, _fp16(-z.float() * d)
    g = levels.view(N, K // GROUP, GROUP).to(torch.int32)
    u = g - z[..., None] + 128
    # an asymmetric 8-bit group whose levels lie over 127 steps from its zero: offset from its lowest level
    off = (u.amin(-1) < 1) | (u.amax(-1) > 255)
    lo = g.amin(-1)
    u = torch.where(off[..., None], g - lo[..., None] + 1, u)
    m = torch.where(off, _fp16((lo - 1 - z).float() * d), -128 * d)
    return u.view(N, K).clamp(1, 255).to(torch.uint8), d, m


def fp8_rows(q: CheckpointQuant, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """An e4m3 linear as the CUDA kernel takes it: (bytes uint8 [N, K], float32 scales [N, K / SK], SK)
    with a scale per row and block of SK inputs: the checkpoint's block rows repeated (so fused parts of
    any height concatenate), a scale per channel or per tensor as one block of the whole row."""
    weight, scale = parts["weight"], parts[q.parts[1]].float()
    N, K = weight.shape
    rows = scale.reshape(1, 1).expand(N, 1) if scale.numel() == 1 else scale.reshape(-1, scale.shape[-1])
    if q.block[0] > 1:
        rows = rows.repeat_interleave(q.block[0], dim=0)[:N]
    return weight.view(torch.uint8), rows.contiguous(), q.block[1] or K


def fp8_dequantize(q: CheckpointQuant, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 [N, K]: each e4m3 value times its block's scale."""
    data, scales, block_k = fp8_rows(q, parts)
    K = data.shape[1]
    return parts["weight"].float() * scales.repeat_interleave(block_k, dim=1)[:, :K]


class QuantizedCheckpoint:
    """A directory of safetensors quantized by `quant`: its float tensors as they are, its quantized
    linears as levels (for the packed kernels) or dequantized (float32, or where a linear is not packed)."""

    def __init__(self, path: Path, quant: CheckpointQuant) -> None:
        from safetensors import safe_open

        self.path, self.quant = path, quant
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._files: dict[str, Path] = {}
        for file in sorted(path.glob("*.safetensors")):  # each header read once
            with safe_open(str(file), "pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())
                    self._files[name] = file
        # a quantized linear: its packed levels, or (where its weight keeps the name) its scale
        marker = "." + (quant.parts[1] if quant.parts[0] == "weight" else quant.parts[0])
        self.linears = {n.removesuffix(marker) for n in self.shapes if n.endswith(marker)}

    def parts(self, module: str) -> dict[str, torch.Tensor]:
        """A quantized linear's tensors (qweight, qzeros, scales, g_idx where stored)."""
        from safetensors import safe_open

        out = {}
        for part in self.quant.parts:
            name = f"{module}.{part}"
            if name in self._files:
                with safe_open(str(self._files[name]), "pt") as f:
                    out[part] = f.get_tensor(name)
        return out

    def perm(self, module: str) -> torch.Tensor | None:
        """The input order a GPTQ `desc_act` linear's groups need (`linear_levels`), or None."""
        if self.quant.method != "gptq" or f"{module}.g_idx" not in self._files:
            return None
        from safetensors import safe_open

        with safe_open(str(self._files[f"{module}.g_idx"]), "pt") as f:
            g_idx = f.get_tensor(f"{module}.g_idx").to(torch.int64)
        K = len(g_idx)
        group = K if self.quant.group_size == -1 else self.quant.group_size
        return None if torch.equal(g_idx, torch.arange(K) // group) else torch.argsort(g_idx, stable=True)

    def dense_tensors(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """Every float tensor, and each quantized linear but those in `skip` (module names) dequantized
        as `<module>.weight` (float32), once its parts are read."""
        ours = self.quant.parts
        for name, t in iter_safetensors(self.path):
            module, _, part = name.rpartition(".")
            if part in UNUSED:
                continue
            if module in self.linears and part in ours:
                if part == ours[0] and module not in skip:
                    parts = self.parts(module)
                    q = self.quant
                    yield f"{module}.weight", fp8_dequantize(q, parts) if q.float8 else dequantize(q, parts)
                continue
            yield name, t


def file_quantization(model_dir: Path) -> dict[str, int] | None:
    """A converted GGUF model's tensor types with their counts, or a quantized checkpoint's method with
    its count of quantized linears (None for float models)."""
    path = Path(model_dir) / "quantization.json"
    if not path.is_file():
        quant = read_quantization(model_dir)
        if quant is None:
            return None
        detail = f"{quant.method} {quant.bits}-bit" + (
            f" group {quant.group_size}" if not quant.float8 and quant.group_size != -1 else ""
        )
        return {detail: len(QuantizedCheckpoint(Path(model_dir), quant).linears)}
    types = list(json.loads(path.read_text()).get("tensors", {}).values())
    return {t: types.count(t) for t in sorted(set(types))}
