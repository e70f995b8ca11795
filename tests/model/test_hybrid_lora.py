"""LoRA adapters on hybrid models (issue 64, point 3): tiny random Qwen3.5, Qwen3-Next, Nemotron-H,
LFM2, Kimi Linear and more, each with a peft adapter on its attention and MLP projections and on its recurrent mixers'
projections, named as transformers names them (`in_proj_qkv`, `in_proj_qkvz`, Nemotron-H's
`mixer.in_proj`, LFM2's `conv.in_proj` and `feed_forward.w1`). Greedy tokens equal transformers +
peft's (merged) in float32, alone and in one batch with base-model requests; a recurrent state checkpointed
under an adapter serves that adapter only."""

from __future__ import annotations

import pytest
import torch
import transformers

from pytgi.core.sampling_params import SamplingParams
from tests.model.test_falcon_h1 import _model as falcon_h1_model
from tests.model.test_kimi_linear import COMMON as KIMI_COMMON
from tests.model.test_kimi_linear import _save as save_kimi
from tests.model.test_lfm2 import lfm2  # noqa: F401  (a fixture)
from tests.model.test_lora import NEW, PROMPTS, engine_for, make_adapter, reference, run
from tests.model.test_mamba1 import jamba, mamba  # noqa: F401  (fixtures)
from tests.model.test_mamba2 import COMMON as MAMBA_COMMON
from tests.model.test_mamba2 import _save as save_mamba
from tests.model.test_mamba2 import bamba, granite_h_dense_rope  # noqa: F401  (fixtures)
from tests.model.test_qwen3_next import qwen3_5, qwen3_next  # noqa: F401  (fixtures)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = {
    "qwen3_5": [*ATTENTION, "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z", "in_proj_b"]
    + ["in_proj_a", "out_proj"],
    # (its MoE layers' shared experts would take gate_proj too: the experts are not targets)
    "qwen3_next": [*ATTENTION, "in_proj_qkvz", "in_proj_ba", "out_proj"],
    # (peft refuses a Mamba mixer's out_proj: its fused CUDA scan reads the weight itself)
    "nemotron_h": [*ATTENTION, "up_proj", "down_proj", "in_proj"],
    "lfm2": ["q_proj", "k_proj", "v_proj", "out_proj", "w1", "w2", "w3", "in_proj"],
    "bamba": [*ATTENTION, "gate_proj", "up_proj", "down_proj", "in_proj", "out_proj"],
    # the shared MLP's fused input_linear (gate | up) as one target
    "granite_h_dense_rope": [*ATTENTION, "input_linear", "output_linear", "in_proj", "out_proj"],
    # µP multipliers folded into the weights' rows at load: B's rows take them too
    "falcon_h1": [*ATTENTION, "gate_proj", "up_proj", "down_proj", "in_proj"],
    # Mamba-1: x_proj (row-parallel) and dt_proj (with a bias) too
    "jamba": [*ATTENTION, "in_proj", "x_proj", "dt_proj", "out_proj"],
    "mamba": ["in_proj", "x_proj", "dt_proj"],  # (no attention nor MLP; peft refuses out_proj)
    # KDA's projections (the forget and output gates' low-rank pairs too) and latent attention's, its
    # kv_b_proj in the absorbed products (its MoE layers' shared experts would take the MLP's names)
    "kimi_linear": [*ATTENTION, "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj"]
    + ["kv_a_proj_with_mqa", "kv_b_proj"],
}
# also on two tensor-parallel shards: B's rows split as the mixer's channels are, A's columns as out_proj's
SHARDED = ("qwen3_5", "kimi_linear")


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    """Mamba-2, an ungated MLP, attention, an MLP, Mamba-2 (no experts: peft would target their
    shared expert's up_proj, which pytgi does not)."""
    torch.manual_seed(0)
    cfg = transformers.NemotronHConfig(
        **MAMBA_COMMON,
        head_dim=16,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention"],
        intermediate_size=64,
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        chunk_size=16,
    )
    return save_mamba(transformers.NemotronHForCausalLM(cfg).eval(), tmp_path_factory.mktemp("nemotron-h"))


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    """KDA, latent attention (with q_proj) with experts, KDA, KDA."""
    torch.manual_seed(0)
    cfg = transformers.KimiLinearConfig(**KIMI_COMMON, q_lora_rank=None)
    return save_kimi(transformers.KimiLinearForCausalLM(cfg).eval(), tmp_path_factory.mktemp("kimi-linear"))


@pytest.fixture(scope="module")
def falcon_h1(tmp_path_factory):
    return falcon_h1_model(tmp_path_factory, 0)


@pytest.mark.parametrize("family", list(TARGETS))
def test_an_adapter_on_a_hybrid_equals_peft_alone_and_beside_the_base_model(family, request, tmp_path):
    _, path = request.getfixturevalue(family)
    adapter = make_adapter(path, tmp_path / "a", dict(r=4, lora_alpha=8, target_modules=TARGETS[family]), 1)
    want = {None: reference(path, None, PROMPTS), "a": reference(path, adapter, PROMPTS, merged=True)}
    assert want["a"] != want[None], "an adapter that changes nothing tests nothing"
    engine = engine_for(path, {"a": adapter})
    try:
        wrapped = {module for _, module in engine.runner.adapters().wrapped}
        assert any(m.startswith("linear_attn.") for m in wrapped), wrapped  # the mixers take adapters
        assert run(engine, [(p, "a") for p in PROMPTS]) == want["a"]
        jobs = [(p, name) for p in PROMPTS for name in (None, "a")]  # one batch, each prompt twice
        assert run(engine, jobs) == [want[name][PROMPTS.index(p)] for p, name in jobs]
    finally:
        engine.shutdown()
    if family in SHARDED:
        engine = engine_for(path, {"a": adapter}, num_shard=2)
        try:
            assert run(engine, jobs) == [want[name][PROMPTS.index(p)] for p, name in jobs]
        finally:
            engine.shutdown()


def test_a_state_checkpoint_serves_the_adapter_it_was_made_under_only(qwen3_5, tmp_path):  # noqa: F811
    """Qwen3.5's states are checkpointed every 64 tokens; the checkpoints are keyed by block hashes,
    which start from the adapter's root: the base model and another adapter find nothing of adapter
    a's, a finds its own and still gives peft's tokens."""
    _, path = qwen3_5
    adapters = {
        name: make_adapter(path, tmp_path / name, dict(r=4, target_modules=TARGETS["qwen3_5"]), seed)
        for seed, name in enumerate(["a", "b"], start=1)
    }
    prompt = [(7 * i) % 97 + 1 for i in range(80)]
    want: dict[str | None, list[int]] = {None: reference(path, None, [prompt])[0]}
    want |= {name: reference(path, d, [prompt])[0] for name, d in adapters.items()}
    assert len({tuple(w) for w in want.values()}) == 3
    engine = engine_for(path, adapters)
    bm = engine.block_manager
    try:
        assert bm.checkpointing and bm.checkpoint_stride == 64
        cached: dict[str | None, list[int]] = {}
        for name in ["a", None, "b", "a"]:
            got = run_cached(engine, prompt, name)
            assert got[0] == want[name], name
            cached.setdefault(name, []).append(got[1])
        assert cached == {"a": [0, 64], None: [0], "b": [0]}
        assert bm.state_restores == 1
    finally:
        engine.shutdown()


def run_cached(engine, prompt, adapter):
    """One request's greedy tokens and its cached prompt tokens."""
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=NEW, temperature=0, adapter=adapter))
    tokens, cached = [], 0
    while engine.has_unfinished():
        for u in engine.step():
            if u.token_id >= 0:
                tokens.append(u.token_id)
            cached = u.num_cached_tokens
    return tokens, cached
