"""The encoders' kernels (encoder.c) against float64 references: the attention kernel against a softmax
attention, the encoder layer's attention on whichever path this build takes (the kernel, else
PyTorch's SDPA), bf16's bias + GELU and bias + residual + LayerNorm, and a bf16 layer on them against
the same layer in float32."""

import math

import pytest
import torch

from pytgi.engine import kernels
from pytgi.engine.models.encoder import EncoderLayer

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler")


def reference(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    L = qkv.shape[0]
    q, k, v = qkv.double().view(L, 3, heads, -1).unbind(1)  # [L, H, D] each
    w = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1]), dim=-1)
    return torch.einsum("hij,jhd->ihd", w, v).reshape(L, -1)


LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 33, 130, 257]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 3e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads, head_dim", [(12, 32), (4, 64), (2, 128), (3, 16)])
def test_the_kernel_equals_softmax_attention(dtype, tol, heads, head_dim):
    if not kernels.encoder_attention_supported(dtype, head_dim):
        pytest.skip(f"no encoder attention kernel for {dtype} here")
    g = torch.Generator().manual_seed(0)
    for L in LENGTHS:
        qkv = (torch.randn(L, 3 * heads * head_dim, generator=g) * 2).to(dtype)
        got = kernels.encoder_attention(qkv, heads, 1 / math.sqrt(head_dim))
        assert got.dtype == dtype and got.shape == (L, heads * head_dim)
        torch.testing.assert_close(got.double(), reference(qkv, heads), atol=tol, rtol=tol)


def test_a_head_size_the_kernel_does_not_take_is_not_supported():
    assert not kernels.encoder_attention_supported(torch.float32, 24)
    assert not kernels.encoder_attention_supported(torch.bfloat16, 24)
    assert not kernels.encoder_attention_supported(torch.float16, 32)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 3e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(
    "hidden, heads", [(64, 4), (48, 2)]
)  # head size 16: the kernel where built; 24: SDPA
def test_the_layers_attention_is_each_prompts_own(dtype, tol, hidden, heads):
    """Whatever path runs, a prompt's attention output equals the reference over its own rows alone."""
    torch.manual_seed(0)
    layer = EncoderLayer(hidden, heads, 4 * hidden, 1e-12, "gelu").to(dtype)
    lens = [5, 17, 1, 40]
    x = torch.randn(sum(lens), hidden).to(dtype)
    with torch.inference_mode():
        qkv = layer.qkv(x)
        ctx = layer.attention(qkv, lens)
    assert ctx.shape == (sum(lens), hidden)
    for part, rows in zip(qkv.split(lens), ctx.split(lens), strict=True):
        torch.testing.assert_close(rows.double(), reference(part, heads), atol=tol, rtol=tol)


@pytest.mark.parametrize("N", [384, 37])  # 37: the rows' tails past the last 16 values
def test_bias_gelu_and_bias_residual_norm_equal_float64(N):
    g = torch.Generator().manual_seed(1)
    T = 5
    x, residual = (torch.randn(T, N, generator=g) * 3).bfloat16(), torch.randn(T, N, generator=g).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16()
    v = x.double() + bias.double()
    want = v * 0.5 * (1 + torch.erf(v / math.sqrt(2)))
    got = kernels.bias_gelu_(x.clone(), bias)
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=8e-3)  # one bf16 rounding
    norm = torch.nn.LayerNorm(N, eps=1e-12)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(N, generator=g) + 0.5)
        norm.bias.copy_(torch.randn(N, generator=g))
    norm = norm.bfloat16()
    out = kernels.bias_residual_norm(x, bias, residual, norm)
    h = x.double() + bias.double() + residual.double()
    want = torch.nn.functional.layer_norm(h, (N,), norm.weight.double(), norm.bias.double(), 1e-12)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=8e-3)


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_a_bf16_layer_on_the_kernels_is_close_to_float32(act):
    """The fused bf16 layer (GELU fused, or the activation left to PyTorch) against the float32 layer."""
    torch.manual_seed(0)
    layer = EncoderLayer(64, 4, 256, 1e-12, act)
    lens = [3, 30, 9]
    x = torch.randn(sum(lens), 64)
    with torch.inference_mode():
        want = layer(x, lens)
        got = layer.bfloat16()(x.bfloat16(), lens).float()
    cos = torch.nn.functional.cosine_similarity(got, want)
    assert cos.min() > 0.999, cos
