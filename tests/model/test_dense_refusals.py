"""What the dense families' readers cannot serve exactly is refused at load, in one line naming it;
and the config variants they read as transformers does."""

from __future__ import annotations

import pytest

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.cohere2 import cohere2_config
from pytgi.engine.models.decoder import FULL, SLIDING
from pytgi.engine.models.exaone4 import exaone4_config
from pytgi.engine.models.olmo import olmo_config

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def test_olmo3_sliding_layers_with_a_scaled_rope_of_their_own_are_refused():
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = dict(
        BASE,
        architectures=["Olmo3ForCausalLM"],
        sliding_window=8,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e4},
            "sliding_attention": yarn,
        },
    )
    with pytest.raises(UnsupportedModel, match="sliding layers with a scaled RoPE"):
        olmo_config(cfg)


def test_olmo3_yarn_on_its_full_layers_leaves_the_sliding_ones_unscaled():
    yarn = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = dict(
        BASE, architectures=["Olmo3ForCausalLM"], sliding_window=8, rope_parameters={"full_attention": yarn}
    )
    got = olmo_config(cfg)
    assert got.rope_scaling is not None and got.rope_scaling["rope_type"] == "yarn"
    assert got.rope_local_theta == 5e5 and got.layer_types == [SLIDING, SLIDING, SLIDING, FULL]
    assert got.qk_norm_whole and not got.pre_norms


def test_cohere2_partial_rotary_is_refused():
    cfg = dict(BASE, architectures=["Cohere2ForCausalLM"], sliding_window=8, rotary_pct=0.5)
    with pytest.raises(UnsupportedModel, match="rotary_pct 0.5"):
        cohere2_config(cfg)


def test_exaone4_reads_a_string_pattern_and_no_window():
    cfg = dict(BASE, architectures=["Exaone4ForCausalLM"], sliding_window=8, sliding_window_pattern="LLG")
    got = exaone4_config(cfg)
    assert got.layer_types == [SLIDING, SLIDING, FULL, SLIDING]
    assert got.rope_layers == [True, True, False, True]  # the global layer without RoPE
    got = exaone4_config(dict(BASE, architectures=["Exaone4ForCausalLM"], sliding_window=None))
    assert got.sliding_window is None and got.rope_layers is None  # no window: every layer rotates
