"""Triton matmuls by weights kept low-bit on the GPU: GGUF's grids (and W4A16 group layouts) and FP8.

Two weight forms, both row-major over the output features:

- **levels on a grid per group** (`pytgi.engine.models.quant.grid_layout`'s (u, d, m), w = d·u + m): int4
  packs two levels a byte, byte j of each 32-input group holding input j (low nibble) and j + 16
  (high), as GGUF's own Q4 blocks do; int8 and int8x16 keep one level a byte. d and m sit side by
  side in one fp16 tensor [N, K / group, 2], per 32 inputs (per 16 for int8x16: Q6_K, Q3_K, Q2_K).
  Every GGUF type pytgi packs on CPU, and GPTQ/AWQ's int4 groups, are in these terms without
  rounding a level again.
- **FP8 e4m3** bytes [N, K] with a float32 scale per block of (SN rows, SK inputs): SN = 1, SK = K
  is one scale per output channel; 128 x 128 is the block-scaled layout of DeepSeek and Qwen3-FP8.
  The kernel turns a byte into fp16 by moving its bits (e4m3's 4-bit exponent into fp16's 5-bit one,
  times 2^8): exact, and no float8 type needed, so the interpreter runs it too.

A program multiplies `BLOCK_M` rows of x by `BLOCK_N` output features, walking the inputs `BLOCK_K` at
a time: each weight tile is turned into the activations' dtype in registers (the same values a dense
copy of the dequantized weight would hold) and goes through `tl.dot`. Small steps split the inputs
over `SPLIT` programs whose float32 partial sums are then added in a fixed order (so a run repeats
itself bit for bit: no atomics). Prompt steps bigger than `DENSE_M` rows dequantize the weight to a
scratch tensor and take cuBLAS, which is compute bound there anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pytgi.engine.kernels.gpu import INTERPRETED, f32_to_fp8, fp8_to_f32

DENSE_M = 16  # more rows than this: FP8 per channel through torch._scaled_mm (W8A8), else the weight
# dequantized to a scratch tensor and cuBLAS (the tiled kernel below reached a fifth of cuBLAS's speed)


@triton.jit
def _fp8_bytes(b, dtype: tl.constexpr, NATIVE: tl.constexpr):
    """e4m3 bytes (uint8) → `dtype`, exactly: the GPU's own conversion, or (interpreter) bit moves."""
    if NATIVE:
        return b.to(tl.float8e4nv, bitcast=True).to(dtype)
    return fp8_to_f32(b.to(tl.int32)).to(dtype)


@triton.jit
def _group_levels(
    w_ptr, s_ptr, rn64, n_ok, gk, gm, K, BITS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr
):
    """A tile's levels as float32, [BN, G, GROUP / 2] (low nibbles, then high ones times 16: inputs j
    and j + 16) for BITS 4 or [BN, G, GROUP] for 8, and each group's d and m [BN, G]. `gk`: the first
    input of each of the tile's G groups. A byte becomes a float as 2^23 + its bits, less 2^23 (two
    cheap operations where an integer conversion runs at a quarter of the rate)."""
    j = tl.arange(0, HALF)
    mask = n_ok[:, None, None] & gm[None, :, None]
    if BITS == 4:
        off = rn64[:, None, None] * (K // 2) + (gk // 2)[None, :, None] + j[None, None, :]
    else:
        off = rn64[:, None, None] * K + gk[None, :, None] + j[None, None, :]
    b = tl.load(w_ptr + off, mask=mask, other=0).to(tl.int32)
    si = rn64[:, None] * (K // GROUP) + (gk // GROUP)[None, :]
    d = tl.load(s_ptr + 2 * si, mask=n_ok[:, None] & gm[None, :], other=0.0).to(tl.float32)
    m = tl.load(s_ptr + 2 * si + 1, mask=n_ok[:, None] & gm[None, :], other=0.0).to(tl.float32)
    if BITS == 4:
        lo = ((b & 0x0F) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        hi16 = ((b & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return lo, hi16, d, m
    q = (b | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return q, q, d, m


@triton.jit
def _lowbit_gemv_kernel(
    x_ptr,  # [M, K]: each program takes one row
    w_ptr,
    s_ptr,
    out_ptr,  # [SPLIT, M, N] float32 partial sums, or [M, N] in x's dtype when SPLIT == 1
    M,
    N,
    K,
    stride_xm,
    stride_s,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,  # levels per group held in one half of its bytes (GROUP / 2 for BITS 4)
    G: tl.constexpr,  # groups per tile (BLOCK_K / GROUP)
    FP8: tl.constexpr,
    SN: tl.constexpr,
    SK: tl.constexpr,
    PER_TILE: tl.constexpr,  # FP8 with scales per block of inputs (SK divides into BLOCK_K's)
    SPLIT: tl.constexpr,
    PER_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """Steps of a few rows (decodes): no tensor cores, each weight tile read once per row (the rows of
    one tile run side by side, so after the first the tile comes from L2). For levels on a grid the
    scales come out of the sums: sum_j (d q_j + m) x_j = d sum_j q_j x_j + m sum_j x_j."""
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N], tl.float32)
    for kk in range(0, PER_SPLIT, BLOCK_K):
        k0 = pid_k * PER_SPLIT + kk
        if FP8:
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            x = tl.load(x_row + k, mask=km, other=0.0).to(tl.float32)
            b = tl.load(w_ptr + rn64[:, None] * K + k[None, :], mask=n_ok[:, None] & km[None, :], other=0)
            part = tl.sum(_fp8_bytes(b, tl.float32, NATIVE) * x[None, :], 1)
            if PER_TILE:
                part *= tl.load(s_ptr + (rn // SN) * stride_s + k0 // SK, mask=n_ok, other=0.0)
            acc += part
        else:
            gk = k0 + tl.arange(0, G) * GROUP
            gm = gk < K
            j = tl.arange(0, HALF)
            lo, hi, d, m = _group_levels(w_ptr, s_ptr, rn64, n_ok, gk, gm, K, BITS, GROUP, HALF)
            x_lo = tl.load(x_row + gk[:, None] + j[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
            if BITS == 4:
                x_hi = tl.load(x_row + gk[:, None] + HALF + j[None, :], mask=gm[:, None], other=0.0).to(
                    tl.float32
                )
                dq = tl.sum(lo * x_lo[None, :, :] + hi * (x_hi * 0.0625)[None, :, :], 2)
                sx = tl.sum(x_lo + x_hi, 1)
            else:
                dq = tl.sum(lo * x_lo[None, :, :], 2)
                sx = tl.sum(x_lo, 1)
            acc += tl.sum(d * dq + m * sx[None, :], 1)
    if FP8 and not PER_TILE:
        acc *= tl.load(s_ptr + (rn // SN) * stride_s, mask=n_ok, other=0.0)
    if SPLIT == 1:
        tl.store(out_ptr + row * N + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(out_ptr + (pid_k * M + row) * N + rn, acc, mask=n_ok)


@triton.jit
def _lowbit_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # uint8 [N, K / 2] (BITS 4) or [N, K] (BITS 8), or e4m3 bytes [N, K] (FP8)
    s_ptr,  # fp16 [N, K / GROUP, 2]: d and m per group; FP8: float32 scales [N / SN, K / SK]
    out_ptr,  # [SPLIT, M, N] float32 partial sums, or [M, N] in x's dtype when SPLIT == 1
    M,
    N,
    K,
    stride_xm,
    stride_s,  # FP8: the scales' row stride
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,  # levels per group held in one half of its bytes (GROUP / 2 for BITS 4)
    G: tl.constexpr,  # groups per tile (BLOCK_K / GROUP)
    FP8: tl.constexpr,
    SN: tl.constexpr,
    SK: tl.constexpr,
    PER_TILE: tl.constexpr,
    SPLIT: tl.constexpr,
    PER_SPLIT: tl.constexpr,  # inputs per split, a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE: tl.constexpr,  # the GPU's own e4m3 conversion
    UPCAST: tl.constexpr,  # products in float32 (the interpreter's bf16 dot is wrong)
    IEEE: tl.constexpr,  # float32 activations: full-precision products (else TF32)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dt = x_ptr.dtype.element_ty
    for kk in range(0, PER_SPLIT, BLOCK_K):  # this program's inputs (the last split's may pass K)
        k0 = pid_k * PER_SPLIT + kk
        if FP8:
            k = k0 + tl.arange(0, BLOCK_K)
            wm = n_ok[:, None] & (k < K)[None, :]
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0
            )
            b = tl.load(w_ptr + rn64[:, None] * K + k[None, :], mask=wm, other=0)
            w = _fp8_bytes(b, dt, NATIVE)  # exact in bf16 too: the scale comes after the sum
            x_lo, w_lo, x_hi, w_hi = x, w, x, w
        else:
            gk = k0 + tl.arange(0, G) * GROUP
            gm = gk < K
            lo, hi, d, m = _group_levels(w_ptr, s_ptr, rn64, n_ok, gk, gm, K, BITS, GROUP, HALF)
            w_lo = tl.reshape(lo * d[:, :, None] + m[:, :, None], (BLOCK_N, G * HALF)).to(dt)
            w_hi = tl.reshape(hi * (d * 0.0625)[:, :, None] + m[:, :, None], (BLOCK_N, G * HALF)).to(dt)
            c = tl.arange(0, G * HALF)  # column c: group c // HALF, its input c % HALF (and + HALF)
            k_lo = k0 + (c // HALF) * GROUP + c % HALF
            xm = m_ok[:, None] & (k_lo < K)[None, :]
            x_lo = tl.load(x_ptr + rm[:, None] * stride_xm + k_lo[None, :], mask=xm, other=0.0)
            x_hi = tl.load(x_ptr + rm[:, None] * stride_xm + (k_lo + HALF)[None, :], mask=xm, other=0.0)
        if UPCAST:
            part = tl.dot(x_lo.to(tl.float32), tl.trans(w_lo.to(tl.float32)), input_precision="ieee")
        elif IEEE:
            part = tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
        else:
            part = tl.dot(x_lo, tl.trans(w_lo))
        if BITS == 4 and not FP8:
            if UPCAST:
                part += tl.dot(x_hi.to(tl.float32), tl.trans(w_hi.to(tl.float32)), input_precision="ieee")
            elif IEEE:
                part += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
            else:
                part += tl.dot(x_hi, tl.trans(w_hi))
        if FP8 and PER_TILE:
            part *= tl.load(s_ptr + (rn // SN) * stride_s + k0 // SK, mask=n_ok, other=0.0)[None, :]
        acc += part
    if FP8 and not PER_TILE:
        acc *= tl.load(s_ptr + (rn // SN) * stride_s, mask=n_ok, other=0.0)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + (pid_k * M + rm)[:, None] * N + rn[None, :], acc, mask=mask)


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_s,
    BITS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, G: tl.constexpr, FP8: tl.constexpr,
    SN: tl.constexpr, SK: tl.constexpr, PER_TILE: tl.constexpr, NATIVE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The weight in the output's dtype, a tile of BLOCK_N rows and BLOCK_K inputs a program (whole
    groups: G of them; FP8 tiles within one block of scales)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    dt = out_ptr.dtype.element_ty
    if FP8:
        k = k0 + tl.arange(0, BLOCK_K)
        mask = n_ok[:, None] & (k < K)[None, :]
        b = tl.load(w_ptr + rn64[:, None] * K + k[None, :], mask=mask, other=0)
        scale = tl.load(s_ptr + (rn // SN) * stride_s + (k0 // SK if PER_TILE else 0), mask=n_ok, other=0.0)
        w = _fp8_bytes(b, tl.float32, NATIVE) * scale[:, None]
        tl.store(out_ptr + rn64[:, None] * K + k[None, :], w.to(dt), mask=mask)
    else:
        gk = k0 + tl.arange(0, G) * GROUP
        gm = gk < K
        j = tl.arange(0, HALF)
        lo, hi, d, m = _group_levels(w_ptr, s_ptr, rn64, n_ok, gk, gm, K, BITS, GROUP, HALF)
        mask = n_ok[:, None, None] & gm[None, :, None]
        at = out_ptr + rn64[:, None, None] * K + gk[None, :, None] + j[None, None, :]
        tl.store(at, (lo * d[:, :, None] + m[:, :, None]).to(dt), mask=mask)
        if BITS == 4:
            tl.store(at + HALF, (hi * (d * 0.0625)[:, :, None] + m[:, :, None]).to(dt), mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK: tl.constexpr):
    """One row of activations to e4m3 bytes with its own scale (its largest magnitude becomes 448)."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(
            amax, tl.abs(tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32))
        )
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        code = f32_to_fp8(tl.minimum(tl.maximum(x / scale, -448.0), 448.0))
        tl.store(q_ptr + row * K + k, code.to(tl.uint8), mask=k < K)
    tl.store(s_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], float32 scales [M, 1]): one launch (PyTorch's ops took six)."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.uint8, device=x.device)
    scales = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows_kernel[(M,)](x, q, scales, K, x.stride(0), BLOCK=1024)
    return q.view(torch.float8_e4m3fn), scales


GEMV_M = 1  # steps of at most this many rows take the kernel without tensor cores (at 4 rows the
# tile kernel was as fast or faster: benchmarks/gpu_quant.py on the H200)


def _blocks(M: int, N: int, K: int, bits: int, sms: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, warps, stages) for a step of M rows (BLOCK_M 1: the GEMV
    kernel). Small steps read the weight once and are bound by its bytes: narrow column tiles and,
    where those leave the multiprocessors short of programs, the inputs split over several; bigger
    steps take square tiles."""
    if M <= 16:
        if M <= GEMV_M:  # the GEMV kernel, with the H200's best tiles for an 8B's linears (docs/cuda.md)
            bm, bn, bk = (1, 32, 256) if bits == 0 else (1, 16, 512)
        else:
            bm, bn, bk = 16, 16, 256 if bits == 4 else 128
        split = 1  # more programs, while the outputs alone leave the multiprocessors short of two each
        while triton.cdiv(N, bn) * split < 2 * sms and K // (split * 2) >= 4 * bk:
            split *= 2
        return bm, bn, bk, split, 4, 3
    if M <= 64:
        return 64 if M > 32 else 32, 64, 128 if bits == 4 else 64, 1, 4, 4
    return 128, 128, 64, 1, 8, 3


class LowbitWeight:
    """One linear's weight on the GPU in one of the two forms (see the module's docstring), and the
    product by it."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        shape: tuple[int, int],
        bits: int,
        group: int = 32,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        """`bits` 4 or 8 (levels) or 0 with `fp8_block` (SN, SK) for FP8."""
        self.qweight, self.scales, self.shape, self.bits, self.group = qweight, scales, shape, bits, group
        self.fp8 = fp8_block is not None
        self.sn, self.sk = fp8_block or (1, 1)
        dev = qweight.device
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        self.scaled_mm = True  # until torch._scaled_mm refuses

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """Big steps with per-channel FP8 weights: each row of x to e4m3 with its own scale, then the
        FP8 tensor cores (torch._scaled_mm, rowwise scales), as vLLM's dynamic FP8 does."""
        xq, xs = quantize_rows_fp8(x)
        w = self.qweight.view(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=self.scales.view(1, -1), out_dtype=x.dtype)

    def _meta(self) -> dict[str, int | bool]:
        bits = 8 if self.fp8 else self.bits
        per_tile = self.fp8 and self.sk < self.shape[1]
        return {
            "BITS": bits,
            "GROUP": self.group,
            "FP8": self.fp8,
            "SN": self.sn,
            "SK": self.sk,
            "PER_TILE": per_tile,
        }

    def matmul(
        self, x: torch.Tensor, blocks: tuple[int, int, int, int, int, int] | None = None
    ) -> torch.Tensor:
        """x [M, K] (bf16 or fp16) → [M, N] in x's dtype. `blocks`: the tiles to use (benchmarks)."""
        N, K = self.shape
        x = x.contiguous()
        M = x.shape[0]
        if M > DENSE_M and blocks is None:
            if self.fp8 and self.sk == K and x.dtype == torch.bfloat16 and self.scaled_mm:
                try:
                    return self._w8a8(x)
                except RuntimeError:  # a shape or build that _scaled_mm refuses: dequantize instead
                    self.scaled_mm = False
            return torch.nn.functional.linear(x, self.dequantize(x.dtype))
        bm, bn, bk, split, warps, stages = blocks or _blocks(M, N, K, self.bits, self.sms)
        if split > 1:
            out = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        else:
            out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        if M == 0:
            return out.new_empty((0, N), dtype=x.dtype) if split > 1 else out
        if self.fp8 and self.sk < K:  # scales per block of inputs: whole blocks a tile
            bk = min(bk, self.sk)
        extra = {} if INTERPRETED else {"num_warps": warps, "num_stages": stages}
        tiles = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, "PER_SPLIT": triton.cdiv(K, split * bk) * bk}
        args = (x, self.qweight, self.scales, out, M, N, K, x.stride(0), self.scales.stride(0))
        tiles |= {"G": max(1, bk // self.group), "HALF": self.group // 2 if self.bits == 4 else self.group}
        if bm == 1:
            _lowbit_gemv_kernel[(M, triton.cdiv(N, bn), split)](
                *args, NATIVE=not INTERPRETED, **tiles, **self._meta(), **extra
            )
        else:
            _lowbit_matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), split)](
                *args, BLOCK_M=bm, NATIVE=not INTERPRETED, UPCAST=INTERPRETED, IEEE=x.dtype == torch.float32,
                **tiles, **self._meta(), **extra,
            )  # fmt: skip
        return out.sum(0).to(x.dtype) if split > 1 else out

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as `dtype` [N, K]: the values the product multiplies by."""
        N, K = self.shape
        out = torch.empty((N, K), dtype=dtype, device=self.qweight.device)
        bn, bk = 32, 256
        if self.fp8 and self.sk < K:
            bk = min(bk, self.sk)
        meta = self._meta() | {
            "G": max(1, bk // self.group),
            "HALF": self.group // 2 if self.bits == 4 else self.group,
        }
        _dequantize_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
            self.qweight, self.scales, out, N, K, self.scales.stride(0),
            NATIVE=not INTERPRETED, BLOCK_N=bn, BLOCK_K=bk, **meta,
        )  # fmt: skip
        return out


def pack_levels(
    u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(u [N, K] levels, d and m [N, K / group]) → (qweight, scales) in this module's layout."""
    N, K = u.shape
    u = u.to(torch.uint8)
    if bits == 4:  # per 32 inputs: byte j = input j | input j + 16 << 4
        g = u.view(N, K // 32, 2, 16)
        u = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(N, K // 2)
    return u.contiguous(), torch.stack([d, m], dim=-1).to(torch.float16).contiguous()


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (e4m3 bytes as uint8 [N, K], float32 scales): per output channel ([N, 1]) or per
    `block` (SN, SK) ([N / SN, K / SK]), each scale its block's absmax / 448."""
    N, K = w.shape
    sn, sk = block or (1, K)
    wf = w.float()
    blocks = wf.view(N // sn, sn, K // sk, sk)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(N, K).view(torch.uint8), scale.contiguous()


def fp8_values(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [N, K] from `quantize_fp8`'s bytes and scales (the reference the kernel must equal)."""
    sn, sk = block
    w = q.view(torch.float8_e4m3fn).float()
    return w * scale.repeat_interleave(sn, 0).repeat_interleave(sk, 1)
