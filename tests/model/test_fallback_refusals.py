"""The transformers fallback refuses, by name, the models it would serve wrong (issue 46, point 3).

Each model here runs in transformers; through pytgi's fallback (which keeps no state between steps
and drops arguments its paged attention has no use for) each would give other tokens without a word.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.errors import UnsupportedModel
from pytgi.engine.execution.runner import ModelRunner

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
LINEAR = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16
)
HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

# name → (config class, its arguments, words the refusal must name, whether weights are read first)
REFUSED = {
    "qwen3-next": (
        transformers.Qwen3NextConfig,
        dict(
            BASE,
            **LINEAR,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        "linear-attention or state-space layers (a recurrent state between steps): 3 of 4",
        False,
    ),
    "qwen3.5": (
        transformers.Qwen3_5TextConfig,
        dict(BASE, **LINEAR, layer_types=HYBRID),
        "linear-attention or state-space layers",
        False,
    ),
    "olmo-hybrid": (
        transformers.OlmoHybridConfig,
        dict(BASE, **LINEAR, layer_types=HYBRID),
        "linear-attention or state-space layers",
        False,
    ),
    "granite-4.0-h": (
        transformers.GraniteMoeHybridConfig,
        dict(BASE, layer_types=["mamba", "attention"] * 2),
        "state-space layers (a recurrent state between steps): 2 of 4",
        False,
    ),
    "gemma2-softcap": (transformers.Gemma2Config, dict(BASE), "soft-caps attention logits", False),
}


def save(tmp_path, cfg_cls, kw, weights: bool):
    cfg = cfg_cls(**kw)
    cfg.architectures = [transformers.MODEL_FOR_CAUSAL_LM_MAPPING[cfg_cls].__name__]  # type: ignore[attr-defined]
    if weights:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    else:  # refused from config.json alone: no weight is read
        cfg.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("impl", ["auto", "transformers"])
@pytest.mark.parametrize("name", list(REFUSED))
def test_fallback_refuses_by_name(name, impl, tmp_path):
    cfg_cls, kw, words, weights = REFUSED[name]
    if impl == "auto" and name in ("gemma2-softcap", "qwen3-next", "qwen3.5", "granite-4.0-h"):
        pytest.skip(
            "pytgi's own code runs it (tests/model/test_tiny_models.py, test_qwen3_next.py, test_mamba2.py)"
        )
    path = save(tmp_path, cfg_cls, kw, weights)
    with pytest.raises(UnsupportedModel) as err:
        ModelRunner(EngineConfig(model=str(path), dtype="float32", device="cpu", model_impl=impl))
    msg = str(err.value)
    arch = cfg_cls.__name__.removesuffix("Config").removesuffix("Text")
    assert "cannot be served" in msg and words in msg, msg
    assert arch.lower().replace("_", "") in msg.lower().replace("_", ""), msg
    assert "Llama, Mistral" in msg and "softmax attention" in msg  # and what pytgi runs


def test_plain_attention_still_runs_through_transformers(tmp_path):
    """The check passes what the fallback serves right: full and sliding-window softmax attention, and
    attention sinks, which it hands the paged kernel (its probe found each equal to transformers' own
    forward; greedy equality is tests/model/test_every_family.py's)."""
    for cfg in (
        transformers.Olmo2Config(**BASE),
        transformers.MistralConfig(**BASE, sliding_window=8),
        transformers.GptOssConfig(**BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    ):
        path = tmp_path / cfg.model_type
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        runner = ModelRunner(
            EngineConfig(model=str(path), dtype="float32", device="cpu", model_impl="transformers")
        )
        assert type(runner.model).__name__ == "TransformersModel"


def test_a_forward_that_differs_from_transformers_is_refused_naming_the_layer(tmp_path, monkeypatch):
    """Issue 63, point 4: before it serves, the fallback compares its paged forward with transformers'
    own on a probe past every window; a path that ignored the window (as Exaone 4's was served, silently
    wrong) is refused at start, naming the first layer that differs."""
    from pytgi.engine.models import transformers_impl

    monkeypatch.setattr(transformers_impl.StepContext, "metadata", lambda self, window: self.full)
    cfg = transformers.MistralConfig(**BASE, sliding_window=8)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel) as err:
        ModelRunner(
            EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", model_impl="transformers")
        )
    msg = str(err.value)
    assert "differs from transformers' own at layer 0" in msg and "24-token probe" in msg, msg
    assert "\n" not in msg
