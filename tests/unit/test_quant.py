"""Weight-only quantization: grids, kernels and the per-tensor plan."""

import json

import pytest
import torch

from pytgi.engine import kernels
from pytgi.engine.loading.gguf import FP4_LEVELS, group_values
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.quant import (
    LayoutRows,
    QuantizedWeight,
    can_quantize,
    gguf_plan,
    pack_vnni,
    pack_vnni_reference,
    quantize_int4,
    quantize_int8,
    quantize_int8_groups,
    quantize_mxfp4,
    resolve_plan,
    unpack_rows,
)


def cpu(**kernel_choice) -> Kernels:
    """This CPU's kernels for bf16 (`vnni=False`: PyTorch's low-bit kernels)."""
    return Kernels.for_device(torch.device("cpu"), torch.bfloat16, **kernel_choice)


def q4_1_weight(N=32, K=64, seed=0):
    """A weight on Q4_1's grid: per 32 values, d·q + m with q in 0..15 using both ends."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.01 + 0.001).half().float()  # GGUF stores fp16
    m = (-torch.rand(N, K // 32, 1, generator=g) * 0.05).half().float()
    return (q * d + m).view(N, K)


def test_int4_grid_holds_q4_1_weights():
    w = q4_1_weight()
    *_, deq = quantize_int4(w)
    torch.testing.assert_close(deq, w, atol=1e-6, rtol=0)


def test_int4_keeps_the_grid_of_4_bit_blocks_that_do_not_span_it():
    """Q4_0 / Q4_1 blocks using only some of their 16 levels, and Q4_K sub-blocks (scale d·sc and
    min dmin·m from 6-bit integers): the re-pack finds their own grid instead of rounding onto a new
    one (min/max would put level 15 on the block's largest value)."""
    g = torch.Generator().manual_seed(3)
    N, K = 16, 128
    q = torch.randint(2, 12, (N, K // 32, 32), generator=g).float()  # levels 2..11 only
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.01 + 0.001).half().float()
    sc = torch.randint(1, 64, (N, K // 32, 1), generator=g).float()
    mn = torch.randint(0, 64, (N, K // 32, 1), generator=g).float()
    for w, step in [((q * d - 0.03).view(N, K), d), ((d * sc * q - 0.0005 * mn).view(N, K), d * sc)]:
        *_, deq = quantize_int4(w)
        # exact but for the step and offset held in fp16 (the kernel's scales): under 1% of a step
        err = (deq - w).view(N, K // 32, 32).abs()
        assert (err <= 0.01 * step).all()
        lo, hi = w.view(N, K // 32, 32).amin(-1, keepdim=True), w.view(N, K // 32, 32).amax(-1, keepdim=True)
        minmax = ((w.view(N, K // 32, 32) - lo) / ((hi - lo) / 15)).round() * ((hi - lo) / 15) + lo
        assert ((minmax - w.view(N, K // 32, 32)).abs() > 0.1 * step).any()  # what a new grid would cost
    _, _, _, regrid = quantize_int4(torch.randn(N, K, generator=g))  # off any grid: min/max, as before
    assert regrid.shape == (N, K)


def test_int8_is_per_channel_and_close():
    w = torch.randn(16, 64)
    q, scale, deq = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (16,)
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-6


def test_int8_groups_hold_q8_0_weights():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (16, 2, 32), generator=g).float()
    q[..., 0] = 127  # Q8_0 scales by the group's absolute max
    d = (torch.rand(16, 2, 1, generator=g) * 0.01 + 0.001).half().float()
    w = (q * d).view(16, 64)
    u, dd, m, deq = quantize_int8_groups(w)
    assert (
        torch.equal(deq, w) and torch.equal(u.float().view(16, 2, 32) - 128, q) and torch.equal(m, -128 * dd)
    )


def _blocks(levels: range, N: int = 16, K: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(levels.start, levels.stop, (N, K // 32, 32), generator=g).float(), g


def _fp16_rounding(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """What holding a group's step and offset in fp16 may cost (half an fp16 ulp of each, the step's
    times the levels): the only error of a re-pack onto the group's own grid."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    return 2.0**-11 * (lo.abs() + step + (hi - lo + step)) + 1e-9


def test_int8_keeps_the_grids_of_5_to_8_bit_gguf_blocks():
    """Q8_0 blocks whose largest |q| is under 127, Q5_0 (d·(q − 16)), Q5_1 (d·q + m) and Q5_K
    sub-blocks (d·sc·q − dmin·mn, 6-bit sc and mn): each keeps its own grid (exact but for fp16
    scales), where absmax / 127 would round every value again."""
    N, K = 16, 128
    q8, g = _blocks(range(-90, 91))
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.01 + 0.001).half().float()
    sc = torch.randint(1, 64, (N, K // 32, 1), generator=g).float()
    mn = torch.randint(0, 64, (N, K // 32, 1), generator=g).float()
    q5, _ = _blocks(range(32), seed=1)
    cases = {
        "Q8_0": (q8 * d, d),
        "Q5_0": ((q5 - 16) * d, d),
        "Q5_1": (q5 * d - 0.07, d),
        "Q5_K": (d * sc * q5 - 0.0004 * mn, d * sc),
    }
    for name, (w, step) in cases.items():
        *_, deq = quantize_int8_groups(w.view(N, K))
        err = (deq.view(N, K // 32, 32) - w).abs()
        assert (err <= _fp16_rounding(w, step)).all(), name
        if name in ("Q8_0", "Q5_0"):  # zero on the grid: the symmetric form, exact
            assert torch.equal(deq, w.view(N, K)), name


def test_int8_keeps_q3_k_pairs_whose_scales_share_a_divisor():
    """Q3_K: d·sc·(q − 4) per 16 values, sc signed 6-bit. Two sub-blocks whose scales share a
    divisor s lie on one grid of step d·s; scales with none (gcd 1) still fit 256 levels. Exact but
    for the step and offset held in fp16."""
    N, K = 16, 64
    q, g = _blocks(range(8), N, K)
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.01 + 0.001).half().float()
    sc = torch.tensor([[-32.0, 31.0, 12.0, 18.0]]).repeat(N, 1)  # group 0: gcd 1 (the widest); group 1: gcd 6
    w = d * sc.repeat_interleave(16, dim=1).view(N, K // 32, 32) * (q - 4)
    deq = quantize_int8_groups(w.view(N, K))[-1].view(N, K // 32, 32)
    assert ((deq - w).abs()[:, 0] <= _fp16_rounding(w, d)[:, 0]).all()  # 253 levels from -124·d: m rounded
    assert (
        (deq - w).abs()[:, 1] <= _fp16_rounding(w, 6 * d)[:, 1]
    ).all()  # steps of 6·d: 2·(q − 4), 3·(q − 4)


def _sub16_blocks(N: int = 32, K: int = 256, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Q6_K- and Q2_K-shaped weights: a super-block scale d (fp16) times a signed 8-bit (Q6_K) or
    4-bit (Q2_K, with a min) scale per 16 values. name → (w [N, K], the step of each 16 values'
    grid [N, K/16, 1]). (Q3_K's 16-value sub-blocks always share a grid of step d per 32: int8.)"""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(N, K // 256, 1, 1, generator=g) * 1e-3 + 1e-4).half().float()
    dmin = (torch.rand(N, K // 256, 1, 1, generator=g) * 1e-3).half().float()

    def sub(lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi, (N, K // 256, 16, 1), generator=g).float()

    def vals(lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi, (N, K // 256, 16, 16), generator=g).float()

    s6, s2 = sub(-128, 128), sub(1, 16)
    cases = {
        "Q6_K": (d * s6 * (vals(0, 64) - 32), d * s6),
        "Q2_K": (d * s2 * vals(0, 4) - dmin * sub(0, 16), d * s2),
    }
    return {name: (w.view(N, K), step.abs().view(N, K // 16, 1)) for name, (w, step) in cases.items()}


def test_int8x16_keeps_the_grids_of_k_quant_sub_blocks():
    """Q6_K and Q2_K scale every 16 values on their own: int8x16 holds each sub-block on its
    grid (exact but for its step and offset held in fp16), where one grid per 32 rounds them."""
    for name, (w, step) in _sub16_blocks().items():
        *_, deq = quantize_int8_groups(w, 16)
        g = w.view(w.shape[0], -1, 16)
        assert ((deq.view_as(g) - g).abs() <= _fp16_rounding(g, step)).all(), name
        *_, per32 = quantize_int8_groups(w, 32)
        assert (per32 - w).abs().mean() > 10 * (deq - w).abs().mean(), name  # what one grid per 32 costs


def test_own_grid_finds_steps_the_smallest_gap_overstates():
    """A block using only levels 0, 2 and 5 has no gap of one step: the grid is still found."""
    w = torch.tensor([0.0, 2.0, 5.0] * 5 + [5.0] * 17).view(1, 32) * 2**-7  # a step fp16 holds exactly
    deq = quantize_int8_groups(w.repeat(16, 1))[-1]
    assert torch.equal(deq, w.repeat(16, 1))


@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "torch"])
@pytest.mark.parametrize("kind", ["int4", "int8", "int8x16", "mxfp4"])
@pytest.mark.parametrize("M", [1, 3, 4, 7])
def test_kernel_multiplies_by_the_dequantized_weight(kind, vnni, M):
    if vnni and not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    w = q4_1_weight(N=48, K=96)
    qw = QuantizedWeight(kind, w, torch.bfloat16, cpu(vnni=vnni))
    assert qw.vnni == vnni
    x = torch.randn(M, 96).bfloat16()
    ref = x.float() @ qw.dequantized.float().t()
    # the VNNI kernel also rounds the activations to int8 (per 32): a relative error of about 1%
    torch.testing.assert_close(qw.matmul(x).float(), ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: rounded to int8 per group of 32 (scale amax / 127)."""
    g = x.float().view(x.shape[0], -1, 32)
    amax = g.abs().amax(dim=-1, keepdim=True)
    return (torch.round(g * (127 / amax)) * (amax / 127)).view(x.shape)  # the kernel's own rounding


@pytest.mark.parametrize("kind", ["int4", "int8", "int8x16", "mxfp4"])
@pytest.mark.parametrize("M", [1, 2, 5])
def test_low_bit_kernel_sums_exactly_what_the_layout_holds(kind, M):
    """Against the dequantized weight times the int8-rounded activations, the kernel is off only by
    float32 sums and the bf16 output: a layout or sign slip would show far above that."""
    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    torch.manual_seed(3)
    w = torch.randn(64, 256) * 0.05
    w[:16, :32] = 0.0  # a block of one value
    w[16:32, 64:96] *= torch.linspace(0.1, 10, 32)  # halves of very different scales (int8x16's own)
    w[32:48] *= 1e-3  # small ones (MXFP4's powers of two)
    qw = QuantizedWeight(kind, w, torch.bfloat16, cpu())
    x = torch.randn(M, 256).bfloat16()
    x[:, 32:64] = -x[:, 32:64].abs()  # negative activations against the 8-bit sign trick
    x[:, 64:80] *= 8  # the two halves of a group with unequal sums
    if kind == "mxfp4":
        deq = quantize_mxfp4(w)[-1]
    else:
        deq = (
            quantize_int4(w) if kind == "int4" else quantize_int8_groups(w, 16 if kind == "int8x16" else 32)
        )[-1]
    ref = _int8_activations(x) @ deq.t()
    torch.testing.assert_close(qw.matmul(x).float(), ref, atol=2e-4 * ref.abs().max().item(), rtol=8e-3)


@pytest.mark.parametrize("bits", [4, 5, 6, 7, 8, 16])
def test_packing_in_c_writes_the_reference_layout(bits):
    """pack.c (what a model's load runs) writes byte for byte what the PyTorch reference does."""
    if not kernels.available():
        pytest.skip("pytgi's C kernels are not built here")
    g = torch.Generator().manual_seed(bits)
    N, K = 48, 96
    q = torch.randint(0, {4: 16, 6: 64, 7: 32}.get(bits, 256), (N, K), generator=g)
    if bits == 5:  # MXFP4's levels
        q = torch.tensor(FP4_LEVELS)[torch.randint(0, 16, (N, K), generator=g)]
    d, m = torch.rand(N, K // (16 if bits in (6, 16) else 32), 2, generator=g).unbind(-1)
    assert torch.equal(pack_vnni(q, d, m - 0.5, bits), pack_vnni_reference(q, d, m - 0.5, bits))


def q6_k_rows(N: int, K: int, seed: int = 0) -> LayoutRows:
    """A weight on Q6_K's grid in int8x16's terms, as a GGUF file's loader gives it: u = q + 96 (q in
    0..63, zero 32) and m = -128·d per 16 inputs, d fp16 (some tiny, one zero)."""
    g = torch.Generator().manual_seed(seed)
    u = (torch.randint(0, 64, (N, K), generator=g) + 96).to(torch.uint8)
    u[0, :16], u[1, :16] = 96, 159  # both ends
    d = (torch.rand(N, K // 16, generator=g) * 0.01).half().float()
    d[2, 0], d[3, 1] = 0.0, 2.0**-20  # a zero scale, an fp16 subnormal one
    return LayoutRows((N, K), lambda: iter([(u, d, -128 * d)]), six=True)


@pytest.mark.parametrize("M", [1, 2, 5, 9])
def test_q6_k_levels_pack_in_six_bits(M):
    """Q6_K's (and Q3_K's) levels take qgemv.c's 6-bit format, 448 bytes a block where int8x16 takes
    640: the same values (rows read back), the kernel sums what the layout holds, a row's output does
    not depend on the step's other rows, and it is near the 8-bit layout's of the same values."""
    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    rows = q6_k_rows(64, 256)
    qw = QuantizedWeight("int8x16", rows, torch.bfloat16, cpu())
    u, d, m = rows.whole()
    assert qw.bits == 6 and qw.packed.shape[-1] == 448
    assert torch.equal(qw.packed, pack_vnni_reference(u - 96, d, m, 6))
    deq = group_values(u, d, m)
    assert torch.equal(unpack_rows(qw.packed, torch.arange(64), 6), deq)
    torch.manual_seed(M)
    x = torch.randn(M, 256).bfloat16()
    x[:, 64:80] *= 8  # the two halves of a group with unequal sums
    y = qw.matmul(x)
    ref = _int8_activations(x) @ deq.t()
    torch.testing.assert_close(y.float(), ref, atol=2e-4 * ref.abs().max().item(), rtol=8e-3)
    assert all(torch.equal(y[i], qw.matmul(x[i : i + 1])[0]) for i in range(M))  # batch invariant
    if qw.amx:  # a step past the VNNI kernel's: AMX tiles over the spread 8-bit blocks, the same rows
        big = torch.randn(qw.vnni_max_m + 8, 256).bfloat16()
        assert all(torch.equal(qw.matmul(big)[i], qw.matmul(big[i : i + 1])[0]) for i in range(3))
    eight = QuantizedWeight("int8x16", LayoutRows(rows.shape, rows.slices), torch.bfloat16, cpu())
    assert eight.bits == 16
    torch.testing.assert_close(
        y.float(), eight.matmul(x).float(), atol=1e-3 * ref.abs().max().item(), rtol=1e-2
    )


def q5_0_rows(N: int, K: int, seed: int = 0) -> LayoutRows:
    """A weight on Q5_0's grid in int8's terms, as a GGUF file's loader gives it: u = q + 112 (q in
    0..31, zero 16) and m = -128·d per 32 inputs, d fp16 (some tiny, one zero)."""
    g = torch.Generator().manual_seed(seed)
    u = (torch.randint(0, 32, (N, K), generator=g) + 112).to(torch.uint8)
    u[0, :32], u[1, :32] = 112, 143  # both ends
    d = (torch.rand(N, K // 32, generator=g) * 0.01).half().float()
    d[2, 0], d[3, 1] = 0.0, 2.0**-20  # a zero scale, an fp16 subnormal one
    return LayoutRows((N, K), lambda: iter([(u, d, -128 * d)]), six=True, five=True)


@pytest.mark.parametrize("M", [1, 2, 5, 9])
def test_q5_0_levels_pack_in_five_and_a_half_bits(M):
    """Q5_0's levels take qgemv.c's format 7, 352 bytes a block where the 6-bit format takes 448 and
    int8 576: the same values (rows read back), the kernel sums what the layout holds, a row's output
    does not depend on the step's other rows, and it is the 6-bit and 8-bit layouts' of the same values
    (the integer sums are exact in all three)."""
    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    rows = q5_0_rows(64, 256)
    qw = QuantizedWeight("int8", rows, torch.bfloat16, cpu())
    u, d, m = rows.whole()
    assert qw.bits == 7 and qw.packed.shape[-1] == 352
    assert torch.equal(qw.packed, pack_vnni_reference(u - 112, d, -16 * d, 7))
    deq = group_values(u, d, m)
    assert torch.equal(unpack_rows(qw.packed, torch.arange(64), 7), deq)
    torch.manual_seed(M)
    x = torch.randn(M, 256).bfloat16()
    x[:, 64:80] *= 8  # the two halves of a group with unequal sums
    y = qw.matmul(x)
    ref = _int8_activations(x) @ deq.t()
    # the offset's term (m·sx·Σq) cancels most of the levels' (all three layouts give these bits)
    torch.testing.assert_close(y.float(), ref, atol=5e-4 * ref.abs().max().item(), rtol=8e-3)
    assert all(torch.equal(y[i], qw.matmul(x[i : i + 1])[0]) for i in range(M))  # batch invariant
    if qw.amx:  # a step past the VNNI kernel's: AMX tiles over the spread 8-bit blocks, the same rows
        big = torch.randn(qw.vnni_max_m + 8, 256).bfloat16()
        assert all(torch.equal(qw.matmul(big)[i], qw.matmul(big[i : i + 1])[0]) for i in range(3))
    six = QuantizedWeight("int8", LayoutRows(rows.shape, rows.slices, six=True), torch.bfloat16, cpu())
    eight = QuantizedWeight("int8", LayoutRows(rows.shape, rows.slices), torch.bfloat16, cpu())
    assert (six.bits, eight.bits) == (6, 8)
    torch.testing.assert_close(
        y.float(), six.matmul(x).float(), atol=1e-3 * ref.abs().max().item(), rtol=1e-2
    )
    torch.testing.assert_close(
        y.float(), eight.matmul(x).float(), atol=1e-3 * ref.abs().max().item(), rtol=1e-2
    )


def test_vnni_kernel_on_a_model_sized_weight():
    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    w = torch.randn(960, 576) * 0.05
    for kind in ("int4", "int8", "int8x16", "mxfp4"):
        qw = QuantizedWeight(kind, w, torch.bfloat16, cpu())
        x = torch.randn(5, 576).bfloat16()
        y, ref = qw.matmul(x).float(), x.float() @ qw.dequantized.float().t()
        assert ((y - ref).norm() / ref.norm()).item() < 0.02, kind


def test_plan_follows_the_gguf_types(tmp_path):
    (tmp_path / "quantization.json").write_text(
        json.dumps(
            {
                "source": "gguf",
                "tensors": {
                    "model.layers.0.self_attn.q_proj.weight": "Q4_1",
                    "model.embed_tokens.weight": "Q8_0",
                    "model.layers.0.mlp.down_proj.weight": "Q6_K",
                    "model.layers.0.mlp.up_proj.weight": "Q5_0",
                    "model.layers.0.self_attn.o_proj.weight": "Q4_K",
                    "model.norm.weight": "F32",
                },
            }
        )
    )
    assert gguf_plan(tmp_path) == {
        "model.layers.0.self_attn.q_proj.weight": "int4",
        "model.embed_tokens.weight": "int8",
        "model.layers.0.mlp.down_proj.weight": "int8x16",  # K-quant sub-blocks
        "model.layers.0.mlp.up_proj.weight": "int8",
        "model.layers.0.self_attn.o_proj.weight": "int4",
    }
    cpu = torch.device("cpu")
    assert resolve_plan("auto", tmp_path, torch.bfloat16, cpu) == gguf_plan(tmp_path)
    assert resolve_plan("auto", tmp_path, torch.float32, cpu) == {}  # float32 stays exact
    assert resolve_plan("none", tmp_path, torch.bfloat16, cpu) == {}
    assert resolve_plan("int8", tmp_path, torch.bfloat16, cpu) == "int8"
    with pytest.raises(ValueError, match="needs a bfloat16 model"):
        resolve_plan("int4", tmp_path, torch.float32, cpu)
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_plan("fp3", tmp_path, torch.bfloat16, cpu)


@pytest.mark.parametrize("kind", ["int4", "int8", "int8x16", "mxfp4"])
@pytest.mark.parametrize("M", [13, 16, 40, 64, 65, 96])
def test_amx_kernel_multiplies_by_the_dequantized_weight(kind, M):
    """Steps of 13..96 tokens: AMX tiles over the same packed weights (int8 activations, int32 sums
    per group), in tiles of 16 rows."""
    if not kernels.amx_supported():
        pytest.skip("this CPU (or kernel) has no AMX")
    w = torch.randn(96, 160) * 0.05
    qw = QuantizedWeight(kind, w, torch.bfloat16, cpu())
    assert qw.amx and qw.max_m >= M
    x = torch.randn(M, 160).bfloat16()
    y, ref = qw.matmul(x).float(), x.float() @ qw.dequantized.float().t()
    assert ((y - ref).norm() / ref.norm()).item() < 0.02  # int8 activations, as the VNNI kernel's


@pytest.mark.parametrize("kind", ["int4", "int8", "int8x16", "mxfp4"])
def test_every_row_is_the_same_whatever_the_step(kind):
    """Batch invariance: the AMX tiles' rows equal the VNNI kernel's bit for bit, and a row's output
    does not depend on how many rows share the step (the default serves every step size)."""
    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    torch.manual_seed(1)
    w = torch.randn(96, 320) * 0.05
    qw = QuantizedWeight(kind, w, torch.bfloat16, cpu())
    assert qw.max_m >= 1 << 20
    x = torch.randn(150, 320).bfloat16()
    full = qw.matmul(x)
    for M in (1, 3, 12, 13, 16, 17, 64, 65, 100):
        assert torch.equal(qw.matmul(x[:M]), full[:M]), M
        assert torch.equal(qw.matmul(x[M : M + 20]), full[M : M + 20]), M
    if kernels.amx_supported():
        for M in (1, 2, 5, 9, 15, 16, 33):  # tiles of M rows below 16, of 16 above
            vnni = kernels.lowbit_matmul(x[:M].contiguous(), qw.packed, 96, qw.bits, amx=False)
            assert torch.equal(
                kernels.lowbit_matmul(x[:M].contiguous(), qw.packed, 96, qw.bits, amx=True), vnni
            )


def test_amx_kernel_leaves_pytorch_bf16_matmuls_alone():
    """PyTorch's bf16 matmuls use AMX tiles too (oneDNN): ours restore the tile configuration."""
    if not kernels.amx_supported():
        pytest.skip("this CPU (or kernel) has no AMX")
    a, b = torch.randn(256, 576).bfloat16(), torch.randn(1024, 576).bfloat16()
    before = torch.nn.functional.linear(a, b)
    qw = QuantizedWeight("int4", torch.randn(256, 576), torch.bfloat16, cpu())
    for _ in range(3):
        qw.matmul(torch.randn(32, 576).bfloat16())
        assert torch.equal(torch.nn.functional.linear(a, b), before)


def test_without_bf16_in_the_cpu_the_low_bit_kernel_serves_every_step():
    """AVX2 emulates bf16 GEMMs (several times slower than the low-bit kernel at any step size), so
    prefill chunks stay on the packed weights there; with AVX512_BF16 big steps take bf16 GEMMs."""
    emulated = Kernels(fused=True, vnni=True, native_bf16=False, batch_invariant=False)
    assert emulated.lowbit_max_m(True, False) >= 1 << 20
    assert emulated.lowbit_max_m(False, False) == emulated.limits.lowbit_torch
    native = Kernels(fused=True, vnni=True, native_bf16=True, batch_invariant=False)
    assert native.lowbit_max_m(True, False) == native.limits.lowbit_vnni
    assert Kernels(fused=True, vnni=True).lowbit_max_m(True, False) >= 1 << 20  # batch invariant: all sizes


# -- a bf16 model's weights as they are (bf16gemm.c) -------------------------------------------------
bf16_kernel = pytest.mark.skipif(
    not kernels.bf16gemm_supported(), reason="no bf16gemm.c here (AVX2 or AVX-512 BF16)"
)


def bf16_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16gemm.c's sums, spelled out: per output, over input pairs in order, the odd product then the
    even one added to a float32 sum (vdpbf16ps), denormals flushed (none arise here)."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(w.shape[1] // 2):
        acc = acc + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
        acc = acc + xf[:, 2 * p, None] * wf[None, :, 2 * p]
    return acc.bfloat16()


@bf16_kernel
@pytest.mark.parametrize("M", [1, 3, 4, 5, 17])
def test_bf16_kernel_sums_the_weights_as_they_are(M):
    """The same bits as the pairwise float32 sums written out (so the AVX2 path, run on this file by
    test_portable_kernels.py, gives the AVX-512 BF16 path's bits too), for tile and row counts that
    fill the kernel's blocks and that do not (48 rows: 3 tiles of 16)."""
    g = torch.Generator().manual_seed(M)
    w, x = torch.randn(48, 64, generator=g).bfloat16(), torch.randn(M, 64, generator=g).bfloat16()
    qw = QuantizedWeight("bf16", w, torch.bfloat16, cpu())
    assert torch.equal(qw.matmul(x), bf16_reference(x, w))
    assert torch.equal(qw.dequantized, w)  # exact to the checkpoint: nothing re-quantized


@bf16_kernel
def test_bf16_kernel_rows_do_not_depend_on_the_step():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 576, generator=g).bfloat16(), torch.randn(37, 576, generator=g).bfloat16()
    qw = QuantizedWeight("bf16", w, torch.bfloat16, cpu())
    together = qw.matmul(x)
    assert all(torch.equal(qw.matmul(x[i : i + 1]), together[i : i + 1]) for i in range(37))
    ref = x.float() @ w.float().t()
    assert ((together.float() - ref).norm() / ref.norm()).item() < 0.01


@bf16_kernel
@pytest.mark.parametrize("T", [1, 5])
def test_per_head_bf16_matmuls_read_strided_rows_and_write_into_wider_ones(T):
    """Latent attention's per-head projections (`kernels.bf16_matmul_heads`): each head's rows, read
    from a slice of wider rows and written into one, are the single matmul's bits, whatever T."""
    from pytgi.engine.models.quant import pack_bf16

    g = torch.Generator().manual_seed(T)
    H, N, K = 3, 48, 64
    w = torch.randn(H, N, K, generator=g).bfloat16()
    wide = torch.randn(T, H, K + 32, generator=g).bfloat16()  # q's [nope, rope] rows: nope read
    out = torch.zeros(T, H, N + 16, dtype=torch.bfloat16)  # [latent, rope] rows: latent written
    kernels.bf16_matmul_heads(wide[..., :K], pack_bf16(w.reshape(H * N, K)), N, out[..., :N])
    for h in range(H):
        assert torch.equal(out[:, h, :N], bf16_reference(wide[:, h, :K], w[h]))
    assert out[..., N:].abs().sum() == 0  # the rest of each row left alone
    alone = torch.zeros(1, H, N, dtype=torch.bfloat16)
    kernels.bf16_matmul_heads(wide[-1:, :, :K], pack_bf16(w.reshape(H * N, K)), N, alone)
    assert torch.equal(alone[0], out[-1, :, :N])


def test_a_bf16_models_plan(tmp_path):
    """A Hugging Face model (no quantization.json) in bf16 keeps its weights, on bf16gemm.c where it
    builds; every step size takes it when batch invariant, else steps up to the crossover."""
    cpu_dev = torch.device("cpu")
    want = "bf16" if kernels.bf16gemm_supported() else {}
    assert resolve_plan("auto", tmp_path, torch.bfloat16, cpu_dev) == want
    assert resolve_plan("auto", tmp_path, torch.float32, cpu_dev) == {}
    assert resolve_plan("none", tmp_path, torch.bfloat16, cpu_dev) == {}
    assert Kernels(batch_invariant=True).bf16_max_m() >= 1 << 20
    assert Kernels(batch_invariant=False, native_bf16=True).bf16_max_m() == Kernels().limits.bf16gemm
    assert Kernels(batch_invariant=False, native_bf16=False).bf16_max_m() >= 1 << 20  # oneDNN emulates bf16


def test_mxfp4_grid_holds_e2m1_values_and_unpacks_from_codes():
    """MXFP4's values (e2m1 times a power of two per 32) are levels 12 + 2·value on a grid of step half
    that power: the grid holds every such value exactly, the packed layout stores their codes, and rows
    read back from it (an embedding table's path) are those values."""
    g = torch.Generator().manual_seed(7)
    fp4 = torch.tensor(
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    )
    codes = torch.randint(0, 16, (32, 128), generator=g)
    # steps 2^-23 (fp16's subnormals) .. 2^15 (its largest), and a block of zeros
    scale = torch.exp2(torch.randint(-22, 17, (32, 4, 1), generator=g).float())
    w = (fp4[codes].view(32, 4, 32) * scale).view(32, 128)
    w[3, 32:64] = 0
    q, d, m, deq = quantize_mxfp4(w)
    assert torch.equal(deq, w) and int(q.min()) >= 0 and int(q.max()) <= 24
    assert torch.equal(m, -12 * d)
    d[3, 1] = m[3, 1] = 0  # a step of zero: exponent byte 0
    packed = pack_vnni(q, d, m, 5)
    assert packed.shape[-1] == 272  # the 4-bit codes, then each row's e8m0 exponent: 4.25 bits a weight
    assert torch.equal(packed, pack_vnni_reference(q, d, m, 5))
    assert torch.equal(unpack_rows(packed, torch.arange(32), 5), w)


def test_int8_only_where_the_cpu_kernels_read_whole_inputs():
    """The CPU's int8 kernels read a row's inputs 16 at a time: a linear of 24 inputs (a DeepSeek-shaped
    tiny q_lora_rank) read past its end (garbage at one token, a crash at five), so it stays float."""
    for kind in ("int8", "int8x16"):
        assert not can_quantize(kind, torch.zeros(48, 24)) and not can_quantize(kind, torch.zeros(48, 8))
        assert can_quantize(kind, torch.zeros(48, 48)) and can_quantize(kind, torch.zeros(48, 96))
