"""All decoder layers of a quantized Llama-family model in one C call (`pytgi/kernels/decoder.c`).

The loop runs the kernels the Python layer loop runs (`KernelOps`, the low-bit matmuls, paged
attention) with the same arguments, without a Python dispatch per op: its output equals the
Python path's bit for bit. It applies to a model, decided once at load, when the model is
unsharded, bias- and q/k-norm-free and every linear of every layer has a VNNI-packed weight; and to
a step when its tokens fit the packed weights' kernels and all its attention is paged.
"""

from __future__ import annotations

import numpy as np
import torch

from pytgi import kernels
from pytgi.distributed import tp_size
from pytgi.models.cpu import CpuKernels


def _linears(layer):  # type: ignore[no-untyped-def]
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


class DecoderLoop:
    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        self.layers, self.final_norm = list(model.layers), model.norm
        attn, cfg = model.layers[0].self_attn, model.config
        self.sizes = (cfg.hidden_size, cfg.intermediate_size, attn.n_heads, attn.n_kv, attn.head_dim)  # unsharded
        self.eps, self.scale = cfg.rms_norm_eps, attn.scale
        quant = model.layers[0].mlp.down_proj.quant
        self.max_m, self.vnni_max_m = quant.max_m, quant.vnni_max_m
        self._table: tuple[int, np.ndarray] | None = None  # (first K cache's address, per-layer pointers)

    @classmethod
    def build(cls, model, cpu: CpuKernels) -> DecoderLoop | None:  # type: ignore[no-untyped-def]
        """The loop for this model, or None when it does not apply (see the module doc)."""
        cfg = model.config
        if not cpu.decoder_loop or tp_size() != 1 or cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias \
                or cfg.qk_norm or cfg.moe is not None:
            return None
        quants = [getattr(m, "quant", None) for layer in model.layers for m in _linears(layer)]
        return cls(model) if all(q is not None and q.vnni for q in quants) else None

    def _layers(self, kv_caches) -> np.ndarray:  # type: ignore[no-untyped-def]
        """The per-layer pointers decoder.c reads (rebuilt when the KV cache is reallocated)."""
        if self._table is not None and self._table[0] == kv_caches[0][0].data_ptr():
            return self._table[1]
        layers, final = self.layers, self.final_norm
        rows = []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches)):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final
            row = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   nxt.weight.data_ptr()]
            for mod in _linears(layer):
                row += [mod.quant.packed.data_ptr(), mod.quant.bits]
            rows.append(row + [k_cache.data_ptr(), v_cache.data_ptr()])
        self._table = (kv_caches[0][0].data_ptr(), np.array(rows, dtype=np.int64))
        return self._table[1]

    def __call__(self, x: torch.Tensor, rope, kv_caches, meta) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
        """The final hidden states for this step (x, updated in place, is the residual stream), or
        None when the step is not for the loop."""
        if x.shape[0] > self.max_m or meta.paged is None or meta.decode is not None or meta.prefill is not None:
            return None
        cos, sin = rope
        return kernels.decoder_layers(self._layers(kv_caches), x.contiguous(), cos, sin, meta.slot_mapping,
                                      meta.paged, self.sizes, self.eps, self.scale, self.vnni_max_m)
