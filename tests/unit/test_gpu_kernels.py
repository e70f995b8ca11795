"""The CUDA path's Triton kernels (`pytgi.engine.kernels.gpu`) against PyTorch's reference ops.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so CI
checks the kernels' logic; on a GPU machine the same tests check the compiled kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from pytgi.engine.execution.batch import StepBatch
from pytgi.engine.kernels import gpu
from pytgi.engine.models.attention import TorchAttention
from pytgi.engine.models.cpu import Kernels, TorchOps, _rotate
from pytgi.engine.models.layers import RMSNorm, RotaryEmbedding
from pytgi.engine.models.triton_backend import TritonAttention, TritonOps

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def mixed_step(q_lens, ctx, bs, num_blocks, seed=0):
    """A flat step's layout: request i computes its last q_lens[i] of ctx[i] positions, its blocks
    scattered over the cache."""
    blocks = [-(-c // bs) for c in ctx]
    perm = np.random.default_rng(seed).permutation(num_blocks)[: sum(blocks)]
    tables = [t.tolist() for t in np.split(perm, np.cumsum(blocks)[:-1])]
    starts = [c - n for n, c in zip(q_lens, ctx)]
    return StepBatch.build([[0] * n for n in q_lens], starts, tables, bs).layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, KVH, D", [(8, 2, 32), (4, 4, 16), (6, 2, 64), (3, 1, 16)])
def test_paged_attention_matches_gather_and_sdpa(dtype, H, KVH, D):
    """Prefill chunks on top of cached context, whole prompts and decodes in one step."""
    torch.manual_seed(0)
    bs, num_blocks = 4, 64
    layout = mixed_step([1, 19, 1, 7, 70, 1], [33, 40, 1, 7, 70, 66], bs, num_blocks)
    T = int(layout.query_lens.sum())
    k_cache = torch.randn(num_blocks * bs, KVH, D, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_blocks * bs, KVH, D, device=DEVICE).to(dtype)
    q, k, v = (torch.randn(T, n, D, device=DEVICE).to(dtype) for n in (H, KVH, KVH))
    outs = []
    for backend in (
        TorchAttention(Kernels.none(), (H, KVH, D)),
        TritonAttention(Kernels.none(), (H, KVH, D)),
    ):
        meta = backend.prepare(layout, DEVICE)
        outs.append(backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, D**-0.5).float())
    torch.testing.assert_close(outs[1], outs[0], atol=TOL[dtype], rtol=TOL[dtype])


def test_window_and_spans_take_the_gather_path():
    backend = TritonAttention(Kernels.none(), (4, 2, 16))
    layout = mixed_step([3, 1], [3, 9], 4, 8)
    assert type(backend.prepare(layout, DEVICE)).__name__ == "TritonMetadata"
    assert type(backend.prepare(layout, DEVICE, window=4)).__name__ == "TorchAttentionMetadata"
    layout.spans = np.array([[0, 0, 2]])
    assert type(backend.prepare(layout, DEVICE)).__name__ == "TorchAttentionMetadata"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_y", [True, False])
def test_add_rms_norm(dtype, with_y):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(DEVICE, dtype)
    norm.weight.data.normal_()
    x, y = (torch.randn(5, 96, device=DEVICE).to(dtype) for _ in range(2))
    ref_res, ref = TorchOps().add_norm(y if with_y else None, x.clone(), norm)
    res = x.clone()
    got_res, got = TritonOps().add_norm(y if with_y else None, res, norm)
    exact = dtype == torch.float32 or DEVICE.type == "cuda"  # the interpreter rounds to bf16 its own way
    tol = 0 if exact else TOL[dtype]
    torch.testing.assert_close(got_res, ref_res, atol=tol, rtol=tol)
    torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert got_res.data_ptr() == res.data_ptr()  # the residual stream is updated in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gate_up = torch.randn(3, 2 * 1500, device=DEVICE).to(dtype)  # wider than one program's block
    ref = TorchOps().act_mul("silu", gate_up)
    torch.testing.assert_close(TritonOps().act_mul("silu", gate_up), ref, atol=TOL[dtype], rtol=TOL[dtype])


class _Attn:
    n_heads, n_kv, head_dim, q_norm = 4, 2, 32, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 96])
def test_rope_write_kv(dtype, head_dim):
    """The rotation of q and k and the cache write of k and v, against PyTorch's rotation (heads of 96:
    halves of 48, padded to 64 and masked)."""
    torch.manual_seed(0)
    attn, T, S = _Attn(), 6, 40
    attn.head_dim = head_dim
    rotary = RotaryEmbedding(attn.head_dim, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([0, 5, 9, 10, 11, 63], device=DEVICE)
    qkv = torch.randn(T, (attn.n_heads + 2 * attn.n_kv) * attn.head_dim, device=DEVICE).to(dtype)
    slots = torch.tensor([3, 17, 0, 39, 21, 8], device=DEVICE)
    cache = [torch.zeros(S, attn.n_kv, attn.head_dim, device=DEVICE, dtype=dtype) for _ in range(2)]
    meta = type("Meta", (), {"slot_mapping": slots})()
    q, k, v = TritonOps().qkv_rotary(
        attn, qkv, TritonOps().rope_tables(rotary, positions, dtype), cache, meta
    )
    assert k is None and v is None
    rq, rk, rv = _rotate(attn, qkv, *TorchOps().rope_tables(rotary, positions, dtype))
    tol = TOL[dtype]
    torch.testing.assert_close(q, rq, atol=tol, rtol=tol)
    torch.testing.assert_close(cache[0][slots], rk, atol=tol, rtol=tol)
    torch.testing.assert_close(cache[1][slots], rv, atol=0, rtol=0)
    untouched = torch.ones(S, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert cache[0][untouched].abs().sum() == 0 and cache[1][untouched].abs().sum() == 0


def test_query_block():
    assert gpu.query_block(1, 4) == 4  # a decode: 4 tokens x 4 heads fill 16 rows
    assert gpu.query_block(1, 1) == 16
    assert gpu.query_block(100, 4) == 16  # a prefill chunk: 64 rows a program
    assert gpu.query_block(4, 3) == 4


def test_attention_programs():
    """One program per block of queries a request has: none for blocks only a longer request has."""
    progs = gpu.attention_programs(np.array([1, 40, 3, 16]), 16)
    assert progs.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0], [3, 0]]
    assert progs.dtype == np.int32


def test_row_stats():
    """The sampler's argmax and logsumexp on CUDA: ties go to the first index, -inf entries (a
    grammar's forbidden tokens) count for nothing, rows with NaN or +inf are flagged."""
    torch.manual_seed(0)
    x = torch.randn(5, 3000, device=DEVICE)
    x[1, 100:2000] = float("-inf")
    x[2, 7] = x[2, 2900] = 50.0  # a tie
    x[3, 10] = float("nan")
    x[4, 20] = float("inf")
    arg, lse, bad = gpu.row_stats(x)
    good = [0, 1, 2]
    assert arg[good].tolist() == x[good].argmax(-1).tolist() and arg[2] == 7
    torch.testing.assert_close(lse[good], x[good].logsumexp(-1))
    assert bad.tolist() == [False, False, False, True, True]
    # a row's values do not depend on the rows beside it
    arg1, lse1, _ = gpu.row_stats(x[1:2])
    assert arg1[0] == arg[1] and lse1[0] == lse[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 4, 32])
def test_split_decode_attention_matches_gather_and_sdpa(dtype, splits):
    """A decode step's keys shared by several programs per request (short contexts use fewer than
    `splits`, a request with one key one), their partial sums merged."""
    torch.manual_seed(1)
    H, KVH, D, bs, num_blocks = 8, 2, 32, 16, 96
    layout = mixed_step([1, 1, 1, 1], [1, 130, 700, 64], bs, num_blocks)
    k_cache = torch.randn(num_blocks * bs, KVH, D, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_blocks * bs, KVH, D, device=DEVICE).to(dtype)
    q = torch.randn(4, H, D, device=DEVICE).to(dtype)
    ref = TorchAttention(Kernels.none(), (H, KVH, D))
    want = ref.forward(q, None, None, k_cache, v_cache, ref.prepare(layout, DEVICE), D**-0.5).float()
    meta = TritonAttention(Kernels.none(), (H, KVH, D)).prepare(layout, DEVICE)
    meta.splits = splits
    out = torch.empty_like(q)
    got = gpu.paged_attention(
        q,
        k_cache,
        v_cache,
        out,
        meta.programs,
        meta.q_start,
        meta.context_lens,
        meta.block_tables,
        meta.block_m,
        bs,
        D**-0.5,
        splits,
    ).float()
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_splits_fill_the_gpu_and_stop_when_requests_do():
    assert gpu.decode_splits(1, 8, 132) == 32  # 8 programs alone would leave 124 multiprocessors idle
    assert gpu.decode_splits(4, 8, 132) == 8
    assert gpu.decode_splits(16, 8, 132) == 2
    assert gpu.decode_splits(64, 8, 132) == 1
    layout = mixed_step([1, 1], [5, 9], 4, 8)
    assert TritonAttention(Kernels.none(), (4, 2, 16)).prepare(layout, DEVICE).splits > 1
    layout = mixed_step([3, 1], [3, 9], 4, 8)  # a prompt in the step: one program per request block
    assert TritonAttention(Kernels.none(), (4, 2, 16)).prepare(layout, DEVICE).splits == 1


def test_fp8_bytes_round_as_pytorch_casts():
    """`gpu.f32_to_fp8` (integer steps, so the interpreter rounds as a GPU does) against PyTorch's cast:
    normal and subnormal values, ties, the largest, zeros."""
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, z_ptr, N: tl.constexpr):
        i = tl.program_id(0) * N + tl.arange(0, N)
        code = gpu.f32_to_fp8(tl.load(x_ptr + i))
        tl.store(y_ptr + i, code.to(tl.uint8))
        tl.store(z_ptr + i, gpu.fp8_to_f32(code))

    n = 1 << 14
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(n // 4, generator=g) * s for s in (100.0, 0.01, 1e-3, 1.0)]).clamp(-448, 448)
    edges = [127.0, 120.0, 124.0, 0.0, -0.0, 448.0, -448.0, 2**-6, 2**-7, 2**-10, 3 * 2**-10, 2**-11, 1e-30]
    x[: len(edges)] = torch.tensor(edges)
    x = x.to(DEVICE)
    y, z = torch.empty(n, dtype=torch.uint8, device=DEVICE), torch.empty(n, device=DEVICE)
    cast[(n // 1024,)](x, y, z, N=1024)
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(y, want.view(torch.uint8))
    assert torch.equal(z, want.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 96])
def test_fp8_kv_cache_written_by_rope_and_read_by_attention(dtype, D):
    """An FP8 cache: rows of e4m3 bytes and a float32 scale per token and head, written by the rotary
    kernel as `quantize_kv_fp8` writes them, and attended as the values they hold."""
    torch.manual_seed(0)
    H, KVH, bs, num_blocks = 4, 2, 4, 16
    T = 6
    qkv = torch.randn(T, (H + 2 * KVH) * D, device=DEVICE).to(dtype)
    rope = RotaryEmbedding(D, 64, 10000.0, None).to(DEVICE)
    positions = torch.arange(T, device=DEVICE)
    slots = torch.tensor([5, 9, 0, 33, 34, 63], device=DEVICE)
    caches = [torch.zeros(num_blocks * bs, KVH, D + 4, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    cos, sin = rope.cos[positions].float(), rope.sin[positions].float()
    q = gpu.rope_write_kv(qkv, cos, sin, slots, caches[0], caches[1], H, KVH, D)
    ref_k = torch.zeros(num_blocks * bs, KVH, D, device=DEVICE).to(dtype)
    ref_v = torch.zeros_like(ref_k)
    q_ref = gpu.rope_write_kv(qkv, cos, sin, slots, ref_k, ref_v, H, KVH, D)
    assert torch.equal(q, q_ref)
    for cache, ref in ((caches[0], ref_k), (caches[1], ref_v)):
        want = gpu.quantize_kv_fp8(ref[slots])
        if dtype == torch.float32 or DEVICE.type == "cuda":
            assert torch.equal(cache[slots], want)
        vals = gpu.kv_fp8_values(cache)[slots]
        assert (vals - ref[slots].float()).abs().max() <= ref[slots].float().abs().max() / 16
    # attention over the FP8 cache equals attention over the values it holds
    layout = mixed_step([1, 1, 2], [5, 9, 14], bs, num_blocks)
    k_cache = torch.randn(num_blocks * bs, KVH, D, device=DEVICE)
    v_cache = torch.randn(num_blocks * bs, KVH, D, device=DEVICE)
    k8, v8 = gpu.quantize_kv_fp8(k_cache), gpu.quantize_kv_fp8(v_cache)
    qq = torch.randn(4, H, D, device=DEVICE).to(dtype)
    torch_attn = TorchAttention(Kernels.none(), (H, KVH, D))
    kv = [gpu.kv_fp8_values(c).to(dtype) for c in (k8, v8)]
    want = torch_attn.forward(
        qq, None, None, kv[0], kv[1], torch_attn.prepare(layout, DEVICE), D**-0.5
    ).float()
    backend = TritonAttention(Kernels.none(), (H, KVH, D))
    got = backend.forward(qq, None, None, k8, v8, backend.prepare(layout, DEVICE), D**-0.5).float()
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def reference_attention(q, k_cache, v_cache, layout, scale):
    """Plain PyTorch: each request's context gathered through its block table, every query head against
    its kv head's keys, causal, in float32."""
    T, H = q.shape[:2]
    KVH, bs = k_cache.shape[1], layout.block_size
    out = torch.zeros(T, H, v_cache.shape[2], device=q.device)
    start = 0
    for b, (n, c) in enumerate(zip(layout.query_lens.tolist(), layout.context_lens.tolist())):
        pos = np.arange(c)
        slots = torch.from_numpy(layout.block_tables[b][pos // bs] * bs + pos % bs).to(q.device)
        k = k_cache[slots].float().repeat_interleave(H // KVH, dim=1)  # [c, H, D]
        v = v_cache[slots].float().repeat_interleave(H // KVH, dim=1)
        s = torch.einsum("nhd,chd->hnc", q[start : start + n].float(), k) * scale
        seen = torch.from_numpy(pos[None, :] <= (c - n + np.arange(n))[:, None]).to(q.device)
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)
        out[start : start + n] = torch.einsum("hnc,chd->nhd", p, v)
        start += n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "q_lens, ctx", [([1, 1], [40, 7]), ([1, 5, 1, 9], [33, 21, 1, 9])], ids=["decode", "chunks"]
)
@pytest.mark.parametrize("H", [16, 128])
def test_mla_latent_rows_on_the_triton_kernel(dtype, q_lens, ctx, H):
    """MLA as `MLAttention` runs it: every query head on one kv head of 576-wide latent rows (padded to
    1024 in the kernel), the values the keys themselves (the value cache has no columns); 128 heads take
    8 programs of 16 per kv head. Decodes (split over programs) and prefill chunks."""
    torch.manual_seed(0)
    D, bs, num_blocks = 576, 4, 24
    layout = mixed_step(q_lens, ctx, bs, num_blocks)
    k_cache = torch.randn(num_blocks * bs, 1, D, device=DEVICE).to(dtype)
    q = torch.randn(int(layout.query_lens.sum()), H, D, device=DEVICE).to(dtype)
    backend = TritonAttention(Kernels.none(), (H, 1, D))
    meta = backend.prepare(layout, DEVICE)
    assert type(meta).__name__ == "TritonMetadata"
    if H == 16 and q_lens == [1, 1]:
        assert meta.splits > 1
    got = backend.forward(q, None, None, k_cache, k_cache, meta, 192**-0.5).float()
    want = reference_attention(q, k_cache, k_cache, layout, 192**-0.5)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("H", [16, 128])
def test_mla_split_decode(H):
    """Split decodes over 576-wide rows (each split at least 4 key tiles of 16 here), merged."""
    torch.manual_seed(2)
    D, bs, num_blocks = 576, 16, 16
    layout = mixed_step([1, 1, 1], [1, 150, 70], bs, num_blocks)
    k_cache = torch.randn(num_blocks * bs, 1, D, device=DEVICE)
    q = torch.randn(3, H, D, device=DEVICE)
    meta = TritonAttention(Kernels.none(), (H, 1, D)).prepare(layout, DEVICE)
    out = torch.empty_like(q)
    args = (meta.programs, meta.q_start, meta.context_lens, meta.block_tables, meta.block_m, bs, 0.05, 4)
    got = gpu.paged_attention(q, k_cache, k_cache, out, *args)
    torch.testing.assert_close(
        got, reference_attention(q, k_cache, k_cache, layout, 0.05), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("H, KVH, D", [(4, 2, 96), (8, 1, 512)])
def test_paged_attention_head_dims_96_and_512(dtype, splits, H, KVH, D):
    """Heads of 96 features (padded to 128 in the kernel, masked) and of 512 (Gemma 4's full layers:
    smaller tiles, `attention_tiles`): prefill chunks and decodes, and decodes split over programs."""
    torch.manual_seed(3)
    bs, num_blocks = 4, 48
    q_lens = [1, 1, 1] if splits > 1 else [1, 6, 1, 20]
    layout = mixed_step(q_lens, [150, 9, 70] if splits > 1 else [33, 6, 1, 25], bs, num_blocks)
    k_cache = torch.randn(num_blocks * bs, KVH, D, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_blocks * bs, KVH, D, device=DEVICE).to(dtype)
    q = torch.randn(int(layout.query_lens.sum()), H, D, device=DEVICE).to(dtype)
    meta = TritonAttention(Kernels.none(), (H, KVH, D)).prepare(layout, DEVICE)
    out = torch.full_like(q, float("nan"))
    args = (meta.programs, meta.q_start, meta.context_lens, meta.block_tables, meta.block_m, bs, D**-0.5)
    got = gpu.paged_attention(q, k_cache, v_cache, out, *args, splits).float()
    want = reference_attention(q, k_cache, v_cache, layout, D**-0.5)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_fp8_cache_head_dim_96():
    """An FP8 cache of 96-wide heads (rows of 96 bytes and the scale): padded reads stop at the scale."""
    torch.manual_seed(4)
    H, KVH, D, bs, num_blocks = 4, 2, 96, 4, 16
    layout = mixed_step([1, 3, 1], [9, 14, 30], bs, num_blocks)
    k8, v8 = (gpu.quantize_kv_fp8(torch.randn(num_blocks * bs, KVH, D, device=DEVICE)) for _ in range(2))
    q = torch.randn(5, H, D, device=DEVICE)
    backend = TritonAttention(Kernels.none(), (H, KVH, D))
    got = backend.forward(q, None, None, k8, v8, backend.prepare(layout, DEVICE), D**-0.5)
    want = reference_attention(q, gpu.kv_fp8_values(k8), gpu.kv_fp8_values(v8), layout, D**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_attention_tiles():
    """Heads of up to 256 keep their tiles (the whole group, 64 keys); MLA's 576-wide rows take 16 query
    rows and 16 keys a program, 8 warps, a group of 128 in 8 programs."""
    assert gpu.attention_tiles(4, 128) == (4, 64, 4)
    assert gpu.attention_tiles(8, 256) == (8, 64, 4)
    assert gpu.attention_tiles(8, 512) == (8, 32, 8)  # Gemma 4's full layers (64 x 64 on 4 warps spilled)
    assert gpu.attention_tiles(16, 576) == (16, 16, 8)
    assert gpu.attention_tiles(128, 576) == (16, 16, 8)
    assert gpu.head_parts(128, 576) == 8 and gpu.head_parts(16, 576) == 1 and gpu.head_parts(12, 96) == 1
    assert gpu.query_block(1, 16, 576) == 1 and gpu.query_block(100, 16, 576) == 1
    assert gpu.query_block(100, 4, 96) == 16
