"""LoRA without a model: `--lora-adapters` entries, adapter configs refused by name, and lora.c's
per-row products (against PyTorch, and the same bits for a row whatever the rest of the step)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pytgi.core.adapters import AdapterError, AdapterSpec, parse_specs, read_config
from pytgi.engine import kernels


def test_specs_are_name_equals_source_or_a_bare_source():
    assert parse_specs(["a=/x/y", " org/adapter ", "b = org/other"]) == [
        AdapterSpec("a", "/x/y"),
        AdapterSpec("org/adapter", "org/adapter"),
        AdapterSpec("b", "org/other"),
    ]
    with pytest.raises(AdapterError, match="two adapters are named 'a'"):
        parse_specs(["a=/x", "a=/y"])
    with pytest.raises(AdapterError, match="names no path"):
        parse_specs(["a="])
    with pytest.raises(AdapterError, match="adapter name ' bad name'|adapter name 'bad name'"):
        parse_specs(["bad name=/x"])


def adapter_dir(tmp_path, **config):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **config})
    )
    return tmp_path


@pytest.mark.parametrize(
    "config, message",
    [
        ({"peft_type": "IA3"}, "a IA3 adapter"),
        ({"use_dora": True}, "DoRA is not supported"),
        ({"bias": "all"}, "trained biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"r": 128}, "rank 128 is above --max-lora-rank 64"),
        ({"r": 0}, "r must be a positive integer"),
    ],
)
def test_adapters_pytgi_cannot_apply_are_refused_by_name(tmp_path, config, message):
    with pytest.raises(AdapterError, match=message):
        read_config(adapter_dir(tmp_path, **config), 64)


def test_scaling_is_alpha_over_r_or_over_its_root_with_rslora(tmp_path):
    assert read_config(adapter_dir(tmp_path), 64).scaling == 2.0
    assert read_config(adapter_dir(tmp_path, r=16, lora_alpha=8, use_rslora=True), 64).scaling == 2.0
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_config(tmp_path / "nothing", 64)


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the C kernels are not built here")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_kernel_rows_do_not_depend_on_the_step(dtype):
    """Against PyTorch's dense product; slot 1 is a fused layer's two parts, each reaching only its
    own columns (4 rank rows over columns 0..29, 20 over 30..79); slot 2 skips the layer."""
    torch.manual_seed(0)
    K, N = 96, 80
    dense, compact = [], []
    for spans in ([(0, N)] * 8, [(0, 30)] * 4 + [(30, 50)] * 20, []):
        a = torch.randn(len(spans), K).to(dtype)
        bt = torch.zeros(len(spans), N)
        for r, (c0, n) in enumerate(spans):
            bt[r, c0 : c0 + n] = torch.randn(n)
        bt = bt.to(dtype)
        dense.append((a.float(), bt.float()))
        flat = torch.cat([bt[r, c0 : c0 + n] for r, (c0, n) in enumerate(spans)]) if spans else bt.reshape(-1)
        compact.append((a, flat.contiguous(), np.array(spans, np.int64).reshape(-1, 2)))
    table = np.array(
        [
            [w.data_ptr() for w, _, _ in compact],
            [b.data_ptr() for _, b, _ in compact],
            [w.shape[0] for w, _, _ in compact],
            [c.ctypes.data for _, _, c in compact],
        ],
        np.int64,
    )
    x = torch.randn(13, K).to(dtype)
    y0 = torch.randn(13, N).to(dtype)
    slots = np.array([0, 1, -1, 2, 0, 0, 1, -1, 1, 0, 2, 1, 0], np.int64)
    y = y0.clone()
    kernels.lora_add(y, x, slots, table)
    want = y0.float().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            a, bt = dense[s]
            want[t] += (x[t].float() @ a.T) @ bt
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.float(), want.to(dtype).float(), rtol=tol, atol=tol * want.abs().max().item())
    for t in range(13):  # each row alone gives the same bits as in the step
        alone = y0[t : t + 1].clone()
        kernels.lora_add(alone, x[t : t + 1].contiguous(), slots[t : t + 1], table)
        assert torch.equal(alone[0], y[t]), t
