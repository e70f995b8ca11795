"""The prefix cache on a hybrid model (issue 64, point 3): recurrent states checkpointed at block
boundaries, a request resuming from its longest cached prefix that ends at a checkpoint. A tiny random
Qwen3.5 (three linear-attention layers, one attention layer): a hit computes fewer prompt tokens and
gives the bits of a cold prefill, tokens and logprobs; so does a prefix that diverges inside a block,
a preempted request that resumes from checkpoints, and a byte budget of one checkpoint. Every other
recurrent family too (Mamba-2, Mamba-1, short convolutions, KDA; tests/model/hybrids.py), each on its
kinds' grid, float32 and bf16."""

from __future__ import annotations

import math
import random

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine import kernels
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.models.kda import KdaConfig
from pytgi.engine.models.linear_attention import (
    LinearAttnConfig,
    RecurrentConfig,
    RecurrentMixer,
    StateMetadata,
)
from pytgi.engine.models.mamba1 import WEIGHTED, Mamba1Config
from pytgi.engine.models.mamba2 import Mamba2Config
from pytgi.engine.models.short_conv import ShortConvConfig
from tests.model import hybrids
from tests.model.test_falcon_h1 import _model as falcon_h1_model
from tests.model.test_kimi_linear import COMMON as kimi_config
from tests.model.test_kimi_linear import _save as save_kimi
from tests.model.test_lfm2 import lfm2  # noqa: F401  (fixtures)
from tests.model.test_mamba1 import jamba, mamba  # noqa: F401
from tests.model.test_mamba2 import bamba, granite_h, nemotron_h  # noqa: F401
from tests.model.test_qwen3_next import qwen3_5  # noqa: F401

rng = random.Random(3)
PREFIX = [rng.randrange(1, 101) for _ in range(200)]
TURN_1 = PREFIX + [rng.randrange(1, 101) for _ in range(10)]  # its last checkpoint boundary: 192
TURN_2 = TURN_1 + [rng.randrange(1, 101) for _ in range(60)]  # resumes at 192, checkpoints 256


def _engine(path, **kw) -> LLMEngine:
    kw.setdefault("max_batch_total_tokens", 1024)
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(path), **kw))


def _run(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int = 8) -> list[tuple]:
    """Each prompt's greedy tokens, their logprobs and its cached prompt tokens, all at once."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    ids = [f"r{engine.scheduler.num_preemptions}-{i}-{rng.random()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    out: dict[str, tuple[list[int], list[float], int]] = {rid: ([], [], 0) for rid in ids}
    while engine.has_unfinished():
        for u in engine.step():
            tokens, lps, _ = out[u.request_id]
            if u.token_id >= 0:
                tokens.append(u.token_id)
                lps.append(u.logprob)
            out[u.request_id] = (tokens, lps, u.num_cached_tokens)
    return [out[rid] for rid in ids]


def _cold(path, prompt: list[int], **kw) -> tuple[list[int], list[float]]:
    """A fresh engine's answer, without the prefix cache (one chunk from zero)."""
    engine = _engine(path, enable_prefix_caching=False, **kw)
    try:
        assert engine.scheduler.block_manager.has_states and not engine.info.enable_prefix_caching
        tokens, lps, cached = _run(engine, [prompt])[0]
    finally:
        engine.shutdown()
    assert cached == 0
    return tokens, lps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_hit_gives_the_bits_of_a_cold_prefill(qwen3_5, dtype):  # noqa: F811
    _, path = qwen3_5
    engine = _engine(path, dtype=dtype)
    try:
        bm = engine.block_manager
        assert engine.info.enable_prefix_caching and bm.checkpointing and bm.checkpoint_stride == 64
        assert engine.runner.state_grid == 64  # gated DeltaNet's chunks
        first = _run(engine, [TURN_1])[0]
        assert first[2] == 0
        assert len(bm.checkpoints) == 1  # at 192: the prefill is cut there, its chunk ends on a boundary
        assert engine.stats()["state_checkpoints"] == 1  # pytgi_prefix_cache_state_checkpoints
        second = _run(engine, [TURN_2])[0]
        assert second[2] == 192 and bm.state_restores == 1
        again = _run(engine, [TURN_2])[0]  # its own checkpoint at 256
        assert again[2] == 256
    finally:
        engine.shutdown()
    assert first[:2] == _cold(path, TURN_1, dtype=dtype)
    cold = _cold(path, TURN_2, dtype=dtype)
    assert len(set(cold[0])) > 1
    assert second[:2] == cold and again[:2] == cold  # tokens and logprobs, to the bit


def test_an_agents_turns_resume_each_from_the_last(qwen3_5):  # noqa: F811
    """Each turn sends the conversation so far: the last prompt, its answer (24 tokens), a tool's
    result. Each resumes from the checkpoint at its last prompt's last boundary; the third also
    reads, before it, a block the first turn's decode filled. Every answer is the cold one's bits."""
    _, path = qwen3_5
    conversation, answers, cached = list(TURN_1), [], []
    engine = _engine(path)
    try:
        for turn in range(3):
            tokens, lps, n = _run(engine, [conversation], max_new_tokens=24)[0]
            answers.append((list(conversation), tokens, lps))
            cached.append(n)
            conversation += tokens + [rng.randrange(1, 101) for _ in range(40)]
    finally:
        engine.shutdown()
    assert cached == [0, 192, 256]  # 210, then 274 and 338 tokens
    for turn, (prompt, tokens, lps) in enumerate(answers):
        engine = _engine(path, enable_prefix_caching=False)
        try:
            assert _run(engine, [prompt], max_new_tokens=24)[0][:2] == (tokens, lps), turn
        finally:
            engine.shutdown()


def test_a_prefix_that_diverges_inside_a_block_resumes_before_it(qwen3_5):  # noqa: F811
    """A prompt that leaves TURN_2 at token 150 finds 9 blocks (144 tokens) cached but no state
    there: it computes from zero, and keeps a checkpoint at 128, where the KV it shared ends on the
    grid. A third prompt that leaves both at token 140 resumes there."""
    _, path = qwen3_5
    other = TURN_2[:150] + [(t % 100) + 1 for t in TURN_2[150:]]
    third = TURN_2[:140] + [(t % 99) + 2 for t in TURN_2[140:]]
    engine = _engine(path)
    try:
        _run(engine, [TURN_2])
        got = _run(engine, [other])[0]
        assert got[2] == 0 and len(engine.block_manager.checkpoints) == 3  # 256, 128, 192
        got_third = _run(engine, [third])[0]
    finally:
        engine.shutdown()
    assert got_third[2] == 128
    assert got[:2] == _cold(path, other)
    assert got_third[:2] == _cold(path, third)


def test_a_preempted_request_resumes_from_its_checkpoints(qwen3_5):  # noqa: F811
    """A KV cache too small for three long requests at once: the last admitted is preempted, and
    readmitted it resumes from a checkpoint of its own prompt. Its answer is the cold one's tokens; its
    logprobs after the preemption are close, not equal: the tokens it had decoded one at a time are
    recomputed as a prefill chunk (so it is without the prefix cache too)."""
    _, path = qwen3_5
    prompts = [TURN_2[i:] + TURN_2[:i] for i in (0, 7, 13)]
    engine = _engine(path, max_batch_total_tokens=640, max_batch_size=3)
    try:
        got = _run(engine, prompts, max_new_tokens=64)
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.state_restores > 0
        assert sorted(engine.block_manager.free_states) == [0, 1, 2]
    finally:
        engine.shutdown()
    engine = _engine(path, enable_prefix_caching=False)
    try:
        cold = [_run(engine, [prompt], max_new_tokens=64)[0] for prompt in prompts]
    finally:
        engine.shutdown()
    for (tokens, lps, _), (ref, ref_lps, _) in zip(got, cold):
        assert tokens == ref
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


def test_a_budget_of_one_checkpoint_keeps_the_latest(qwen3_5):  # noqa: F811
    _, path = qwen3_5
    engine = _engine(path)
    state = engine.runner.state_bytes
    engine.shutdown()
    engine = _engine(path, prefix_cache_state_bytes=state)
    try:
        bm = engine.block_manager
        assert len(bm.free_checkpoints) == 1
        _run(engine, [TURN_1])
        assert len(bm.checkpoints) == 1  # 64 and 128 gave way to 192
        assert _run(engine, [TURN_2])[0][2] == 192
        assert _run(engine, [TURN_1])[0][2] == 0  # 192 gave way to 256
    finally:
        engine.shutdown()
    engine = _engine(path, prefix_cache_state_bytes=state - 1)
    try:
        assert not engine.info.enable_prefix_caching  # no room for one state: no prefix cache
        assert _run(engine, [TURN_1, TURN_1])[1][2] == 0
    finally:
        engine.shutdown()


def test_two_shards_copy_the_states_on_every_rank(qwen3_5):  # noqa: F811
    """Rank 1 holds half of every state: its checkpoints are saved and restored with rank 0's
    (`commands.CopyStates`), or its half of a resumed request would start from zero."""
    _, path = qwen3_5
    engine = _engine(path, num_shard=2)
    try:
        _run(engine, [TURN_1])
        tokens, lps, cached = _run(engine, [TURN_2])[0]
    finally:
        engine.shutdown()
    assert cached == 192
    ref_tokens, ref_lps = _cold(path, TURN_2)
    assert tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-5


def test_a_recurrent_kind_that_says_no_grid_runs_without_the_prefix_cache(qwen3_5, monkeypatch):  # noqa: F811
    """Where a layer kind's prefill state is exact is the kind's to say (`RecurrentMixer.state_grid`);
    a kind that does not (a new one) gets no checkpoints rather than inexact hits."""
    from pytgi.engine.models.linear_attention import GatedDeltaNet

    monkeypatch.setattr(GatedDeltaNet, "state_grid", 0)
    _, path = qwen3_5
    engine = _engine(path)
    try:
        assert engine.runner.state_grid == 0 and not engine.info.enable_prefix_caching
        assert not engine.block_manager.free_checkpoints
        assert _run(engine, [TURN_1, TURN_1])[1][2] == 0
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**kimi_config)).eval()
    return save_kimi(model, tmp_path_factory.mktemp("kimi-linear"))


@pytest.fixture(scope="module")
def falcon_h1(tmp_path_factory):  # with the gated norm: mamba.c's kernels run its Mamba-2 mixers
    return falcon_h1_model(tmp_path_factory, 1, mamba_rms_norm=True, mamba_norm_before_gate=False)


# each family with its recurrent kinds' grid: Mamba-2's 64-token chunks (its C kernels exact at any
# split), Mamba-1's and the short convolutions' 1, KDA's 32-token chunks; in bf16 (the bits), and
# one family of each kind in float32 too
FAMILIES = [
    pytest.param("nemotron_h", 64, "float32"),
    pytest.param("jamba", 1, "float32"),
    pytest.param("lfm2", 1, "float32"),
    pytest.param("kimi_linear", 32, "float32"),
    *(
        pytest.param(name, grid, "bfloat16")
        for name, grid in [
            ("nemotron_h", 64),
            ("granite_h", 64),
            ("bamba", 64),
            ("falcon_h1", 64),  # (attention and Mamba-2 in one layer: the copies take its states only)
            ("jamba", 1),
            ("mamba", 1),  # (no attention layer: checkpoints and blocks that hold no bytes)
            ("lfm2", 1),
            ("kimi_linear", 32),
        ]
    ),
]


@pytest.mark.parametrize("name, grid, dtype", FAMILIES)
def test_every_recurrent_family_hits_with_a_cold_prefills_bits(name, grid, dtype, request):
    _, path = request.getfixturevalue(name)
    hybrids.assert_a_hit_gives_the_bits_of_a_cold_prefill(path, dtype, grid)


def test_mamba2s_pytorch_path_hits_with_a_cold_prefills_bits(nemotron_h, monkeypatch):  # noqa: F811
    """Without the C kernels (no compiler, CUDA) a Mamba-2 prompt chunk runs `ssd_chunked`, exact
    only on its 64-token chunks: the same grid serves both paths."""
    for kernel in ("supports", "vnni_supported", "bf16gemm_supported"):
        monkeypatch.setattr(kernels, kernel, lambda *_: False)
    _, path = nemotron_h
    hybrids.assert_a_hit_gives_the_bits_of_a_cold_prefill(path, "bfloat16", 64)


def _kind(name: str, fused: bool, dtype: torch.dtype) -> RecurrentMixer:
    """A tiny layer of each recurrent kind, hidden 64, its weights random (decays in (e^-1, e))."""
    configs: dict[str, RecurrentConfig] = {
        "mamba2": Mamba2Config(num_heads=8, head_dim=16, n_groups=2, d_state=16, conv_kernel=4),
        "mamba1": Mamba1Config(inner=128, d_state=16, dt_rank=8, conv_kernel=4, bcdt_norms=WEIGHTED),
        "short_conv": ShortConvConfig(kernel=3),
        "kda": KdaConfig(num_heads=4, head_dim=16, conv_kernel=4),
        "gated_deltanet": LinearAttnConfig(2, 4, 16, 16, 4, fused_qkvz=False),
    }
    layer = configs[name].build(64, 1e-5, fused)
    assert isinstance(layer, torch.nn.Module)
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            if "A_log" in pname:
                p.uniform_(-1, 1)
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    layer.to(dtype)
    return layer


def _prefill(layer: RecurrentMixer, x: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, ...]:
    """The layer's outputs over x [L, 64] computed in chunks ending at `cuts`, then its state; each
    chunk after the first from the state the one before left (`fresh` false, as after a restore)."""
    state = tuple(torch.zeros(1, *s.shape, dtype=s.dtype or x.dtype) for s in layer.state_specs())
    none = torch.zeros(0, dtype=torch.int64)
    outs, start = [], 0
    for end in [*cuts, len(x)]:
        meta = StateMetadata(
            attn=None,  # (the recurrent layers read none of it)
            slots=torch.tensor([0]),
            query_lens=[end - start],
            fresh=[start == 0],
            decodes=none,
            decode_rows=none,
            reset=None,
            decode_fresh=none,
        )
        outs.append(layer(x[start:end], None, state, meta))
        start = end
    return (torch.cat(outs), *state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "name, fused",
    [("mamba2", False), ("mamba2", True), ("mamba1", False), ("short_conv", False), ("kda", False)]
    + [("gated_deltanet", False), ("gated_deltanet", True)],
)
def test_a_prefill_cut_on_its_kinds_grid_is_a_whole_prefills_bits(name, fused, dtype):
    """The grid a kind declares (`state_grid`) is where its prefill's outputs and state are the bits
    of the prefill uncut, whichever path runs it (Mamba-2's and gated DeltaNet's C kernels where
    `fused`): cut at one, two and three multiples of the checkpoints' stride (16 tokens at least: at a
    handful of rows float32's matmuls round otherwise, a thing of the projections, not of the kind).
    Measured off the grid (a one-off script, both dtypes): Mamba-2's PyTorch path and KDA differ cut
    at 16, 48 or 100 tokens, gated DeltaNet (both paths) at 16, 32, 48, 96 or 100."""
    if fused and not kernels.supports(dtype):
        pytest.skip("no C kernels here")
    torch.manual_seed(0)
    layer = _kind(name, fused, dtype)
    grid = getattr(layer, "state_grid", 0)  # (a kind may say none: `RecurrentMixer`)
    assert grid
    x = torch.randn(300, 64, dtype=dtype)
    step = math.lcm(grid, 16)  # the checkpoints' stride with 16-token blocks
    with torch.no_grad():
        whole = _prefill(layer, x, [])
        for cuts in ([step], [2 * step, 4 * step], [step, 3 * step, 4 * step]):
            got = _prefill(layer, x, [c for c in cuts if c < len(x)])
            assert all(torch.equal(a, b) for a, b in zip(got, whole)), cuts


def test_a_grid_of_256_keeps_checkpoints_every_256_tokens(kimi_linear, monkeypatch):
    """A model whose kinds' lcm is large (KDA said to be exact on 256 only here, a multiple of its 32):
    checkpoints every lcm(16, 256) tokens, none in a 210-token prompt, so its next turn computes
    from zero and keeps one at 256; a prefill budget under the grid cuts chunks off it, and such a
    request keeps no checkpoint and caches no block past its first chunk (docs/prefix-cache.md)."""
    from pytgi.engine.models.kda import KimiDeltaAttention

    monkeypatch.setattr(KimiDeltaAttention, "state_grid", 256)
    _, path = kimi_linear
    hybrids.assert_a_hit_gives_the_bits_of_a_cold_prefill(path, "bfloat16", 256)
    eng = hybrids.engine(path, dtype="bfloat16", max_batch_prefill_tokens=96, enable_chunked_prefill=True)
    try:
        assert hybrids.answer(eng, hybrids.TURN_2)[2] == 0
        # the first chunk's 6 blocks (it began on the grid: a cold prefill's KV), none after
        assert not eng.block_manager.checkpoints and len(eng.block_manager.hash_to_block) == 6
        assert hybrids.answer(eng, hybrids.TURN_2)[2] == 0
    finally:
        eng.shutdown()
