"""The CUDA path's attention backend and element-wise steps, on the Triton kernels of
`pytgi.engine.kernels.gpu`.

`TritonAttention` runs every plain causal step (prefills, decodes, both at once) through one paged
attention launch that reads the cache in place. What the kernel does not do, a sliding window or
Gemma 3's two-way image spans, goes through the gather + SDPA path it inherits. `TritonOps` fuses
the residual add with the norm after it, SiLU·up, and the rotation with the cache write; where a
family needs more (Gemma's offset norms and sandwich, Qwen3's q/k norms, GELU) it keeps PyTorch's.

Both are chosen at load (`Kernels.triton`: CUDA with Triton installed); imported only then.
"""

from __future__ import annotations

import numpy as np
import torch

from pytgi.engine.kernels import gpu
from pytgi.engine.models.attention import StepLayout, TorchAttention, TorchAttentionMetadata, TritonMetadata
from pytgi.engine.models.cpu import TorchOps, _rotate


def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors (8 for the interpreter on a CPU, so tests split too)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def triton_metadata(
    layout: StepLayout, device: torch.device, group: int, kv_heads: int = 0, head_dim: int = 128
) -> TritonMetadata:
    """`group`: query heads per kv head; `kv_heads`: the cache's heads (0: never split a decode);
    `head_dim`: its rows' width (MLA's latent row: 576 for DeepSeek)."""
    decode = bool((layout.query_lens == 1).all())
    splits = (
        gpu.decode_splits(
            len(layout.query_lens), kv_heads * gpu.head_parts(group, head_dim), multiprocessors(device)
        )
        if decode and kv_heads
        else 1
    )
    q_start = np.zeros(len(layout.query_lens) + 1, np.int32)
    np.cumsum(layout.query_lens, out=q_start[1:])
    block_m = gpu.query_block(int(layout.query_lens.max()), group, head_dim)
    to = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a, dtype=dt)).to(device, non_blocking=True)
    return TritonMetadata(
        slot_mapping=to(layout.slot_mapping, np.int64),
        programs=to(gpu.attention_programs(layout.query_lens, block_m), np.int32),
        q_start=to(q_start, np.int32),
        context_lens=to(layout.context_lens, np.int32),
        block_tables=to(layout.block_tables, np.int32),
        block_m=block_m,
        block_size=layout.block_size,
        splits=splits,
    )


class TritonAttention(TorchAttention):
    captures_decode = True  # a decode step's launches read only device tensors: CUDA graphs replay it
    fp8_cache = True  # its rotary kernel writes e4m3 keys and values, its attention reads them

    def prepare(  # type: ignore[override]
        self, layout: StepLayout, device: torch.device, window: int | None = None
    ) -> TritonMetadata | TorchAttentionMetadata:
        if window is not None or layout.spans is not None:
            return super().prepare(layout, device, window)
        return triton_metadata(layout, device, self.group, self.kv_heads, self.head_dim)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale: float, sinks=None) -> torch.Tensor:
        if sinks is not None:
            raise NotImplementedError("attention sinks run on SinkAttention, not the Triton kernel")
        if not isinstance(meta, TritonMetadata):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        if k is not None and v is not None:
            if k_cache.dtype == torch.uint8:  # an FP8 cache: bytes and scales, as the rotary kernel writes
                k, v = gpu.quantize_kv_fp8(k), gpu.quantize_kv_fp8(v)
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        return gpu.paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            out,
            meta.programs,
            meta.q_start,
            meta.context_lens,
            meta.block_tables,
            meta.block_m,
            meta.block_size,
            scale,
            meta.splits,
        )


class TritonOps(TorchOps):
    def rope_tables(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        cos, sin = rotary.rows(positions)
        return cos.float(), sin.float()  # float32 [T, D] (the tables follow the model's dtype)

    def add_norm(self, y, residual, norm, out_norm=None):
        if out_norm is not None or norm is None or norm.offset:  # nothing to fuse, or Gemma's norms
            return super().add_norm(y, residual, norm, out_norm)
        residual = residual.contiguous()
        return residual, gpu.add_rms_norm(y, residual, norm.weight, norm.eps)

    def act_mul(self, activation: str, gate_up: torch.Tensor) -> torch.Tensor:
        if activation != "silu":
            return super().act_mul(activation, gate_up)
        return gpu.silu_mul(gate_up)

    def qkv_rotary(self, attn, qkv: torch.Tensor, rope, kv_cache, meta):
        if attn.q_norm is not None:  # Qwen3's and Gemma 3's q/k norms: PyTorch's rotation
            cos, sin = (t.unsqueeze(1).to(qkv.dtype) for t in rope)
            return _rotate(attn, qkv, cos, sin)
        cos, sin = rope
        q = gpu.rope_write_kv(
            qkv, cos, sin, meta.slot_mapping, kv_cache[0], kv_cache[1], attn.n_heads, attn.n_kv, attn.head_dim
        )
        return q, None, None
