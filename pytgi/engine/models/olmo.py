"""OLMo 2 and OLMo 3 read as `DecoderConfig`s: Llama's projections and MLP with three differences.

- No norm before attention nor before the MLP: each sublayer's output is normed
  (`post_attention_layernorm`, `post_feedforward_layernorm`) before it joins the residual stream
  (`pre_norms` False);
- q and k are normed over the whole projection, all heads at once, before the rotation
  (`qk_norm_whole`; with `--num-shard` each rank's sum of squares is all-reduced);
- OLMo 3: three layers of four attend within a window (`layer_types`), rotated with their own RoPE
  parameters (`rope_parameters["sliding_attention"]`, unscaled: `rope_local_theta`), the others with
  `rope_parameters["full_attention"]` (YaRN in the long-context checkpoints).

The C all-layers loop and the fused per-head q/k norm step aside for these; the rest is Llama's
kernels. llama.cpp writes both as "olmo2" (q/k rows as the checkpoint has them, the output norms as
`post_attention_norm` and `post_ffw_norm`, OLMo 3's windows as `olmo2.attention.sliding_window` and
`sliding_window_pattern`): pytgi.core.gguf_convert reads such a file back as OLMo 3.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.decoder import FULL, SLIDING, DecoderConfig
from pytgi.engine.models.llama import llama_config


def _default(rope: dict[str, Any]) -> bool:
    return rope.get("rope_type", rope.get("type", "default")) == "default"


def olmo_config(cfg: dict[str, Any]) -> DecoderConfig:
    arch = (cfg.get("architectures") or [""])[0]
    olmo3 = arch == "Olmo3ForCausalLM" or cfg.get("model_type") == "olmo3"
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    full, local = rope.get(FULL, rope), rope.get(SLIDING)
    theta = full.get("rope_theta") or cfg.get("rope_theta") or (500_000.0 if olmo3 else 10_000.0)
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or (
        [SLIDING if (i + 1) % 4 else FULL for i in range(n)] if olmo3 else [FULL] * n
    )
    window = cfg.get("sliding_window") if olmo3 and SLIDING in types else None
    local_theta = None
    if window:  # transformers gives the sliding layers unscaled RoPE unless their own parameters say
        local = {"rope_type": "default", "rope_theta": theta} if local is None else local
        if local != full:
            if not _default(local):
                raise UnsupportedModel(
                    f"OLMo 3's sliding layers with a scaled RoPE of their own ({local.get('rope_type')}) "
                    "are not supported (only the full-attention layers' may be scaled)"
                )
            local_theta = float(local.get("rope_theta") or theta)
    text = {
        k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "use_sliding_window")
    }
    text.update(rope_theta=theta, rope_parameters={**full, "rope_theta": theta})
    base = llama_config(text)
    return dataclasses.replace(
        base,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        qk_norm=True,
        qk_norm_whole=True,
        pre_norms=False,
        sliding_window=int(window) if window else None,
        layer_types=list(types) if window else None,
        rope_local_theta=local_theta,
    )
