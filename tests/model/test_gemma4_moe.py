"""Gemma 4's mixture-of-experts block (gemma-4-26B-A4B) in pytgi's own code: the router and experts
against transformers' modules, greedy tokens against transformers' `generate`, bf16 rows that do not
depend on the batch. (test_tiny_models' "gemma4-moe" compares the logits of prefills, chunks and
decodes; test_gguf_families' the file llama.cpp's converter writes.)"""

from __future__ import annotations

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models

from pytgi import LLM, SamplingParams
from pytgi.core.config import EngineConfig
from pytgi.engine import kernels
from pytgi.engine.execution.runner import ModelRunner
from pytgi.engine.models.decoder import DecoderModel
from pytgi.engine.models.gemma4 import gemma4_config
from pytgi.engine.models.moe import SparseMoE
from tests.model.test_tiny_models import CONFIGS, randomize_gemma4_router

PROMPTS = [[1, 2, 3, 4], [50, 60, 70], [9] * 40, list(range(100, 160)), [7, 8]]


def _hf(dtype=torch.float32, **change):
    cls, kw = CONFIGS["gemma4-moe"]
    torch.manual_seed(0)
    cfg = cls(**{**kw, "vocab_size": 256, "eos_token_id": None, **change})
    hf = transformers.Gemma4ForCausalLM(cfg).float().eval()
    randomize_gemma4_router(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        hf.model.embed_tokens.weight.mul_(8)  # a tied head of std 0.16: greedy choices far from ties
    return hf.to(dtype)


def _save(path, hf) -> None:
    hf.save_pretrained(path)
    vocab = hf.config.vocab_size
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(
        str(path / "tokenizer.json")
    )


def test_the_block_is_transformers_router_and_experts():
    """One layer's SparseMoE (Gemma 4's routing, GELU experts) with transformers' router and experts'
    weights: the same (expert, weight) pairs and outputs for random inputs, whose router input is not
    the experts' (transformers routes the residual stream)."""
    hf = _hf()
    layer = hf.model.layers[0]
    cfg = gemma4_config(hf.config.to_dict())
    assert cfg.moe is not None and cfg.moe.beside_dense and cfg.moe.activation == "gelu_tanh"
    moe = SparseMoE(
        64, 32, 8, 2, True, routing=cfg.moe.routing, activation="gelu_tanh", router_eps=cfg.rms_norm_eps
    )
    for name, t in [
        ("gate.weight", layer.router.proj.weight),
        ("router_scale", layer.router.scale),
        ("per_expert_scale", layer.router.per_expert_scale),
    ]:
        moe.get_parameter(name).data.copy_(t)
    moe.load_experts("experts.gate_up_proj", layer.experts.gate_up_proj.data)
    moe.load_experts("experts.down_proj", layer.experts.down_proj.data)
    torch.manual_seed(1)
    residual, x = torch.randn(37, 64) * 3, torch.randn(37, 64)
    with torch.no_grad():
        _, want_w, want_e = layer.router(residual)
        want = layer.experts(x, want_e, want_w)
        got_w, got_e = moe.route(residual)
        got = moe(x, router_input=residual)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_multimodal_checkpoint_with_experts_serves_its_language_model(tmp_path):
    """gemma-4-26B-A4B is published as `Gemma4ForConditionalGeneration`: its language model's router and
    experts (`model.language_model.layers.N.router.*`, `.experts.*`) are read, the logits transformers'."""
    from tests.model.test_gguf_families import prompt_logits
    from tests.model.test_tiny_models import reference

    cls, kw = CONFIGS["gemma4-multimodal-as-text"]
    moe = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(
        cls(**{**kw, "text_config": {**kw["text_config"], **moe}})
    )
    hf = hf.float().eval()
    randomize_gemma4_router(hf)
    hf.save_pretrained(tmp_path)
    runner = ModelRunner(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu"))
    model = runner.model
    assert isinstance(model, DecoderModel) and all(isinstance(layer.moe, SparseMoE) for layer in model.layers)
    seq = np.random.default_rng(1).integers(0, 97, 23).tolist()
    torch.testing.assert_close(prompt_logits(runner, seq), reference(hf, seq), atol=2e-5, rtol=1e-4)


def test_greedy_tokens_follow_transformers(tmp_path):
    hf = _hf()
    _save(tmp_path, hf)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    llm = LLM(str(tmp_path), dtype="float32", max_batch_total_tokens=1024, max_batch_prefill_tokens=24)
    model = llm.engine.runner.model
    assert isinstance(model, DecoderModel) and all(isinstance(layer.moe, SparseMoE) for layer in model.layers)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref  # now from the prefix cache


def test_bf16_rows_do_not_depend_on_the_batch(tmp_path):
    """The default (bf16) path: a prompt's tokens and logprobs alone are those it gets in a batch
    (chunks of 48 tokens beside decodes), the experts on bf16gemm.c as the linears are. (A window
    past every prompt: with the window of 8, a short prompt's first logprob changes in a prefill
    step beside a prompt longer than the window, dense Gemma 4 alike: the sliding layers', not this
    block's.)"""
    _save(tmp_path, _hf(torch.bfloat16, sliding_window=128))
    llm = LLM(str(tmp_path), max_batch_total_tokens=2048, max_batch_prefill_tokens=48)
    moe = llm.engine.runner.model.layers[0].moe
    assert (len(moe.packed) == 8 and moe.gate_up.numel() == 0) == kernels.bf16gemm_supported()
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, top_n_tokens=2)
    alone = [llm.generate(p, params)[0] for p in PROMPTS]
    together = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.logprobs for o in together] == [o.logprobs for o in alone]  # the same bits
