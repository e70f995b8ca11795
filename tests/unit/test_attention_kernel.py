"""The CPU paged decode kernel against a plain softmax attention over each request's context."""

import numpy as np
import pytest
import torch

from pytgi.engine import kernels
from pytgi.engine.models.attention import StepLayout, TorchAttention
from pytgi.engine.models.cpu import CROSSOVERS, Crossovers, Kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler")


def attention(dtype, heads, **kernel_choice):
    """The attention backend on this CPU's kernels (`fused=False`: the gather + SDPA path)."""
    return TorchAttention(Kernels.for_device(torch.device("cpu"), dtype, **kernel_choice), heads)


def reference(q, k_cache, v_cache, tables, ctx, rows, bs, scale):
    H, KVH = q.shape[1], k_cache.shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    for b, row in enumerate(rows):
        pos = np.arange(ctx[b])
        slots = torch.from_numpy(tables[b, pos // bs] * bs + pos % bs)
        k = k_cache[slots].float().repeat_interleave(H // KVH, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(H // KVH, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[row].float(), k) * scale, dim=-1)
        out[row] = torch.einsum("hl,lhd->hd", w, v)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H, KVH", [(4, 4), (6, 2), (9, 3), (4, 1)])
@pytest.mark.parametrize("B", [4, 1])  # one request with few kv heads: a task per query head
def test_decode_kernel_matches_softmax_attention(dtype, tol, H, KVH, B):
    g = torch.Generator().manual_seed(0)
    bs, D, num_blocks = 4, 16, 32
    k_cache = torch.randn(num_blocks * bs, KVH, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, KVH, D, generator=g).to(dtype)
    rng = np.random.default_rng(0)
    ctx = np.array([30, 5, 17, 1])[:B]
    tables = np.stack([rng.permutation(num_blocks)[:8] for _ in ctx]).astype(np.int64)  # scattered blocks
    q = torch.randn(7, H, D, generator=g).to(dtype)  # flat step: decodes sit at rows 6, 0, 3, 2
    rows = [6, 0, 3, 2][:B]
    layout = StepLayout(
        query_lens=np.ones(B, np.int64),
        context_lens=ctx,
        block_tables=tables,
        slot_mapping=np.zeros(B, np.int64),
        block_size=bs,
    )
    backend = attention(dtype, (H, KVH, D))
    meta = backend.prepare(layout, torch.device("cpu"))
    meta.paged.q_starts = np.array(rows, np.int64)
    out = torch.zeros_like(q)
    kernels.paged_attention(q, k_cache, v_cache, out, meta.paged, 0.25)
    ref = reference(q, k_cache, v_cache, tables, ctx, rows, bs, 0.25)
    torch.testing.assert_close(out[rows].float(), ref[rows], atol=tol, rtol=tol)
    assert out[[1, 4, 5]].abs().sum() == 0  # rows that are not decodes are left alone


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("B", [1, 3])
def test_latent_attention_rows_take_the_kernel(dtype, tol, B):
    """MLA's decode: 16 query heads on one kv "head" of 576 values (past the AVX-512 kernel's sizes:
    the portable one, its query heads split between threads in shares), each row the same alone."""
    g = torch.Generator().manual_seed(1)
    H, KVH, D, bs, num_blocks = 16, 1, 576, 16, 24
    k_cache = torch.randn(num_blocks * bs, KVH, D, generator=g).to(dtype)
    rng = np.random.default_rng(1)
    ctx = np.array([70, 3, 200])[:B]
    tables = np.stack([rng.permutation(num_blocks)[:13] for _ in ctx]).astype(np.int64)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    rows = list(range(B))

    def run(rs: list[int]) -> torch.Tensor:
        n = len(rs)
        layout = StepLayout(
            query_lens=np.ones(n, np.int64),
            context_lens=ctx[rs],
            block_tables=tables[rs],
            slot_mapping=np.zeros(n, np.int64),
            block_size=bs,
        )
        meta = attention(dtype, (H, KVH, D)).prepare(layout, torch.device("cpu"))
        out = torch.zeros(n, H, D, dtype=dtype)
        kernels.paged_attention(q[rs], k_cache, k_cache, out, meta.paged, 0.05)
        return out

    out = run(rows)
    ref = reference(q, k_cache, k_cache, tables, ctx, rows, bs, 0.05)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert all(torch.equal(run([b])[0], out[b]) for b in rows)


def test_decode_kernel_equals_torch_path_in_a_mixed_step():
    """A step with a prefill chunk and decodes: the kernel path and the gather+SDPA path agree."""
    torch.manual_seed(0)
    bs, H, KVH, D = 4, 6, 2, 8
    k_cache, v_cache = torch.randn(64 * bs, KVH, D), torch.randn(64 * bs, KVH, D)
    q_lens, ctx = np.array([1, 5, 1]), np.array([9, 12, 3])
    tables = np.array([[3, 7, 9, 0], [10, 11, 12, 13], [20, 0, 0, 0]], np.int64)
    positions = np.concatenate([np.arange(c - n, c) for n, c in zip(q_lens, ctx)])
    req = np.repeat(np.arange(3), q_lens)
    slots = tables[req, positions // bs] * bs + positions % bs
    layout = StepLayout(q_lens, ctx, tables, slots, bs)
    q, k, v = torch.randn(7, H, D), torch.randn(7, KVH, D), torch.randn(7, KVH, D)
    outs = []
    for use in (True, False):
        backend = attention(torch.float32, (H, KVH, D), fused=use)
        meta = backend.prepare(layout, torch.device("cpu"))
        assert (meta.paged is not None) == use
        outs.append(backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, D**-0.5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def scattered_step(
    q_lens: np.ndarray, ctx: np.ndarray, bs: int, spare: int, seed: int
) -> tuple[StepLayout, int]:
    """A step's layout whose requests' blocks are scattered over a pool with `spare` blocks more
    than they take; and the pool's slots."""
    n_blocks = [(c + bs - 1) // bs for c in ctx]
    perm = np.random.default_rng(seed).permutation(sum(n_blocks) + spare)
    tables = np.zeros((len(ctx), max(n_blocks)), np.int64)
    at = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = perm[at : at + n]
        at += n
    positions = np.concatenate([np.arange(c - n, c) for n, c in zip(q_lens, ctx)])
    req = np.repeat(np.arange(len(ctx)), q_lens)
    slots = tables[req, positions // bs] * bs + positions % bs
    return StepLayout(q_lens, ctx, tables, slots, bs), len(perm) * bs


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
# (10, 2, 20): heads the AVX-512 kernel does not take, so the portable kernel on every CPU
@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (4, 2, 16), (8, 8, 128), (10, 2, 20)])
def test_paged_prefill_kernel_equals_torch_path(dtype, tol, H, KVH, D):
    """Prefill chunks next to decodes, with contexts that span several of the kernel's 128-key
    chunks: the in-place kernel agrees with gather+SDPA (for chunks bigger than the default
    threshold too)."""
    torch.manual_seed(0)
    bs = 16
    q_lens, ctx = np.array([1, 40, 3, 1, 17, 64]), np.array([300, 300, 3, 129, 17, 200])
    layout, n_slots = scattered_step(q_lens, ctx, bs, spare=4, seed=0)
    T = int(q_lens.sum())
    k_cache = torch.randn(n_slots, KVH, D).to(dtype)
    v_cache = torch.randn(n_slots, KVH, D).to(dtype)
    q, k, v = (torch.randn(T, n, D).to(dtype) for n in (H, KVH, KVH))
    outs = []
    for use in (True, False):
        backend = attention(dtype, (H, KVH, D), fused=use, limits=Crossovers(paged_prefill=64))
        meta = backend.prepare(layout, torch.device("cpu"))
        if use:
            assert (
                meta.prefill is None
                and meta.paged is not None
                and meta.paged.q_lens.tolist() == q_lens.tolist()
            )
        outs.append(backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, D**-0.5).float())
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
# (10, 2, 20): the portable kernel on every CPU
@pytest.mark.parametrize("H, KVH, D", [(8, 2, 64), (4, 2, 16), (10, 2, 20)])
@pytest.mark.parametrize("decodes_only", [False, True])
def test_sinks_in_the_paged_kernel_equal_the_gathered_path(dtype, tol, H, KVH, D, decodes_only):
    """gpt-oss's sinks (a logit per query head in each softmax, attending to nothing), some of them
    above every score: the paged kernel (split-K, its rows' tiles, the portable path) equals the
    gathered two-matmul attention (`_attend_sinks`)."""
    torch.manual_seed(1)
    bs = 16
    q_lens = np.ones(4, np.int64) if decodes_only else np.array([1, 40, 3, 17])
    ctx = np.array([300, 300, 3, 129])
    layout, n_slots = scattered_step(q_lens, ctx, bs, spare=4, seed=1)
    T = int(q_lens.sum())
    k_cache, v_cache = (torch.randn(n_slots, KVH, D).to(dtype) for _ in range(2))
    q, k, v = (torch.randn(T, n, D).to(dtype) for n in (H, KVH, KVH))
    sinks = torch.randn(H) * 3
    outs = []
    for use in (True, False):
        backend = attention(dtype, (H, KVH, D), fused=use, limits=Crossovers(paged_prefill=64))
        meta = backend.prepare(layout, torch.device("cpu"))
        assert (meta.paged is not None) == use
        out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, D**-0.5, sinks=sinks)
        outs.append(out.float())
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    plain = attention(dtype, (H, KVH, D), fused=True).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), meta, D**-0.5
    )
    assert not torch.allclose(plain.float(), outs[1], atol=tol, rtol=tol)  # the sinks matter


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
# (10, 2, 20): the portable kernel on every CPU
@pytest.mark.parametrize("H, KVH, D", [(8, 2, 64), (4, 4, 128), (10, 2, 20)])
@pytest.mark.parametrize("kv8, sinks", [(False, False), (False, True), (True, False)])
def test_a_window_in_the_paged_kernel_equals_the_gathered_path(dtype, tol, H, KVH, D, kv8, sinks):
    """A sliding window (gpt-oss's, Gemma's) for decodes in the paged kernel: each request's keys
    start where its last token's window does (not on a block's or a chunk's edge), and equal the
    gathered path's masked attention; the step's prefill chunk keeps the gathered path."""
    torch.manual_seed(2)
    bs, window = 16, 100
    q_lens, ctx = np.array([1, 1, 17, 1, 1]), np.array([300, 60, 250, 101, 133])
    layout, n_slots = scattered_step(q_lens, ctx, bs, spare=4, seed=2)
    T = int(q_lens.sum())
    if kv8:
        k_cache, v_cache = int8_cache(n_slots, KVH, D, dtype)
    else:
        k_cache, v_cache = (torch.randn(n_slots, KVH, D).to(dtype) for _ in range(2))
    q = torch.randn(T, H, D).to(dtype)
    sink = torch.randn(H) * 3 if sinks else None
    outs = []
    for use in (True, False):
        backend = attention(dtype, (H, KVH, D), fused=use, limits=Crossovers(paged_prefill=64))
        meta = backend.prepare(layout, torch.device("cpu"), window=window)
        if use:
            assert meta.paged.q_lens.tolist() == [1, 1, 1, 1] and meta.paged.first.tolist() == [200, 0, 1, 33]
            assert meta.prefill is not None and meta.decode is None
        out = backend.forward(q, None, None, k_cache, v_cache, meta, D**-0.5, sinks=sink)
        outs.append(out.float())
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    full = attention(dtype, (H, KVH, D), fused=True).prepare(layout, torch.device("cpu"))
    whole = attention(dtype, (H, KVH, D)).forward(q, None, None, k_cache, v_cache, full, D**-0.5, sinks=sink)
    assert not torch.allclose(whole[0].float(), outs[0][0], atol=tol, rtol=tol)  # the window matters


def test_big_prefill_chunks_keep_sdpa_unless_batch_invariant():
    n = CROSSOVERS.paged_prefill + 1
    layout = StepLayout(
        np.array([1, n]),
        np.array([5, n]),
        np.array([[0, 0], [1, 2]], np.int64),
        np.zeros(n + 1, np.int64),
        64,
    )
    backend = attention(torch.float32, (4, 2, 16), batch_invariant=False)
    meta = backend.prepare(layout, torch.device("cpu"))
    assert meta.prefill is not None and meta.paged.q_lens.tolist() == [1]
    meta = attention(torch.float32, (4, 2, 16)).prepare(layout, torch.device("cpu"))  # SDPA's numerics differ
    assert meta.prefill is None and meta.paged.q_lens.tolist() == [1, n]


def test_every_row_takes_tiles_when_batch_invariant():
    """Batch invariant, every request's rows use AMX tiles where the CPU has them (decodes, draft
    verifications and prompt chunks alike), so no row's numerics depend on what else is in its
    chunk; without invariance the tiles are chosen by size (16 query rows per kv head)."""
    q_lens, ctx = np.array([1, 1, 5, 10, 3]), np.array([9, 4, 20, 30, 3])
    tables = np.arange(5 * 2, dtype=np.int64).reshape(5, 2)
    layout = StepLayout(q_lens, ctx, tables, np.zeros(int(q_lens.sum()), np.int64), 16)
    p = attention(torch.bfloat16, (6, 2, 32)).prepare(layout, torch.device("cpu")).paged
    assert p.q_starts.tolist() == [0, 1, 2, 7, 17] and p.q_lens.tolist() == q_lens.tolist()
    decodes = StepLayout(np.ones(2, np.int64), np.array([9, 12]), tables[:2], np.zeros(2, np.int64), 16)
    d = attention(torch.bfloat16, (6, 2, 32)).prepare(decodes, torch.device("cpu")).paged
    if kernels.amx_supported():
        assert p.tiles.tolist() == [1] * 5 and not p.decodes_only
        assert d.tiles.tolist() == [1, 1] and not d.decodes_only  # through the entry that takes tiles
    else:
        assert p.tiles is None and d.tiles is None and d.decodes_only
    old = (
        attention(torch.bfloat16, (6, 2, 32), batch_invariant=False)
        .prepare(layout, torch.device("cpu"))
        .paged
    )
    assert old.tiles.tolist() == [0, 0, 0, 1, 0]  # by size


def test_a_decode_row_is_the_same_in_a_verification_chunk():
    """A decode's attention equals the same row's as the first of several query rows (a draft being
    verified): bit for bit, tiles or not."""
    torch.manual_seed(1)
    bs, H, KVH, D = 16, 6, 2, 32
    k_cache, v_cache = (torch.randn(4 * bs, KVH, D).bfloat16() for _ in range(2))
    q = torch.randn(9, H, D).bfloat16()
    table = np.array([[2, 0, 3, 1]], np.int64)
    backend = attention(torch.bfloat16, (H, KVH, D))

    def run(n: int, ctx: int) -> torch.Tensor:
        layout = StepLayout(np.array([n]), np.array([ctx]), table, np.zeros(n, np.int64), bs)
        out = torch.zeros(n, H, D).bfloat16()
        p = backend.prepare(layout, torch.device("cpu")).paged
        kernels.paged_attention(q[:n].contiguous(), k_cache, v_cache, out, p, D**-0.5)
        return out

    assert torch.equal(run(1, 50)[0], run(9, 58)[0])


def caches(slots: int, KVH: int, D: int, kv8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 K and V caches, or the int8 caches of random bf16 values."""
    if kv8:
        return int8_cache(slots, KVH, D, torch.bfloat16)
    k, v = (torch.randn(slots, KVH, D).bfloat16() for _ in range(2))
    return k, v


@pytest.mark.parametrize("kv8", [False, True])
@pytest.mark.parametrize("tiles, D", [(0, 32), (1, 32), (0, 20)])
def test_a_rows_attention_does_not_depend_on_its_chunk(tiles, D, kv8):
    """The same 40 query rows, in one chunk or in chunks of 7, 1 and 32 (the keys already written),
    give the same bits: with AMX tiles (prompt rows, where the CPU has them) or without, and in the
    portable kernel (D = 20 on every CPU; every D without AVX-512); from an int8 cache too."""
    torch.manual_seed(0)
    bs, H, KVH, n = 16, 6, 2, 40
    k_cache, v_cache = caches(4 * bs, KVH, D, kv8)
    q = torch.randn(n, H, D).bfloat16()
    table = np.array([[2, 0, 3, 1]], np.int64)

    def run(chunks):
        out, start = torch.zeros_like(q), 0
        for c in chunks:
            p = kernels.PagedBatch(
                q_starts=np.array([0], np.int64),
                q_lens=np.array([c], np.int64),
                block_tables=table,
                context_lens=np.array([start + c], np.int64),
                block_size=bs,
                decodes_only=False,
                tiles=np.array([tiles], np.int64),
            )
            part = torch.zeros(c, H, D).bfloat16()
            kernels.paged_attention(q[start : start + c].contiguous(), k_cache, v_cache, part, p, D**-0.5)
            out[start : start + c] = part
            start += c
        return out

    whole = run([n])
    assert torch.equal(run([7, 1, 32]), whole)
    assert torch.equal(run([1] * n), whole)


@pytest.mark.parametrize("kv8", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128])
def test_long_chunks_by_row_tiles_equal_split_k(D, kv8):
    """A long prompt's chunk (many query rows, context past one key chunk) goes by row tiles (AMX
    tiles, or the lanes kernel on AVX-512 BF16; an int8 cache: the lanes), small chunks and decodes
    by split-K: the same bits for every row, however the prompt is cut."""
    torch.manual_seed(2)
    bs, H, KVH, n = 16, 6, 2, 500
    nb = n // bs + 1
    k_cache, v_cache = caches((nb + 2) * bs, KVH, D, kv8)
    q = (3 * torch.randn(n, H, D)).bfloat16()  # sharp softmaxes: a different cut would show in the bits
    table = np.random.default_rng(0).permutation(nb + 2)[:nb].astype(np.int64)[None]

    def run(chunks):
        out, start = torch.zeros_like(q), 0
        for c in chunks:
            p = kernels.PagedBatch(
                q_starts=np.array([0], np.int64),
                q_lens=np.array([c], np.int64),
                block_tables=table,
                context_lens=np.array([start + c], np.int64),
                block_size=bs,
                decodes_only=False,
                tiles=np.array([1], np.int64),
            )
            part = torch.zeros(c, H, D).bfloat16()
            kernels.paged_attention(q[start : start + c].contiguous(), k_cache, v_cache, part, p, D**-0.5)
            out[start : start + c] = part
            start += c
        return out

    whole = run([n])  # row tiles
    # rows past the first key chunk by split-K (decodes, a chunk of 20 rows), the rest by row tiles
    assert torch.equal(run([200] + [1] * 10 + [20, 270]), whole)
    assert torch.equal(run([7, 1, 100, 392]), whole)


@pytest.mark.parametrize("window", [None, 3])
def test_two_way_spans_unmask_an_image_for_itself(window):
    """`StepLayout.spans`: within a span a query sees the span's later keys too (causal OR same image,
    then the window), on the gathered path even where the paged kernel would take the chunk; the
    other requests and the rows outside the span stay causal."""
    torch.manual_seed(0)
    bs, H, KVH, D = 4, 4, 2, 8
    q_lens, ctx = np.array([1, 9, 6]), np.array([5, 12, 6])  # a decode, a chunk after 3 cached, a prompt
    T = int(q_lens.sum())
    tables = np.array([[0, 1, 0], [2, 3, 4], [5, 6, 0]], np.int64)
    starts = np.concatenate(([0], np.cumsum(q_lens)[:-1]))
    slots = np.concatenate(
        [tables[b, p // bs] * bs + p % bs for b in range(3) for p in [np.arange(ctx[b] - q_lens[b], ctx[b])]]
    )
    spans = np.array([[1, 2, 8], [2, 1, 4]], np.int64)  # request 1: positions 2-7 (from a cached one)
    layout = StepLayout(q_lens, ctx, tables, slots, bs, spans)
    k_cache, v_cache = torch.randn(32, KVH, D), torch.randn(32, KVH, D)
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    backend = attention(torch.float32, (H, KVH, D), fused=True, limits=Crossovers(paged_prefill=64))
    meta = backend.prepare(layout, torch.device("cpu"), window=window)
    assert meta.prefill is not None and meta.prefill.token_idx.shape[0] == 2  # both spans' requests
    out = backend.forward(q, k, v, k_cache, v_cache, meta, D**-0.5)
    spans_of = {int(r): (lo, hi) for r, lo, hi in spans}
    for b in range(3):
        pos = np.arange(ctx[b])
        kv = torch.from_numpy(tables[b, pos // bs] * bs + pos % bs)
        kb, vb = k_cache[kv].repeat_interleave(H // KVH, 1), v_cache[kv].repeat_interleave(H // KVH, 1)
        for i in range(q_lens[b]):
            p = ctx[b] - q_lens[b] + i
            lo, hi = spans_of.get(b, (0, 0))
            see = (pos <= p) | ((lo <= p < hi) & (pos >= lo) & (pos < hi))
            if window is not None:
                see &= pos > p - window
            s = torch.einsum("hd,lhd->hl", q[starts[b] + i], kb) * D**-0.5
            w = torch.softmax(s.masked_fill(~torch.from_numpy(see), float("-inf")), -1)
            torch.testing.assert_close(
                out[starts[b] + i], torch.einsum("hl,lhd->hd", w, vb), atol=1e-5, rtol=1e-5
            )


# -- the int8 KV cache (--kv-cache-dtype int8, kv8.h) ----------------------------------------------------------
def int8_cache(slots: int, KVH: int, D: int, dtype, g=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V written into int8 caches of `slots` rows, as the engine writes them."""
    k8, v8 = (torch.zeros(slots, KVH, D + 2, dtype=torch.uint8) for _ in range(2))
    k, v = (torch.randn(slots, KVH, D, generator=g).to(dtype) for _ in range(2))
    kernels.write_kv8(k, v, torch.arange(slots), k8, v8)
    return k8, v8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_row_holds_each_value_within_half_its_step(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]).to(dtype)
    x[7, 1] = 0  # an all-zero row: scale 0, values 0
    k8, v8 = (torch.zeros(60, 3, 66, dtype=torch.uint8) for _ in range(2))
    slots = torch.arange(10, 60)
    kernels.write_kv8(x, -x, slots, k8, v8)
    scale = k8[slots, :, 64:].contiguous().view(torch.bfloat16).float()[..., 0]
    amax = x.float().abs().amax(-1)
    assert (scale * 127 >= amax).all() and (scale <= amax / 127 * (1 + 2**-7)).all()  # rounded up
    back = kernels.kv8_values(k8[slots], torch.float32)
    assert ((back - x.float()).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(kernels.kv8_values(v8[slots], torch.float32), -back)  # symmetric
    assert k8[:10].eq(0).all()  # other slots untouched


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (8, 8, 128), (10, 2, 20)])
def test_the_paged_kernel_reads_the_int8_cache_as_gather_and_sdpa_do(dtype, tol, H, KVH, D):
    """Decodes and prefill chunks over an int8 cache: the kernel (rows widened in place) agrees with
    gather + SDPA over the rows' values, and the step's own keys go in as the engine writes them."""
    g = torch.Generator().manual_seed(1)
    bs = 16
    q_lens, ctx = np.array([1, 40, 3, 1, 17]), np.array([300, 300, 3, 129, 17])
    layout, n_slots = scattered_step(q_lens, ctx, bs, spare=2, seed=1)
    tables = layout.block_tables
    T = int(q_lens.sum())
    k8, v8 = int8_cache(n_slots, KVH, D, dtype, g)
    q, k, v = (torch.randn(T, n, D, generator=g).to(dtype) for n in (H, KVH, KVH))
    outs, caches = [], []
    for use in (True, False):
        backend = attention(dtype, (H, KVH, D), fused=use, limits=Crossovers(paged_prefill=64))
        meta = backend.prepare(layout, torch.device("cpu"))
        assert (meta.paged is not None) == use
        kc, vc = k8.clone(), v8.clone()
        outs.append(backend.forward(q, k, v, kc, vc, meta, D**-0.5).float())
        caches.append((kc, vc))
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    ref = reference(
        q,
        kernels.kv8_values(caches[0][0], torch.float32),
        kernels.kv8_values(caches[0][1], torch.float32),
        tables,
        ctx,
        [int(r) for r in np.cumsum(q_lens) - 1],
        bs,
        D**-0.5,
    )
    last = np.cumsum(q_lens) - 1  # each request's last query row sees its whole context
    torch.testing.assert_close(outs[0][last], ref[last], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_writes_the_int8_rows_of_the_keys_it_would_store(dtype):
    """The fused rope's int8 rows are those of the keys (and values) it writes to a plain cache."""
    g = torch.Generator().manual_seed(2)
    T, H, KVH, D = 5, 4, 2, 64
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    slots = torch.tensor([3, 9, 0, 17, 4])
    kc, vc = torch.zeros(20, KVH, D, dtype=dtype), torch.zeros(20, KVH, D, dtype=dtype)
    q = kernels.rope_write_kv(qkv, cos, sin, slots, kc, vc, H, KVH, D)
    k8, v8 = (torch.zeros(20, KVH, D + 2, dtype=torch.uint8) for _ in range(2))
    q8 = kernels.rope_write_kv(qkv, cos, sin, slots, k8, v8, H, KVH, D)
    w8, u8 = (torch.zeros_like(k8) for _ in range(2))
    kernels.write_kv8(kc[slots], vc[slots], slots, w8, u8)
    assert torch.equal(q, q8) and torch.equal(k8, w8) and torch.equal(v8, u8)
