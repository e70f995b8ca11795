"""GPTQ, AWQ and compressed-tensors W8A8 (int8 and FP8) checkpoints (written here by their published
layouts, tests/quant_checkpoints.py) served over HTTP: float32 greedy output equals transformers on the dequantized weights, the default
bf16 path serves from the packed levels, and /info says what the checkpoint is."""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from tests.e2e.server import Server
from tests.e2e.tiny import llama_config
from tests.quant_checkpoints import write
from tests.unit import tiny_tokenizer

# name: (method, bits, group, sym, format), and what /info says of it
FORMATS = {
    "gptq": (("gptq", 4, 32, True, "gptq"), "gptq 4-bit group 32"),
    "awq": (("awq", 4, 32, False, "gptq"), "awq 4-bit group 32"),
    "w8a8-int8": (("compressed-tensors", 8, -1, True, "int-quantized"), "compressed-tensors 8-bit"),
    "fp8-dynamic": (("compressed-tensors", 8, -1, True, "float-quantized"), "compressed-tensors 8-bit"),
}


def quantized(path, name):
    tiny_tokenizer.build(path)
    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(llama_config(vocab)).float().eval()
    return write(hf, path, *FORMATS[name][0])


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_quantized_checkpoint_serves_over_http(tmp_path, name):
    if FORMATS[name][0][0] == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    method = name
    ref = quantized(tmp_path / method, method)
    body = {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 8, "details": True,
                                                             "decoder_input_details": True}}  # fmt: skip
    srv = Server("--model-id", str(tmp_path / method), log=tmp_path / "exact.log").wait_ready()
    try:
        info = httpx.get(f"{srv.url}/info").json()
        assert info["model_quantization"] == {FORMATS[name][1]: 14}
        r = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
    finally:
        srv.stop()
    prompt = [t["id"] for t in r["details"]["prefill"]]
    got = [t["id"] for t in r["details"]["tokens"]]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    assert got == want.tolist()
    fast = Server("--model-id", str(tmp_path / method), exact=False, log=tmp_path / "fast.log").wait_ready()
    try:
        r = httpx.post(f"{fast.url}/generate", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["details"]["tokens"]) == 8
    finally:
        fast.stop()
