"""Speculative decoding with a draft model (`draft_model=`, `--draft-model-id`) on tiny random models
with one tokenizer: greedy and seeded outputs are the ones without speculation, the sampled
distribution is unchanged (a two-sample test over independent seeds), and the draft's KV is freed."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models

from pytgi import LLM, SamplingParams
from pytgi.core.errors import DraftModelError
from tests.kernel_paths import batch_invariant

VOCAB = 64


def save_tiny(path, seed: int, base=None, noise: float = 0.0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions: drafts are often right
        if base is not None:  # the target's weights, a little perturbed: a draft that is mostly right
            for p, q in zip(model.parameters(), base.parameters()):
                p.copy_(q + noise * torch.randn_like(q) * q.std())
    model.save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(
        str(path / "tokenizer.json")
    )
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    target = save_tiny(target_dir, 0)
    save_tiny(draft_dir, 1, base=target, noise=0.3)
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def engines(pair):
    target_dir, draft_dir = pair
    kw = dict(max_batch_total_tokens=4096, max_batch_size=4, block_size=4)
    plain = LLM(str(target_dir), **kw)
    spec = LLM(str(target_dir), draft_model=str(draft_dir), speculate=4, **kw)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


PROMPTS = [[1, 2, 3], [5, 9, 11, 3, 7], [20, 21], [40, 41, 42, 43, 44, 45]]


@batch_invariant
def test_greedy_and_seeded_outputs_are_the_ones_without_speculation(engines):
    plain, spec = engines
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    sampled = [
        SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    before = spec.engine.scheduler.spec_drafted
    for params in (greedy, sampled):
        a, b = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.logprobs for o in a] == [o.logprobs for o in b]  # batch invariant: the same bits
    sched = spec.engine.scheduler
    assert sched.spec_drafted - before > 50 and sched.spec_accepted > 0  # the draft model did draft
    drafter = sched.drafter
    assert not drafter.seqs and drafter.blocks.num_free_blocks == drafter.blocks.num_blocks  # all released


def _chi_square_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom for two samples of equal size over the same categories."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 5]  # sparse categories dropped
    stat = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in keys)
    return stat, len(keys) - 1


def test_sampled_distribution_is_unchanged(engines):
    """Independent seeds with and without the draft model: the second, third and fourth tokens (the
    ones verified drafts give) follow the same distribution. The bound is chi-square's 0.999
    quantile (Wilson-Hilferty), so a correct sampler fails about once in a thousand runs per token."""
    plain, spec = engines
    n, prompt = 600, [3, 8, 13]

    def tokens(llm, first_seed):
        params = [
            SamplingParams(max_new_tokens=4, do_sample=True, seed=first_seed + i, ignore_eos=True)
            for i in range(n)
        ]
        return [o.token_ids for o in llm.generate([prompt] * n, params)]

    accepted = spec.engine.scheduler.spec_accepted
    a, b = tokens(plain, 0), tokens(spec, 10_000)
    assert spec.engine.scheduler.spec_accepted - accepted > n // 8  # drafts were verified and kept
    for pos in (1, 2, 3):
        ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
        stat, dof = _chi_square_two_sample(ca, cb)
        z = 3.09  # the normal's 0.999 quantile
        bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
        assert dof >= 3 and stat < bound, (pos, stat, dof, bound)


def test_a_draft_model_with_another_tokenizer_is_refused(pair, tmp_path):
    target_dir, _ = pair
    save_tiny(tmp_path, 2, vocab=VOCAB)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0")).save(
        str(tmp_path / "tokenizer.json")
    )
    with pytest.raises(DraftModelError, match="tokenizer"):
        LLM(str(target_dir), draft_model=str(tmp_path), max_batch_total_tokens=1024)


@batch_invariant
def test_preemption_keeps_the_output_and_frees_the_drafts_cache(pair, engines):
    target_dir, draft_dir = pair
    plain, _ = engines
    small = LLM(
        str(target_dir),
        draft_model=str(draft_dir),
        speculate=4,
        max_batch_total_tokens=96,
        max_total_tokens=64,
        max_batch_size=4,
        block_size=4,
    )
    try:
        params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
        assert [o.token_ids for o in small.generate(PROMPTS, params)] == want
        sched = small.engine.scheduler
        assert sched.num_preemptions > 0 and sched.spec_accepted > 0
        assert (
            not sched.drafter.seqs and sched.drafter.blocks.num_free_blocks == sched.drafter.blocks.num_blocks
        )
    finally:
        small.shutdown()


@batch_invariant
def test_a_sharded_model_keeps_its_draft_model_whole(pair):
    """With two shards the draft model runs whole on rank 0 (no collective of its own): the output is
    the sharded model's without speculation."""
    target_dir, draft_dir = pair
    kw = dict(max_batch_total_tokens=2048, max_batch_size=4, block_size=4, num_shard=2)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(str(target_dir), **kw)
    try:
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    finally:
        plain.shutdown()
    spec = LLM(str(target_dir), draft_model=str(draft_dir), speculate=4, **kw)
    try:
        assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
        assert spec.engine.scheduler.spec_accepted > 0
    finally:
        spec.shutdown()


@batch_invariant
def test_a_long_prompt_catches_up_in_pieces(pair, engines, monkeypatch):
    """The draft model computes a prompt it is far behind on a piece a step (here 4 tokens), and
    drafts once near: the output is unchanged."""
    import pytgi.engine.speculation.draft_model as draft_module

    _target_dir, _draft_dir = pair
    plain, spec = engines
    monkeypatch.setattr(draft_module, "CATCHUP_TOKENS", 4)
    pieces = []
    real = spec.engine.scheduler.drafter._forward
    monkeypatch.setattr(
        spec.engine.scheduler.drafter,
        "_forward",
        lambda seqs, tokens: pieces.append(max(map(len, tokens))) or real(seqs, tokens),
    )
    prompt = list(range(1, 30))
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    drafted = spec.engine.scheduler.spec_drafted
    assert spec.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
    assert max(pieces) <= 4 and spec.engine.scheduler.drafter.seqs == {}
    assert spec.engine.scheduler.spec_drafted > drafted  # it drafted once caught up
