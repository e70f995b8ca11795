"""Gemma 3n's text model in pytgi's own code (`pytgi.engine.models.altup`, `gemma3n`): greedy tokens
against transformers' `generate`, the published multimodal layout served as text, bf16 rows that do not
depend on the batch. (test_tiny_models' "gemma3n" compares the logits of prefills, chunks, decodes and
cached prefixes.)"""

from __future__ import annotations

import json

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models

from pytgi import LLM, SamplingParams
from pytgi.core.config import EngineConfig
from pytgi.engine.execution.runner import ModelRunner
from pytgi.engine.models.decoder import DecoderModel
from tests.model.test_tiny_models import CONFIGS

PROMPTS = [[1, 2, 3, 4], [50, 60, 70], [9] * 40, list(range(10, 70)), [7, 8]]


def _hf(dtype=torch.float32, **change):
    cls, kw = CONFIGS["gemma3n"]
    torch.manual_seed(0)
    hf = transformers.Gemma3nForCausalLM(cls(**{**kw, "eos_token_id": None, **change})).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if ".altup." in name or ".laurel." in name:
                p.add_(torch.randn_like(p) * 0.2)
        hf.model.embed_tokens.weight.mul_(4)  # greedy choices far from ties
    return hf.to(dtype)


def _save(path, hf) -> None:
    hf.save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0")).save(
        str(path / "tokenizer.json")
    )


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
    assert isinstance(llm.engine.runner.model, DecoderModel)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref  # now from the prefix cache


def test_a_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """E2B and E4B are published as `Gemma3nForConditionalGeneration`: the language model's tensors
    under `model.language_model.`, beside the vision and audio towers (not read). The text model's
    tensors moved there (transformers builds the towers only with timm) give its logits."""
    from tests.model.test_gguf_families import prompt_logits
    from tests.model.test_tiny_models import reference

    hf = _hf()
    hf.save_pretrained(tmp_path / "text")
    tensors = load_file(tmp_path / "text" / "model.safetensors")
    moved = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    moved["model.vision_tower.timm_model.conv_stem.conv.weight"] = torch.zeros(4, 3, 3, 3)
    moved["model.embed_audio.embedding.weight"] = torch.zeros(8, 4)
    (tmp_path / "vlm").mkdir()
    save_file(moved, tmp_path / "vlm" / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    config = {
        "architectures": ["Gemma3nForConditionalGeneration"],
        "model_type": "gemma3n",
        "text_config": text,
        "vision_config": {"model_type": "gemma3n_vision"},
        "audio_config": {"model_type": "gemma3n_audio"},
        "tie_word_embeddings": True,
    }
    (tmp_path / "vlm" / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(EngineConfig(model=str(tmp_path / "vlm"), dtype="float32", device="cpu"))
    assert isinstance(runner.model, DecoderModel)
    seq = np.random.default_rng(1).integers(0, 97, 23).tolist()
    torch.testing.assert_close(prompt_logits(runner, seq), reference(hf, seq), atol=2e-5, rtol=1e-4)


def test_bf16_rows_do_not_depend_on_the_batch(tmp_path):
    """The default (bf16) path, its linears packed for the CPU's kernels: a prompt's tokens and
    logprobs alone are those it gets in a batch (chunks of 48 tokens beside decodes). (A window past
    every prompt, as Gemma 4's test has it: a short prompt's first logprob beside a prompt longer than
    the window is the sliding layers' business.)"""
    _save(tmp_path, _hf(torch.bfloat16, sliding_window=128))
    llm = LLM(str(tmp_path), max_batch_total_tokens=2048, max_batch_prefill_tokens=48)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, top_n_tokens=2)
    alone = [llm.generate(p, params)[0] for p in PROMPTS]
    together = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.logprobs for o in together] == [o.logprobs for o in alone]  # the same bits
