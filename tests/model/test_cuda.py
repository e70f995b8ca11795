"""The CUDA path end to end: Triton kernels, decode CUDA graphs and sampling on the GPU, against
transformers and against pytgi's CPU path. Skipped without a GPU (benchmarks/gpu.sh runs them on
one); the kernels' logic is checked everywhere by tests/unit/test_gpu_kernels.py in Triton's
interpreter.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pytgi import LLM, SamplingParams
from pytgi.core.config import EngineConfig
from pytgi.engine.execution.batch import StepBatch
from pytgi.engine.execution.runner import ModelRunner
from tests.unit import tiny_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CONFIG = dict(
    vocab_size=300,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[transformers.PreTrainedModel, Path]:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer.build(path / "tok")  # `LLM` needs a tokenizer (ids below its 400 decode)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / "tok" / name, path / name)
    return hf, path


def test_logits_match_transformers_with_graphs(tiny):
    """Prefill, then decode steps replayed from the captured graphs (batch 3 pads to 4), against
    transformers' float32 logits; the graph's logits equal the eager step's."""
    hf, path = tiny
    runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cuda"))
    runner.allocate_kv_cache(64, 16)
    assert runner.paged.graphs is not None and 4 in runner.paged.graphs.graphs
    prompts = [[5, 9, 2, 7, 11], list(range(20, 57)), [3]]
    tables = [[1, 2, 3, 4], [10, 11, 12, 13], [20, 21, 22, 23]]
    seqs = [list(p) for p in prompts]
    step = StepBatch.build(prompts, [0, 0, 0], tables, 16)
    logits = runner.paged.forward(step, step.last_rows)
    for _ in range(6):
        nxt = logits.argmax(-1).tolist()
        starts = [len(s) for s in seqs]
        for s, t in zip(seqs, nxt):
            s.append(t)
        step = StepBatch.build([[t] for t in nxt], starts, tables, 16)
        logits = runner.paged.forward(step, step.last_rows)
        graphs, runner.paged.graphs = runner.paged.graphs, None
        eager = runner.paged.forward(step, step.last_rows)
        runner.paged.graphs = graphs
        torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            ref = torch.stack([hf(torch.tensor([s])).logits[0, -1].float() for s in seqs])
        torch.testing.assert_close(logits.cpu(), ref, atol=1e-4, rtol=1e-4)


def _llm(path: Path, device: str, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", device=device, **kw)


def test_batched_equals_alone_and_seeds_reproduce(tiny):
    _, path = tiny
    llm = _llm(path, "cuda")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 290, n).tolist() for n in (3, 40, 17, 90, 8)]
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    for params in (greedy, seeded):
        together = [o.token_ids for o in llm.generate(prompts, params)]
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        assert together == alone


def test_greedy_cuda_equals_cpu(tiny):
    _, path = tiny
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 290, n).tolist() for n in (5, 64, 200)]
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    cpu = [o.token_ids for o in _llm(path, "cpu").generate(prompts, params)]
    cuda = [o.token_ids for o in _llm(path, "cuda").generate(prompts, params)]
    assert cuda == cpu


@pytest.mark.skipif(
    not os.environ.get("PYTGI_DEFAULT_MODEL_CHECK"), reason="the default model's GGUF is not here"
)
def test_default_model_greedy_cuda_equals_cpu():
    """The default model in float32: CUDA's greedy tokens are the CPU's."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
    params = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
    cpu = [o.token_ids for o in LLM(dtype="float32", device="cpu").generate(prompts, params)]
    cuda = [o.token_ids for o in LLM(dtype="float32", device="cuda").generate(prompts, params)]
    print("default model, CPU:", cpu[0][:12], "CUDA:", cuda[0][:12])
    assert cuda == cpu
