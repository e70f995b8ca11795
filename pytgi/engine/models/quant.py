"""Weight-only quantization for small-batch CPU decode.

A decode step with a few tokens is bound by reading the weights: 4-bit weights are 4× fewer bytes
than bf16. By default (batch invariant, docs/batch-invariance.md) the packed low-bit weight serves
every step size, so that a row's output does not depend on the step's. With
`--disable-batch-invariance`, large batches and prefill chunks, which are compute bound, take a
bf16 matmul instead (`benchmarks/matmul_kernels.py` measures the crossover). So a quantized linear keeps
both: the packed weight for steps of at most `max_m` tokens, and the bf16 weight *made from the
same low-bit values* for bigger ones. At load, `quantize_model` swaps each planned linear for a
`QuantizedLinear` holding both.

The grids are GGUF's, with fp16 scales: int4 is Q4_1's (w = d·q + m, q in 0..15 per group of 32
input features), int8 holds 8-bit values u with w = d·u + m per group of 32, and int8x16 the same
with a scale and offset per 16 inputs, the sub-blocks of GGUF's Q6_K and Q2_K. Three
kernels multiply by them:
- on CPUs with AVX-512 VNNI, pytgi's own (`pytgi/engine/kernels/qgemv.c`), which also quantizes the
  activations to int8 per group of 32, as llama.cpp does, and runs near memory speed;
- on CPUs with AMX as well, bigger steps make the same integer sums with AMX int8 tiles and scale
  them in the same order, so their rows equal the VNNI kernel's bit for bit;
- elsewhere PyTorch's `_weight_int4pack_mm_for_cpu` (bf16 scales) and `_weight_int8pack_mm`
  (whose per-channel scales need a per-channel int8 grid instead).

Which tensors to quantize, and how, is a per-tensor plan:
- a GGUF model follows its file (`quantization.json`, written by the converter): Q4_0, Q4_1 and
  Q4_K tensors become int4, Q5_0/Q5_1/Q5_K/Q8_0 int8 and Q2_K/Q3_K/Q6_K int8x16 (on a CPU with the
  kernels Q3_K and Q6_K, symmetric and of at most 64 levels, take 6 bits, qgemv.c's format 6, and
  Q5_0, symmetric with 32 levels, 5.5 bits as in the file, format 7; a linear mixing Q5_0 with
  Q3_K/Q6_K parts takes 6 bits). The loader reads
  each tensor's levels and grids from its blocks (`pytgi.engine.loading.gguf`, `grid_layout`) and
  packs them as they are: exact but for fp16 scales, for every type, with no float copy of the
  model; float tensors, and types on no uniform grid (IQ*, TQ*), are dequantized to bf16;
- MXFP4 (gpt-oss's experts, in a GGUF file or a Hugging Face checkpoint) keeps its 4-bit codes: format
  "mxfp4", which the kernels turn into levels on a uniform grid of 25 as they read them (qgemv.c);
- a Hugging Face model is quantized only on request (`--quantize int8|int4`). By default (bf16 on a CPU
  whose kernels build) its weights stay as they are, bf16, and are only re-laid out for
  `pytgi/engine/kernels/bf16gemm.c` ("bf16"): a decode step then reads them at memory speed, every step size
  gives a row the same bits (batch invariant), and nothing is rounded that the checkpoint did not.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pytgi.core.errors import ConfigError
from pytgi.engine import kernels
from pytgi.engine.loading.gguf import FP4_LEVELS, Grid, group_values
from pytgi.engine.models.cpu import Kernels, triton_available
from pytgi.engine.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

GROUP = 32
INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K"}  # on a 16-level grid per 32 values
INT8_TYPES = {"Q5_0", "Q5_1", "Q5_K", "Q8_0"}  # on a grid of at most 256 levels per 32 values
SUB16_TYPES = {"Q2_K", "Q3_K", "Q6_K"}  # scales per 16 values that no grid per 32 holds
# the symmetric types of at most 64 levels: 6 bits on CPU (qgemv.c's format 6), whether their kind is
# int8x16 (Q6_K, Q3_K: a scale per 16) or int8 (Q5_0: one per 32, given to both halves, where Q5_0 parts
# share a linear with Q6_K or Q3_K ones; alone they take FIVE_BIT_TYPES' format)
SIX_BIT_TYPES = {"Q6_K", "Q3_K", "Q5_0"}
# Q5_0 alone (symmetric, 32 levels, one scale per 32): 5.5 bits on CPU (qgemv.c's format 7), as in the file
FIVE_BIT_TYPES = {"Q5_0"}
MODES = ("none", "auto", "int8", "int4", "bf16", "fp8")
BITS = {"int4": 4, "mxfp4": 5, "int8": 8, "int8x16": 16}  # the kernels' name for each layout (qgemv.c)
# MXFP4's level (12 + 2·value) → its e2m1 code (as pack.c's table: off-grid levels to the one below)
FP4_CODES = torch.tensor(
    [15, 15, 15, 15, 14, 14, 13, 13, 12, 11, 10, 9, 0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 6, 6, 7]
)
FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def gguf_plan(model_dir: Path) -> dict[str, str]:
    """HF tensor name → "int4" | "int8" | "int8x16" from the converter's record of the GGUF types
    ({} if none)."""
    path = Path(model_dir) / "quantization.json"
    if not path.is_file():
        return {}
    types = json.loads(path.read_text()).get("tensors", {})
    return {name: kind for name, t in types.items() if (kind := kind_for_gguf_type(t)) is not None}


def six_bit(types: Iterable[str]) -> bool:
    """Whether a linear whose parts are of these GGUF types takes the CPU's 6-bit layout
    (`LayoutRows.six`)."""
    return all(t in SIX_BIT_TYPES for t in types)


def five_bit(types: Iterable[str]) -> bool:
    """Whether a linear whose parts are of these GGUF types takes the CPU's 5.5-bit layout
    (`LayoutRows.five`): all of them Q5_0 (with a part of another type, `six_bit` decides)."""
    return all(t in FIVE_BIT_TYPES for t in types)


def kind_for_gguf_type(t: str) -> str | None:
    """The packed layout that holds a GGUF type's values exactly (but for fp16 scales), or None to
    keep the converted float values: float types, and types whose values lie on no uniform grid
    (IQ*, TQ*: codebooks)."""
    if t == "MXFP4":
        return "mxfp4"
    if t in INT4_TYPES:
        return "int4"
    if t in SUB16_TYPES:
        return "int8x16"
    return "int8" if t in INT8_TYPES else None


def resolve_plan(
    mode: str, model_dir: Path, act_dtype: torch.dtype, device: torch.device, gpu: bool | None = None
) -> dict[str, str] | str:
    """The plan for this run: a dict per tensor, a single kind for every linear, or {} for none.
    `gpu`: the weights go to the Triton kernels of `pytgi.engine.kernels.gpu_quant` (default: on CUDA with
    Triton), which take the same kinds as the CPU's but "bf16", and "fp8"."""
    if mode not in MODES:
        raise ConfigError(f"unknown quantization {mode!r} ({' | '.join(MODES)})")
    if gpu is None:
        gpu = device.type == "cuda" and triton_available()
    if mode == "none":
        return {}
    if act_dtype == torch.float32 or (device.type != "cpu" and not gpu):
        if mode == "auto":
            return {}  # float32 stays exact; a GPU without Triton has no low-bit kernel
        raise ConfigError(
            f"--quantize {mode} needs a bfloat16 model on CPU or a CUDA GPU with Triton (got "
            f"{str(act_dtype).removeprefix('torch.')} on {device.type}); pass --dtype bfloat16"
        )
    if mode == "fp8" and not gpu:
        raise ConfigError("--quantize fp8 runs on a CUDA GPU (with Triton); on CPU use int8 or int4")
    if mode == "bf16" and gpu:
        raise ConfigError("--quantize bf16 is the CPU kernels' layout: a GPU takes bf16 weights as they are")
    if mode == "auto":
        if (model_dir / "quantization.json").is_file():
            return gguf_plan(model_dir)
        return float_kind(act_dtype, gpu) or {}
    return mode


def float_kind(act_dtype: torch.dtype, gpu: bool) -> str | None:
    """The packed layout a float linear of a bf16 model runs in on this CPU ("bf16"), or None (float32
    stays exact; a GPU, `gpu`, takes float weights as they are)."""
    if gpu or act_dtype != torch.bfloat16 or not kernels.bf16gemm_supported():
        return None
    return "bf16"


# A pre-quantized checkpoint's float LM head on CPU: 8 bits in groups of 32 (Q8_0's grid), the width a
# GGUF Q4_K_M's head has, half the bytes of bf16 (a 3B Llama's 128k-token head is 0.79 GB a token in
# bf16); what it costs in fidelity: docs/models.md, benchmarks/quant_fidelity.py.
HEAD_KIND = "int8"


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 (for PyTorch's kernel): (q [N, K] int8, scales [N],
    dequantized w)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127)
    return q.to(torch.int8), scale, q * scale[:, None]


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(min=-65504, max=65504).half().float()


def _own_grid(
    g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the step of the grid of at most `levels` + 1 values its values already lie on (a
    GGUF block's: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the 32-value sub-blocks of Q4_K/Q5_K, the 16-value ones
    of Q2_K/Q3_K/Q6_K, pairs of those whose scales share a small divisor), and whether they lie on
    it. So a GGUF tensor keeps its own grid instead of being rounded again onto a new one. The step
    is the smallest gap between the group's values, or the first of gap/2, gap/3, ... that puts
    every value on a grid, where the values use only some levels (gaps of 2 and 3 steps; two
    sub-blocks of scales 29 and 10, whose smallest gap is 10 steps). Returns (step, on_grid)."""
    span = hi - lo
    gaps = g.sort(dim=-1).values.diff(dim=-1)
    gap = torch.where(gaps > span[..., None] * 1e-4, gaps, torch.inf).amin(dim=-1)
    # a group of one value (a sub-block whose scale is 0) lies on the grid of step |value|
    const = span == 0
    step = torch.where(const, torch.where(lo != 0, lo.abs(), 1.0), gap)
    on_grid = const.clone()
    for div in range(1, levels + 1):
        # the groups without a grid yet whose values would still fit the levels at this step (fewer
        # with every div: none left, none later)
        todo = (~on_grid & gap.isfinite() & (span * div <= (levels + 1e-3) * gap)).nonzero(as_tuple=True)
        if not todo[0].numel():
            break
        s = gap[todo] / div
        k = (g[todo] - lo[todo][..., None]) / s[..., None]
        ok = ((k - k.round()).abs() < 1e-3).all(dim=-1)
        step[todo] = torch.where(ok, s, step[todo])
        on_grid[todo] = ok
    return step, on_grid


def quantize_int8_groups(
    w: torch.Tensor, group: int = GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w = d·u + m, u in 1..255 per `group` inputs, d and m in fp16. A group on a grid of its own
    (a GGUF Q5/Q6/Q8 block) keeps it: symmetric (m = -128·d, exact) where zero is on it, else from
    its smallest value; any other group gets Q8_0's grid (d = absmax / 127, m = -128·d).
    Returns (u [N, K] int32, d, m [N, K/group], dequantized w)."""
    N, K = w.shape
    g = w.float().view(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    amax = torch.maximum(-lo, hi)
    step, on_grid = _own_grid(g, lo, hi, 254)
    z = lo / step  # zero on the grid, within the symmetric range: the form with an exact offset
    symmetric = ~on_grid | (((z - z.round()).abs() < 1e-3) & (amax / step <= 127.001))
    d = _fp16(torch.where(on_grid, step, amax / 127))
    m = torch.where(symmetric, -128 * d, _fp16(lo - d))
    u = torch.round((g - m[..., None]) / d.clamp(min=1e-30)[..., None]).clamp(1, 255)
    return u.view(N, K).to(torch.int32), d, m, (u * d[..., None] + m[..., None]).view(N, K)


def quantize_int4(
    w: torch.Tensor, group: int = GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1's grid: w ≈ d·q + m, q in 0..15 per `group` inputs, d and m in fp16: the group's own
    16-level grid where it lies on one (`_own_grid`), else min/max.
    Returns (q [N, K] int32, d, m [N, K/group], dequantized w)."""
    N, K = w.shape
    g = w.float().view(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    step, on_grid = _own_grid(g, lo, hi, 15)
    d, m = _fp16(torch.where(on_grid, step, (hi - lo) / 15)), _fp16(lo)
    q = torch.round((g - m[..., None]) / d.clamp(min=1e-30)[..., None]).clamp(0, 15)
    return q.view(N, K).to(torch.int32), d, m, (q * d[..., None] + m[..., None]).view(N, K)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The OCP MXFP4 grid (gpt-oss's experts): per 32 inputs a power of two 2^e (the largest value
    in 4..8 of it) and each value the nearest e2m1 value (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6) times it.
    Returns (levels 12 + 2·value [N, K] int32, d = 2^(e - 1), m = -12·d [N, K/32], dequantized w)."""
    N, K = w.shape
    g = w.float().view(N, K // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-30))) - 2, torch.zeros_like(amax))
    v = g / torch.exp2(e)[..., None]
    mag = (v.abs()[..., None] - FP4_MAGNITUDES).abs().argmin(dim=-1)
    q = (12 + torch.sign(v) * 2 * FP4_MAGNITUDES[mag]).round()
    d = torch.exp2(e - 1)
    m = -12 * d
    return q.view(N, K).to(torch.int32), d, m, (q * d[..., None] + m[..., None]).view(N, K)


def pack_vnni(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout `pytgi/engine/kernels/qgemv.c` reads: q unsigned ([N, K], values < 256), d and m
    [N, K/32] (bits 4, 7, 8) or [N, K/16] (bits 16: int8x16); per tile of 16 rows and group of 32
    inputs, the weight bytes then 16 fp16 d and m (for each 16 inputs with bits 16)."""
    N, K = q.shape
    if kernels.available():  # the same bytes in one pass (pack.c)
        out = torch.empty(N // 16, K // GROUP, block_bytes(bits), dtype=torch.uint8)
        kernels.pack_lowbit(q.to(torch.uint8), d, m, bits, out)
        return out
    return pack_vnni_reference(q, d, m, bits)


def block_bytes(bits: int) -> int:
    """Bytes of a packed (16 rows, 32 inputs) block: the levels, then fp16 d and m (mxfp4: each row's
    e8m0 exponent instead, d = 2^(E - 128) and m = -12·d; bits 6: d per 16 inputs, m = -32·d; bits 7:
    d alone, m = -16·d)."""
    return {4: 320, 5: 272, 6: 448, 7: 352, 8: 576, 16: 640}[bits]


def fp4_exponents(d: torch.Tensor) -> torch.Tensor:
    """MXFP4's steps (powers of two, as fp16 holds them) → their e8m0 bytes E (d = 2^(E - 128); 0: zero)."""
    d = d.half().float()
    return torch.where(d > 0, torch.frexp(d).exponent + 127, 0).to(torch.uint8)


def pack_vnni_reference(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack_vnni` in PyTorch's operations (where the C kernels are not built, and to test pack.c)."""
    N, K = q.shape
    G = K // GROUP
    if bits == 5:  # MXFP4's levels stored as their e2m1 codes
        q = FP4_CODES[q.long()]
    v = q.to(torch.uint8).view(N // 16, 16, G, 8, 4).permute(0, 2, 3, 1, 4).reshape(N // 16, G, 8, 64)
    if bits in (4, 5):
        v = v[:, :, :4] | (v[:, :, 4:] << 4)

    def scales(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N/16, G, 32 bytes]
        return t.half().view(N // 16, 16, G).permute(0, 2, 1).contiguous().view(torch.uint8)

    if bits == 5:
        e = fp4_exponents(d).view(N // 16, 16, G).permute(0, 2, 1)
        return torch.cat([v.reshape(N // 16, G, -1), e], dim=-1).contiguous()
    if bits == 6:  # low nibbles as bits 4; vector j's high 2 bits at bit 2·(j % 4) of vector 4 + j // 4
        low = (v[:, :, :4] & 15) | ((v[:, :, 4:] & 15) << 4)
        top = (v >> 4).view(N // 16, G, 2, 4, 64)
        high = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
        ds = d.half().view(N // 16, 16, G, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
        return torch.cat(
            [low.reshape(N // 16, G, -1), high.reshape(N // 16, G, -1), ds.reshape(N // 16, G, -1)], -1
        )
    if bits == 7:  # low nibbles as bits 4; vector j's high bit at bit j of one more vector
        low = (v[:, :, :4] & 15) | ((v[:, :, 4:] & 15) << 4)
        bit = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
        high = (((v >> 4) & 1) << bit).sum(2, dtype=torch.uint8)  # distinct bits: the sum is their or
        return torch.cat([low.reshape(N // 16, G, -1), high, scales(d)], -1).contiguous()
    halves = [(d, m)] if bits != 16 else [(d.view(N, G, 2)[..., h], m.view(N, G, 2)[..., h]) for h in (0, 1)]
    return torch.cat(
        [v.reshape(N // 16, G, -1)] + [scales(t) for pair in halves for t in pair], dim=-1
    ).contiguous()


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows of a `pack_vnni` layout, dequantized: float32 [len(rows), K]."""
    T, G = len(rows), packed.shape[1]
    wbytes = 256 if bits in (4, 5) else 512
    blocks = packed[rows // 16]  # [T, G, bytes]: each row's tile
    r = (rows % 16).view(T, 1, 1, 1)
    w = blocks[..., :wbytes]
    if bits == 6:  # the low nibbles as bits 4, then each vector's high 2 bits; d per 16, m = -32·d
        low = blocks[..., :256].reshape(T, G, 4, 64)
        high = blocks[..., 256:384].reshape(T, G, 2, 1, 64) >> torch.tensor([0, 2, 4, 6]).view(1, 1, 1, 4, 1)
        w = (torch.cat([low & 15, low >> 4], dim=2) | ((high.reshape(T, G, 8, 64) & 3) << 4)).view(
            T, G, 8, 16, 4
        )
        q = w.gather(3, r.view(T, 1, 1, 1, 1).expand(T, G, 8, 1, 4)).view(T, G, 2, 16).float()
        ds = blocks[..., 384:].contiguous().view(torch.float16).view(T, G, 2, 16)
        dr = ds.gather(3, r.expand(T, G, 2, 1)).float()  # [T, G, 2, 1]
        return (dr * (q - 32)).view(T, G * 32)
    if bits == 7:  # the low nibbles as bits 4, then each vector's high bit; d per 32, m = -16·d
        low = blocks[..., :256].reshape(T, G, 4, 64)
        bit = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
        high = (blocks[..., 256:320].reshape(T, G, 1, 64) >> bit) & 1
        w = (torch.cat([low & 15, low >> 4], dim=2) | (high << 4)).view(T, G, 8, 16, 4)
        q = w.gather(3, r.view(T, 1, 1, 1, 1).expand(T, G, 8, 1, 4)).view(T, G, 32).float()
        ds = blocks[..., 320:].contiguous().view(torch.float16).view(T, G, 16)
        dr = ds.gather(2, r.view(T, 1, 1).expand(T, G, 1)).float()  # [T, G, 1]
        return (dr * (q - 16)).view(T, G * 32)
    if bits in (4, 5):  # byte j of a quad holds quad j (low nibble) and quad j + 4 (high)
        w = w.reshape(T, G, 4, 16, 4)
        w = torch.cat([w & 15, w >> 4], dim=2)
        if bits == 5:  # e2m1 codes → their levels
            w = torch.tensor(FP4_LEVELS, dtype=torch.uint8)[w.long()]
    w = w.reshape(T, G, 8, 16, 4)
    q = w.gather(3, r.view(T, 1, 1, 1, 1).expand(T, G, 8, 1, 4)).view(T, G, 32).float()
    if bits == 5:
        e = blocks[..., wbytes:].long().gather(2, r.view(T, 1, 1).expand(T, G, 1)).float()  # [T, G, 1]
        step = torch.where(e > 0, torch.exp2(e - 128), 0.0)
        return (q * step - 12 * step).view(T, G * 32)
    scales = blocks[..., wbytes:].contiguous().view(torch.float16).view(T, G, -1, 16)
    s = scales.gather(3, r.expand(T, G, scales.shape[2], 1)).squeeze(3).float()  # [T, G, d m (d m)]
    groups = s.shape[2] // 2  # scales per 32 inputs: 1, or 2 for int8x16
    q = q.view(T, G, groups, 32 // groups)
    return (q * s[..., 0::2, None] + s[..., 1::2, None]).view(T, G * 32)


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """[N, K] → bf16gemm.c's layout: per tile of 16 rows, K/2 vectors of (row, pair of inputs)."""
    N, K = w.shape
    return w.to(torch.bfloat16).view(N // 16, 16, K // 2, 2).transpose(1, 2).contiguous()


def grid_layout(grid: Grid, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF tensor's levels and grids (`pytgi.engine.loading.gguf.Grid`) in a packed layout's terms,
    its levels kept: (u uint8 [N, K], d, m float32 holding fp16 values [N, K / group]) with
    w = d·u + m. int4 takes 16 levels per 32 values; int8 (per 32) and int8x16 (per 16) hold u in
    1..255, symmetric grids (m = -zero·d) at u = q - zero + 128 with m = -128·d, offset ones at
    u = q + 1 with m = fp16(m - d). Exact but for the fp16 rounding of d and m (and, for Q8_0 alone,
    a level of -128, which no file llama.cpp writes, read as -127). mxfp4 takes MXFP4's grids alone
    (levels 12 + 2·value, zero 12: `gguf_weights.FP4_LEVELS`)."""
    group = 16 if kind == "int8x16" else GROUP
    if grid.group != group and not (grid.group == GROUP and group == 16):
        raise ValueError(f"a grid per {grid.group} values does not fit {kind}")
    if kind == "int4" and grid.levels > 16:
        raise ValueError(f"{grid.levels} levels do not fit int4")
    if kind == "mxfp4" and (grid.levels != 25 or grid.zero != 12):
        raise ValueError("only MXFP4 blocks fit mxfp4")
    d = _fp16(grid.d)
    if kind in ("int4", "mxfp4"):
        u = grid.q
        m = -float(grid.zero or 0) * d if grid.m is None else _fp16(grid.m)
    elif grid.m is None:  # q - zero + 128 stays in 0..255 (zero: half the levels); 0 only for Q8_0's -128
        u = (grid.q + (128 - int(grid.zero or 0))).clamp_(min=1)
        m = -128 * d
    else:
        u, m = grid.q + 1, _fp16(grid.m - d)
    if grid.group != group:  # a grid per 32 values, repeated for each 16
        d, m = d.repeat_interleave(2, dim=1), m.repeat_interleave(2, dim=1)
    return u, d, m


Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (u, d, m) of `grid_layout`


@dataclass
class LayoutRows:
    """A weight given a slice of rows at a time, each in a layout's terms (`grid_layout`), so that it
    is packed without ever being whole in another form."""

    shape: tuple[int, int]
    slices: Callable[[], Iterator[Layout]]
    # int8x16's or int8's levels all q - zero + 128 with m = -128·d and |q - zero| <= 32 (Q6_K's, Q3_K's,
    # Q5_0's): the CPU packs them in 6 bits (qgemv.c's format 6), 7 bits a weight where int8 takes 9
    six: bool = False
    # int8's levels all q - 16 + 128 with m = -128·d, q in 0..31 (Q5_0's): the CPU packs them in 5.5 bits
    # (qgemv.c's format 7), as the file holds them; before `six`
    five: bool = False

    def tiles(self) -> Iterator[Layout]:
        """The slices regrouped on whole tiles of 16 rows (the packed layout's unit)."""
        held: list[Layout] = []
        for part in self.slices():
            held.append(part)
            rows = sum(len(u) for u, _, _ in held)
            if rows % 16 == 0:
                yield _joined(held)
                held = []
        if held:
            yield _joined(held)

    def whole(self) -> Layout:
        return _joined(list(self.slices()))


def _joined(parts: list[Layout]) -> Layout:
    if len(parts) == 1:
        return parts[0]
    u, d, m = zip(*parts)
    return torch.cat(u), torch.cat(d), torch.cat(m)


class QuantizedWeight:
    """The low-bit form of one linear's weight and the kernel that multiplies by it."""

    def __init__(
        self,
        kind: str,
        w: torch.Tensor | LayoutRows,
        act_dtype: torch.dtype,
        cpu: Kernels,
    ) -> None:
        """`w`: the float weight, or its levels and grids already in the layout's terms, by rows
        (`LayoutRows`); `cpu`: the kernels this process uses (`Kernels.for_device`)."""
        N, K = w.shape
        self.kind, self.shape, self.act_dtype = kind, (N, K), act_dtype
        if kind == "bf16":  # the weight itself, laid out for bf16gemm.c
            assert isinstance(w, torch.Tensor)
            self.bits, self.vnni, self.amx, self.vnni_max_m = 0, False, False, 1 << 30
            self.max_m = cpu.bf16_max_m()
            self.packed, self.dequantized = pack_bf16(w), w.to(act_dtype)
            return
        self.bits = BITS[kind]
        self.vnni = cpu.vnni and act_dtype == torch.bfloat16 and N % 16 == 0 and K % GROUP == 0
        self.amx = self.vnni and cpu.amx
        self.max_m = cpu.lowbit_max_m(self.vnni, self.amx)
        self.vnni_max_m = cpu.limits.vnni_before_amx if self.amx else 1 << 30  # AMX tiles above
        if isinstance(w, LayoutRows):
            if self.vnni:  # the file's levels, packed as they are, a slice of rows at a time
                self._pack_rows(w, act_dtype)
                return
            w = group_values(*w.whole())  # PyTorch's kernels: their own grids
        if kind == "mxfp4" and self.vnni:
            q, d, m, deq = quantize_mxfp4(w)
            self.packed = pack_vnni(q, d, m, 5)
        elif kind == "int4":
            q, d, m, deq = quantize_int4(w)
            if self.vnni:
                self.packed = pack_vnni(q, d, m, 4)
            else:
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
                # The kernel computes (q - 8)·s + z per group: z = m + 8·s. Layout [K/group, N, 2].
                self.scales = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).contiguous().to(act_dtype)
        elif self.vnni:
            u, d, m, deq = quantize_int8_groups(w, 16 if kind == "int8x16" else GROUP)
            self.packed = pack_vnni(u, d, m, BITS[kind])
        else:  # PyTorch's kernel: one grid per output channel (both 8-bit kinds)
            self.packed, scale, deq = quantize_int8(w)
            self.scales = scale.to(act_dtype)
        self.dequantized = deq.to(act_dtype)

    def _pack_rows(self, w: LayoutRows, act_dtype: torch.dtype) -> None:
        N, K = self.shape
        keep = self.max_m < 1 << 30  # bigger steps multiply by the dequantized weight
        self.dequantized = torch.empty(N if keep else 0, K, dtype=act_dtype)
        if self.kind == "int8" and w.five:
            self.bits = 7
        elif self.kind in ("int8", "int8x16") and w.six:
            self.bits = 6
        self.packed = torch.empty(N // 16, K // GROUP, block_bytes(self.bits), dtype=torch.uint8)
        at = 0
        for u, d, m in w.tiles():
            levels, scales = u, d
            if self.bits == 6:
                levels = (u.to(torch.int16) - 96).clamp_(0, 63).to(torch.uint8)
                if self.kind == "int8":  # one scale per 32 inputs: each half of the group takes it
                    scales = d.repeat_interleave(2, dim=1)
            elif self.bits == 7:
                levels = (u.to(torch.int16) - 112).clamp_(0, 31).to(torch.uint8)
            kernels.pack_lowbit(levels, scales, m, self.bits, self.packed[at // 16 : (at + len(u)) // 16])
            if keep:
                self.dequantized[at : at + len(u)] = group_values(u, d, m)
            at += len(u)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight (an embedding table's, for token ids), dequantized to the activations'
        dtype: read from the packed layout, so a GGUF model keeps one copy of a tied table."""
        assert self.vnni, "rows are read from pytgi's packed layout"
        return unpack_rows(self.packed, ids.reshape(-1), self.bits).to(self.act_dtype).view(*ids.shape, -1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] → [T, out_features]."""
        if self.kind == "bf16":
            return kernels.bf16_matmul(x.contiguous(), self.packed, self.shape[0])
        if self.vnni:
            x = x.contiguous()
            return kernels.lowbit_matmul(
                x, self.packed, self.shape[0], self.bits, amx=x.shape[0] > self.vnni_max_m
            )
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)


@dataclass
class Fp8Rows:
    """An FP8 checkpoint's linear, as the CUDA kernel takes it: e4m3 bytes [N, K] and a float32 scale
    per row and block of `block_k` inputs ([N, K / block_k])."""

    data: torch.Tensor
    scales: torch.Tensor
    block_k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1])


class GpuQuantizedWeight:
    """One linear's weight kept low-bit on a GPU: GGUF's levels and grids (int4, int8, int8x16) as
    `grid_layout` gives them, or FP8 e4m3 with a scale per output channel, multiplied by the Triton
    kernels of `pytgi.engine.kernels.gpu_quant` at every step size (bigger prompt steps dequantize the
    weight and take cuBLAS). No float copy of the weight is kept."""

    vnni = amx = False
    max_m = vnni_max_m = 1 << 30

    def __init__(
        self, kind: str, w: torch.Tensor | LayoutRows | Fp8Rows, act_dtype: torch.dtype, device: torch.device
    ) -> None:
        from pytgi.engine.kernels import gpu_quant

        N, K = w.shape
        self.kind, self.shape, self.act_dtype = kind, (N, K), act_dtype
        self.dequantized = torch.empty(0, dtype=act_dtype, device=device)
        if kind == "fp8" and isinstance(w, torch.Tensor):  # a bf16 weight: e4m3 per output channel
            w = Fp8Rows(*gpu_quant.quantize_fp8(w.to(device)), block_k=K)
        if isinstance(w, Fp8Rows):  # e4m3 bytes and their scales, as they are
            self.packed, self.scales, self.bits = w.data.to(device), w.scales.to(device), 0
            self.lowbit = gpu_quant.LowbitWeight(
                self.packed, self.scales, (N, K), 0, fp8_block=(1, w.block_k)
            )
            return
        self.bits = 4 if kind == "int4" else 8
        group = 16 if kind == "int8x16" else GROUP
        self.packed = torch.empty((N, K // 2 if self.bits == 4 else K), dtype=torch.uint8, device=device)
        self.scales = torch.empty((N, K // group, 2), dtype=torch.float16, device=device)
        at = 0
        for u, d, m in w.slices() if isinstance(w, LayoutRows) else [_levels(kind, w, group)]:
            q, s = gpu_quant.pack_levels(u, d, m, self.bits)
            self.packed[at : at + len(u)] = q
            self.scales[at : at + len(u)] = s
            at += len(u)
        self.lowbit = gpu_quant.LowbitWeight(self.packed, self.scales, (N, K), self.bits, group)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowbit.matmul(x)


def float_rows(w: torch.Tensor, kind: str, rows: int = 2048) -> LayoutRows:
    """A float weight on a grid of `kind`, quantized a slice of rows at a time (a 128k-token LM head
    never whole in float32)."""
    group = 16 if kind == "int8x16" else GROUP

    def slices() -> Iterator[Layout]:
        for i in range(0, w.shape[0], rows):
            part = w[i : i + rows].float()
            if kind == "int4":
                u, d, m = _levels(kind, part, group)
            else:  # Q8_0's grid (trained weights lie on no grid of their own: no search for one)
                g = part.view(len(part), -1, group)
                d = _fp16(g.abs().amax(dim=-1) / 127)
                u = torch.round(g / d.clamp(min=1e-30)[..., None]).add_(128).view(part.shape)
                m = -128 * d
            yield u.to(torch.uint8), d, m

    return LayoutRows((w.shape[0], w.shape[1]), slices)


def _levels(kind: str, w: torch.Tensor, group: int) -> Layout:
    """A float weight on a grid of `kind` (quantized on the fly: `--quantize int4|int8`)."""
    if kind == "int4":
        q, d, m, _ = quantize_int4(w)
    else:
        q, d, m, _ = quantize_int8_groups(w, group)
    return q, d, m


def can_quantize(kind: str, w: torch.Tensor, gpu: bool = False) -> bool:
    N, K = w.shape
    if gpu:  # the Triton kernels take any rows, and inputs on whole groups
        return kind == "fp8" or K % (16 if kind == "int8x16" else GROUP) == 0
    if kind == "bf16":
        return N % 16 == 0 and K % 2 == 0
    if kind == "fp8":
        return True
    if kind in ("int8", "int8x16"):  # the CPU kernels read inputs 16 at a time (K = 24 read past its end)
        return K % 16 == 0
    return kind not in ("int4", "mxfp4") or (K % GROUP == 0 and N % 16 == 0)


class QuantizedLinear(nn.Module):
    """Stands in for a linear layer (column or row parallel, or the LM head) whose weight has a
    low-bit copy: steps of at most `quant.max_m` tokens multiply by the packed weight, bigger ones
    run the layer itself, whose weight holds the same values dequantized."""

    def __init__(
        self,
        layer: ColumnParallelLinear | RowParallelLinear | ParallelLMHead,
        quant: QuantizedWeight | GpuQuantizedWeight,
        perm: torch.Tensor | None = None,
    ):
        """`perm`: the order the packed weight takes its inputs in (a GPTQ `desc_act` checkpoint's)."""
        super().__init__()
        self.layer, self.quant, self.perm = layer, quant, perm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.quant.max_m:
            return self.layer(x)
        return self.layer.finish(self.product(x))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T before the layer's `finish` (bias, all-reduce), as `forward` computes it."""
        if x.shape[0] > self.quant.max_m:
            return nn.functional.linear(x, self.layer.weight)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self.quant.matmul(x)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return self.layer.finish(y)


def quantize_model(
    model: nn.Module,
    kinds: dict[nn.Module, str],
    act_dtype: torch.dtype,
    cpu: Kernels,
    layouts: dict[nn.Module, Callable[[str], LayoutRows | Fp8Rows]] | None = None,
    perms: dict[nn.Module, torch.Tensor] | None = None,
) -> None:
    """Swap each linear in `kinds` ("int4" | "int8" | "int8x16" | "bf16") for a `QuantizedLinear`, and cast
    the model to `act_dtype`. Call on float32 weights, so the low-bit grids see the checkpoint's values (or on
    bf16 ones for "bf16"), or give `layouts`: per linear, what reads its levels and grids (`grid_layout`),
    for linears whose float weight was never loaded. A layer whose packed weight serves every step size
    (batch invariant) keeps no other copy."""
    layouts = layouts or {}
    for name, mod in list(model.named_modules()):
        if mod not in kinds:
            continue
        assert isinstance(mod, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)), name
        kind = kinds[mod]
        layout = layouts.get(mod)
        if not can_quantize(kind, mod.weight, cpu.triton):
            if kind == "bf16" or cpu.triton:
                continue  # a shape the bf16 kernel (or a GPU's grids) cannot take stays a linear
            kind = "int8"
            if layout is None and not can_quantize(kind, mod.weight):
                continue  # nor the int8 kernels (fewer than 16 inputs, or not a multiple): a linear
        w = layout(kind) if layout else mod.weight.data
        quant: QuantizedWeight | GpuQuantizedWeight
        if cpu.triton:
            quant = GpuQuantizedWeight(kind, w, act_dtype, mod.weight.device)
        else:
            assert not isinstance(w, Fp8Rows), "an FP8 checkpoint's rows are packed on CUDA only"
            quant = QuantizedWeight(kind, w, act_dtype, cpu)
        if quant.max_m >= 1 << 30:  # the layer's own matmul never runs
            quant.dequantized = torch.empty(0, dtype=act_dtype)
        # Bigger steps run the layer on the dequantized values (the LM head stops sharing the
        # embedding's tensor here: the embedding keeps the checkpoint's values).
        mod.weight = nn.Parameter(quant.dequantized, requires_grad=False)
        parent, _, attr = name.rpartition(".")
        perm = (perms or {}).get(mod)
        perm = None if perm is None else perm.to(mod.weight.device)
        setattr(model.get_submodule(parent), attr, QuantizedLinear(mod, quant, perm))
    model.to(act_dtype)


def merged_kind(kinds: set[str | None]) -> str | None:
    """The one layout that holds every part of a fused weight (None: some part is not packed)."""
    if None in kinds:
        return None
    if len(kinds) == 1 and kinds <= {"bf16", "fp8", "int4", "mxfp4"}:
        return next(iter(kinds))
    return "int8x16" if "int8x16" in kinds else "int8"
