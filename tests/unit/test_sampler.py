"""Sampler tests: fixed random logits, no model.

References are written per row and independently of the sampler: transformers' own logits processors /
warpers for repetition penalty, temperature, top-k, top-p and typical-p, and plain Python for the OpenAI
penalties. Because draws use the exponential race with V noise values per row per call, the token a
seeded row should pick is reproduced here exactly as argmax(reference_probs / Exp(1) noise) from a fresh
generator with the same seed.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from pytgi.core.sampling_params import SamplingParams
from pytgi.engine import kernels
from pytgi.engine.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata, _apply_penalties, _warp

CPU = torch.device("cpu")
V = 200
SAMPLER = Sampler()


# --- helpers -------------------------------------------------------------------------------------------


def rand_logits(b: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


def gen(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def build(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    v: int = V,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        [gen(p.seed) if p.sampling else None for p in params],
        v,
        CPU,
    )


def ref_penalised(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Penalties for one row: HF's repetition penalty, then OpenAI frequency/presence written out."""
    scores = row.clone()[None]
    if p.repetition_penalty != 1.0:
        ids = torch.tensor([prompt + output], dtype=torch.int64)
        scores = RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(ids, scores)
    scores = scores[0].clone()
    for tok, count in Counter(output).items():
        scores[tok] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return scores


def ref_warped(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature and warpers for one sampling row, with transformers' own classes in HF's order."""
    scores = row[None]
    dummy_ids = torch.zeros(1, 1, dtype=torch.int64)
    scores = TemperatureLogitsWarper(float(p.temperature))(dummy_ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(dummy_ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(dummy_ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(dummy_ids, scores)
    if p.typical_p < 1.0:
        scores = TypicalLogitsWarper(p.typical_p)(dummy_ids, scores)
    return scores[0]


def race(probs: torch.Tensor, g: torch.Generator) -> int:
    """The token an exponential race picks with this generator's next V draws."""
    q = -torch.log1p(-torch.rand(probs.shape[-1], generator=g))
    return int((probs / q).argmax())


def ref_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    gens: list[torch.Generator | None],
) -> list[int]:
    tokens = []
    for i, p in enumerate(params):
        row = ref_penalised(logits[i], p, prompts[i], outputs[i])
        if not p.sampling:
            tokens.append(int(row.argmax()))
        else:
            tokens.append(race(ref_warped(row, p).softmax(-1), gens[i]))
    return tokens


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same -inf pattern (the kept set) and the same finite values."""
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-5, atol=1e-5)


# --- metadata ------------------------------------------------------------------------------------------


def test_build_packs_rows_and_flags() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=5, top_n_tokens=3),  # greedy: its warpers are switched off
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, do_sample=False, repetition_penalty=1.3),
        SamplingParams(temperature=1.2, top_k=V + 10, seed=2, frequency_penalty=0.5),  # top_k >= V is off
    ]
    meta = build(params, prompts=[[1, 2], [3], [4, 5, 6], [7]], outputs=[[8], [9], [10, V + 5], [11, 11]])
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.7, 0.0, 1.2])
    assert meta.top_k.tolist() == [0, 5, 0, 0]
    assert meta.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert meta.generators[0] is None and meta.generators[2] is None
    assert meta.generators[1] is not None and meta.generators[3] is not None
    assert meta.max_top_n == 3
    assert (meta.all_greedy, meta.no_penalties, meta.no_warpers) == (False, False, False)
    # Only the repetition-penalty row contributes prompt ids; padding is V.
    assert meta.prompt_ids is not None and meta.prompt_ids.tolist() == [[V] * 3, [V] * 3, [4, 5, 6], [V] * 3]
    # Output ids for rows with any penalty; an out-of-range id is mapped to the pad column.
    assert meta.output_ids is not None and meta.output_ids.tolist() == [[V, V], [V, V], [10, V], [11, 11]]
    for t in (meta.temperature, meta.top_p, meta.typical_p, meta.repetition_penalty):
        assert t.dtype == torch.float32
    assert meta.top_k.dtype == torch.int64 and meta.output_ids.dtype == torch.int64


def test_build_plain_greedy_batch_has_no_tensors_to_scatter() -> None:
    meta = build([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)])
    assert meta.prompt_ids is None and meta.output_ids is None
    assert meta.all_greedy and meta.no_penalties and meta.no_warpers and meta.max_top_n == 0


# --- greedy, logprobs, top-n ---------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = rand_logits(6)
    logits[2, 17] = logits[2, 90] = logits[2].max() + 1.0  # a tie: the lower index wins
    meta = build([SamplingParams(temperature=0.0) for _ in range(6)])
    out = SAMPLER(logits, meta)
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.token_ids[2] == 17
    assert out.top_ids is None and out.top_logprobs is None


def test_logprobs_and_top_n_come_from_raw_logits() -> None:
    logits = rand_logits(5, seed=3).to(torch.bfloat16)  # any dtype: upcast
    params = [
        SamplingParams(temperature=0.0, top_n_tokens=2),
        SamplingParams(temperature=0.5, top_k=10, seed=11, top_n_tokens=4),
        SamplingParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=2.0),
        SamplingParams(temperature=2.0, top_p=0.5, seed=12, presence_penalty=1.0),
        SamplingParams(temperature=1.0, typical_p=0.3, seed=13),
    ]
    outputs = [[], [], [int(logits[2].float().argmax())] * 3, [1, 2], []]
    meta = build(params, prompts=[[0, 1]] * 5, outputs=outputs)
    out = SAMPLER(logits, meta)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    ref_vals, ref_ids = raw.topk(4, dim=-1)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == (5, 4) and out.top_ids.dtype == torch.int64
    assert torch.equal(out.top_ids, ref_ids)
    torch.testing.assert_close(out.top_logprobs, ref_vals)
    # The penalised greedy row did not pick the raw argmax, yet reports the raw logprob of its choice.
    assert out.token_ids[2] != raw[2].argmax()


def test_logprobs_without_top_n_match_log_softmax() -> None:
    logits = rand_logits(4, seed=4)
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(4)]
    out = SAMPLER(logits, build(params))
    expected = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)


# --- penalties -----------------------------------------------------------------------------------------

PENALTY_CASES = [
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, repetition_penalty=0.5),  # < 1 rewards repetition
    SamplingParams(temperature=0.0, frequency_penalty=2.0),
    SamplingParams(temperature=0.0, presence_penalty=2.0),
    SamplingParams(temperature=0.0, frequency_penalty=-0.7, presence_penalty=0.4, repetition_penalty=1.2),
    SamplingParams(temperature=0.0),  # no penalty in a batch with penalties
]


def penalty_batch() -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    logits = rand_logits(len(PENALTY_CASES), seed=5)
    top = logits.topk(6, dim=-1).indices.tolist()
    # Prompts and outputs hit each row's best tokens (so penalties change the answer), with repeats.
    prompts = [[r[0], r[2], 3, 3, 150] for r in top]
    outputs = [[r[0], r[1], r[1], r[1], r[3], 7] for r in top]
    return logits, prompts, outputs


def test_penalised_logits_match_reference() -> None:
    logits, prompts, outputs = penalty_batch()
    meta = build(PENALTY_CASES, prompts, outputs)
    processed = _apply_penalties(logits, meta)
    for i, p in enumerate(PENALTY_CASES):
        torch.testing.assert_close(processed[i], ref_penalised(logits[i], p, prompts[i], outputs[i]))
    assert torch.equal(processed[-1], logits[-1])  # the row without penalties is untouched


def test_penalties_change_greedy_choice_like_reference() -> None:
    logits, prompts, outputs = penalty_batch()
    out = SAMPLER(logits, build(PENALTY_CASES, prompts, outputs))
    expected = ref_tokens(logits, PENALTY_CASES, prompts, outputs, [None] * len(PENALTY_CASES))
    assert out.token_ids.tolist() == expected
    # Non-vacuous: the penalising rows move away from the raw argmax.
    for i in (0, 2, 3, 4):
        assert expected[i] != int(logits[i].argmax())


# --- temperature and warpers ---------------------------------------------------------------------------

WARPER_CASES = {
    "temperature": SamplingParams(temperature=0.6, seed=1),
    "top_k": SamplingParams(temperature=1.0, top_k=7, seed=2),
    "top_k_1": SamplingParams(temperature=1.3, top_k=1, seed=3),
    "top_p": SamplingParams(temperature=0.9, top_p=0.8, seed=4),
    "top_p_tiny": SamplingParams(temperature=1.0, top_p=0.01, seed=5),
    "typical_p": SamplingParams(temperature=1.1, typical_p=0.5, seed=6),
    "typical_p_tiny": SamplingParams(temperature=1.0, typical_p=0.05, seed=7),
    "k_p_typical": SamplingParams(temperature=0.7, top_k=40, top_p=0.9, typical_p=0.8, seed=8),
    "do_sample_plain": SamplingParams(temperature=1.0, do_sample=True, seed=9),
}


def test_warped_logits_match_transformers_per_row() -> None:
    params = list(WARPER_CASES.values())
    logits = rand_logits(len(params), seed=6)
    meta = build(params)
    warped = _warp(logits, meta, rows=None)
    for i, p in enumerate(params):
        assert_same_logits(warped[i], ref_warped(logits[i], p))
    kept = torch.isfinite(warped).sum(-1).tolist()
    assert kept[1] == 7 and kept[2] == 1 and kept[-1] == V  # top-k sizes; the plain row keeps everything
    assert 1 <= kept[4] < 5 and 1 <= kept[6] < V // 2  # the tiny masses keep few tokens


@pytest.mark.parametrize("scale", [0.05, 1.0, 6.0])  # flat (the cut needs most of V), medium, peaked
def test_top_k_and_top_p_cut_like_transformers_over_a_large_vocabulary(scale: float) -> None:
    """The cut-offs come from a widening topk, not a sort of V: the kept sets must still be HF's."""
    v = 5000
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=3000, seed=2),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=3),
        SamplingParams(temperature=0.5, seed=4),
    ]
    logits = rand_logits(len(params), v=v, seed=13, scale=scale)
    warped = _warp(logits, build(params, v=v), rows=None)
    for i, p in enumerate(params):
        assert_same_logits(warped[i], ref_warped(logits[i], p))


def test_top_k_keeps_ties_at_threshold_like_transformers() -> None:
    logits = rand_logits(2, seed=7)
    order = logits[0].argsort(descending=True)
    logits[0, order[3]] = logits[0, order[2]]  # 3rd and 4th largest tie: top_k=3 keeps both
    params = [SamplingParams(top_k=3, seed=1), SamplingParams(top_k=3, seed=2)]
    warped = _warp(logits, build(params), rows=None)
    for i, p in enumerate(params):
        assert_same_logits(warped[i], ref_warped(logits[i], p))
    assert torch.isfinite(warped).sum(-1).tolist() == [4, 3]


@pytest.mark.parametrize("name", list(WARPER_CASES))
def test_sampled_tokens_match_reference_race(name: str) -> None:
    p = WARPER_CASES[name]
    logits = rand_logits(1, seed=8)
    meta, ref_gen = build([p]), gen(p.seed)
    for _ in range(5):  # the generator advances identically in sampler and reference
        out = SAMPLER(logits, meta)
        assert out.token_ids.tolist() == ref_tokens(logits, [p], [[]], [[]], [ref_gen])


def test_generator_advances_exactly_v_draws_per_call() -> None:
    p = SamplingParams(temperature=0.5, top_k=1, seed=42)  # top_k=1 needs no randomness, still draws V
    meta = build([p], v=V)
    SAMPLER(rand_logits(1), meta)
    SAMPLER(rand_logits(1), meta)
    reference = gen(42)
    torch.rand(2 * V, generator=reference)
    g = meta.generators[0]
    assert g is not None
    assert torch.equal(torch.rand(8, generator=g), torch.rand(8, generator=reference))


# --- batching and reproducibility ----------------------------------------------------------------------

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=20, seed=101),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=1.0, do_sample=True, seed=102),  # all "off" but sampling
    SamplingParams(temperature=1.4, top_p=0.7, frequency_penalty=1.0, seed=103, top_n_tokens=3),
    SamplingParams(temperature=0.9, typical_p=0.6, repetition_penalty=0.8, seed=104),
    SamplingParams(temperature=0.5, top_k=3, top_p=0.95, seed=105),
]


def test_mixed_batch_rows_equal_running_alone_over_steps() -> None:
    logits_steps = [rand_logits(len(MIXED), seed=20 + s) for s in range(3)]
    prompts = [[i, i + 1, 40, 41] for i in range(len(MIXED))]
    outputs: list[list[int]] = [[5, 5, 6] for _ in MIXED]
    batch_meta = build(MIXED, prompts, outputs)
    alone_metas = [build([p], [prompts[i]], [outputs[i]]) for i, p in enumerate(MIXED)]
    ref_gens = [gen(p.seed) if p.sampling else None for p in MIXED]
    for logits in logits_steps:
        batched = SAMPLER(logits, batch_meta)
        alone = [SAMPLER(logits[i : i + 1], m) for i, m in enumerate(alone_metas)]
        assert batched.token_ids.tolist() == [int(o.token_ids[0]) for o in alone]
        torch.testing.assert_close(batched.logprobs, torch.cat([o.logprobs for o in alone]))
        assert batched.token_ids.tolist() == ref_tokens(logits, MIXED, prompts, outputs, ref_gens)


def test_same_seed_same_sequence_different_seed_differs() -> None:
    logits = rand_logits(1, v=1000, seed=9, scale=0.5)  # flat: many likely tokens

    def sequence(seed: int) -> list[int]:
        meta = build([SamplingParams(temperature=1.5, seed=seed)], v=1000)
        return [int(SAMPLER(logits, meta).token_ids[0]) for _ in range(6)]

    first = sequence(1234)
    assert first == sequence(1234)
    assert len(set(first)) > 1  # the generator advances between calls
    assert first != sequence(4321)


def test_row_sample_independent_of_batch_neighbours() -> None:
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    logits = rand_logits(5, seed=10)
    alone = SAMPLER(logits[2:3], build([target]))
    neighbours_a = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1, seed=1),
        target,
        SamplingParams(typical_p=0.2, seed=3, repetition_penalty=2.0),
        SamplingParams(temperature=3.0, seed=4),
    ]
    neighbours_b = [
        SamplingParams(temperature=0.1, seed=9),
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        target,
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.1, seed=8),
    ]
    outs = [
        SAMPLER(logits, build(n, prompts=[[1, 2, 3]] * 5, outputs=[[4, 4]] * 5))
        for n in (neighbours_a, neighbours_b)
    ]
    assert int(outs[0].token_ids[2]) == int(outs[1].token_ids[2]) == int(alone.token_ids[0])


def test_empirical_distribution_matches_probabilities() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 2000
    g = torch.Generator().manual_seed(2024)
    logits = probs.log().expand(n, 4).clone()
    # One seeded generator shared by all rows: n consecutive draws of the same distribution.
    meta = SamplingMetadata.build(
        [SamplingParams(temperature=1.0, do_sample=True, seed=2024)] * n, [[]] * n, [[]] * n, [g] * n, 4, CPU
    )
    freq = torch.bincount(SAMPLER(logits, meta).token_ids, minlength=4).float() / n
    torch.testing.assert_close(freq, probs, atol=0.04, rtol=0)  # ~4 standard deviations

    # With top_k=2 only tokens 2 and 3 remain, renormalised to 3/7 and 4/7.
    g_k = torch.Generator().manual_seed(7)
    top_k = [SamplingParams(top_k=2, seed=1)] * n
    meta_k = SamplingMetadata.build(top_k, [[]] * n, [[]] * n, [g_k] * n, 4, CPU)
    freq_k = torch.bincount(SAMPLER(logits, meta_k).token_ids, minlength=4).float() / n
    torch.testing.assert_close(freq_k, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]), atol=0.04, rtol=0)


# --- logits mask ---------------------------------------------------------------------------------------


def test_logits_mask_forbids_tokens() -> None:
    b = 6
    logits = rand_logits(b, seed=11)
    mask = torch.zeros(b, V, dtype=torch.bool)
    allowed = [[3, 50, 120], [7], list(range(100, 200)), [0, 1], [199], list(range(0, V, 3))]
    for i, ids in enumerate(allowed):
        mask[i, ids] = True
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1, do_sample=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=2.0, top_k=50, seed=2),
        SamplingParams(temperature=0.7, top_p=0.5, seed=3),
        SamplingParams(temperature=5.0, seed=4),
    ]
    meta = build(params, prompts=[[110, 111]] * b, outputs=[[]] * b)
    for _ in range(20):
        out: SamplerOutput = SAMPLER(logits, meta, logits_mask=mask)
        for i, ids in enumerate(allowed):
            assert int(out.token_ids[i]) in ids
    assert int(out.token_ids[0]) == max(allowed[0], key=lambda t: float(logits[0, t]))
    assert int(out.token_ids[1]) == 7 and int(out.token_ids[4]) == 199
    # The additive form (0 / -inf, what the engine builds from bitmasks) chooses the same tokens.
    bias = torch.zeros(b, V).masked_fill(~mask, float("-inf"))
    assert torch.equal(
        SAMPLER(logits, build(params, prompts=[[110, 111]] * b, outputs=[[]] * b), bias).token_ids,
        SAMPLER(logits, build(params, prompts=[[110, 111]] * b, outputs=[[]] * b), mask).token_ids,
    )
    # Without the mask the greedy row picks its unconstrained argmax, which the mask forbade.
    assert int(SAMPLER(logits, build(params[:1]), None).token_ids[0]) not in allowed[0]


def test_zero_temperature_row_is_greedy_even_with_a_generator() -> None:
    logits = rand_logits(3, seed=12, scale=0.3)  # flat: a sample would rarely be the argmax
    params = [SamplingParams(temperature=1.5, seed=s) for s in (1, 2, 3)]
    meta = build(params)
    meta.temperature = torch.tensor([1.5, 0.0, 1.5])  # hand-built metadata: row 1 greedy, generator kept
    for _ in range(5):
        assert int(SAMPLER(logits, meta).token_ids[1]) == int(logits[1].argmax())


# --- the C kernel's row reductions (argmax, logsumexp) ----------------------------------------------------


@pytest.mark.skipif(not kernels.available(), reason="no C compiler")
def test_row_stats_kernel_matches_torch_and_ignores_the_batch() -> None:
    torch.manual_seed(0)
    V = 49_157  # not a multiple of the kernel's pieces or of 16
    logits = torch.randn(7, V) * 4
    logits[1, 5000] = logits[1, 40_000] = logits[1].max() + 1  # a tie across pieces: the lower index
    logits[2, 4095] = logits[2, 4096] = logits[2].max() + 1  # and at a piece boundary
    arg, lse, bad = kernels.logit_stats(logits, True)
    assert arg.tolist() == logits.argmax(-1).tolist() and arg[1] == 5000 and arg[2] == 4095
    torch.testing.assert_close(lse, logits.double().logsumexp(-1).float(), rtol=0, atol=2e-5)
    assert not bad.any()
    for i in range(7):  # a row's values are the same bits alone as in the batch
        one_arg, one_lse, _ = kernels.logit_stats(logits[i : i + 1].contiguous(), True)
        assert one_arg[0] == arg[i] and torch.equal(one_lse[0], lse[i])


def test_sampler_falls_back_for_rows_with_nan_or_inf() -> None:
    logits = rand_logits(3, seed=9)
    logits[0, 3] = float("inf")
    logits[1, 4] = float("nan")
    out = SAMPLER(logits, build([SamplingParams(temperature=0.0) for _ in range(3)]))
    ref = logits.argmax(-1)
    assert out.token_ids.tolist() == ref.tolist()
    expected = torch.log_softmax(logits, -1).gather(1, ref[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected, equal_nan=True)


def test_min_p_cuts_like_transformers_alone_and_after_top_k_and_top_p() -> None:
    params = [
        SamplingParams(temperature=0.8, min_p=0.1, seed=1),
        SamplingParams(temperature=1.3, min_p=0.5, top_k=20, seed=2),
        SamplingParams(temperature=1.0, min_p=0.05, top_p=0.9, typical_p=0.8, seed=3),
        SamplingParams(temperature=0.7, seed=4),  # no min_p beside rows that have one
    ]
    logits = rand_logits(len(params), seed=11)
    warped = _warp(logits, build(params), rows=None)
    for i, p in enumerate(params):
        assert_same_logits(warped[i], ref_warped(logits[i], p))
    kept = torch.isfinite(warped).sum(-1).tolist()
    assert 1 <= kept[1] < 20 and kept[3] == V


def test_logit_bias_moves_the_choice_but_not_the_reported_logprobs() -> None:
    logits = rand_logits(3, seed=12)
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={top[0]: -100.0}),  # the top token is banned
        SamplingParams(temperature=0, logit_bias={7: 100.0}),  # token 7 is forced
        SamplingParams(temperature=0),  # no bias beside rows that have one
    ]
    out = SAMPLER(logits, build(params))
    banned = logits[0].clone()
    banned[top[0]] -= 100.0
    assert out.token_ids.tolist() == [int(banned.argmax()), 7, top[2]]
    want = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, want)  # raw logprobs: the model's, not the request's


def test_min_p_and_logit_bias_are_checked() -> None:
    from pytgi.core.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    assert SamplingParams(min_p=0.1).sampling and not SamplingParams(min_p=0.1, temperature=0).sampling
