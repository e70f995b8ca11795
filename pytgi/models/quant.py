"""Weight-only quantization for small-batch CPU decode.

A decode step with a few tokens is bound by reading the weights: on this kind of CPU an int4
(group-32, asymmetric) weight-only matmul reads 4× fewer bytes than bf16 and runs 2–5× faster at
M = 1, int8 (per-channel) about 2×. Large batches and prefill chunks are compute bound, where a
bf16 matmul wins (`benchmarks/kernels.py` measures the crossover). So a quantized linear keeps
both: the packed low-bit weight for steps of at most `SMALL_M` tokens, and the bf16 weight *made
from the same low-bit values* for bigger ones, so both paths multiply by identical weights.

Which tensors to quantize, and how, is a per-tensor plan:
- a GGUF model follows its file (`quantization.json`, written by the converter): Q4_0/Q4_1
  tensors become int4, whose grid holds them exactly (up to the bf16 rounding of scales);
  Q8_0 and other types become int8; float tensors stay as they are;
- a Hugging Face model is quantized only on request (`--quantize int8|int4`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

GROUP = 32
INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K"}
FLOAT_TYPES = {"F32", "F16", "BF16"}
MODES = ("none", "auto", "int8", "int4")

# Steps with at most this many tokens use the low-bit kernel (measured crossover, see module doc).
SMALL_M = 10


def gguf_plan(model_dir: Path) -> dict[str, str]:
    """HF tensor name → "int4" | "int8" from the converter's record of the GGUF types ({} if none)."""
    path = Path(model_dir) / "quantization.json"
    if not path.is_file():
        return {}
    types = json.loads(path.read_text()).get("tensors", {})
    plan = {}
    for name, t in types.items():
        if t in FLOAT_TYPES:
            continue
        plan[name] = "int4" if t in INT4_TYPES else "int8"
    return plan


def resolve_plan(mode: str, model_dir: Path, act_dtype: torch.dtype, device: torch.device) -> dict[str, str] | str:
    """The plan for this run: a dict per tensor, a single kind for every linear, or {} for none."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r} ({' | '.join(MODES)})")
    if mode == "none":
        return {}
    if act_dtype == torch.float32 or device.type != "cpu":
        if mode == "auto":
            return {}  # float32 stays exact; CUDA has no use for these CPU kernels
        raise ValueError(
            f"--quantize {mode} needs a bfloat16 model on CPU (got {str(act_dtype).removeprefix('torch.')} "
            f"on {device.type}); pass --dtype bfloat16"
        )
    if mode == "auto":
        return gguf_plan(model_dir)
    return mode


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [N, K] int8, scales [N], dequantized w)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127)
    return q.to(torch.int8), scale, q * scale[:, None]


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group` input features, min/max grid (Q4_1's):
    w ≈ q·scale + min with q in 0..15. Returns (q [N, K] int32, scale/min [N, K/group] each
    stacked as [N, K/group, 2], dequantized w)."""
    N, K = w.shape
    g = w.float().view(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    deq = (q * scale[..., None] + lo[..., None]).view(N, K)
    return q.view(N, K).to(torch.int32), torch.stack([scale, lo], dim=-1), deq


class QuantizedWeight:
    """The low-bit form of one linear's weight and the kernel that multiplies by it."""

    def __init__(self, kind: str, w: torch.Tensor, act_dtype: torch.dtype) -> None:
        self.kind = kind
        if kind == "int4":
            q, scale_min, deq = quantize_int4(w)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            scale, lo = scale_min.unbind(-1)
            # The kernel computes (q - 8)·s + z per group: z = min + 8·s. Layout [K/group, N, 2].
            self.scales = torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1).contiguous().to(act_dtype)
        else:
            self.packed, scale, deq = quantize_int8(w)
            self.scales = scale.to(act_dtype)
        self.dequantized = deq.to(act_dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] → [T, out_features]."""
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)


def can_quantize(kind: str, w: torch.Tensor) -> bool:
    N, K = w.shape
    return kind == "int8" or (K % GROUP == 0 and N % 16 == 0)
