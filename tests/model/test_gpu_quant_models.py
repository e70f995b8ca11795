"""Quantized weights on the CUDA path (Triton's interpreter without a GPU): a GGUF model's linears kept
in their levels and grids, and `--quantize fp8`, give the logits of the dequantized weights."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from pytgi.core.config import EngineConfig
from pytgi.core.model_files import resolve_model
from pytgi.engine.execution.runner import ModelRunner
from pytgi.engine.kernels import gpu_quant
from pytgi.engine.loading.model import load_model
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear
from pytgi.engine.models.quant import GpuQuantizedWeight, QuantizedLinear
from tests.model.test_gguf_families import prompt_logits, tiny_model, write_gguf
from tests.model.test_gguf_loading import FAMILIES, _quant

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_triton(path, monkeypatch, quantize: str) -> tuple[ModelRunner, torch.nn.Module]:
    """A bf16 runner on the Triton kernels: on a GPU as `pytgi serve` builds it, else the CPU runner
    with its model loaded again for the Triton path (interpreted)."""
    quant = quantize if DEVICE.type == "cuda" else "none"  # (on CPU, fp8 is refused: the model is swapped)
    runner = ModelRunner(EngineConfig(model=str(path), dtype="bfloat16", device=DEVICE.type, quantize=quant))
    if DEVICE.type != "cuda":
        monkeypatch.setattr(
            runner, "model", load_model(path, torch.bfloat16, DEVICE, Kernels(triton=True), quantize)
        )
    return runner, cast(torch.nn.Module, runner.model)


def test_gguf_linears_stay_in_their_levels_on_the_triton_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    arch, kw, hf = tiny_model(FAMILIES["llama"])
    path = write_gguf(hf, arch, tmp_path / "llama.gguf", quant=_quant)
    model_dir = resolve_model(str(path), progress=False).path
    exact = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    seq = np.random.default_rng(1).integers(0, kw["vocab_size"], 23).tolist()
    want = prompt_logits(exact, seq).float()
    runner, model = _on_triton(model_dir, monkeypatch, "auto")
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 1 + 4 * kw["num_hidden_layers"]
    for m in linears:  # kept low-bit, and no float weight beside it
        assert isinstance(m.quant, GpuQuantizedWeight) and m.layer.weight.numel() == 0
    kinds = {m.quant.kind for m in linears}
    assert kinds == {"int4", "int8"}, kinds
    got = prompt_logits(runner, seq).float().cpu()
    # the file's levels, bf16 activations and bf16 dequantized weights: nothing else rounds
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_fp8_weights_give_the_logits_of_their_e4m3_values(tmp_path, monkeypatch):
    _arch, kw, hf = tiny_model(FAMILIES["llama"])
    hf.save_pretrained(tmp_path / "m", safe_serialization=True)
    exact = ModelRunner(EngineConfig(model=str(tmp_path / "m"), dtype="float32", device="cpu"))
    with torch.no_grad():  # the reference: every linear but the head on its e4m3 values, in float32
        for mod in cast(Any, exact.model).modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                q, s = gpu_quant.quantize_fp8(mod.weight.data.to(torch.bfloat16))
                mod.weight.copy_(gpu_quant.fp8_values(q, s, (1, mod.weight.shape[1])))
    seq = np.random.default_rng(2).integers(0, kw["vocab_size"], 19).tolist()
    want = prompt_logits(exact, seq).float()
    runner, model = _on_triton(tmp_path / "m", monkeypatch, "fp8")
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * kw["num_hidden_layers"] and all(m.quant.kind == "fp8" for m in linears)
    assert not isinstance(model.lm_head, QuantizedLinear)  # the head stays in bf16
    got = prompt_logits(runner, seq).float().cpu()
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_fp8_kv_cache_gives_the_logits_of_the_values_it_holds(tmp_path, monkeypatch):
    """`--kv-cache-dtype fp8` (CUDA only: refused elsewhere) on a tiny model: a prompt in chunks and
    decodes over an e4m3 cache give logits close to the model-dtype cache's, and the same cache
    refuses the paths that would read it otherwise."""
    from pytgi.core.families import family_of
    from pytgi.engine.execution.batch import PagedModel, fp8_kv_refusal
    from tests.model.test_tiny_models import BLOCK, NUM_BLOCKS, Paged, step

    _arch, kw, hf = tiny_model(FAMILIES["llama"])
    hf.save_pretrained(tmp_path / "m", safe_serialization=True)
    runner = ModelRunner(EngineConfig(model=str(tmp_path / "m"), dtype="float32", device="cpu"))
    llama = family_of("LlamaForCausalLM")
    assert "CUDA" in fp8_kv_refusal(runner.model, torch.device("cpu"), llama)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        ModelRunner(
            EngineConfig(model=str(tmp_path / "m"), dtype="float32", device="cpu", kv_cache_dtype="fp8")
        )
    model = load_model(tmp_path / "m", torch.float32, DEVICE, Kernels(triton=True), "none")
    assert fp8_kv_refusal(model, torch.device("cuda"), llama) is None
    assert "plain causal" in fp8_kv_refusal(model, torch.device("cuda"), family_of("Gemma3ForCausalLM"))
    seq = np.random.default_rng(3).integers(0, kw["vocab_size"], 21).tolist()
    outs = []
    for kv in ("auto", "fp8"):
        runner.paged = PagedModel(model, torch.float32, DEVICE, kv_dtype=kv)
        runner.allocate_kv_cache(NUM_BLOCKS, BLOCK)
        if kv == "fp8":
            assert runner.paged.kv_caches[0][0].dtype == torch.uint8
            assert (
                runner.paged.kv_bytes_per_token() * 2
                > PagedModel(model, torch.bfloat16, DEVICE).kv_bytes_per_token()
            )
        pager = Paged()
        req = pager.request("r", seq)
        logits = [step(runner, pager, [(req, 13)])[0], step(runner, pager, [(req, 8)])[0]]
        for _ in range(3):  # decodes: split over programs
            req.append_token(int(logits[-1][-1].argmax()))
            logits.append(step(runner, pager, [(req, 1)])[0])
        outs.append(torch.cat(logits).float().cpu())
    want, got = outs
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize(
    "case",
    ["gptq-4bit-sym", "awq-4bit", "fp8-blocks", "ct-w8a8-int-channel", "ct-fp8-channel", "ct-fp8-tensor"],
)
def test_gptq_awq_fp8_checkpoints_stay_in_their_levels_on_the_triton_path(tmp_path, monkeypatch, case):
    from tests.model.test_quant_checkpoints import checkpoint
    from tests.model.test_tiny_models import reference

    path, kw, ref = checkpoint(tmp_path, case)
    runner, model = _on_triton(path, monkeypatch, "auto")
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * kw["num_hidden_layers"]
    kind = "fp8" if "fp8" in case else "int8" if "w8a8" in case else "int4"
    assert all(isinstance(m.quant, GpuQuantizedWeight) and m.quant.kind == kind for m in linears)
    seq = np.random.default_rng(6).integers(0, kw["vocab_size"], 19).tolist()
    got, want = prompt_logits(runner, seq).float().cpu(), reference(ref, seq)
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
