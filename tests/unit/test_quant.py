"""Weight-only quantization: grids, kernels and the per-tensor plan."""

import json

import pytest
import torch

from pytgi.models.quant import QuantizedWeight, gguf_plan, quantize_int4, quantize_int8, resolve_plan


def q4_1_weight(N=32, K=64, seed=0):
    """A weight on Q4_1's grid: per 32 values, d·q + m with q in 0..15 using both ends."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(N, K // 32, 1, generator=g) * 0.01 + 0.001
    m = -torch.rand(N, K // 32, 1, generator=g) * 0.05
    return (q * d + m).view(N, K)


def test_int4_grid_holds_q4_1_weights():
    w = q4_1_weight()
    _, _, deq = quantize_int4(w)
    torch.testing.assert_close(deq, w, atol=1e-6, rtol=0)


def test_int8_is_per_channel_and_close():
    w = torch.randn(16, 64)
    q, scale, deq = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (16,)
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-6


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_kernel_multiplies_by_the_dequantized_weight(kind):
    w = q4_1_weight(N=48, K=96)
    qw = QuantizedWeight(kind, w, torch.bfloat16)
    x = torch.randn(3, 96).bfloat16()
    ref = x.float() @ qw.dequantized.float().t()
    torch.testing.assert_close(qw.matmul(x).float(), ref, atol=0.05, rtol=0.02)


def test_plan_follows_the_gguf_types(tmp_path):
    (tmp_path / "quantization.json").write_text(json.dumps({"source": "gguf", "tensors": {
        "model.layers.0.self_attn.q_proj.weight": "Q4_1", "model.embed_tokens.weight": "Q8_0",
        "model.norm.weight": "F32"}}))
    assert gguf_plan(tmp_path) == {"model.layers.0.self_attn.q_proj.weight": "int4",
                                   "model.embed_tokens.weight": "int8"}
    cpu = torch.device("cpu")
    assert resolve_plan("auto", tmp_path, torch.bfloat16, cpu) == gguf_plan(tmp_path)
    assert resolve_plan("auto", tmp_path, torch.float32, cpu) == {}  # float32 stays exact
    assert resolve_plan("none", tmp_path, torch.bfloat16, cpu) == {}
    assert resolve_plan("int8", tmp_path, torch.bfloat16, cpu) == "int8"
    with pytest.raises(ValueError, match="needs a bfloat16 model"):
        resolve_plan("int4", tmp_path, torch.float32, cpu)
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_plan("fp3", tmp_path, torch.bfloat16, cpu)
