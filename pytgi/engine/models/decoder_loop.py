"""All decoder layers of a quantized Llama-family model in one C call (`pytgi/engine/kernels/decoder.c`).

The loop runs the kernels the Python layer loop runs (`KernelOps`, the low-bit matmuls, paged
attention) with the same arguments, without a Python dispatch per op: its output equals the
Python path's bit for bit. It applies to a model, decided once at load, when the model is
unsharded, bias- and q/k-norm-free and every linear of every layer has a VNNI-packed weight; and to
a step when its tokens fit the packed weights' kernels and all its attention is paged. Layers
without rotary embedding (SmolLM3's) run in calls of their own, given the identity's tables.
"""

from __future__ import annotations

import numpy as np
import torch

from pytgi.engine import kernels
from pytgi.engine.distributed import tp_size
from pytgi.engine.models.cpu import Kernels


def _linears(layer):
    """The layer's four linears (their base layers where LoRA wraps them: `pytgi.engine.models.lora`)."""
    mods = layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
    return tuple(getattr(m, "inner", m) for m in mods)


def _plain_layers(cfg, nope: bool = False) -> bool:
    """No layer differs in a way the C loops do not take: NoPE layers (unless `nope`: Llama's loop runs
    them, `DecoderLoop.runs`), norms after the sublayers only, q/k norms over the whole projection,
    LayerNorms, parallel blocks (`DecoderConfig`'s fields for SmolLM3, OLMo 2/3, Exaone 4, Cohere 2)."""
    return (
        (nope or cfg.rope_layers is None)
        and cfg.pre_norms
        and not cfg.qk_norm_whole
        and not cfg.layer_norm
        and not cfg.parallel_block
    )


def _packed(layer) -> list[int]:
    """(address, format) of each linear's packed weight, in _linears' order."""
    return [v for mod in _linears(layer) for v in (mod.quant.packed.data_ptr(), mod.quant.bits)]


class DecoderLoop:
    def __init__(self, model) -> None:
        self.layers, self.final_norm = list(model.layers), model.norm
        attn, cfg = model.layers[0].self_attn, model.config
        self.sizes = (
            cfg.hidden_size,
            cfg.intermediate_size,
            attn.n_heads,
            attn.n_kv,
            attn.head_dim,
        )  # unsharded
        self.eps, self.scale = cfg.rms_norm_eps, attn.scale
        quant = model.layers[0].mlp.down_proj.quant
        self.max_m, self.vnni_max_m = quant.max_m, quant.vnni_max_m
        self._table: tuple[int, np.ndarray] | None = None  # (first K cache's address, per-layer pointers)
        # (first layer, end, whether they rotate): one run of every layer, or, with NoPE layers
        # (SmolLM3), one C call per run of layers alike, the NoPE ones given the identity's tables
        # (each call norms its first layer's input from the residual stream, as the layer before
        # would have: the same bits)
        rotates = cfg.rope_layers or [True] * len(self.layers)
        self.runs: list[tuple[int, int, bool]] = []
        for i, r in enumerate(rotates):
            if self.runs and self.runs[-1][2] == r:
                self.runs[-1] = (self.runs[-1][0], i + 1, r)
            else:
                self.runs.append((i, i + 1, r))

    @classmethod
    def build(cls, model, cpu: Kernels) -> DecoderLoop | None:
        """The loop for this model, or None when it does not apply (see the module doc)."""
        if not cpu.decoder_loop or tp_size() != 1 or not cls._applies(model.config):
            return None
        if not model.config.uniform_layers:  # Gemma 4's per-layer heads, inputs, scalars: not in decoder.c
            return None
        linears = [m for layer in model.layers for m in _linears(layer)]
        quants = [getattr(m, "quant", None) for m in linears]
        if any(getattr(m, "perm", None) is not None for m in linears):  # inputs reordered (GPTQ desc_act)
            return None
        return cls(model) if all(q is not None and q.vnni for q in quants) else None

    @staticmethod
    def _applies(cfg) -> bool:
        return not (
            cfg.attention_bias
            or cfg.o_proj_bias
            or cfg.mlp_bias
            or cfg.qk_norm
            or cfg.qk_norm_whole
            or (cfg.rotary_dim or cfg.head_dim) != cfg.head_dim  # partial rotary: PyTorch's ops
            or cfg.moe is not None
            or cfg.linear is not None
            or cfg.attn_output_gate
            or cfg.residual_scale is not None
            or not _plain_layers(cfg, nope=True)
        )

    def _row(self, i: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[int]:
        """Layer i's fields in decoder.c's order."""
        layer = self.layers[i]
        nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.final_norm
        row = [
            layer.input_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(),
            nxt.weight.data_ptr(),
        ]
        return row + _packed(layer) + [k_cache.data_ptr(), v_cache.data_ptr()]

    def _layers(self, kv_caches) -> np.ndarray:
        """The per-layer pointers decoder.c reads (rebuilt when the KV cache is reallocated)."""
        if self._table is None or self._table[0] != kv_caches[0][0].data_ptr():
            rows = [self._row(i, k, v) for i, (k, v) in enumerate(kv_caches)]
            self._table = (kv_caches[0][0].data_ptr(), np.array(rows, dtype=np.int64))
        return self._table[1]

    def takes(self, x: torch.Tensor, meta) -> bool:
        """Whether the loop runs this step: few enough rows, all attending through the paged kernel."""
        return (
            x.shape[0] <= self.max_m
            and meta.paged is not None
            and meta.decode is None
            and meta.prefill is None
        )

    takes_lora = True  # LoRA adapters' products inside the loop (decoder.c)
    takes_window = False  # steps past a sliding window (all layers one metadata until then)

    def __call__(self, x: torch.Tensor, ropes, kv_caches, meta, lora=None, first=None) -> torch.Tensor | None:
        """The final hidden states for this step (x, updated in place, is the residual stream), or
        None when the step is not for the loop. `ropes`: the (full, sliding) layers' tables; Llama's
        loop takes models without a sliding layer's base of its own: the first. `lora`: the adapters'
        tables and each row's slot (`pytgi.engine.models.lora.LoraContext`), or None. `first`: per
        request the sliding layers' first key (`WindowedMetadata.paged_window`; loops that take
        windows only)."""
        assert first is None, "this loop takes no sliding window"
        if not self.takes(x, meta):
            return None
        table, x = self._layers(kv_caches), x.contiguous()
        for start, stop, rotates in self.runs:
            cos, sin = ropes[0] if rotates else ropes[2]  # (the identity's: `DecoderModel.forward`)
            h = kernels.decoder_layers(
                table[start:stop],
                x,
                cos,
                sin,
                meta.slot_mapping,
                meta.paged,
                self.sizes,
                self.eps,
                self.scale,
                self.vnni_max_m,
                None if lora is None else (lora[0][start:stop], lora[1]),
                kernels.kv8(kv_caches[0][0]),
            )
        return h


class GemmaDecoderLoop(DecoderLoop):
    """Gemma 3's layers in one call. Returns the residual stream (the final norm is the caller's)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.sliding = [layer.sliding for layer in model.layers]

    @staticmethod
    def _applies(cfg) -> bool:
        # soft-capped attention is not paged
        return not cfg.attention_bias and not cfg.attn_logit_softcapping and _plain_layers(cfg)

    def _row(self, i: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[int]:
        layer, attn = self.layers[i], self.layers[i].self_attn
        norms = [
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.post_feedforward_layernorm,
        ]
        qk = (
            [attn.q_norm.scale().data_ptr(), attn.k_norm.scale().data_ptr()]
            if attn.q_norm is not None
            else [0, 0]
        )
        return (
            [n.scale().data_ptr() for n in norms]
            + qk
            + _packed(layer)
            + [k_cache.data_ptr(), v_cache.data_ptr(), int(self.sliding[i])]
        )

    takes_lora = False  # a step with adapters runs the layers one by one
    takes_window = True  # decodes past the window: the sliding layers start at their first keys

    def __call__(self, x: torch.Tensor, ropes, kv_caches, meta, lora=None, first=None) -> torch.Tensor | None:
        if not self.takes(x, meta):
            return None
        x = x.contiguous()
        kernels.gemma_layers(
            self._layers(kv_caches),
            x,
            ropes,
            meta.slot_mapping,
            meta.paged,
            self.sizes,
            self.eps,
            self.scale,
            self.vnni_max_m,
            kernels.kv8(kv_caches[0][0]),
            first,
        )
        return x
