"""The CUDA path's low-bit matmuls (`pytgi.engine.kernels.gpu_quant`) against the dequantized weights.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1): float32
activations must give the float32 reference to rounding; bf16 ones are checked loosely there (the
interpreter rounds bf16 its own way) and tightly on a GPU (`benchmarks/gpu.sh tests`).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from pytgi.engine.kernels import gpu_quant
from pytgi.engine.models.quant import GpuQuantizedWeight, LayoutRows, quantize_int4

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"


def levels(N: int, K: int, bits: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16 if bits == 4 else 256, (N, K), generator=g)
    d = (torch.rand(N, K // group, generator=g) * 0.01).half().float()
    m = (-torch.rand(N, K // group, generator=g) * 0.05).half().float()
    w = (u.float().view(N, K // group, group) * d[..., None] + m[..., None]).view(N, K)
    return u, d, m, w


def weight(u, d, m, bits, group):
    qw, sc = gpu_quant.pack_levels(u, d, m, bits)
    return gpu_quant.LowbitWeight(qw.to(DEVICE), sc.to(DEVICE), tuple(u.shape), bits, group)


def close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (y.float().cpu() - ref).abs().max() / ref.abs().max()
    limit = 1e-5 if dtype == torch.float32 else (2e-2 if not ON_GPU else 8e-3)
    assert err < limit, (err, dtype)


def test_pack_levels_puts_input_j_and_j_plus_16_in_one_byte():
    u = torch.randint(0, 16, (3, 64), generator=torch.Generator().manual_seed(7))
    qw, sc = gpu_quant.pack_levels(u, torch.ones(3, 2), torch.zeros(3, 2), 4)
    assert qw.shape == (3, 32) and sc.shape == (3, 2, 2) and sc.dtype == torch.float16
    for g in range(2):  # byte g·16 + j of a row: input g·32 + j (low nibble), g·32 + 16 + j (high)
        for j in range(16):
            assert torch.equal(qw[:, g * 16 + j].long(), u[:, g * 32 + j] | (u[:, g * 32 + 16 + j] << 4))


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 32), (8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 5, 17, 70])
def test_lowbit_matmul_equals_the_dequantized_weight(bits, group, dtype, M):
    N, K = 48, 320  # neither a multiple of the tiles
    u, d, m, w = levels(N, K, bits, group, seed=M)
    W = weight(u, d, m, bits, group)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.float() @ w.to(dtype).float().t()
    y = W.matmul(x.to(DEVICE))
    assert y.dtype == dtype and y.shape == (M, N)
    close(y, ref, dtype)


def test_small_steps_split_the_inputs_and_add_in_a_fixed_order():
    N, K = 16, 2048
    u, d, m, w = levels(N, K, 4, 32)
    W = weight(u, d, m, 4, 32)
    x = torch.randn(2, K).to(DEVICE)
    for bm in (1, 16):  # the GEMV kernel and the tensor cores'
        whole = W.matmul(x, blocks=(bm, 16, 256, 1, 4, 4))
        split = W.matmul(x, blocks=(bm, 16, 256, 4, 4, 4))
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
        assert torch.equal(split, W.matmul(x, blocks=(bm, 16, 256, 4, 4, 4)))  # the same bits every run
        close(split, x.cpu() @ w.t(), torch.float32)


def test_big_prompt_steps_take_the_dequantized_weight(monkeypatch):
    monkeypatch.setattr(gpu_quant, "DENSE_M", 8)
    u, d, m, w = levels(32, 64, 4, 32)
    W = weight(u, d, m, 4, 32)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(W.dequantize(torch.float32).cpu(), w)
        x = torch.randn(20, 64).to(dtype)
        close(W.matmul(x.to(DEVICE)), x.float() @ w.to(dtype).float().t(), dtype)


def test_fp8_bytes_read_as_e4m3():
    """Every finite e4m3fn byte (the kernel has no NaN: checkpoints hold none)."""
    b = torch.arange(256, dtype=torch.uint8)
    finite = b[(b & 0x7F) != 0x7F]
    qw = finite.view(1, -1).repeat(16, 1)[:, :224].contiguous()
    W = gpu_quant.LowbitWeight(
        qw.to(DEVICE), torch.ones(16, 1, device=DEVICE), (16, 224), 0, fp8_block=(1, 224)
    )
    want = qw.view(torch.float8_e4m3fn).float()
    assert torch.equal(W.dequantize(torch.float32).cpu(), want)


@pytest.mark.parametrize("block", [None, (32, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 9])
def test_fp8_matmul_per_channel_and_block_scales(block, dtype, M):
    N, K = 64, 256
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.02
    q, s = gpu_quant.quantize_fp8(w, block)
    b = block or (1, K)
    assert s.shape == (N // b[0], K // b[1])
    ref_w = gpu_quant.fp8_values(q, s, b)
    assert (ref_w - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 bits of mantissa
    W = gpu_quant.LowbitWeight(q.to(DEVICE), s.to(DEVICE), (N, K), 0, fp8_block=b)
    assert torch.equal(W.dequantize(torch.float32).cpu(), ref_w)
    x = torch.randn(M, K).to(dtype)
    close(W.matmul(x.to(DEVICE)), x.float() @ ref_w.to(dtype).float().t(), dtype)


def test_gpu_quantized_weight_from_levels_by_rows_or_from_a_float_weight():
    N, K = 48, 64
    u, d, m, w = levels(N, K, 4, 32)
    parts = [(u[:16], d[:16], m[:16]), (u[16:], d[16:], m[16:])]
    Q = GpuQuantizedWeight("int4", LayoutRows((N, K), lambda: iter(parts)), torch.float32, DEVICE)
    assert Q.packed.shape == (N, K // 2) and Q.dequantized.numel() == 0
    x = torch.randn(3, K)
    close(Q.matmul(x.to(DEVICE)), x @ w.t(), torch.float32)
    f = torch.randn(N, K) * 0.02
    Q = GpuQuantizedWeight("int4", f.to(DEVICE), torch.float32, DEVICE)
    close(Q.matmul(x.to(DEVICE)), x @ quantize_int4(f)[3].t(), torch.float32)
    Q = GpuQuantizedWeight("fp8", f.to(DEVICE), torch.float32, DEVICE)
    q, s = gpu_quant.quantize_fp8(f)
    close(Q.matmul(x.to(DEVICE)), x @ gpu_quant.fp8_values(q, s, (1, K)).t(), torch.float32)


def test_big_fp8_steps_quantize_the_activations_per_row():
    """W8A8 through torch._scaled_mm (where it runs: its CPU build too): each row of x on its own e4m3
    grid, so a step's rows are those of the FP8 product of their own values."""
    N, K, M = 32, 64, 40
    w = torch.randn(N, K) * 0.02
    q, s = gpu_quant.quantize_fp8(w)
    W = gpu_quant.LowbitWeight(q.to(DEVICE), s.to(DEVICE), (N, K), 0, fp8_block=(1, K))
    x = torch.randn(M, K).to(torch.bfloat16)
    xs = x.float().abs().amax(dim=1, keepdim=True) / 448
    xq = (x.float() / xs).to(torch.float8_e4m3fn).float() * xs
    ref = xq @ gpu_quant.fp8_values(q, s, (1, K)).t()
    y = W.matmul(x.to(DEVICE))
    assert W.scaled_mm  # it ran
    close(y, ref, torch.bfloat16)
