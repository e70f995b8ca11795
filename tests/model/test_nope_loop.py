"""SmolLM3's NoPE layers in the one-call C decoder loop: one call per run of layers alike, the NoPE
runs given the identity's rope tables, gives the Python layer loop's tokens and prompt logprobs bit
for bit (int8 weights, bf16), with LoRA adapters too (each run given its layers' adapter tables)."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from pytgi.core.model_files import resolve_model
from pytgi.core.sampling_params import SamplingParams
from tests.kernel_paths import decoder_loop
from tests.model.loop_check import assert_loop_equals_python_path


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    """8 layers, 3 and 7 without RoPE (four runs), SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("smollm3-loop")
    torch.manual_seed(0)
    cfg = transformers.SmolLM3Config(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    transformers.SmolLM3ForCausalLM(cfg).save_pretrained(path)
    tok = resolve_model(None, progress=False).path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, path / name)
    return path


@decoder_loop
def test_smollm3_nope_layers_run_in_the_c_loop(smollm3):
    from pytgi import LLM

    fast = LLM(model=str(smollm3), dtype="bfloat16", quantize="int8", max_batch_total_tokens=2048)
    try:
        loop = fast.engine.runner.model.decoder_loop
        assert loop is not None and [r[2] for r in loop.runs] == [True, False, True, False]
        texts = ("The capital of France is", "def f(x):\n", "Once upon a time, " * 8)
        prompts = [fast.tokenizer.encode(t) for t in texts]
        assert_loop_equals_python_path(fast, prompts, 11, quantize="int8")
    finally:
        fast.shutdown()


@decoder_loop
def test_smollm3_nope_runs_add_their_layers_adapters(smollm3, tmp_path):
    peft = pytest.importorskip("peft")
    from tests.model.test_lora import engine_for

    adapters = {}
    for i, targets in enumerate([["q_proj", "k_proj", "v_proj"], ["o_proj", "gate_proj", "down_proj"]]):
        torch.manual_seed(i + 1)
        model = transformers.AutoModelForCausalLM.from_pretrained(smollm3, dtype=torch.float32)
        lora = peft.get_peft_model(
            model, peft.LoraConfig(r=8, init_lora_weights=False, target_modules=targets)
        )
        lora.save_pretrained(tmp_path / str(i))
        adapters[f"a{i}"] = tmp_path / str(i)
    engine = engine_for(smollm3, adapters, dtype="bfloat16", quantize="int8")
    model = engine.runner.model
    loop, used = model.decoder_loop, []
    assert loop is not None and len(loop.runs) == 4

    def counting(*args, **kwargs):
        h = loop(*args, **kwargs)
        used.append(h is not None and args[-1] is not None)
        return h

    counting.takes_lora = True  # type: ignore[attr-defined]
    counting.takes_window = False  # type: ignore[attr-defined]

    def outputs():
        for i in range(6):
            params = SamplingParams(
                max_new_tokens=8,
                temperature=0,
                prompt_logprobs=True,
                ignore_eos=True,
                adapter=[None, "a0", "a1"][i % 3],
            )
            engine.add_request(str(i), [5 + i, 17, 3, 99, 42, 8, 1, 64][: 4 + i], params)
        got: dict[str, list] = {str(i): [] for i in range(6)}
        while engine.has_unfinished():
            for u in engine.step():
                got[u.request_id].append((u.token_id, u.logprob, u.prompt_logprobs))
        return got

    try:
        model.decoder_loop = counting
        with_loop = outputs()
        assert sum(used) >= 7, used  # decode steps ran in the loop with their adapters
        model.decoder_loop = None
        assert outputs() == with_loop
    finally:
        engine.shutdown()
