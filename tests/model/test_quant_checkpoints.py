"""GPTQ and AWQ checkpoints served as published (`pytgi.engine.loading.checkpoints`): written here by
each format's layout from a tiny random Llama, their float32 path equals transformers on the
dequantized weights, their bf16 path keeps the levels packed (no float copy) and stays close, and
formats not served are refused with the list of those that are."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from pytgi.core.config import EngineConfig
from pytgi.engine.execution.runner import ModelRunner
from pytgi.engine.loading.checkpoints import (
    QuantizedCheckpoint,
    UnsupportedQuantization,
    dequantize,
    fp8_dequantize,
    fp8_rows,
    grid_of,
    linear_levels,
    read_quantization,
)
from pytgi.engine.loading.gguf import group_values
from pytgi.engine.models.quant import HEAD_KIND, QuantizedLinear
from tests.model.test_gguf_families import prompt_logits, tiny_model
from tests.model.test_gguf_loading import FAMILIES
from tests.model.test_tiny_models import reference
from tests.quant_checkpoints import write

CASES = {  # name: (method, bits, group, sym, format, desc_act)
    "gptq-4bit-sym": ("gptq", 4, 32, True, "gptq", False),
    "gptq-4bit-asym-v2": ("gptq", 4, 64, False, "gptq_v2", False),
    "gptq-8bit-row": ("gptq", 8, -1, True, "gptq", False),
    "gptq-4bit-desc-act": ("gptq", 4, 32, True, "gptq", True),
    "awq-4bit": ("awq", 4, 32, False, "gptq", False),
    "ct-4bit-sym": ("compressed-tensors", 4, 32, True, "", False),
    "ct-4bit-asym": ("compressed-tensors", 4, 64, False, "", False),
    "ct-8bit-channel": ("compressed-tensors", 8, -1, True, "", False),
    "fp8-blocks": ("fp8", 8, -1, True, "gptq", False),
    # compressed-tensors' unpacked formats (group: -1 channel, 0 tensor, else group or float block)
    "ct-w8a8-int-channel": ("compressed-tensors", 8, -1, True, "int-quantized", False),
    "ct-w8a8-int-tensor-asym": ("compressed-tensors", 8, 0, False, "int-quantized", False),
    "ct-naive-4bit-group": ("compressed-tensors", 4, 32, True, "naive-quantized", False),
    "ct-fp8-channel": ("compressed-tensors", 8, -1, True, "float-quantized", False),
    "ct-fp8-tensor": ("compressed-tensors", 8, 0, True, "float-quantized", False),
    "ct-fp8-block": ("compressed-tensors", 8, 32, True, "float-quantized", False),
}


def checkpoint(tmp_path, case):
    method, bits, group, sym, fmt, act_order = CASES[case]
    if method == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    _, kw, hf = tiny_model(FAMILIES["llama"])
    ref = write(hf, tmp_path / case, method, bits, group, sym, fmt, act_order)
    return tmp_path / case, kw, ref


@pytest.mark.parametrize("case", list(CASES))
def test_levels_and_grids_hold_the_checkpoints_values(tmp_path, case):
    path, _, ref = checkpoint(tmp_path, case)
    quant = read_quantization(path)
    ckpt = QuantizedCheckpoint(path, quant)
    assert len(ckpt.linears) == 7 * 2
    module = "model.layers.1.mlp.down_proj"
    want = ref.get_submodule(module).weight.data
    parts = ckpt.parts(module)
    if quant.float8:
        assert torch.equal(fp8_dequantize(quant, parts), want)
        q, s, block_k = fp8_rows(quant, parts)
        assert q.dtype == torch.uint8 and s.shape == (want.shape[0], -(-want.shape[1] // block_k))
        return
    assert torch.equal(dequantize(quant, parts), want)
    levels, zeros, scales, perm = linear_levels(quant, parts)
    assert (perm is not None) == case.endswith("desc-act")
    if quant.method == "compressed-tensors" and quant.stored == "int":  # signed int8s, offset to unsigned
        assert torch.equal(parts["weight"].to(torch.int32) + (1 << (quant.bits - 1)), levels.to(torch.int32))
    elif quant.method == "compressed-tensors":  # the library's own unpacking, offset back to unsigned
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        own = unpack_from_int32(parts["weight_packed"], quant.bits, torch.Size(want.shape)).to(torch.int32)
        assert torch.equal(own + (1 << (quant.bits - 1)), levels.to(torch.int32))
    u, d, m = grid_of(quant, levels, zeros, scales, quant.kind)
    got = group_values(u.to(torch.int32), d, m)
    if perm is not None:  # the levels come with their inputs in group order
        got = got[:, torch.argsort(perm)]
    if quant.sym:  # exact: fp16 scales, zeros folded exactly
        assert torch.equal(got, want)
    else:  # zero points: -zero·scale (8-bit: an offset from the lowest level) rounded to fp16 once per group
        assert (got - want).abs().max() <= 2**-11 * (1 << quant.bits) * d.max()


@pytest.mark.parametrize("case", list(CASES))
def test_float32_equals_transformers_on_the_dequantized_weights(tmp_path, case):
    path, kw, ref = checkpoint(tmp_path, case)
    runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    seq = np.random.default_rng(4).integers(0, kw["vocab_size"], 17).tolist()
    torch.testing.assert_close(prompt_logits(runner, seq), reference(ref, seq), atol=2e-5, rtol=1e-4)


PACKED = ["gptq-4bit-sym", "awq-4bit", "gptq-8bit-row", "gptq-4bit-desc-act", "ct-4bit-asym", "ct-8bit-channel",
          "fp8-blocks", "ct-w8a8-int-channel", "ct-naive-4bit-group", "ct-fp8-channel"]  # fmt: skip


@pytest.mark.parametrize("case", PACKED)
def test_bf16_keeps_the_levels_packed(tmp_path, case):
    """(FP8 on CPU: dequantized to bf16, on the bf16 kernel where it builds.)"""
    path, kw, ref = checkpoint(tmp_path, case)
    fast = ModelRunner(EngineConfig(model=str(path), dtype="bfloat16", device="cpu"))
    model: Any = fast.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    kind = read_quantization(path).kind
    # qkv, o, gate|up, down as the checkpoint's levels (FP8: dequantized to bf16); the tied float head int8
    head = model.lm_head
    assert isinstance(head, QuantizedLinear) and head.quant.kind == HEAD_KIND
    assert len(linears) == 4 * kw["num_hidden_layers"] + 1
    assert {m.quant.kind for m in linears if m is not head} == {"bf16" if kind == "fp8" else kind}
    assert all((m.perm is not None) == case.endswith("desc-act") for m in linears if m is not head)
    seq = np.random.default_rng(5).integers(0, kw["vocab_size"], 17).tolist()
    got, want = prompt_logits(fast, seq).float(), reference(ref, seq)
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize(
    "qc, why",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not served"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"format": "nvfp4-pack-quantized", "weights": {"type": "float", "num_bits": 4}}
                },
            },
            "compressed-tensors nvfp4-pack-quantized",
        ),
        ({"quant_method": "hqq"}, "'hqq' is not served"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3 bits"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group size of 48"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ gemv"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    ],
)
def test_formats_not_served_are_refused_with_the_list(tmp_path, qc, why):
    path, _, _ = checkpoint(tmp_path, "gptq-4bit-sym")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    with pytest.raises(UnsupportedQuantization, match=why) as err:
        ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    assert "gptq (bits 4 or 8" in str(err.value) and "awq (gemm" in str(err.value)
    with pytest.raises(ValueError, match="quantized already"):
        cfg["quantization_config"] = CASES_CONFIG
        (path / "config.json").write_text(json.dumps(cfg))
        ModelRunner(EngineConfig(model=str(path), dtype="bfloat16", device="cpu", quantize="int8"))


CASES_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}


def test_lora_and_speculation_on_a_gptq_checkpoint(tmp_path):
    """An adapter trained on the float model serves on the checkpoint as peft runs it on the
    dequantized weights (float32), and speculation leaves greedy outputs as they are."""
    peft = pytest.importorskip("peft")
    from pytgi.engine.llm_engine import LLMEngine
    from tests.model.test_lora import NEW, PROMPTS, make_adapter, run

    path, kw, ref = checkpoint(tmp_path, "gptq-4bit-sym")
    ref.save_pretrained(tmp_path / "float")
    targets = {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    adapter = make_adapter(tmp_path / "float", tmp_path / "adapter", targets, 1)
    model = peft.PeftModel.from_pretrained(transformers_model(tmp_path / "float"), adapter).eval()
    prompts = [[p % kw["vocab_size"] for p in prompt] for prompt in PROMPTS]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
            )
        want.append(out[0, len(p) :].tolist())
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", max_batch_total_tokens=2048,
                                    lora_adapters=(f"a={adapter}",), speculate=2))  # fmt: skip
    try:
        assert run(engine, [(p, "a") for p in prompts]) == want
        assert run(engine, [(p, None) for p in prompts]) != want
    finally:
        engine.shutdown()


def transformers_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
