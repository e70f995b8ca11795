"""gpt-oss in pytgi's own model code (issue 46, point 1), through the engine: greedy tokens equal
transformers' `generate` in float32 (sinks, alternating windows, YaRN, biased router and experts, the
clamped SwiGLU), and in bf16 a request batched with others gives what it gives alone. The layer-level
logits under chunking and prefix hits are tests/model/test_tiny_models.py's ("gpt-oss"); N shards =
one is tests/model/test_sharding.py's."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.engine.llm_engine import LLMEngine
from tests.model.test_sharding import run, run_sharded

PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64] * 3, [7, 9] * 10, list(range(30, 60))]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,  # the prompts reach past it
        swiglu_limit=1.0,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        eos_token_id=None,
        initializer_range=0.2,  # weights big enough for greedy tokens that vary
    )
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # biases and sinks large enough to matter
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name:
                p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp("gpt-oss")
    model.save_pretrained(path)
    return model, path


def test_greedy_equals_transformers_in_float32(gpt_oss):
    model, path = gpt_oss
    engine = LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, dtype="float32"))
    try:
        got = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    for prompt, (tokens, _) in zip(PROMPTS, got):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        ref = out[0, len(prompt) :].tolist()
        assert tokens == ref, (prompt, tokens, ref)


def alone_and_batched(path) -> tuple[list, list]:
    """Each prompt's greedy tokens and logprobs in bf16, run alone, then all three in one batch."""
    engine = LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, dtype="bfloat16"))
    try:
        return [run(engine, [p])[0] for p in PROMPTS], run(engine, PROMPTS)
    finally:
        engine.shutdown()


def test_batched_equals_alone_in_bf16(gpt_oss):
    alone, batched = alone_and_batched(gpt_oss[1])
    assert batched == alone  # tokens and every prompt and output logprob, to the bit


@pytest.fixture(scope="module")
def mxfp4(gpt_oss, tmp_path_factory):
    """gpt-oss as published: the experts in MXFP4 (`_blocks` / `_scales`, quant_method mxfp4), random codes
    and exponents; beside it the float checkpoint holding transformers' own dequantization of the same
    bytes. Returns (float dir, mxfp4 dir, {name: transformers' float tensor [E, in, out]})."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, _ = gpt_oss
    cfg = model.config
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(3)
    packed = {
        "gate_up_proj": (
            torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=g, dtype=torch.uint8),
            torch.randint(122, 128, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8),
        ),
        "down_proj": (
            torch.randint(0, 256, (e, h, i // 32, 16), generator=g, dtype=torch.uint8),
            torch.randint(122, 128, (e, h, i // 32), generator=g, dtype=torch.uint8),
        ),
    }
    floats = {n: convert_moe_packed_tensors(b, s, dtype=torch.float32) for n, (b, s) in packed.items()}
    ref = type(model)(cfg).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in ref.model.layers:
            for name, t in floats.items():
                getattr(layer.mlp.experts, name).copy_(t)
    tmp = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    ref.save_pretrained(tmp / "float")
    (tmp / "mxfp4").mkdir()
    tensors = load_file(str(tmp / "float" / "model.safetensors"))
    for n in range(cfg.num_hidden_layers):
        for name, (blocks, scales) in packed.items():
            del tensors[f"model.layers.{n}.mlp.experts.{name}"]
            tensors[f"model.layers.{n}.mlp.experts.{name}_blocks"] = blocks.clone()
            tensors[f"model.layers.{n}.mlp.experts.{name}_scales"] = scales.clone()
    save_file(tensors, str(tmp / "mxfp4" / "model.safetensors"))
    config = json.loads((tmp / "float" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (tmp / "mxfp4" / "config.json").write_text(json.dumps(config))
    return tmp / "float", tmp / "mxfp4", floats


def test_an_mxfp4_checkpoint_serves_its_experts_exactly(mxfp4):
    """In float32 pytgi dequantizes the experts at load; served, the checkpoint gives what the float
    checkpoint of transformers' dequantization of the same bytes gives, to the bit."""
    outs = []
    for path in mxfp4[:2]:
        engine = LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, dtype="float32"))
        try:
            outs.append(run(engine, PROMPTS))
        finally:
            engine.shutdown()
    assert outs[0] == outs[1]
    assert len({tuple(t) for t, _ in outs[1]}) > 1  # the answers differ: the experts matter


def test_mxfp4_experts_stay_4_bit_in_bf16(mxfp4):
    """In bf16 on a CPU with pytgi's low-bit kernel the experts keep their codes (format mxfp4: 4 bits a
    weight, no float copy): the packed weights hold exactly transformers' values; served, a request
    batched with others gives what it gives alone, and near the float32 tokens."""
    from pytgi.engine import kernels
    from pytgi.engine.loading.model import load_model
    from pytgi.engine.models.cpu import Kernels
    from pytgi.engine.models.moe import SparseMoE
    from pytgi.engine.models.quant import unpack_rows

    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2: MXFP4 is dequantized")
    _, path, floats = mxfp4
    cpu = Kernels.for_device(torch.device("cpu"), torch.bfloat16)
    model: Any = load_model(path, torch.bfloat16, torch.device("cpu"), cpu)
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert layers and all(m.gate_up.numel() == 0 and m.down.numel() == 0 for m in layers)
    gate_up, down = (
        floats["gate_up_proj"],
        floats["down_proj"],
    )  # [E, H, 2I] (gate, up interleaved), [E, I, H]
    for moe in layers:
        for e, (gu, dn) in enumerate(moe.packed):
            assert gu.kind == dn.kind == "mxfp4" and gu.bits == 5
            want = torch.cat([gate_up[e].t()[0::2], gate_up[e].t()[1::2]])
            assert torch.equal(unpack_rows(gu.packed, torch.arange(want.shape[0]), 5), want)
            assert torch.equal(unpack_rows(dn.packed, torch.arange(down.shape[2]), 5), down[e].t())
    del model
    alone, batched = alone_and_batched(path)
    assert batched == alone
    assert len({tuple(t) for t, _ in batched}) > 1


def test_mxfp4_is_refused_beyond_gpt_oss(tmp_path):
    from pytgi.engine.loading.checkpoints import UnsupportedQuantization, read_quantization

    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match="gpt-oss's experts only"):
        read_quantization(tmp_path)


def test_mxfp4_experts_over_two_shards(mxfp4):
    """The 4-bit experts split over 2 shards in bf16 (each rank a half of every expert's intermediate
    features, the experts' down bias in the first rank's part alone): the prompts' logprobs move from one
    shard's no more than the float checkpoint's do in bf16 (partial sums rounded apart)."""
    from pytgi.engine import kernels

    if not kernels.vnni_supported():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2: MXFP4 is dequantized")
    moved = []
    for path in mxfp4[:2]:
        outs = [run_sharded(path, PROMPTS, n, "bfloat16") for n in (1, 2)]
        diffs = [
            (torch.tensor(one[: len(p) - 1]) - torch.tensor(two[: len(p) - 1])).abs()
            for p, (_, one), (_, two) in zip(PROMPTS, *outs)
        ]
        moved.append(torch.cat(diffs).mean().item())
    float_moved, mxfp4_moved = moved
    assert mxfp4_moved <= 2 * float_moved + 0.05, moved
