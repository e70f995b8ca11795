"""Multi-head latent attention (DeepSeek V2 / V3) in the engine: the KV cache holds the latent row only
and is sized from it, the engine's greedy tokens follow transformers' (float32, with speculation and
prefix hits), the default bf16 path is batch invariant on a latent row the AVX-512 kernels take
(96 values), an int8 cache follows the float one, and what MLA does not serve is refused by name. Logits against transformers on every
kernel path: tests/model/test_tiny_models.py; GGUF files: tests/model/test_gguf_families.py."""

from __future__ import annotations

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models

from pytgi import LLM, SamplingParams
from pytgi.core.families import family_of
from pytgi.engine import kernels
from pytgi.engine.execution.batch import PagedModel, kv_dtype_refusal
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.decoder import DecoderModel
from pytgi.engine.models.deepseek import deepseek_config
from pytgi.engine.models.mla import MLAttention
from tests.model.test_tiny_models import CONFIGS

PROMPTS = [[1, 2, 3, 4], [50, 60, 70], [9] * 40, list(range(100, 160)), [7, 8]]


def _save(path, cls, kw, dtype=torch.float32):
    torch.manual_seed(0)
    hf = getattr(transformers, cls.__name__.replace("Config", "ForCausalLM"))(cls(**kw)).to(dtype).eval()
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
        hf.lm_head.weight.mul_(20.0)  # peaked logits: greedy choices far from ties
    hf.save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(kw["vocab_size"])}, unk_token="t0")).save(
        str(path / "tokenizer.json")
    )
    return hf


def test_the_cache_holds_the_latent_row_only():
    cls, kw = CONFIGS["deepseek-v3-moe"]
    cfg = deepseek_config({**cls(**kw).to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    paged = PagedModel(DecoderModel(cfg, Kernels.none()), torch.bfloat16, torch.device("cpu"))
    row = kw["kv_lora_rank"] + kw["qk_rope_head_dim"]  # 48, not 4 heads × (32 + 24)
    assert paged.kv_bytes_per_token() == kw["num_hidden_layers"] * row * 2
    paged.allocate(8, 16)
    assert [tuple(t.shape) for t in paged.kv_caches[0]] == [(128, 1, row), (128, 1, 0)]
    int8 = PagedModel(paged.model, torch.bfloat16, torch.device("cpu"), kv_dtype="int8")
    assert int8.kv_bytes_per_token() == kw["num_hidden_layers"] * (row + 2)  # the row and its bf16 scale
    int8.allocate(8, 16)
    assert [tuple(t.shape) for t in int8.kv_caches[0]] == [(128, 1, row + 2), (128, 1, 0)]


@pytest.mark.skipif(not kernels.available(), reason="the int8 cache is written and read by the C kernels")
def test_an_int8_cache_follows_the_float_one(tmp_path):
    cls, kw = CONFIGS["deepseek-v3-mla-yarn"]  # (no router: a near tie between experts cannot flip)
    _save(tmp_path, cls, dict(kw, vocab_size=256, eos_token_id=None))
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    runs = {}
    for kv in ("auto", "int8"):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_dtype=kv, max_batch_total_tokens=1024)
        runs[kv] = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in runs["int8"]] == [o.token_ids for o in runs["auto"]]
    gap = max(abs(a - b) for x, y in zip(runs["int8"], runs["auto"]) for a, b in zip(x.logprobs, y.logprobs))
    assert gap < 0.05, gap


def test_what_mla_does_not_serve_is_refused_by_name():
    family = family_of("DeepseekV3ForCausalLM")
    assert family is not None and family.lora and "fp8" not in family.kv_dtypes  # (LoRA: test_lora.py)
    cls, kw = CONFIGS["deepseek-v3-mla-yarn"]
    model = DecoderModel(
        deepseek_config({**cls(**kw).to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}), Kernels.none()
    )
    fp8 = kv_dtype_refusal(model, torch.device("cuda"), torch.bfloat16, "fp8", family)
    assert "plain causal attention" in (fp8 or "")
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not served"):
        v2: dict = dict(CONFIGS["deepseek-v2-lite-moe"][1])
        deepseek_config({**v2, "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc"})


def test_greedy_tokens_follow_transformers_with_speculation_and_prefix_hits(tmp_path):
    cls, kw = CONFIGS["deepseek-v3-moe"]
    hf = _save(tmp_path, cls, dict(kw, vocab_size=256, eos_token_id=None))
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    llm = LLM(str(tmp_path), dtype="float32", max_batch_total_tokens=1024, max_batch_prefill_tokens=24)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref  # now from the prefix cache
    spec = LLM(str(tmp_path), dtype="float32", max_batch_total_tokens=1024, speculate=3)
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == ref


def test_bf16_rows_do_not_depend_on_the_batch(tmp_path):
    """A latent row of 96 values (64 + 32): the AVX-512 kernels' bf16 paths where the CPU has them,
    and the per-head projections in bf16gemm.c (values of 32 features)."""
    cls, kw = CONFIGS["deepseek-v3-moe"]
    kw = dict(kw, vocab_size=256, kv_lora_rank=64, qk_rope_head_dim=32, v_head_dim=32, eos_token_id=None)
    _save(tmp_path, cls, kw, torch.bfloat16)
    llm = LLM(str(tmp_path), max_batch_total_tokens=2048, max_batch_prefill_tokens=48)
    kv_b = next(m for m in llm.engine.runner.model.modules() if isinstance(m, MLAttention)).kv_b_proj
    assert (kv_b.packed is not None) == kernels.bf16gemm_supported()
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, top_n_tokens=2)
    alone = [llm.generate(p, params)[0] for p in PROMPTS]
    together = llm.generate(PROMPTS, params)  # chunks of 48 tokens beside decodes
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.logprobs for o in together] == [o.logprobs for o in alone]  # the same bits


def test_the_latent_rows_go_to_disk_and_come_back(tmp_path):
    """--prefix-cache-dir: the blocks of the latent rows (no value columns to write) are read back at a
    restart, the output is the cold run's, and a block recomputed to check equals its file to the bit
    (the default bf16 path is batch invariant)."""
    from pytgi.core.config import EngineConfig
    from pytgi.engine.llm_engine import LLMEngine
    from tests.model.test_prefix_disk import PROMPT, generate

    cls, kw = CONFIGS["deepseek-v3-moe"]
    _save(tmp_path / "m", cls, dict(kw, vocab_size=256, eos_token_id=None))

    def engine(cache=None, **extra):
        return LLMEngine(
            EngineConfig(
                model=str(tmp_path / "m"),
                max_batch_total_tokens=512,
                block_size=4,
                progress=False,
                prefix_cache_dir=cache and str(cache),
                **extra,
            )
        )

    cold = engine()
    want = generate(cold, PROMPT + [5, 6])[0]
    cold.shutdown()
    first = engine(tmp_path / "kv")
    generate(first, PROMPT)
    first.shutdown()  # the writes in flight land first
    second = engine(tmp_path / "kv", prefix_cache_verify_rate=1.0)
    tokens, cached, disk = generate(second, PROMPT + [5, 6])
    stats = second.disk.stats
    second.shutdown()
    assert tokens == want and cached == disk == 84
    assert stats.verify_mismatches == 0


def test_kv_b_repacks_alike_from_a_checkpoint_and_from_a_gguf_files_two_halves():
    """kv_b_proj whole (a checkpoint, shard 0) or as llama.cpp splits it (W_UK transposed, shard 1;
    W_UV, shard 2): the same per-head weights packed for bf16gemm.c, and the flat parameter freed."""
    from pytgi.engine.models.mla import _KVB

    H, nope, v, r = 3, 16, 32, 64
    kv_b = torch.randn(H * (nope + v), r).bfloat16()  # per head: W_UK rows [nope, r], then W_UV [v, r]
    per_head = kv_b.view(H, nope + v, r)
    halves = (per_head[:, :nope].transpose(1, 2).contiguous(), per_head[:, nope:].contiguous())
    whole, split = _KVB(H, nope, v, r), _KVB(H, nope, v, r)
    for m in (whole, split):
        m.weight.data = m.weight.data.bfloat16()
        m.pack = True
    whole.load(whole.weight, kv_b, 0)
    split.load(split.weight, halves[0], 1)
    assert split.packed is None  # (not before both halves are in)
    split.load(split.weight, halves[1], 2)
    assert whole.packed is not None and split.packed is not None
    assert all(torch.equal(a, b) for a, b in zip(whole.packed, split.packed))
    assert whole.weight.numel() == split.weight.numel() == 0
    if kernels.bf16gemm_supported():  # and they are W_UK and W_UV: queries into the latent space and back
        q, lat = torch.randn(2, H, nope).bfloat16(), torch.randn(2, H, r).bfloat16()
        got_q = kernels.bf16_matmul_heads(q, whole.packed[0], r, torch.empty(2, H, r, dtype=torch.bfloat16))
        got_o = kernels.bf16_matmul_heads(lat, whole.packed[1], v, torch.empty(2, H, v, dtype=torch.bfloat16))
        w_uk, w_uv = per_head[:, :nope].float(), per_head[:, nope:].float()
        want_q = torch.einsum("thn,hnr->thr", q.float(), w_uk)
        want_o = torch.einsum("thr,hvr->thv", lat.float(), w_uv)
        torch.testing.assert_close(got_q.float(), want_q, atol=0.1, rtol=0.02)
        torch.testing.assert_close(got_o.float(), want_o, atol=0.1, rtol=0.02)
