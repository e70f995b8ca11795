"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM) over a paged KV cache."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pytgi import kernels
from pytgi.distributed import check_heads, tp_size
from pytgi.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    merged_shards,
    qkv_shards,
)
from pytgi.models import fused
from pytgi.models.quant import VNNI_MAX_M, QuantizedWeight, can_quantize

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # on q, k, v
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        arch = (cfg.get("architectures") or [""])[0]
        n_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            o_proj_bias=cfg.get("attention_bias", False) and arch != "Qwen2ForCausalLM",
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
        )


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: Any) -> None:
        super().__init__()
        hd, group = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
        shards = qkv_shards(hd, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.n_kv = shards[1][1] // hd
        self.n_heads = self.n_kv * group
        self.head_dim = hd
        self.scale = hd**-0.5
        self.backend = backend
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, shards, cfg.attention_bias)
        self.o_proj = RowParallelLinear(shards[0], cfg.hidden_size, cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, kv_cache, meta, fused_rope=False):  # type: ignore[no-untyped-def]
        T, H, KVH, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = self.qkv_proj(x)
        if fused_rope and self.q_norm is None:  # cos, sin: float32 [T, D]; k and v go straight to the cache
            q = fused.rope_write_kv(qkv, cos, sin, meta.slot_mapping, kv_cache[0], kv_cache[1], H, KVH, D)
            o = self.backend.forward(q, None, None, kv_cache[0], kv_cache[1], meta, self.scale)
            return self.o_proj(o.reshape(T, H * D))
        if fused_rope:
            cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
        v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
        if self.q_norm is None:  # rotate q and k in one go
            qk = apply_rotary(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        else:
            q = self.q_norm(qkv[:, : H * D].view(T, H, D))
            k = self.k_norm(qkv[:, H * D : (H + KVH) * D].view(T, KVH, D))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        shards = merged_shards([cfg.intermediate_size] * 2)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, shards, cfg.mlp_bias)
        self.down_proj = RowParallelLinear(shards[0], cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, fused_act: bool = False) -> torch.Tensor:
        if fused_act:
            return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: Any) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # checkpoint name part → (our parameter name part, shard index in a fused layer)
    FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: LlamaConfig, backend: Any) -> None:
        super().__init__()
        check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp_size())
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.use_c_decoder = True  # run all layers in one C call when the step allows (see _c_decoder)
        self._c_ok: bool | None = None  # can this model use it at all (see _c_layers)
        self._c_table: tuple[int, np.ndarray] | None = None  # (first K cache's address, per-layer pointers)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = self.embed_tokens(input_ids)
        if fused.enabled(x.device, x.dtype):
            return self._forward_fused(x, positions, kv_caches, meta)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def _forward_fused(self, x, positions, kv_caches, meta) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """The same computation with the CPU kernels of `pytgi.models.fused`: each residual add is
        fused with the RMSNorm that follows it (the next layer's input norm included)."""
        cos, sin = self.rotary.cos[positions].float(), self.rotary.sin[positions].float()
        residual = x.contiguous()
        if (h := self._c_decoder(residual, cos, sin, kv_caches, meta)) is not None:
            return h
        norms = [w for layer in self.layers for w in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(self.norm)
        h = fused.add_rms_norm(None, residual, norms[0].weight, norms[0].eps)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            a = layer.self_attn(h, cos, sin, kv_cache, meta, fused_rope=True)
            h = fused.add_rms_norm(a, residual, norms[2 * i + 1].weight, norms[2 * i + 1].eps)
            m = layer.mlp(h, fused_act=True)
            h = fused.add_rms_norm(m, residual, norms[2 * i + 2].weight, norms[2 * i + 2].eps)
        return h

    def _c_layers(self, kv_caches) -> np.ndarray | None:  # type: ignore[no-untyped-def]
        """The per-layer pointers `pytgi/kernels/decoder.c` reads, or None when this model can't use
        it: sharded, biases, q/k norms, or a linear without a packed low-bit weight."""
        if self._c_ok is None:  # decided once: quantization happens at load
            quants = [getattr(m, "quant", None) for layer in self.layers for m in
                      (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            cfg = self.config
            self._c_ok = not (tp_size() != 1 or cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias or cfg.qk_norm
                              or not all(q is not None and q.vnni for q in quants) or kernels.load() is None)
        if not self._c_ok:
            return None
        if self._c_table is not None and self._c_table[0] == kv_caches[0][0].data_ptr():
            return self._c_table[1]
        rows = []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            row = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   nxt.weight.data_ptr()]
            for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                row += [mod.quant.packed.data_ptr(), 4 if mod.quant.kind == "int4" else 8]
            rows.append(row + [k_cache.data_ptr(), v_cache.data_ptr()])
        self._c_table = (kv_caches[0][0].data_ptr(), np.array(rows, dtype=np.int64))
        return self._c_table[1]

    def _c_decoder(self, residual, cos, sin, kv_caches, meta) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
        """All layers in one C call (`pytgi/kernels/decoder.c`: the same kernels, without a Python
        dispatch per op) for bf16 steps small enough for the packed weights, all attention paged."""
        T, quant = residual.shape[0], getattr(self.layers[0].mlp.down_proj, "quant", None)
        if not self.use_c_decoder or quant is None or residual.dtype != torch.bfloat16 or T > quant.max_m:
            return None
        p = getattr(meta, "paged", None)
        if p is None or meta.decode is not None or meta.prefill is not None:
            return None
        table = self._c_layers(kv_caches)
        if table is None:
            return None
        attn, cfg = self.layers[0].self_attn, self.config
        h = torch.empty_like(residual)
        failed = kernels.load().pytgi_decoder_layers_bf16(
            table.ctypes.data, len(self.layers), residual.data_ptr(), h.data_ptr(), T, cfg.hidden_size,
            cfg.intermediate_size, attn.n_heads, attn.n_kv, attn.head_dim,  # unsharded: whole sizes
            ctypes.c_float(cfg.rms_norm_eps), ctypes.c_float(attn.scale), cos.data_ptr(), sin.data_ptr(),
            meta.slot_mapping.data_ptr(), p.q_starts.ctypes.data, p.q_lens.ctypes.data, p.block_tables.ctypes.data,
            p.context_lens.ctypes.data, len(p.q_starts), p.block_tables.shape[1], p.block_size,
            int((p.q_lens == 1).all()), VNNI_MAX_M if quant.amx else 1 << 30)
        if failed:
            raise MemoryError("decoder layers: out of memory")
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def quantize(self, plan: dict[str, str] | str, act_dtype: torch.dtype) -> None:
        """Give each planned linear a low-bit copy of its weight (see `pytgi.models.quant`); its float
        weight becomes the dequantized values in `act_dtype`. Call on float32 weights, before the
        model is cast."""
        parts = {fused: [p for p, (f, _) in self.FUSED.items() if f == fused] for fused, _ in self.FUSED.values()}

        def kind(hf_names: list[str]) -> str | None:
            kinds = {plan} if isinstance(plan, str) else {plan.get(n) for n in hf_names}
            return None if None in kinds else ("int4" if kinds == {"int4"} else "int8")

        todo: list[tuple[nn.Module, str]] = []
        for name, mod in self.named_modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                stem, last = name.rsplit(".", 1)
                names = [f"model.{stem}.{p}.weight" for p in parts.get(last, [last])]
                if (k := kind(names)) is not None:
                    todo.append((mod, k))
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        if (k := kind([head])) is not None:
            todo.append((self.lm_head, "int8"))  # logits are sensitive: never below 8 bits
        for mod, k in todo:
            mod.quant = QuantizedWeight(k if can_quantize(k, mod.weight) else "int8", mod.weight.data, act_dtype)
        self.to(act_dtype)
        for mod, _ in todo:
            if mod is not self.lm_head:
                mod.weight.data = mod.quant.dequantized

    def load_weights(self, weights) -> None:  # type: ignore[no-untyped-def]
        """Copy (name, tensor) pairs in Hugging Face naming into this rank's parameters."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard = 0
            for part, (fused, idx) in self.FUSED.items():
                if f".{part}." in name:
                    name, shard = name.replace(part, fused), idx
                    break
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor.to(param.dtype), shard)
            loaded.add(name)
        missing = {n for n in params if n not in loaded}
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
