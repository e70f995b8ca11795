"""The mixture-of-experts MLP without a model: routing and weighting against a token-by-token
reference, and the two checkpoint layouts (one tensor per expert, or all experts stacked); the
routers beyond softmax top-k (`Routing`) against transformers' own (DeepSeek-V2/V3, GLM-4.5,
MiniMax-M2) and a token-by-token reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytgi.engine import kernels
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.moe import Routing, SparseMoE, route
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


def packed_moe(
    kinds: tuple[str, str], oai: bool = False, routing: Routing | None = None, activation: str = "silu"
) -> SparseMoE:
    """Experts packed for the low-bit kernels (as a GGUF model's are), at sizes those take; `oai`:
    gpt-oss's, with biases and the clamped SwiGLU; `routing`: a router beyond softmax top-k;
    `activation` "relu2": ungated experts (up rows alone)."""
    h, inter, e = 64, 32, 6
    g = torch.Generator().manual_seed(7)
    oai_args = (1.702, 1.5) if oai else None
    moe = SparseMoE(h, inter, e, 3, True, oai=oai_args, routing=routing, activation=activation)
    first = inter if activation == "relu2" else 2 * inter
    moe.gate.weight.data.copy_(torch.randn(e, h, generator=g))
    if moe.gate.e_score_correction_bias is not None:
        moe.gate.e_score_correction_bias.data.copy_(torch.randn(e, generator=g) * 0.3)
    if oai:
        assert moe.gate.bias is not None and moe.gate_up_bias is not None and moe.down_bias is not None
        for b in (moe.gate.bias, moe.gate_up_bias, moe.down_bias):
            b.data.copy_(torch.randn(b.shape, generator=g) * 0.5)
    moe.to(torch.bfloat16)
    cpu = Kernels.for_device(torch.device("cpu"), torch.bfloat16)
    moe.packed = [
        (
            QuantizedWeight(kinds[0], torch.randn(first, h, generator=g) * 0.2, torch.bfloat16, cpu),
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


# -- routers beyond softmax top-k ------------------------------------------------------------------
def reference_route(
    logits: torch.Tensor, routing: Routing, top_k: int, norm_topk: bool, bias: torch.Tensor | None
) -> list[dict[int, float]]:
    """Token by token, as the rule reads: score, correct, keep the best groups, choose, weigh."""
    out = []
    n = logits.shape[1] // routing.n_group
    for row in logits.double():
        scores = row.softmax(-1) if routing.scoring == "softmax" else row.sigmoid()
        choice = scores + (bias.double() if bias is not None else 0)
        groups = [choice[g * n : (g + 1) * n].sort(descending=True).values for g in range(routing.n_group)]
        rank = [float(v[:2].sum() if routing.group_score == "top2" else v[0]) for v in groups]
        kept = sorted(range(routing.n_group), key=lambda g: -rank[g])[: routing.topk_group]
        allowed = [e for e in range(len(row)) if e // n in kept]
        chosen = sorted(allowed, key=lambda e: -float(choice[e]))[:top_k]
        total = sum(float(scores[e]) for e in chosen) if norm_topk else 1.0
        out.append({e: float(scores[e]) / total * routing.scale for e in chosen})
    return out


ROUTINGS = {
    "deepseek-v3": Routing("sigmoid", correction_bias=True, n_group=4, topk_group=2, scale=2.5),
    "deepseek-v2": Routing("softmax", n_group=4, topk_group=2, group_score="max", scale=16.0),
    "minimax-m2": Routing("sigmoid", correction_bias=True),
    "softmax-scaled": Routing(scale=0.5),
}


@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("norm_topk", [True, False])
def test_routers_choose_and_weigh_as_the_rule_reads(name, norm_topk):
    routing = ROUTINGS[name]
    g = torch.Generator().manual_seed(3)
    logits, random_bias = torch.randn(40, 16, generator=g) * 2, torch.randn(16, generator=g) * 0.5
    bias = random_bias if routing.correction_bias else None
    weights, experts = route(logits, routing, 3, norm_topk, bias)
    for got_w, got_e, want in zip(weights, experts, reference_route(logits, routing, 3, norm_topk, bias)):
        got = dict(zip(got_e.tolist(), got_w.tolist()))
        assert got.keys() == want.keys()
        for e, w in want.items():
            assert got[e] == pytest.approx(w, rel=1e-5)


def test_the_correction_bias_steers_the_choice_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    routing = Routing("sigmoid", correction_bias=True)
    weights, experts = route(logits, routing, 1, False, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert experts.tolist() == [[3]] and weights.item() == pytest.approx(torch.tensor(-1.0).sigmoid().item())


def transformers_router(
    kind: str, E: int, H: int, top_k: int
) -> tuple[Any, Routing, bool, torch.Tensor | None]:
    """transformers' own router module for `kind`, its weight and bias random (float32)."""
    common = dict(hidden_size=H, num_experts_per_tok=top_k, num_attention_heads=2, num_key_value_heads=2)
    g = torch.Generator().manual_seed(11)
    cfg: Any
    router: Any
    if kind == "deepseek-v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        cfg = DeepseekV3Config(
            n_routed_experts=E,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            **common,
        )
        router = DeepseekV3TopkRouter(cfg)
        routing = Routing("sigmoid", correction_bias=True, n_group=4, topk_group=2, scale=2.5)
        norm = True
    elif kind == "glm4-moe":
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

        cfg = Glm4MoeConfig(
            n_routed_experts=E,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            **common,
        )
        router = Glm4MoeTopkRouter(cfg)
        routing = Routing("sigmoid", correction_bias=True, n_group=2, topk_group=1, scale=1.5)
        norm = False
    elif kind == "deepseek-v2":
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        cfg = DeepseekV2Config(
            n_routed_experts=E,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=16.0,
            **common,
        )
        router = DeepseekV2TopkRouter(cfg)
        routing = Routing(n_group=4, topk_group=2, group_score="max", scale=16.0)
        norm = False
    else:
        from transformers import MiniMaxM2Config
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

        router = MiniMaxM2TopKRouter(MiniMaxM2Config(num_local_experts=E, **common))
        routing, norm = Routing("sigmoid", correction_bias=True), True
    router.weight.data.copy_(torch.randn(E, H, generator=g))
    bias = torch.randn(E, generator=g) * 0.5
    if hasattr(router, "e_score_correction_bias"):
        router.e_score_correction_bias.copy_(bias)
    return router, routing, norm, bias if routing.correction_bias else None


@pytest.mark.parametrize("kind", ["deepseek-v3", "glm4-moe", "deepseek-v2", "minimax-m2"])
def test_routers_match_transformers(kind):
    E, top_k = 16, 4
    router, routing, norm, bias = transformers_router(kind, E, H, top_k)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = router(x, bias) if kind == "minimax-m2" else router(x)
    want_w, want_e = out[1], out[2]
    moe = SparseMoE(H, INTER, E, top_k, norm, routing=routing)
    moe.gate.weight.data.copy_(router.weight)
    if bias is not None:
        assert moe.gate.e_score_correction_bias is not None
        moe.gate.e_score_correction_bias.data.copy_(bias)
    weights, experts = moe.route(x)
    got_e, order = experts.sort(dim=-1)
    ref_e, ref_order = want_e.sort(dim=-1)
    assert torch.equal(got_e, ref_e)
    torch.testing.assert_close(weights.gather(1, order), want_w.float().gather(1, ref_order))


def test_grouped_sigmoid_moe_with_shared_experts_matches_a_token_by_token_reference():
    """The whole layer: routed experts weighted by the router's rule, plus DeepSeek's ungated shared
    experts (the checkpoint's `shared_experts.*`)."""
    _, gate, up, down = experts()
    E8 = 8
    g = torch.Generator().manual_seed(9)
    router = torch.randn(E8, H, generator=g)
    gate, up, down = (torch.randn(E8, *t.shape[1:], generator=g) * 0.2 for t in (gate, up, down))
    bias = torch.randn(E8, generator=g) * 0.3
    routing = Routing("sigmoid", correction_bias=True, n_group=4, topk_group=2, scale=2.0)
    moe = SparseMoE(H, INTER, E8, 2, True, shared_inter=2 * INTER, routing=routing, shared_gate=False)
    assert moe.shared_expert is not None and moe.shared_expert_gate is None
    assert moe.gate.e_score_correction_bias is not None
    moe.gate.weight.data.copy_(router)
    moe.gate.e_score_correction_bias.data.copy_(bias)
    moe.load_experts("experts.gate_up_proj", torch.cat([gate, up], dim=1))
    moe.load_experts("experts.down_proj", down)
    sg, su, sd = (
        torch.randn(*s, generator=g) * 0.2 for s in ((2 * INTER, H), (2 * INTER, H), (H, 2 * INTER))
    )
    moe.shared_expert.gate_up_proj.weight.data.copy_(torch.cat([sg, su]))
    moe.shared_expert.down_proj.weight.data.copy_(sd)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    chosen = reference_route(x @ router.T, routing, 2, True, bias)
    expected = [
        sum(w * (down[e] @ (F.silu(gate[e] @ t) * (up[e] @ t))) for e, w in c.items())
        + sd @ (F.silu(sg @ t) * (su @ t))
        for t, c in zip(x, chosen)
    ]
    torch.testing.assert_close(moe(x), torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_routing_is_checked():
    with pytest.raises(ValueError, match="groups"):
        SparseMoE(H, INTER, 6, 2, True, routing=Routing(n_group=4, topk_group=2))
    with pytest.raises(ValueError, match="topk_group"):
        Routing(n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="gpt-oss"):
        SparseMoE(H, INTER, 4, 2, True, oai=(1.0, 1.0), routing=Routing("sigmoid"))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu2"])
def test_one_c_call_runs_experts_a_grouped_sigmoid_router_chose(activation):
    """moe.c's experts for pairs routed in PyTorch (`kernels.moe_experts`) against the expert-by-expert
    loop over the same packed weights; a token's output does not depend on the rest of the step.
    SwiGLU, Gemma 4's GELU·up and Nemotron-H's ungated relu² experts."""
    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    routing = Routing("sigmoid", correction_bias=True, n_group=3, topk_group=2, scale=2.5)
    moe = packed_moe(("int8", "int4"), routing=routing, activation=activation)
    assert moe.fused is not None and moe.fused.activation == activation
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


def test_the_correction_bias_stays_float32_in_a_bf16_model():
    """transformers keeps `e_score_correction_bias` in float32: bf16 would round values that differ in
    their third digit, and change which experts are chosen."""
    moe = SparseMoE(H, INTER, 4, 2, True, routing=Routing("sigmoid", correction_bias=True))
    bias = moe.gate.e_score_correction_bias
    assert bias is not None and bias.dtype == torch.float32
    bias.data.copy_(torch.tensor([0.1231, 0.1232, 0.1233, 0.1234]))
    moe.to(torch.bfloat16)
    assert moe.gate.weight.dtype == torch.bfloat16
    assert moe.gate.e_score_correction_bias is not None
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.tolist() == pytest.approx([0.1231, 0.1232, 0.1233, 0.1234])
