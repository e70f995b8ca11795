"""The default model's own weights (SmolLM2-135M-Instruct) written in each pre-quantized format
(tests/quant_checkpoints.py: GPTQ, AWQ, compressed-tensors packed, int8 and FP8, HF's block FP8): in
float32 pytgi's greedy output equals transformers on the checkpoint's dequantized weights; in bf16 the
levels stay packed and score float32's output within 0.05 nats a token."""

from __future__ import annotations

import pytest
import torch

from pytgi import LLM, SamplingParams
from pytgi.core.model_files import resolve_model
from tests.quant_checkpoints import write
from tests.reference import hf_copy

pytestmark = pytest.mark.slow

# name: (method, bits, group, sym, format): 576 and 1536 inputs take groups of 64; FP8 blocks of 128
# leave partial blocks at the edges
FORMATS = {
    "gptq-4bit-g64": ("gptq", 4, 64, True, "gptq"),
    "awq-4bit-g64": ("awq", 4, 64, False, "gptq"),
    "ct-w4a16-g64": ("compressed-tensors", 4, 64, True, "pack-quantized"),
    "ct-w8a8-int8": ("compressed-tensors", 8, -1, True, "int-quantized"),
    "ct-fp8-dynamic": ("compressed-tensors", 8, -1, True, "float-quantized"),
    "fp8-block128": ("fp8", 8, -1, True, "gptq"),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def source():
    from transformers import AutoModelForCausalLM

    path = hf_copy(resolve_model(None).path)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_default_model_in_each_format(tmp_path, source, name):
    path, hf = source
    method, bits, group, sym, fmt = FORMATS[name]
    if method == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    out = tmp_path / name
    ref = write(hf, out, method, bits, group, sym, fmt)
    for f in path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            (out / f.name).write_bytes(f.read_bytes())
    exact = LLM(str(out), dtype="float32", max_batch_total_tokens=4096)
    prompts = [exact.tokenizer.encode(p) for p in PROMPTS]
    got = [o.token_ids for o in exact.generate(prompts, GREEDY)]
    want = []
    with torch.no_grad():
        for ids in prompts:
            seq = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
            want.append(seq[0, len(ids) :].tolist())
    assert got == want
    # bf16 (the packed levels, the int8 head) scores the float32 path's text within 0.05 nats a token
    text = [p + w for p, w in zip(prompts, want)]
    fast = LLM(str(out), dtype="bfloat16", max_batch_total_tokens=4096)
    assert abs(nll(fast, text) - nll(exact, text)) <= 0.05


def nll(llm: LLM, texts: list[list[int]]) -> float:
    """Mean negative log-likelihood per token of `texts`, each token given those before it."""
    outs = llm.generate(texts, SamplingParams(max_new_tokens=1, prompt_logprobs=True, temperature=0))
    lps = [x for o in outs for x in o.prompt_logprobs if x is not None]
    return -sum(lps) / len(lps)
