"""How many bytes a model's weights take: estimated before loading (from the files' headers, no data
read: the check that the model fits) and counted once loaded."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pytgi.engine import kernels
from pytgi.engine.loading.gguf import GGUFWeights, open_gguf
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.moe import SparseMoE
from pytgi.engine.models.quant import resolve_plan

if TYPE_CHECKING:
    from pytgi.engine.models.causal_lm import CausalLM

# bytes per weight of each packed layout, its fp16 scales and offsets included (`pytgi.engine.models.quant`);
# tensors of Q6_K and Q3_K take 0.875 on CPU (6 bits), of Q5_0 0.6875 (5.5 bits): the estimate stays on
# the safe side
PACKED_BYTES = {"int4": 0.625, "mxfp4": 0.53125, "int8": 1.125, "int8x16": 1.25, "fp8": 1.0}


def keeps_mxfp4(dtype: torch.dtype, device: torch.device, cpu: Kernels | None = None) -> bool:
    """Whether a Hugging Face MXFP4 checkpoint's experts stay 4-bit (bf16 on a CPU with pytgi's low-bit
    kernel), rather than being dequantized to `dtype`."""
    vnni = cpu.vnni if cpu is not None else kernels.vnni_supported()
    gpu = cpu is not None and cpu.triton
    return device.type == "cpu" and dtype == torch.bfloat16 and vnni and not gpu


def _shapes(
    path: Path, gguf: GGUFWeights | None, mxfp4: set[str] | None = None
) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's shape, from the GGUF file or the safetensors headers (no data read);
    the names of MXFP4 tensors go to `mxfp4`."""
    if gguf is not None:
        return {name: gguf.shape(name) for name in gguf.names()}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, info in header.items():
            shape = tuple(info["shape"])
            if name.endswith("_blocks"):  # MXFP4 (gpt-oss's experts): two values a byte, loaded as floats
                shapes[name.removesuffix("_blocks")] = (*shape[:-2], shape[-2] * shape[-1] * 2)
                if mxfp4 is not None:
                    mxfp4.add(name.removesuffix("_blocks"))
            elif not name.endswith("_scales"):
                shapes[name] = shape
    return shapes


def weight_bytes(path: Path, dtype: torch.dtype, device: torch.device, quantize: str = "auto") -> int:
    """About how many bytes the whole model's weights take at their largest while loading: a GGUF
    model's packed tensors at their layouts' size and the rest in `dtype`; a Hugging Face model in
    `dtype`, or in float32 when it is quantized on the fly (`--quantize int8|int4`)."""
    plan = resolve_plan(quantize, path, dtype, device)
    weights = open_gguf(path)
    mxfp4: set[str] = set()
    shapes, gguf = _shapes(path, weights, mxfp4), weights is not None
    if not keeps_mxfp4(dtype, device):
        mxfp4.clear()
    elt = (
        4
        if isinstance(plan, str) and plan not in ("bf16", "fp8")
        else torch.empty((), dtype=dtype).element_size()
    )
    total = 0.0
    for name, shape in shapes.items():
        kind = plan.get(name) if gguf and isinstance(plan, dict) else "mxfp4" if name in mxfp4 else None
        total += math.prod(shape) * PACKED_BYTES.get(kind or "", elt)
    return int(total)


def loaded_bytes(model: CausalLM) -> int:
    """The bytes a loaded model holds: its parameters and buffers, its linears' and experts' packed
    weights."""
    from pytgi.engine.models.quant import QuantizedLinear

    seen: set[int] = set()
    total = 0
    tensors: list[torch.Tensor | None] = [*model.parameters(), *model.buffers()]
    for mod in model.modules():
        quants = [mod.quant] if isinstance(mod, QuantizedLinear) else []
        quants += [w for pair in mod.packed for w in pair] if isinstance(mod, SparseMoE) else []
        tensors += [t for q in quants for t in (q.packed, getattr(q, "scales", None))]
    for t in tensors:
        if t is not None and t.device.type != "meta" and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
