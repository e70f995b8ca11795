"""The mixture-of-experts MLP without a model: routing and weighting against a token-by-token
reference, and the two checkpoint layouts (one tensor per expert, or all experts stacked)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pytgi.engine import kernels
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.moe import SparseMoE
from pytgi.engine.models.quant import QuantizedWeight

H, INTER, E = 16, 24, 5


def experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(E, H, generator=g),
        torch.randn(E, INTER, H, generator=g) * 0.2,
        torch.randn(E, INTER, H, generator=g) * 0.2,
        torch.randn(E, H, INTER, generator=g) * 0.2,
    )


def per_expert_moe(norm_topk: bool) -> SparseMoE:
    router, gate, up, down = experts()
    moe = SparseMoE(H, INTER, E, top_k=2, norm_topk=norm_topk)
    moe.gate.weight.data.copy_(router)
    for e in range(E):
        moe.load_experts(f"experts.{e}.w1.weight", gate[e])
        moe.load_experts(f"experts.{e}.w3.weight", up[e])
        moe.load_experts(f"experts.{e}.w2.weight", down[e])
    return moe


@pytest.mark.parametrize("norm_topk", [True, False])
def test_each_token_gets_its_top_k_experts_weighted(norm_topk):
    router, gate, up, down = experts()
    moe = per_expert_moe(norm_topk)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    expected = []
    for t in x:
        p = (router @ t).softmax(-1)
        w, idx = p.topk(2)
        w = w / w.sum() if norm_topk else w
        expected.append(
            sum(wi * (down[e] @ (F.silu(gate[e] @ t) * (up[e] @ t))) for wi, e in zip(w, idx.tolist()))
        )
    torch.testing.assert_close(moe(x), torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_stacked_and_per_expert_checkpoints_load_the_same():
    _, gate, up, down = experts()
    stacked = SparseMoE(H, INTER, E, top_k=2, norm_topk=True)
    assert stacked.load_experts("experts.gate_up_proj", torch.cat([gate, up], dim=1)) == ["gate_up"]
    assert stacked.load_experts("experts.down_proj", down) == ["down"]
    one_by_one = per_expert_moe(True)
    assert torch.equal(stacked.gate_up, one_by_one.gate_up) and torch.equal(stacked.down, one_by_one.down)
    with pytest.raises(ValueError, match="unexpected expert weight"):
        stacked.load_experts("experts.0.w9.weight", gate[0])


def packed_moe(kinds: tuple[str, str], oai: bool = False) -> SparseMoE:
    """Experts packed for the low-bit kernels (as a GGUF model's are), at sizes those take; `oai`:
    gpt-oss's, with biases and the clamped SwiGLU."""
    h, inter, e = 64, 32, 6
    g = torch.Generator().manual_seed(7)
    moe = SparseMoE(h, inter, e, top_k=3, norm_topk=True, oai=(1.702, 1.5) if oai else None)
    moe.gate.weight.data.copy_(torch.randn(e, h, generator=g))
    if oai:
        assert moe.gate.bias is not None and moe.gate_up_bias is not None and moe.down_bias is not None
        for b in (moe.gate.bias, moe.gate_up_bias, moe.down_bias):
            b.data.copy_(torch.randn(b.shape, generator=g) * 0.5)
    moe.to(torch.bfloat16)
    cpu = Kernels.for_device(torch.device("cpu"), torch.bfloat16)
    moe.packed = [
        (
            QuantizedWeight(kinds[0], torch.randn(2 * inter, h, generator=g) * 0.2, torch.bfloat16, cpu),
            QuantizedWeight(kinds[1], torch.randn(h, inter, generator=g) * 0.2, torch.bfloat16, cpu),
        )
        for _ in range(e)
    ]
    moe.fuse()
    return moe


@pytest.mark.parametrize(
    "kinds, oai",
    [
        (("int4", "int4"), False),
        (("int4", "int8x16"), False),
        (("int8", "int4"), False),
        (("mxfp4", "mxfp4"), True),  # gpt-oss's
        (("int8", "int8"), True),
    ],
)
def test_one_c_call_runs_the_experts_as_the_step_by_step_path(kinds, oai):
    """moe.c against the expert-by-expert PyTorch loop over the same packed weights: the same matmuls,
    the sums in another order; and a token's output does not depend on the rest of the step."""
    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    moe = packed_moe(kinds, oai)
    assert moe.fused is not None
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    fused = moe(x)
    fused_alone = torch.cat([moe(x[i : i + 1]) for i in range(len(x))])
    fused_ref, moe.fused = moe.fused, None
    stepwise = moe(x)
    moe.fused = fused_ref
    assert torch.equal(fused, fused_alone)
    torch.testing.assert_close(
        fused.float(), stepwise.float(), atol=0.02 * stepwise.abs().max().item(), rtol=0.02
    )


def test_gpt_oss_down_bias_comes_from_the_first_rank_alone():
    """With tensor parallelism each rank's experts give a partial sum; gpt-oss's down bias belongs in
    one of them only. A rank whose slice does not start at 0 leaves out each token's weighted biases."""
    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    moe = packed_moe(("mxfp4", "mxfp4"), oai=True)
    assert moe.fused is not None and moe.down_bias is not None
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    first = moe(x)
    moe.start = 32  # where a second rank's slice of each expert starts
    other = moe(x)
    moe.start = 0
    logits, chosen = F.linear(x, moe.gate.weight, moe.gate.bias).float().topk(3, dim=-1)
    bias = (moe.down_bias[chosen].float() * logits.softmax(-1)[..., None]).sum(1)
    torch.testing.assert_close((first.float() - other.float()), bias, atol=0.05, rtol=0.05)
