"""Which kernels run a model: decided once, at load, from the machine, the device and the dtype.

`Kernels` says which of the C kernels (`pytgi.engine.kernels`) this process uses and, from one table
of measured crossovers, which of them serves a step of a given size. Its `ops()` are the
element-wise steps of the model's one forward: PyTorch's (`TorchOps`: CUDA, float16, no compiler,
and the reference the kernels are tested against) or the fused C kernels (`KernelOps`).
Tests build a model with the choice they want (`Kernels.none()`, `for_device(..., vnni=False)`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pytgi.engine import kernels
from pytgi.engine.models.layers import apply_rotary


@dataclass(frozen=True)
class Crossovers:
    """Step sizes in tokens where one kernel stops beating the next, measured with
    `benchmarks/matmul_kernels.py` (figures in docs/history/2026-11-30-default-model.md). A step of at
    most `n` tokens takes the kernel named, a bigger one the alternative."""

    lowbit_torch: int = 10  # PyTorch's int4/int8 weight-only kernels, else the bf16 matmul
    lowbit_vnni: int = 32  # qgemv.c without AMX, else the bf16 matmul
    lowbit_amx: int = 96  # qgemv.c or its AMX tiles, else the bf16 matmul
    vnni_before_amx: int = 12  # with AMX: qgemv.c up to here, AMX tiles above
    bf16gemm: int = 128  # a bf16 model's weights: bf16gemm.c up to here (as fast as oneDNN at 64-256 rows)
    paged_prefill: int = 64  # a prefill chunk in the paged attention kernel, else gather + SDPA


CROSSOVERS = Crossovers()


@dataclass(frozen=True)
class Kernels:
    """The kernels this process's model runs on, chosen once at load: on CPU the C kernels (each
    switch below), on CUDA Triton's (`triton`). All False: PyTorch everywhere."""

    fused: bool = False  # the fused element-wise kernels and paged attention
    vnni: bool = False  # low-bit matmuls with qgemv.c (bf16 activations)
    amx: bool = False  # ... and with AMX tiles for bigger steps
    decoder_loop: bool = False  # all layers in one C call where a step allows (decoder.c)
    native_bf16: bool = True  # the CPU multiplies bf16 itself (AVX512_BF16 or AMX), so bf16 GEMMs are fast
    limits: Crossovers = field(default=CROSSOVERS)
    # A row's numerics do not depend on the step it shares (docs/batch-invariance.md): the low-bit
    # kernels serve every step size and the paged kernel every prefill chunk, its AMX tiles chosen
    # by the rows' role (prompt or generated), not by their number.
    batch_invariant: bool = True
    bf16gemm: bool = False  # bf16 weights (a Hugging Face bf16 model) with bf16gemm.c
    triton: bool = (
        False  # CUDA: the Triton kernels (`pytgi.engine.models.triton_backend`) and paged attention
    )

    @classmethod
    def none(cls) -> Kernels:
        return cls()

    @classmethod
    def for_device(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        *,
        fused: bool = True,
        vnni: bool = True,
        amx: bool = True,
        decoder_loop: bool = True,
        limits: Crossovers = CROSSOVERS,
        batch_invariant: bool = True,
    ) -> Kernels:
        """Every kernel that applies, less those switched off (to compare paths)."""
        fused = fused and device.type == "cpu" and kernels.supports(dtype)
        vnni = vnni and device.type == "cpu" and dtype == torch.bfloat16 and kernels.vnni_supported()
        amx = amx and vnni and kernels.amx_supported()
        bf16 = device.type == "cpu" and dtype == torch.bfloat16 and kernels.bf16gemm_supported()
        return cls(
            fused,
            vnni,
            amx,
            decoder_loop and fused and vnni,
            native_bf16(),
            limits,
            batch_invariant,
            bf16,
            triton=device.type == "cuda" and triton_available(),
        )

    def lowbit_max_m(self, vnni: bool, amx: bool) -> int:
        """Steps of at most this many tokens use a weight's low-bit kernel, bigger ones bf16 weights.
        Without bf16 in the CPU (AVX2, AVX-512 without BF16) a bf16 GEMM is emulated, 4-10x slower
        than the low-bit kernel at every step size (docs/history/issue-13-26-small-models-vs-llama-cpp.md),
        so that serves them all.
        Batch invariant, so does qgemv.c (VNNI or AVX2, with AMX tiles above `vnni_before_amx`: the same
        sums): a bf16 matmul's rows change with the step's size (oneDNN picks its kernel by shape)."""
        if vnni and (self.batch_invariant or (not amx and not self.native_bf16)):
            return 1 << 30
        return (
            self.limits.lowbit_amx if amx else self.limits.lowbit_vnni if vnni else self.limits.lowbit_torch
        )

    def bf16_max_m(self) -> int:
        """Steps of at most this many tokens multiply a bf16 model's weights with bf16gemm.c, bigger ones
        with oneDNN's bf16 matmul: every step when batch invariant (oneDNN's rows change with the step's
        size) or when the CPU has no bf16 arithmetic (oneDNN then emulates it, slower at every size)."""
        if self.batch_invariant or not self.native_bf16:
            return 1 << 30
        return self.limits.bf16gemm

    def paged_prefill_max(self) -> int:
        """Prefill chunks of at most this many tokens go to the paged attention kernel (0: none):
        every chunk when batch invariant, since SDPA's numerics differ from the kernel's."""
        if not self.fused:
            return 0
        return 1 << 30 if self.batch_invariant else self.limits.paged_prefill


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def native_bf16() -> bool:
    """The CPU has bf16 arithmetic (AVX512_BF16 or AMX-BF16): PyTorch's bf16 GEMMs run natively."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return True  # not Linux x86: assume the GEMMs are fine
    return "avx512_bf16" in flags or "amx_bf16" in flags


class TorchOps:
    """The element-wise steps of a decoder layer in PyTorch ops."""

    def rope_tables(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        return rotary(positions, dtype)  # cos, signed sin: [T, 1, D] in the model's dtype

    def add_norm(
        self, y: torch.Tensor | None, residual: torch.Tensor, norm, out_norm=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual + y, `norm` of it): y None: no add; `out_norm`: y is normed before the add
        (Gemma's sandwich); `norm` None: no norm after."""
        if y is not None:
            residual = residual + (y if out_norm is None else out_norm(y))
        return residual, None if norm is None else norm(residual)

    def act_mul(self, activation: str, gate_up: torch.Tensor) -> torch.Tensor:
        """activation(gate) * up, for gate_up = [gate | up]: "silu" or "gelu_tanh"."""
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up

    def qkv_rotary(self, attn, qkv: torch.Tensor, rope, kv_cache, meta):
        """q [T, H, D] and k, v [T, KVH, D] with the rotary embedding applied; k, v are None when
        they are already in their cache slots."""
        return _rotate(attn, qkv, *rope)


class KernelOps(TorchOps):
    """The same steps with the fused C kernels: each residual add shares a pass with the norms around
    it, and rope writes k and v straight into the cache."""

    def rope_tables(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        cos, sin = rotary.rows(positions)
        return cos.float(), sin.float()  # float32 [T, D] (the tables follow the model's dtype)

    def add_norm(
        self, y: torch.Tensor | None, residual: torch.Tensor, norm, out_norm=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual = residual.contiguous()  # updated in place from here on
        if out_norm is not None or (norm is not None and norm.offset):  # Gemma's float32 1 + w scales
            if out_norm is None and y is not None:  # no sandwich (Qwen3-Next): a plain add first
                residual.add_(y)
                y = None
            eps = (norm if norm is not None else out_norm).eps
            wa = out_norm.scale() if out_norm is not None else None
            wb = norm.scale() if norm is not None else None
            return residual, kernels.norm_add_norm(y, residual, wa, wb, eps)
        return residual, kernels.add_rms_norm(y, residual, norm.weight, norm.eps)

    def act_mul(self, activation: str, gate_up: torch.Tensor) -> torch.Tensor:
        if activation == "silu":
            return kernels.silu_mul(gate_up)
        return kernels.gelu_tanh_mul(gate_up.contiguous())

    def qkv_rotary(self, attn, qkv: torch.Tensor, rope, kv_cache, meta):
        qkv = qkv.contiguous()
        H, KVH, D = attn.n_heads, attn.n_kv, attn.head_dim
        if attn.q_norm is not None:  # Qwen3's and Gemma 3's, in place
            norm = attn.q_norm
            kernels.qk_norm_(qkv, norm.scale(), attn.k_norm.scale(), H, KVH, D, norm.eps, not norm.offset)
        cos, sin = rope
        q = kernels.rope_write_kv(qkv, cos, sin, meta.slot_mapping, kv_cache[0], kv_cache[1], H, KVH, D)
        return q, None, None


def _rotate(attn, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    T, H, KVH, D = qkv.shape[0], attn.n_heads, attn.n_kv, attn.head_dim
    v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
    if attn.q_norm is None:  # rotate q and k in one go
        qk = apply_rotary(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)
        return qk[:, :H], qk[:, H:], v
    q = attn.q_norm(qkv[:, : H * D].view(T, H, D))
    k = attn.k_norm(qkv[:, H * D : (H + KVH) * D].view(T, KVH, D))
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
