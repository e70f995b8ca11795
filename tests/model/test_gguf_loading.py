"""A GGUF model loaded in its own bytes: every quantized linear (and a mixture's experts, and the
embedding table) packed straight from the file's blocks, with no float copy of the model in memory
or in the cache; its outputs as close to the float32 path's as the packed kernels allow; and a model
larger than the machine refused before loading, with the numbers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.model_files import default_gguf_path, resolve_model
from pytgi.engine import kernels
from pytgi.engine.execution.runner import ModelRunner
from pytgi.engine.models.quant import QuantizedLinear
from tests.model.test_gguf_families import prompt_logits, tiny_model, write_gguf

SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
# DeepSeek V3's and Mistral 4's layers: MLA with a q_lora, a dense layer, then experts in two groups
MLA = dict(
    SHAPE,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama": (
        "llama",
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(SHAPE, tie_word_embeddings=True),
    ),
    "qwen3moe": (
        "qwen3moe",
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            SHAPE,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    # q/k rows reordered by the loader from the packed blocks (`permuted_qk`), LayerNorms, NoPE
    "cohere2": (
        "cohere2",
        transformers.Cohere2Config,
        transformers.Cohere2ForCausalLM,
        dict(
            SHAPE, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=8, tie_word_embeddings=True
        ),
    ),
    # MLA (its latent rows and kv_b split as llama.cpp writes it; W_UK / W_UV dequantized at load),
    # V3's router and shared expert
    "deepseek2": (
        "deepseek2",
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        MLA,
    ),
    # Mistral 4: the same layers, its experts' gate|up one tensor (`ffn_gate_up_exps`), its original
    # context past the prompt (a `mistral4` file is served below it)
    "mistral4": (
        "mistral4",
        transformers.Mistral4Config,
        transformers.Mistral4ForCausalLM,
        dict(
            MLA,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
}
# GGUF tensor → type: a mix as llama.cpp's Q4_K_M-like recipes give (4-bit, 5-bit and 8-bit blocks)
TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "Q5_0",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_1",
    "ffn_down": "Q5_1",
    "ffn_gate_exps": "Q4_0",
    "ffn_up_exps": "Q8_0",
    "ffn_down_exps": "Q5_0",
    "ffn_gate_up_exps": "Q4_1",
    "token_embd": "Q8_0",
    "output": "Q4_0",
    "attn_q_a": "Q4_1",
    "attn_q_b": "Q4_0",
    "attn_kv_a_mqa": "Q8_0",
    "attn_k_b": "Q8_0",
    "attn_v_b": "Q8_0",
    "ffn_gate_shexp": "Q4_0",
    "ffn_up_shexp": "Q4_1",
    "ffn_down_shexp": "Q8_0",
}


def _quant(name: str, a: np.ndarray) -> str | None:
    part = name.split(".")[-2]
    return TYPES.get(part) if a.ndim >= 2 and a.shape[-1] % 32 == 0 else None


@pytest.mark.skipif(not kernels.vnni_supported(), reason="the packed layouts need AVX2 or AVX-512 VNNI")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_tensors_are_packed_from_their_blocks(tmp_path, monkeypatch, family):
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    arch, kw, hf = tiny_model(FAMILIES[family])
    path = write_gguf(hf, arch, tmp_path / f"{family}.gguf", quant=_quant)
    model_dir = resolve_model(str(path), progress=False).path
    assert not list(model_dir.glob("*.safetensors"))  # the weights stay in the GGUF file
    fast = ModelRunner(EngineConfig(model=str(model_dir), dtype="bfloat16", device="cpu"))
    model: Any = fast.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    per_layer = 2 if family == "qwen3moe" else 4  # qkv, o (and gate|up, down without experts)
    if family in ("deepseek2", "mistral4"):
        per_layer = 6  # q_a, q_b, kv_a, o; gate|up, down of the dense MLP or the shared expert
    assert len(linears) == 1 + per_layer * kw["num_hidden_layers"]
    for m in linears:  # packed, and no float weight beside it
        assert m.quant.vnni and m.layer.weight.numel() == 0
    assert any(m.quant.bits == 7 for m in linears)  # attn_output's Q5_0: the 5.5-bit format
    assert model.embed_tokens.packed is not None and model.embed_tokens.weight.numel() == 0
    if kw["tie_word_embeddings"]:  # a tied table reads the head's rows: one copy
        assert model.embed_tokens.packed is model.lm_head.quant
    else:
        for layer in model.layers[kw.get("first_k_dense_replace", 0) :]:
            assert len(layer.mlp.packed) == 4 and layer.mlp.gate_up.numel() == layer.mlp.down.numel() == 0
    exact = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    x = torch.randn(4, kw["hidden_size"], generator=torch.Generator().manual_seed(0))
    floats: Any = exact.model
    for packed, floating in zip(model.layers, floats.layers):  # each expert's packed gate|up rows
        for e, (gate_up, down) in enumerate(getattr(packed.mlp, "packed", [])):
            assert down.bits == 7  # ffn_down_exps' Q5_0 in 5.5 bits
            want = x @ floating.mlp.gate_up[e].T
            assert (gate_up.matmul(x.bfloat16()).float() - want).abs().max() <= 0.05 * want.abs().max()
    seq = np.random.default_rng(1).integers(0, kw["vocab_size"], 23).tolist()
    got, want = prompt_logits(fast, seq).float(), prompt_logits(exact, seq).float()
    # bf16 activations rounded to int8 per group of 32 (as llama.cpp's kernels do), nothing else
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
def test_loading_the_default_gguf_makes_no_float_copy(tmp_path, monkeypatch):
    """A memory probe around the load: the process grows by about the packed model (the file's size,
    its 8-bit embedding kept once for the table and the tied head), never by a float or bf16 copy."""
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    resolve_model(None, progress=False)  # its metadata read first, outside the probe
    script = textwrap.dedent("""
        import json, torch
        from pytgi.engine.models.cpu import Kernels
        from pytgi.engine.loading.model import load_model
        from pytgi.core.model_files import resolve_model
        path = resolve_model(None, progress=False).path
        cpu = Kernels.for_device(torch.device("cpu"), torch.bfloat16)  # kernels built before the probe
        def status(key):
            line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
            return int(line.split()[1]) * 1024
        open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here on
        before = status("VmRSS")
        model = load_model(path, torch.bfloat16, torch.device("cpu"), cpu, "auto")
        print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS")}))
    """)
    env = {"PYTGI_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    size = default_gguf_path().stat().st_size
    # Packed, the 135M model is ~1.5x the file (146 MB here); a bf16 copy of its weights alone would be
    # 2 bytes a parameter (270 MB), a float32 one twice that. The growth stays under the bf16 copy with
    # room for what differs between machines (transparent huge pages, allocator arenas: 201 MB seen in CI).
    assert m["peak"] - m["before"] < 2 * 134_515_008, m
    converted = list((tmp_path / "cache" / "models").iterdir())
    assert len(converted) == 1
    files = {f.name: f.stat().st_size for f in converted[0].iterdir()}
    assert not any(n.endswith((".safetensors", ".bin")) for n in files) and sum(files.values()) < size / 10, (
        files
    )


@pytest.mark.slow
def test_a_model_larger_than_memory_is_refused_before_loading(tmp_path):
    """A 70B-shaped file (its tensors a hole in a sparse file): `pytgi serve` exits with the numbers,
    needed and available, before it reads a weight."""
    from tests.tiny_repos import declared_gguf

    big = declared_gguf(tmp_path / "big.gguf", layers=80, hidden=8192, inter=28672)
    env = dict(os.environ, PYTGI_CACHE=str(tmp_path / "cache"))
    out = subprocess.run(
        [sys.executable, "-m", "pytgi.cli", "serve", "--model-id", str(big), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert out.returncode != 0
    line = next(x for x in out.stderr.splitlines() if "engine failed to start: the model (big-" in x)
    need, avail = re.search(r"(\d+\.\d) GiB in all, and this machine has (\d+\.\d) GiB", line).groups()
    assert float(need) > 36 and 0 < float(avail) < float(need)


def test_safetensors_are_read_as_safetensors_reads_them(tmp_path):
    """A Hugging Face directory's tensors through pytgi's read-only mapping (pages let go once read):
    every dtype and shape as safetensors' own reader gives them, across several files."""
    from safetensors.torch import load_file, save_file

    from pytgi.engine.loading.safetensors_dir import iter_safetensors

    g = torch.Generator().manual_seed(0)
    first = {
        "a.weight": torch.randn(48, 32, generator=g).bfloat16(),
        "b": torch.randn(7, generator=g),
        "c": torch.randn(3, 5, generator=g).half(),
        "d": torch.arange(10),
        "e": torch.tensor([True, False]),
    }
    second = {"f.weight": torch.randn(2, 3, 4, generator=g).to(torch.float8_e4m3fn), "g": torch.zeros(0)}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    got = {name: t.clone() for name, t in iter_safetensors(tmp_path)}
    want = {
        **load_file(str(tmp_path / "model-00001-of-00002.safetensors")),
        **load_file(str(tmp_path / "model-00002-of-00002.safetensors")),
    }
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape
        assert torch.equal(got[name].view(torch.uint8), w.view(torch.uint8)), name


@pytest.mark.skipif(not kernels.vnni_supported(), reason="the packed layouts need AVX2 or AVX-512 VNNI")
def test_mxfp4_experts_stay_4_bit_from_a_gguf_file(tmp_path, monkeypatch):
    """gpt-oss as llama.cpp ships it (experts in MXFP4): in bf16 the experts keep their e2m1 codes
    (format mxfp4), holding the file's values exactly, and the logits stay as close to the float32
    path's as int8 activations allow."""
    from pytgi.engine.models.moe import SparseMoE
    from pytgi.engine.models.quant import unpack_rows
    from tests.model.test_gguf_families import FAMILIES as GGUF_FAMILIES

    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    arch, kw, hf = tiny_model(GGUF_FAMILIES["gpt-oss"])

    def quant(name: str, a: np.ndarray) -> str | None:
        return "MXFP4" if "_exps.weight" in name else None

    path = write_gguf(hf, arch, tmp_path / "gpt-oss.gguf", quant=quant)
    model_dir = resolve_model(str(path), progress=False).path
    fast = ModelRunner(EngineConfig(model=str(model_dir), dtype="bfloat16", device="cpu"))
    exact = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    fast_model: Any = fast.model
    exact_model: Any = exact.model
    layers = [m for m in fast_model.modules() if isinstance(m, SparseMoE)]
    floats = [m for m in exact_model.modules() if isinstance(m, SparseMoE)]
    assert len(layers) == kw["num_hidden_layers"]
    for moe, ref in zip(layers, floats):
        assert moe.gate_up.numel() == moe.down.numel() == 0
        for e, (gu, dn) in enumerate(moe.packed):
            assert gu.kind == dn.kind == "mxfp4"
            rows = torch.arange(gu.shape[0])
            assert torch.equal(unpack_rows(gu.packed, rows, 5), ref.gate_up[e].float())
            assert torch.equal(unpack_rows(dn.packed, torch.arange(dn.shape[0]), 5), ref.down[e].float())
    seq = np.random.default_rng(1).integers(0, kw["vocab_size"], 23).tolist()
    got, want = prompt_logits(fast, seq).float(), prompt_logits(exact, seq).float()
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not kernels.bf16gemm_supported(), reason="the bf16 kernel needs AVX-512 BF16 or AVX2")
def test_a_gguf_files_float_linears_take_the_bf16_kernel(tmp_path, monkeypatch):
    """A GGUF file's F32 / F16 / BF16 linears (gpt-oss's attention and head as ggml-org ships them) run on
    pytgi's bf16 kernel in a bf16 model, as a bf16 Hugging Face model's do, beside the packed experts."""
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    arch, kw, hf = tiny_model(FAMILIES["qwen3moe"])

    # the experts Q8_0, the rest as the float32 model holds it (F32)
    path = write_gguf(hf, arch, tmp_path / "mixed.gguf", quant=lambda n, a: "Q8_0" if "_exps" in n else None)
    model_dir = resolve_model(str(path), progress=False).path
    fast = ModelRunner(EngineConfig(model=str(model_dir), dtype="bfloat16", device="cpu"))
    model: Any = fast.model
    kinds = {n: m.quant.kind for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert kinds["lm_head"] == "bf16"  # the file's F32 head
    assert {k for n, k in kinds.items() if "self_attn" in n} == {"bf16"}
    exact = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    seq = np.random.default_rng(1).integers(0, kw["vocab_size"], 23).tolist()
    got, want = prompt_logits(fast, seq).float(), prompt_logits(exact, seq).float()
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
