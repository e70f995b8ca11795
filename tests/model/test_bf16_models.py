"""A Hugging Face bf16 model on CPU, served as it is: its weights stay bf16 (exact to the checkpoint),
every linear of the default path runs on pytgi's bf16 kernel (`pytgi/engine/kernels/bf16gemm.c`), a
request's output does not depend on what else runs, and `--quantize none` keeps PyTorch's matmuls."""

from __future__ import annotations

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models

from pytgi import LLM, SamplingParams
from pytgi.engine import kernels
from pytgi.engine.models.quant import QuantizedLinear

pytestmark = pytest.mark.skipif(
    not kernels.bf16gemm_supported(), reason="no bf16gemm.c here (AVX2 or AVX-512 BF16)"
)

PROMPTS = [[1, 2, 3, 4], [50, 60, 70], [9] * 40, list(range(100, 160)), [7, 8]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(  # type: ignore[call-arg]
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=None,
        torch_dtype="bfloat16",
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked logits: greedy choices far from ties
    model.save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0")).save(
        str(path / "tokenizer.json")
    )
    return path, model


def test_weights_stay_bf16_on_the_kernel_and_rows_do_not_depend_on_the_batch(model_dir):
    path, hf = model_dir
    llm = LLM(str(path), max_batch_total_tokens=2048, max_batch_prefill_tokens=48)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 2 * 4 + 1 and all(m.quant.kind == "bf16" for m in linears)  # 4 per layer, the head
    head = model.lm_head.quant
    assert torch.equal(
        head.packed.transpose(1, 2).reshape(256, 128), hf.lm_head.weight.data
    )  # the checkpoint's bf16 values, only laid out anew
    assert model.lm_head.layer.weight.numel() == 0  # every step takes the kernel: no second copy kept
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, top_n_tokens=2)
    alone = [llm.generate(p, params)[0] for p in PROMPTS]
    together = llm.generate(PROMPTS, params)  # chunks of 48 tokens beside decodes
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.logprobs for o in together] == [o.logprobs for o in alone]  # the same bits


def test_greedy_tokens_follow_transformers_bf16_and_none_keeps_pytorch(model_dir):
    path, hf = model_dir
    fast = LLM(str(path), max_batch_total_tokens=2048)
    plain = LLM(str(path), max_batch_total_tokens=2048, quantize="none")
    assert not any(isinstance(m, QuantizedLinear) for m in plain.engine.runner.model.modules())
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    ours = [o.token_ids for o in fast.generate(PROMPTS, params)]
    torch_path = [o.token_ids for o in plain.generate(PROMPTS, params)]
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    # bf16 sums in another order can flip a near tie; the peaked head keeps nearly all equal
    agree = sum(a == b for a, b in zip(ours, ref))
    assert agree >= len(PROMPTS) - 1 and sum(a == b for a, b in zip(torch_path, ref)) >= len(PROMPTS) - 1
