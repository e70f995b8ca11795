"""gpt-oss in pytgi's own model code (issue 46, point 1), through the engine: greedy tokens equal
transformers' `generate` in float32 (sinks, alternating windows, YaRN, biased router and experts, the
clamped SwiGLU), and in bf16 a request batched with others gives what it gives alone. The layer-level
logits under chunking and prefix hits are tests/model/test_tiny_models.py's ("gpt-oss"); N shards =
one is tests/model/test_sharding.py's."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.engine.engine import LLMEngine
from tests.model.test_sharding import run

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


def test_batched_equals_alone_in_bf16(gpt_oss):
    _, path = gpt_oss
    engine = LLMEngine(EngineConfig(model=str(path), max_batch_total_tokens=1024, dtype="bfloat16"))
    try:
        alone = [run(engine, [p])[0] for p in PROMPTS]
        batched = run(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert batched == alone  # tokens and every prompt and output logprob, to the bit


def test_an_mxfp4_checkpoint_serves_its_experts_exactly(gpt_oss, tmp_path):
    """gpt-oss as published: the experts in MXFP4 (`_blocks` / `_scales`, quant_method mxfp4). pytgi
    dequantizes them at load; served, the checkpoint gives what the float checkpoint holding
    transformers' own dequantization of the same bytes gives, to the bit."""
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
    ref = type(model)(cfg).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in ref.model.layers:
            for name, (blocks, scales) in packed.items():
                getattr(layer.mlp.experts, name).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
    ref.save_pretrained(tmp_path / "float")
    (tmp_path / "mxfp4").mkdir()
    tensors = load_file(str(tmp_path / "float" / "model.safetensors"))
    for n in range(cfg.num_hidden_layers):
        for name, (blocks, scales) in packed.items():
            del tensors[f"model.layers.{n}.mlp.experts.{name}"]
            tensors[f"model.layers.{n}.mlp.experts.{name}_blocks"] = blocks.clone()
            tensors[f"model.layers.{n}.mlp.experts.{name}_scales"] = scales.clone()
    save_file(tensors, str(tmp_path / "mxfp4" / "model.safetensors"))
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    outs = []
    for kind in ("float", "mxfp4"):
        engine = LLMEngine(
            EngineConfig(model=str(tmp_path / kind), max_batch_total_tokens=1024, dtype="float32")
        )
        try:
            outs.append(run(engine, PROMPTS))
        finally:
            engine.shutdown()
    assert outs[0] == outs[1]
    assert len({tuple(t) for t, _ in outs[1]}) > 1  # the answers differ: the experts matter


def test_mxfp4_is_refused_beyond_gpt_oss(tmp_path):
    from pytgi.engine.models.checkpoint_quant import UnsupportedQuantization, read_quantization

    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match="gpt-oss's experts only"):
        read_quantization(tmp_path)
