"""The mixture-of-experts MLP without a model: routing and weighting against a token-by-token
reference, and the two checkpoint layouts (one tensor per expert, or all experts stacked)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pytgi.models.moe import SparseMoE

H, INTER, E = 16, 24, 5


def experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, generator=g), torch.randn(E, INTER, H, generator=g) * 0.2,
            torch.randn(E, INTER, H, generator=g) * 0.2, torch.randn(E, H, INTER, generator=g) * 0.2)


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
        expected.append(sum(wi * (down[e] @ (F.silu(gate[e] @ t) * (up[e] @ t))) for wi, e in zip(w, idx.tolist())))
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
