"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM) over a paged KV cache.

One forward for every device and dtype: which kernels run it is chosen at load (`CpuKernels`):
its `ops()` give the element-wise steps, the attention backend is built for its kernels and heads,
quantized linears are swapped in (`quantize`), and on CPU a quantized model may run its layers in
one C call (`DecoderLoop`) for the steps that allow it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pytgi.distributed import check_heads, tp_size
from pytgi.models.attention import (
    SlidingWindowBackend,
    TorchAttention,
    WindowedMetadata,
    get_backend,
    layer_metadata,
)
from pytgi.models.cpu import CpuKernels, TorchOps
from pytgi.models.decoder_loop import DecoderLoop
from pytgi.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    merged_shards,
    qkv_shards,
)
from pytgi.models.moe import SparseMoE
from pytgi.models.quant import quantize_model

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # Llama with q, k, v (and gate, up) fused in the checkpoint
    "MixtralForCausalLM",  # ... and with a sparse mixture of experts for MLP (pytgi.models.moe)
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(slots=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk: bool  # renormalize the chosen experts' weights
    shared_intermediate_size: int | None  # Qwen2-MoE's shared expert
    sparse_layers: list[bool]  # which layers route (the others keep the dense MLP)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], arch: str) -> MoEConfig | None:
        if arch not in MOE_ARCHITECTURES:
            return None
        if arch == "MixtralForCausalLM":
            return cls(
                cfg["num_local_experts"],
                cfg["num_experts_per_tok"],
                cfg["intermediate_size"],
                True,
                None,
                [True] * cfg["num_hidden_layers"],
            )
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 5 names Qwen3-MoE's so
        return cls(
            experts,
            cfg["num_experts_per_tok"],
            cfg["moe_intermediate_size"],
            bool(cfg.get("norm_topk_prob", False)),
            cfg.get("shared_expert_intermediate_size") or None,
            [i not in dense and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"])],
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
    sliding_window: int | None = None  # Mistral's (and Qwen2's with use_sliding_window)
    layer_types: list[str] | None = None  # per layer, "sliding_attention" | "full_attention" (with a window)
    moe: MoEConfig | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        arch = (cfg.get("architectures") or [""])[0]
        n_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"partial rotary embeddings (partial_rotary_factor {cfg['partial_rotary_factor']}) "
                "are not supported"
            )
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        uses_window = arch == "MistralForCausalLM" or cfg.get("use_sliding_window", False)
        window = cfg.get("sliding_window") if uses_window else None
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
            attention_bias=cfg.get("qkv_bias", True)
            if arch == "Qwen2MoeForCausalLM"
            else cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            o_proj_bias=cfg.get("attention_bias", False)
            and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            moe=MoEConfig.from_hf(cfg, arch),
            sliding_window=window,
            layer_types=(cfg.get("layer_types") or ["sliding_attention"] * cfg["num_hidden_layers"])
            if window
            else None,
        )


def local_heads(cfg: Any) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) on this rank: split by kv heads, each with its query group."""
    shards = qkv_shards(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
    n_kv = shards[1][1] // cfg.head_dim
    return n_kv * (cfg.num_attention_heads // cfg.num_key_value_heads), n_kv, cfg.head_dim


class Attention(nn.Module):
    def __init__(
        self, cfg: LlamaConfig, backend: TorchAttention, ops: TorchOps, sliding: bool | None = None
    ) -> None:
        """sliding: whether this layer attends within the model's window (None: the model has none)."""
        super().__init__()
        self.sliding = sliding
        self.n_heads, self.n_kv, self.head_dim = local_heads(cfg)
        self.scale = cfg.head_dim**-0.5
        self.backend, self.ops = backend, ops
        shards = qkv_shards(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, shards, cfg.attention_bias)
        self.o_proj = RowParallelLinear(shards[0], cfg.hidden_size, cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, rope, kv_cache, meta):  # type: ignore[no-untyped-def]
        meta = layer_metadata(meta, self.sliding)
        q, k, v = self.ops.qkv_rotary(self, self.qkv_proj(x), rope, kv_cache, meta)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(x.shape[0], self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, ops: TorchOps) -> None:
        super().__init__()
        shards = merged_shards([cfg.intermediate_size] * 2)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, shards, cfg.mlp_bias)
        self.down_proj = RowParallelLinear(shards[0], cfg.hidden_size, cfg.mlp_bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        backend: TorchAttention,
        ops: TorchOps,
        sliding: bool | None = None,
        sparse: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend, ops, sliding)
        moe = cfg.moe
        self.mlp: MLP | SparseMoE = (
            MLP(cfg, ops)
            if moe is None or not sparse
            else SparseMoE(
                cfg.hidden_size,
                moe.intermediate_size,
                moe.num_experts,
                moe.top_k,
                moe.norm_topk,
                moe.shared_intermediate_size,
            )
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ops = ops

    def forward(self, residual, h, rope, kv_cache, meta, next_norm):  # type: ignore[no-untyped-def]
        """h: this layer's input, normed. Returns the residual stream and the next norm of it (the
        next layer's input norm, or the model's final one): each residual add is paired with the
        norm after it, which the C kernels do in one pass."""
        a = self.self_attn(h, rope, kv_cache, meta)
        residual, h = self.ops.add_norm(a, residual, self.post_attention_layernorm)
        return self.ops.add_norm(self.mlp(h), residual, next_norm)


class LlamaForCausalLM(nn.Module):
    # checkpoint name part → (our parameter name part, shard index in a fused layer)
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: LlamaConfig, cpu: CpuKernels, attention: str = "torch") -> None:
        """cpu: the kernels to run on (`CpuKernels.for_device`, or `CpuKernels.none()`: PyTorch's
        ops); attention: the attention backend's name."""
        super().__init__()
        check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp_size())
        self.config, self.cpu, self.ops = cfg, cpu, cpu.ops()
        backend = get_backend(attention, cpu, local_heads(cfg))
        self.attention: TorchAttention | SlidingWindowBackend = backend
        slidings: list[bool | None] = [None] * cfg.num_hidden_layers
        if cfg.sliding_window and cfg.layer_types:
            self.attention = SlidingWindowBackend(backend, cfg.sliding_window)
            slidings = [t == "sliding_attention" for t in cfg.layer_types]
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        sparse = cfg.moe.sparse_layers if cfg.moe else [False] * cfg.num_hidden_layers
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, self.ops, s, m) for s, m in zip(slidings, sparse)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.decoder_loop: DecoderLoop | None = None  # set by `quantize` where it applies

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = self.embed_tokens(input_ids)
        rope = self.ops.rope_tables(self.rotary, positions, x.dtype)
        whole = meta.uniform if isinstance(meta, WindowedMetadata) else meta  # one metadata for every layer
        if (
            self.decoder_loop is not None
            and whole is not None
            and (h := self.decoder_loop(x, rope, kv_caches, whole)) is not None
        ):
            return h
        residual, h = self.ops.add_norm(None, x, self.layers[0].input_layernorm)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, kv_cache, next_norm in zip(self.layers, kv_caches, next_norms):
            residual, h = layer(residual, h, rope, kv_cache, meta, next_norm)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def quantize(self, plan: dict[str, str] | str, act_dtype: torch.dtype) -> None:
        """Swap each planned linear for a low-bit one (see `pytgi.models.quant`) and cast the model
        to `act_dtype`. Call on float32 weights, before the model is cast."""
        parts = {
            fused: [p for p, (f, _) in self.FUSED.items() if f == fused] for fused, _ in self.FUSED.values()
        }

        def kind(hf_names: list[str]) -> str | None:
            kinds = {plan} if isinstance(plan, str) else {plan.get(n) for n in hf_names}
            if None in kinds:
                return None
            if kinds == {"bf16"}:
                return "bf16"
            return "int4" if kinds == {"int4"} else "int8x16" if "int8x16" in kinds else "int8"

        todo: dict[nn.Module, str] = {}
        for name, mod in self.named_modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                stem, last = name.rsplit(".", 1)
                names = [f"model.{stem}.{p}.weight" for p in parts.get(last, [last])]
                if (k := kind(names)) is not None:
                    todo[mod] = k
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        if (k := kind([head])) is not None:
            todo[self.lm_head] = (
                k if k in ("int8x16", "bf16") else "int8"
            )  # logits are sensitive: never below 8 bits
        quantize_model(self, todo, act_dtype, self.cpu)
        self.decoder_loop = self._decoder_loop()

    def _decoder_loop(self) -> DecoderLoop | None:
        """All layers in one C call, where the model and kernels allow (Llama's layer only)."""
        return DecoderLoop.build(self, self.cpu)

    def _unfused(self, weights):  # type: ignore[no-untyped-def]
        """Checkpoints that store q, k, v (or gate, up) as one tensor (Phi-3) as separate ones, so each
        part reaches its shard of the fused layer."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                yield from zip(
                    [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")],
                    tensor.split([q, kv, kv]),
                )
            elif ".gate_up_proj." in name:
                yield from zip(
                    [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")], tensor.chunk(2)
                )
            else:
                yield name, tensor

    def load_weights(self, weights) -> None:  # type: ignore[no-untyped-def]
        """Copy (name, tensor) pairs in Hugging Face naming into this rank's parameters."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in self._unfused(weights):
            name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            if "rotary_emb" in name:
                continue
            if ".mlp.experts." in name:  # a mixture of experts' stacked weights
                layer, rest = name.split(".mlp.", 1)
                mlp = self.get_submodule(layer + ".mlp")
                loaded.update(f"{layer}.mlp.{p}" for p in mlp.load_experts(rest, tensor))
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
