"""Triton kernels for the CUDA path: paged attention over the KV cache and the fused element-wise steps.

`paged_attention` attends a flat batch of mixed prefill chunks and decodes in one launch, reading keys
and values in place through each request's block table (no gather, no padding to the longest
request). A program takes `BLOCK_M` query tokens of one request and the whole query group of one KV
head (so a GQA model's four query heads share one load of each key tile), and walks the request's
context in tiles of `BLOCK_N` keys with an online softmax, stopping at the tile its last query may
see. Everything the kernel needs to know about the step lives in device tensors (query starts,
context lengths, block tables), so a decode step's launch can be replayed from a CUDA graph.

The element-wise kernels fuse what PyTorch runs as several launches: the residual add with the
RMSNorm after it, SiLU(gate)·up, and the rotary embedding with the write of keys and values into
their cache slots. Each rounds where PyTorch's ops round (the residual sum and the normed value to
the model's dtype before the weight), so they agree with `TorchOps` to the dtype's last bit or so.

On a machine without a GPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`), which is
how the tests check them against the PyTorch reference in CI.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
E4M3_MAX = 448.0


@triton.jit
def fp8_to_f32(b):
    """e4m3fn bytes (as int32 0..255) → float32, exactly: sign and the 7 low bits moved into fp16's
    places (an e4m3 exponent e reads as fp16's 2^(e-15)), then times 2^8 (e4m3's bias is 7). No NaN:
    pytgi writes none."""
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def f32_to_fp8(v):
    """float32 (|v| <= 448) → e4m3fn bytes (int32), rounded to nearest even as PyTorch's cast rounds,
    in integer steps (the same bits in the interpreter as on a GPU)."""
    a = v.to(tl.int32, bitcast=True)
    sign = (a >> 24) & 0x80
    a = a & 0x7FFFFFFF
    # |v| >= 2^-6: the mantissa rounded to 3 bits (a carry steps the exponent), rebiased from 127 to 7
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (r >> 20) - (120 << 3)
    # below: a subnormal, |v| / 2^-9 rounded from the 24-bit significand
    e = (a >> 23) - 127
    sig = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(14 - e, 1), 31)
    q = sig >> sh
    rem = sig - (q << sh)
    half = 1 << (sh - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.minimum(tl.where(a >= 0x3C800000, normal, q), 0x7E)
    return code | sign


@triton.jit
def _row_mask(rows, d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """The mask of a [rows, D_PAD] tile: the rows given, and (a head dim not a power of two, padded to
    D_PAD) the head's HEAD_DIM features."""
    if D_PAD == HEAD_DIM:
        mask = rows[:, None]
    else:
        mask = rows[:, None] & (d < HEAD_DIM)[None, :]
    return mask


@triton.jit
def _cache_tile(cache_ptr, f_ptr, row, d, inside, dtype: tl.constexpr, HEAD_DIM: tl.constexpr,
                FP8: tl.constexpr, UPCAST: tl.constexpr, D_PAD: tl.constexpr):  # fmt: skip
    """A tile of keys or values from the cache (rows `row`): an FP8 cache's bytes times their scale,
    in the queries' dtype (float32 with UPCAST); the padding past HEAD_DIM (to D_PAD) reads zeros."""
    mask = _row_mask(inside, d, HEAD_DIM, D_PAD)
    if FP8:
        x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0).to(tl.int32)
        x_scale = tl.load(f_ptr + (row + HEAD_DIM) // 4, mask=inside, other=0.0)
        x = (fp8_to_f32(x) * x_scale[:, None]).to(dtype)
    else:
        x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [S, KVH, D]
    v_cache_ptr,
    out_ptr,  # [T, H, D]
    programs_ptr,  # [P, 2] int32: each program's (request, block of BLOCK_M queries)
    q_start_ptr,  # [B + 1] int32: request b's queries are rows q_start[b] .. q_start[b + 1]
    ctx_ptr,  # [B] int32: tokens in the cache after this step (context lengths)
    tables_ptr,  # [B, M] int32 block tables
    scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_tb,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # query heads per program: GROUP rounded up to 2^n, or (PARTS > 1) a share
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # the KV cache's block size
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per tile
    IEEE: tl.constexpr,  # float32 products in full precision (else TF32)
    UPCAST: tl.constexpr,  # products in float32 whatever the dtype (the interpreter's bf16 dot is wrong)
    SPLITS: tl.constexpr = 1,  # decode steps: at most this many programs share a request's keys
    part_ptr=None,  # SPLITS > 1: float32 [T, H, SPLITS, D + 2]: each split's unnormalised sum, max, total
    FP8: tl.constexpr = False,  # the caches hold e4m3 bytes, each head's row then its float32 scale
    kf_ptr=None,  # FP8: the key and value caches seen as float32 (where the scales are read)
    vf_ptr=None,
    D_PAD: tl.constexpr = 0,  # HEAD_DIM rounded up to a power of two (0: HEAD_DIM is one)
    PARTS: tl.constexpr = 1,  # programs per kv head, each GROUP_PAD of its query heads (MLA's large groups)
    MIN_TILES: tl.constexpr = 2,  # SPLITS > 1: key tiles a split takes at least
):
    DP: tl.constexpr = HEAD_DIM if D_PAD == 0 else D_PAD
    pid = tl.program_id(0)
    if PARTS == 1:
        kvh = tl.program_id(1)
        g0 = 0
    else:
        kvh = tl.program_id(1) // PARTS
        g0 = (tl.program_id(1) % PARTS) * GROUP_PAD
    b = tl.load(programs_ptr + 2 * pid)
    qblock = tl.load(programs_ptr + 2 * pid + 1)
    q_start = tl.load(q_start_ptr + b)
    q_len = tl.load(q_start_ptr + b + 1) - q_start
    ctx = tl.load(ctx_ptr + b)
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = qblock * BLOCK_M + rows // GROUP_PAD  # the query token of each row, within the request
    g = g0 + rows % GROUP_PAD
    valid = (tok < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    q_pos = ctx - q_len + tok  # each query's position: it sees keys 0 ..= q_pos
    d = tl.arange(0, DP)
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=_row_mask(valid, d, HEAD_DIM, DP),
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M * GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DP], tl.float32)
    # the keys this program's last query may see (none when the request has no queries this far)
    kv_end = tl.minimum(ctx, ctx - q_len + (qblock + 1) * BLOCK_M)
    kv_end = kv_end * (qblock * BLOCK_M < q_len).to(tl.int32)
    kv_begin = 0
    if SPLITS > 1:  # this program's share of the keys: whole tiles, at least MIN_TILES a split
        split = tl.program_id(2)
        n_split = tl.maximum(1, tl.minimum(SPLITS, tl.cdiv(kv_end, MIN_TILES * BLOCK_N)))
        part = tl.cdiv(tl.cdiv(kv_end, n_split), BLOCK_N) * BLOCK_N
        kv_begin = tl.minimum(split * part, kv_end)
        kv_end = tl.minimum(kv_begin + part, kv_end)
    for start in range(kv_begin, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < kv_end
        block = tl.load(tables_ptr + b * stride_tb + n // PAGE, mask=inside, other=0)
        slot = block.to(tl.int64) * PAGE + n % PAGE
        row = slot * stride_ks + kvh * stride_kh
        k = _cache_tile(k_cache_ptr, kf_ptr, row, d, inside, q.dtype, HEAD_DIM, FP8, UPCAST, DP)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        s = tl.where((n[None, :] <= q_pos[:, None]) & inside[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _cache_tile(v_cache_ptr, vf_ptr, row, d, inside, q.dtype, HEAD_DIM, FP8, UPCAST, DP)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLITS > 1:
        H = GROUP * (tl.num_programs(1) // PARTS)
        row = (((q_start + tok).to(tl.int64) * H + head) * SPLITS + tl.program_id(2)) * (HEAD_DIM + 2)
        tl.store(part_ptr + row[:, None] + d[None, :], acc, mask=_row_mask(valid, d, HEAD_DIM, DP))
        tl.store(part_ptr + row + HEAD_DIM, m_i, mask=valid)
        tl.store(part_ptr + row + HEAD_DIM + 1, l_i, mask=valid)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=_row_mask(valid, d, HEAD_DIM, DP),
        )


@triton.jit
def _merge_splits_kernel(
    part_ptr, out_ptr, stride_ot, stride_oh, H, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr = 0,
):  # fmt: skip
    """One query row and head: its splits' partial sums rescaled to the largest maximum, in order.
    D_PAD: HEAD_DIM rounded up to a power of two (0: HEAD_DIM is one)."""
    DP: tl.constexpr = HEAD_DIM if D_PAD == 0 else D_PAD
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, DP)
    row = ((t * H + h) * SPLITS + s) * (HEAD_DIM + 2)
    m = tl.load(part_ptr + row + HEAD_DIM)
    total = tl.load(part_ptr + row + HEAD_DIM + 1)
    w = tl.where(total > 0, tl.exp(m - tl.max(m, 0)), 0.0)
    if DP == HEAD_DIM:
        x = tl.load(part_ptr + row[:, None] + d[None, :])
    else:
        x = tl.load(part_ptr + row[:, None] + d[None, :], mask=(d < HEAD_DIM)[None, :], other=0.0)
    acc = tl.sum(x * w[:, None], 0)
    denom = tl.sum(total * w, 0)
    out = acc / tl.where(denom > 0, denom, 1.0)
    if DP == HEAD_DIM:
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))
    else:
        tl.store(
            out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
        )


def decode_splits(batch: int, kv_heads: int, sms: int) -> int:
    """Programs per request and kv head for a decode step of `batch` requests: enough for about two per
    multiprocessor (a power of two, at most 32); 1 once the requests fill the GPU on their own."""
    want = (2 * sms) // max(1, batch * kv_heads)
    return 1 if want < 2 else min(32, triton.next_power_of_2(want + 1) // 2)


# a program's tiles hold at most this many values: query rows x the head dim (rounded up to a power of
# two), keys x the head dim; 128-wide heads keep 64 query rows and 64 keys, MLA's 576 (1024) 16 and 16
TILE_VALUES = 16384


def attention_tiles(group: int, head_dim: int) -> tuple[int, int, int]:
    """(query heads per program, key tile, warps) for a kv head's `group` query heads of `head_dim`
    features. A program takes the whole group where its rows fit (every model with heads of up to 256),
    else a power-of-two share of it (MLA: 16 to 128 query heads on one 576-wide latent row, whose
    accumulator of 16 rows x 1024 float32 alone is 64 kB); wide rows take smaller key tiles and 8 warps."""
    d_pad = triton.next_power_of_2(head_dim)
    heads = min(triton.next_power_of_2(group), max(16, TILE_VALUES // d_pad))
    block_n = min(64, max(16, TILE_VALUES // d_pad))
    return heads, block_n, 8 if d_pad >= 512 else 4


def query_block(max_query_len: int, group: int, head_dim: int = 128) -> int:
    """Query tokens per attention program: at least 16 rows for the tensor cores (a decode's group of
    query heads fills some of them), 64 rows for a step with prefill chunks (fewer for heads wider than
    256, `attention_tiles`). Keys go 64 a tile (fewer for wide heads)."""
    heads = attention_tiles(group, head_dim)[0]
    decode = max(1, 16 // heads)
    rows = min(64, max(16, TILE_VALUES // triton.next_power_of_2(head_dim)))
    return decode if max_query_len <= decode else max(1, rows // heads)


def head_parts(group: int, head_dim: int) -> int:
    """Programs per kv head and query block (more than one where a group is split, `attention_tiles`)."""
    return -(-group // attention_tiles(group, head_dim)[0])


def attention_programs(query_lens: np.ndarray, block_m: int) -> np.ndarray:
    """[P, 2] int32: one program per block of `block_m` queries of each request, as (request, block).
    A grid of requests x the longest request's blocks would start a program for every block a short
    request does not have: with a 4096-token chunk beside 255 decodes, over 99% of them."""
    blocks = -(-query_lens // block_m)
    req = np.repeat(np.arange(len(query_lens)), blocks)
    first = np.cumsum(blocks) - blocks
    return np.stack([req, np.arange(len(req)) - first[req]], axis=1).astype(np.int32)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, KVH, D], or uint8 [S, KVH, D + 4] (FP8: `quantize_kv_fp8`)
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, H, D]
    programs: torch.Tensor,  # [P, 2] int32 (`attention_programs`)
    q_start: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, M] int32
    block_m: int,  # query tokens per program (`query_block`), as `programs` were made for
    block_size: int,
    scale: float,
    splits: int = 1,
) -> torch.Tensor:
    """Causal attention of each request's queries (the last rows of its context) to its context.
    `splits` > 1 (decode steps only: one query a request): each request's keys are shared by up to
    that many programs, whose partial sums a second launch merges."""
    H, D = q.shape[1], q.shape[2]
    KVH = k_cache.shape[1]
    group = H // KVH
    heads, block_n, warps = attention_tiles(group, D)
    parts = -(-group // heads)
    d_pad = triton.next_power_of_2(D)
    grid = (programs.shape[0], KVH * parts, splits)
    part = None
    if splits > 1:
        part = torch.empty((q.shape[0], H, splits, D + 2), dtype=torch.float32, device=q.device)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        programs,
        q_start,
        context_lens,
        block_tables,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=heads,
        HEAD_DIM=D,
        PAGE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32 or INTERPRETED,
        UPCAST=INTERPRETED,
        SPLITS=splits,
        part_ptr=part,
        FP8=k_cache.dtype == torch.uint8,
        kf_ptr=k_cache.view(torch.float32) if k_cache.dtype == torch.uint8 else None,
        vf_ptr=v_cache.view(torch.float32) if v_cache.dtype == torch.uint8 else None,
        D_PAD=0 if d_pad == D else d_pad,
        PARTS=parts,
        # a split's partial sums (heads x D floats) cost no more than half its keys' reads
        MIN_TILES=max(2, -(-4 * heads // block_n)),
        num_warps=warps,
    )
    if part is not None and q.shape[0]:
        _merge_splits_kernel[(q.shape[0], H)](
            part,
            out,
            out.stride(0),
            out.stride(1),
            H,
            SPLITS=splits,
            HEAD_DIM=D,
            D_PAD=0 if d_pad == D else d_pad,
        )
    return out


@triton.jit
def _add_rms_norm_kernel(
    y_ptr,  # [T, N] or unused
    res_ptr,  # [T, N], updated in place to res + y
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_Y: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(res_ptr + row * N + cols, mask=mask, other=0.0)
    if HAS_Y:
        y = tl.load(y_ptr + row * N + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)  # rounded as PyTorch's add rounds
        tl.store(res_ptr + row * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)  # PyTorch's RMSNorm casts before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (normed * w).to(x.dtype), mask=mask)


def add_rms_norm(
    y: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += y (in place; y None: no add), then RMSNorm(residual) · weight."""
    T, N = residual.shape
    out = torch.empty_like(residual)
    if T:
        _add_rms_norm_kernel[(T,)](
            y if y is not None else residual,
            residual,
            weight,
            out,
            eps,
            N=N,
            BLOCK=triton.next_power_of_2(N),
            HAS_Y=y is not None,
        )
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * N + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up for gate_up = [gate | up] ([T, 2N] → [T, N])."""
    gate_up = gate_up.contiguous()
    T, N = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((T, N), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(1024, triton.next_power_of_2(N))
        _silu_mul_kernel[(T, triton.cdiv(N, block))](gate_up, out, N=N, BLOCK=block)
    return out


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,  # [T, (H + 2 KVH) D]
    cos_ptr,  # [T, D] float32
    sin_ptr,  # [T, D] float32, rotate-half's sign folded in
    slots_ptr,  # [T] int64
    q_ptr,  # [T, H, D] out
    k_cache_ptr,  # [S, KVH, D], or (FP8) uint8 [S, KVH, D + 4]: e4m3 bytes, then the float32 scale
    v_cache_ptr,
    kf_ptr,  # FP8: the caches seen as float32 (where the scales go)
    vf_ptr,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
    HALF_PAD: tl.constexpr = 0,  # D / 2 rounded up to a power of two (0: it is one), the rest masked
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # 0 .. H + 2 KVH: query heads, key heads, value heads
    if HALF_PAD == 0:
        half = tl.arange(0, D // 2)
        m, z = None, None  # no mask (the code of a power-of-two head as it was)
    else:
        half = tl.arange(0, HALF_PAD)
        m, z = half < D // 2, 0.0
    row = qkv_ptr + t * (H + 2 * KVH) * D + h * D
    x1 = tl.load(row + half, mask=m, other=z)
    x2 = tl.load(row + D // 2 + half, mask=m, other=z)
    slot = tl.load(slots_ptr + t)
    ROW = D + 4 * FP8  # a head's row in the cache
    if h >= H + KVH:  # a value head: copied into its slot as it is
        cache, fview, o1, o2 = v_cache_ptr, vf_ptr, x1, x2
        off = slot * KVH * ROW + (h - H - KVH) * ROW
    else:
        c1 = tl.load(cos_ptr + t * D + half, mask=m, other=z)
        c2 = tl.load(cos_ptr + t * D + D // 2 + half, mask=m, other=z)
        s1 = tl.load(sin_ptr + t * D + half, mask=m, other=z)
        s2 = tl.load(sin_ptr + t * D + D // 2 + half, mask=m, other=z)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (f1 * c1 + f2 * s1).to(x1.dtype)
        o2 = (f2 * c2 + f1 * s2).to(x1.dtype)
        cache, fview = k_cache_ptr, kf_ptr
        off = slot * KVH * ROW + (h - H) * ROW
    if h < H:
        dst = q_ptr + t * H * D + h * D
        tl.store(dst + half, o1, mask=m)
        tl.store(dst + D // 2 + half, o2, mask=m)
    elif FP8:  # e4m3 with the head's own scale: its largest value becomes 448
        a1, a2 = o1.to(tl.float32), o2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(a1), 0), tl.max(tl.abs(a2), 0))
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        tl.store(cache + off + half, f32_to_fp8(a1 / scale).to(tl.uint8), mask=m)
        tl.store(cache + off + D // 2 + half, f32_to_fp8(a2 / scale).to(tl.uint8), mask=m)
        tl.store(fview + (off + D) // 4, scale)
    else:
        tl.store(cache + off + half, o1, mask=m)
        tl.store(cache + off + D // 2 + half, o2, mask=m)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    H: int,
    KVH: int,
    D: int,
) -> torch.Tensor:
    """Rotate q and k of `qkv` ([T, (H + 2 KVH) D]); k and v go to their cache slots (as e4m3 with a
    scale per token and head, for a uint8 cache), q is returned ([T, H, D]). cos and sin: float32
    [T, D] (sin signed as `RotaryEmbedding` stores it)."""
    qkv = qkv.contiguous()
    T = qkv.shape[0]
    q = torch.empty((T, H, D), dtype=qkv.dtype, device=qkv.device)
    if T:
        fp8 = k_cache.dtype == torch.uint8
        views = (k_cache.view(torch.float32), v_cache.view(torch.float32)) if fp8 else (k_cache, v_cache)
        half_pad = triton.next_power_of_2(D // 2)  # a head of 96: halves of 48 in tiles of 64
        _rope_write_kv_kernel[(T, H + 2 * KVH)](
            qkv,
            cos,
            sin,
            slot_mapping,
            q,
            k_cache,
            v_cache,
            *views,
            H=H,
            KVH=KVH,
            D=D,
            FP8=fp8,
            HALF_PAD=0 if half_pad == D // 2 else half_pad,
        )
    return q


@triton.jit
def _row_stats_kernel(x_ptr, arg_ptr, lse_ptr, bad_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: its largest value and where
    where = tl.zeros([BLOCK], tl.int32)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: the running max and sum of exp
    s = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(x_ptr + row * stride + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        bad |= ((x != x) | (x == float("inf"))).to(tl.int32)  # noqa: PLR0124 - NaN is not itself
        better = x > best  # strictly: the first index of a tie stays
        where = tl.where(better, idx, where)
        best = tl.where(better, x, best)
        m_new = tl.maximum(m, x)
        scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
        s = s * scale + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    top = tl.max(best, 0)
    first = tl.min(tl.where(best == top, where, V), 0)
    tl.store(arg_ptr + row, first.to(tl.int64))
    mx = tl.max(m, 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), 0)
    tl.store(lse_ptr + row, mx + tl.log(total))
    tl.store(bad_ptr + row, tl.max(bad, 0))


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's argmax (the first index of its largest value), logsumexp, and whether it holds NaN
    or +inf (then neither is to be trusted), in one launch: a row's values are summed in the same
    order whatever the batch, so they do not change with the rows beside it."""
    logits = logits.contiguous()
    B, V = logits.shape
    arg = torch.empty(B, dtype=torch.int64, device=logits.device)
    lse = torch.empty(B, dtype=torch.float32, device=logits.device)
    bad = torch.empty(B, dtype=torch.int32, device=logits.device)
    if B:
        _row_stats_kernel[(B,)](logits, arg, lse, bad, V, logits.stride(0), BLOCK=1024)
    return arg, lse, bad.bool()


def quantize_kv_fp8(x: torch.Tensor) -> torch.Tensor:
    """Keys or values [T, KVH, D] → the FP8 cache's rows, uint8 [T, KVH, D + 4]: e4m3 bytes scaled so
    that each head's largest value is 448, then that float32 scale (as `rope_write_kv` writes them)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, scale.view(torch.uint8)], dim=-1)


def kv_fp8_values(cache: torch.Tensor) -> torch.Tensor:
    """The values an FP8 cache holds: float32 [S, KVH, D] from uint8 [S, KVH, D + 4]."""
    D = cache.shape[-1] - 4
    scale = cache[..., D:].contiguous().view(torch.float32)
    return cache[..., :D].contiguous().view(torch.float8_e4m3fn).float() * scale
