"""Fused element-wise steps of a decoder layer on CPU (`pytgi/kernels/fused.c`), called through
ctypes. A decode step of a few tokens spends more time dispatching small PyTorch ops than doing
their arithmetic; these replace 4–9 ops each:

- `add_rms_norm`: the residual add and the next RMSNorm (residual updated in place);
- `silu_mul`: SiLU(gate) * up from the fused gate/up output;
- `rope_write_kv`: rotary embedding of q and k straight from the fused qkv output, q into a new
  tensor and k, v into their KV-cache slots.

`enabled(device, dtype)` says whether the model may use them (CPU, float32 or bfloat16, and the C
kernels built); otherwise the model keeps its PyTorch path, which is also the reference the tests
compare against.
"""

from __future__ import annotations

import ctypes

import torch

from pytgi import kernels

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def enabled(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in _SUFFIX and kernels.load() is not None


def _fn(name: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    return getattr(kernels.load(), f"pytgi_{name}_{_SUFFIX[dtype]}")


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, unless x is None); returns weight * rms_norm(residual)."""
    assert residual.is_contiguous() and (x is None or x.is_contiguous())
    out = torch.empty_like(residual)
    T, D = residual.shape
    _fn("add_rms_norm", residual.dtype)(None if x is None else x.data_ptr(), residual.data_ptr(),
                                        weight.data_ptr(), out.data_ptr(), T, D, ctypes.c_float(eps))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.is_contiguous()
    T, I2 = gate_up.shape
    out = gate_up.new_empty(T, I2 // 2)
    _fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), T, I2 // 2)
    return out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, H: int, KVH: int, D: int) -> torch.Tensor:
    """cos, sin: float32 [T, D]; slots: int64 [T]. Returns the rotated q, [T, H, D]."""
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and slots.is_contiguous()
    T = qkv.shape[0]
    q = qkv.new_empty(T, H, D)
    _fn("rope_write_kv", qkv.dtype)(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), q.data_ptr(),
                                    k_cache.data_ptr(), v_cache.data_ptr(), T, H, KVH, D)
    return q
