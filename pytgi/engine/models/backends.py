"""Which attention backend and element-wise steps a model runs on: the C kernels' (CPU), Triton's
(CUDA), or PyTorch's; chosen once, at load. The Triton side is imported only where it runs (Triton
is not installed everywhere)."""

from __future__ import annotations

from pytgi.engine.models.attention import TorchAttention
from pytgi.engine.models.cpu import KernelOps, Kernels, TorchOps

BACKENDS = ("auto", "torch", "triton")


def get_backend(name: str, cpu: Kernels, heads: tuple[int, int, int]) -> TorchAttention:
    """ "auto": Triton's paged kernel where the model runs on the Triton kernels (CUDA), else "torch"."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")
    if name == "triton" or (name == "auto" and cpu.triton):
        from pytgi.engine.models.triton_backend import TritonAttention

        return TritonAttention(cpu, heads)
    return TorchAttention(cpu, heads)


def ops_for(cpu: Kernels) -> TorchOps:
    """The element-wise steps (norms, activations, rotary): fused C kernels, Triton's, or PyTorch's."""
    if cpu.fused:
        return KernelOps()
    if cpu.triton:
        from pytgi.engine.models.triton_backend import TritonOps

        return TritonOps()
    return TorchOps()
