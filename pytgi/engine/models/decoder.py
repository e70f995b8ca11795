"""One decoder-only transformer over the paged KV cache, for every family pytgi runs itself.

Llama 2/3, Mistral, Qwen2/2.5/3 (and their mixtures of experts), Phi-3, SmolLM, Gemma 2, 3 and 4
(and the families below) differ in data, which `DecoderConfig` holds (parsed from each family's
config.json by its reader: `pytgi.engine.models.llama`, `pytgi.engine.models.gemma`, ...):

- the norms: RMSNorm scaling by ``weight`` in the model's dtype, or by ``1 + weight`` in float32
  (Gemma, `norm_offset`); two a layer (before attention and before the MLP), or four (Gemma's
  `sandwich_norms`: the sublayers' outputs are normed too before they join the residual stream);
  optional per-head q/k norms before the rotation (Qwen3, Gemma 3);
- the MLP's activation (SiLU or tanh-GELU), biases, a sparse mixture of experts;
- the embedding's scale, attention's scale, soft-capped attention scores and logits (Gemma 2);
- sliding-window layers (`layer_types`), with their own RoPE base where the family has one;
- the sublayers' outputs scaled before the residual add, the logits divided (Granite);
- layers without rotary embedding (`rope_layers`: SmolLM3's NoPE layers, the global layers of Exaone 4
  and Cohere 2), which rotate by the identity's tables;
- norms after the sublayers only (`pre_norms` False: OLMo 2/3, Exaone 4), q/k norms over the whole
  projection (`qk_norm_whole`: OLMo 2/3, MiniMax-M2, all-reduced across ranks);
- LayerNorms, attention and the MLP side by side, q/k rows paired for the rotation as (2i, 2i + 1) and
  reordered at load (`layer_norm`, `parallel_block`, `rope_interleaved`: Cohere 2).
- per layer, where layers differ (Gemma 4, `LayerAttention`): kv heads and head size, reading an earlier
  layer's KV cache, keys that are the values, the MLP's width; values normed per head, per-layer
  inputs gated into each layer's output, a scalar on each layer's output.

Which families there are, and which reader each has, is `pytgi.core.families`' table.

The forward is the same for all: which kernels run it is chosen at load (`Kernels`): its `ops()`
give the element-wise steps (PyTorch's, or the fused C kernels: a residual add shares a pass with
the norm after it, rope writes k and v straight into the cache), the attention backend is built for
its kernels and heads, quantized linears are swapped in (`quantize`), and on CPU a quantized model
may run all its layers in one C call (`pytgi.engine.models.decoder_loop`) for the steps that allow it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeAlias

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pytgi.engine.distributed import all_reduce, check_heads, local_range, tp_size
from pytgi.engine.models import altup
from pytgi.engine.models.altup import AltUpConfig
from pytgi.engine.models.attention import (
    LayerCache,
    LayerMetadata,
    Rope,
    SinkAttention,
    SlidingWindowBackend,
    SoftcapAttention,
    TorchAttention,
    WindowedMetadata,
)
from pytgi.engine.models.backends import get_backend, ops_for
from pytgi.engine.models.cpu import KernelOps, Kernels, TorchOps
from pytgi.engine.models.decoder_loop import DecoderLoop, GemmaDecoderLoop
from pytgi.engine.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    merged_shards,
    qkv_shards,
    rotate_half_rows,
    scaled_rows,
)
from pytgi.engine.models.linear_attention import (
    RecurrentConfig,
    RecurrentMixer,
    StateBackend,
    StateMetadata,
)
from pytgi.engine.models.mla import MLAConfig, MLAttention, mla_heads, query_scales
from pytgi.engine.models.moe import Routing, SparseMoE
from pytgi.engine.models.quant import (
    Fp8Rows,
    LayoutRows,
    merged_kind,
    quantize_model,
)

if TYPE_CHECKING:
    from pytgi.engine.loading.checkpoints import Mxfp4
    from pytgi.engine.models.lora import LoraContext

# A checkpoint tensor as the loaders give it: a tensor, or gpt-oss's MXFP4 experts as the checkpoint
# holds them (`Mxfp4`: their codes packed by `SparseMoE`, never dequantized)
Weight: TypeAlias = "torch.Tensor | Mxfp4"
Weights: TypeAlias = "Iterable[tuple[str, Weight]]"  # (name, tensor) pairs in Hugging Face naming

# A decoder's step metadata, as its backend prepares it (`layer_metadata` picks a layer's)
DecoderMetadata: TypeAlias = "LayerMetadata | WindowedMetadata | StateMetadata"

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"
# the layer types whose mixer keeps a per-request state (`DecoderConfig.linear` builds it): gated
# DeltaNet, Mamba's selective scan, short convolutions
MAMBA, CONV = "mamba", "conv"
RECURRENT = (LINEAR, MAMBA, CONV)
# a layer that is its MLP (or mixture of experts) alone: no attention, no state (Nemotron-H's "-" and
# "E" layers, `DecoderConfig.single_mixer`)
FFN = "ffn"


class StepImages(NamedTuple):
    """A step's image rows (a vision model's): `values` replace the embeddings of the flat `rows`;
    with M-RoPE (Qwen2-VL), `rope_rows` take 3-D positions `rope_positions` [3, n] (temporal,
    height, width) instead of their 1-D ones."""

    rows: torch.Tensor
    values: torch.Tensor
    rope_rows: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None


@dataclass(slots=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk: bool  # renormalize the chosen experts' weights
    shared_intermediate_size: int | None  # Qwen2-MoE's shared expert
    sparse_layers: list[bool]  # which layers route (the others keep the dense MLP)
    # gpt-oss's experts: (alpha, limit) of the clamped SwiGLU; with biases on the router and experts
    oai: tuple[float, float] | None = None
    # the router's rule beyond softmax top-k (DeepSeek-V3, GLM-4.5, MiniMax-M2; frozen: one default)
    routing: Routing = Routing()  # noqa: RUF009
    shared_gate: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert; False: added as it is
    activation: str = "silu"  # the experts' act(gate) · up: "silu", or "gelu_tanh" (Gemma 4)
    # Gemma 4: the experts run beside the dense MLP (`DecoderLayer.moe`), each output with its own norm
    beside_dense: bool = False


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One layer's attention where it differs from the model's (Gemma 4: its full-attention layers'
    own head size and kv heads, and the last layers reading an earlier layer's keys and values)."""

    num_key_value_heads: int
    head_dim: int
    # reads layer `kv_source`'s keys and values from that layer's cache (has no k, v projections and
    # writes no cache of its own); None: its own
    kv_source: int | None = None
    k_eq_v: bool = False  # the values are the keys' projection (before k's norm and rotation): no v_proj
    intermediate_size: int | None = None  # its MLP's, where it differs from the model's (Gemma 4)


@dataclass(slots=True)
class DecoderConfig:
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
    qk_norm: bool  # per-head RMSNorm of q and k before the rotation
    attn_scale: float  # queries' scale: head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer, SLIDING | FULL (with a window)
    rope_local_theta: float | None = None  # sliding layers' own RoPE base (Gemma 3); None: rope_theta
    activation: str = "silu"  # the MLP's: "silu" | "gelu_tanh"
    norm_offset: bool = False  # RMSNorms scale by 1 + weight, in float32 (Gemma)
    sandwich_norms: bool = False  # the attention's and the MLP's outputs are normed too (Gemma)
    embed_scale: float | None = None  # the embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    attn_logit_softcapping: float | None = None  # Gemma 2: cap · tanh(score / cap)
    final_logit_softcapping: float | None = None
    moe: MoEConfig | None = None
    attn_sinks: bool = False  # a learned logit per query head in every softmax (gpt-oss)
    # Qwen3-Next / Qwen3.5: gated DeltaNet layers (`layer_types` LINEAR) between the attention layers,
    # whose output is gated (o · sigmoid(gate), the gate a second half of each query head's
    # projection) and whose rotary embedding turns the first `rotary_dim` features of a head only
    linear: RecurrentConfig | None = None
    attn_output_gate: bool = False
    rotary_dim: int | None = None  # None: head_dim
    # the q and k RMSNorms span each token's whole projection (all heads), not each head (OLMo 2/3,
    # MiniMax-M2; `WholeNorm`, all-reduced across ranks)
    qk_norm_whole: bool = False
    ignored_weights: tuple[str, ...] = ()  # checkpoint tensors (by prefix) the model does not use
    # Granite: each sublayer's output is scaled before it joins the residual stream, and the logits
    # divided by `logit_scale`
    residual_scale: float | None = None
    logit_scale: float | None = None
    score_labels: int = 0  # a sequence classifier's score head ([labels, hidden], `score.weight`); 0: none
    # per layer, whether it rotates q and k (None: every layer does): SmolLM3's NoPE layers, the global
    # layers of Exaone 4 and Cohere 2 (their q and k go to the cache as projected)
    rope_layers: list[bool] | None = None
    # False: no norm before attention nor before the MLP (OLMo 2/3, Exaone 4: with `sandwich_norms`
    # their outputs alone are normed, `post_attention_layernorm` and `post_feedforward_layernorm`)
    pre_norms: bool = True
    # Cohere 2: LayerNorms (the mean subtracted, no bias, in float32) instead of RMSNorms; attention and
    # the MLP side by side on one normed input (`input_layernorm`), both added to the residual stream;
    # the checkpoint's q/k rows pair features (2i, 2i + 1) for the rotation (reordered per head at
    # load to rotate-half's halves)
    layer_norm: bool = False
    parallel_block: bool = False
    rope_interleaved: bool = False
    # Gemma 4: each layer's attention (`LayerAttention`; None: every layer the model's heads), values
    # normed per head (RMSNorm without a weight) before they are cached, per-layer inputs (a second
    # embedding of `per_layer_input_size` a layer, over `per_layer_vocab_size` ids, gated into each
    # layer's output) and a learned scalar multiplying each layer's output (`layer_scalar`)
    layer_attention: list[LayerAttention] | None = None
    v_norm: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    layer_scalar: bool = False
    # Gemma 3n: its layers on the active one of several residual streams (AltUp), a low-rank residual
    # (LAuReL) and activation sparsity in the first MLPs (`pytgi.engine.models.altup`)
    altup: AltUpConfig | None = None
    # Nemotron-H: each layer is one mixer (attention, a recurrent mixer, or the MLP alone: `layer_types`
    # FFN) with its own pre-norm and residual, no attention + MLP pairs; its MLP not gated
    # (`mlp_gated` False: down(act(up(x))), act "relu2": relu(x)²)
    single_mixer: bool = False
    mlp_gated: bool = True
    # checkpoint names rewritten before any other rule (regex, replacement), in order: families whose
    # checkpoints name the modules otherwise (Nemotron-H's `backbone.` and `mixer.`, Bamba's `mamba.`,
    # LFM2's `operator_norm` and `feed_forward.w1`: `literal_renames`)
    weight_renames: tuple[tuple[str, str], ...] = ()
    # checkpoint tensors multiplied at load (after the renames), by name (regex), in row segments
    # ((rows, factor), ...; rows -1: all the rest): Falcon-H1's µP multipliers on the projections'
    # inputs and outputs, folded into their weights
    weight_scales: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    # Falcon-H1: every layer runs attention and the recurrent mixer (`linear`) side by side on the same
    # normed input and adds both outputs to the residual stream, then its MLP
    parallel_mixers: bool = False

    @property
    def uniform_layers(self) -> bool:
        """Every layer has the model's heads and none of Gemma 4's per-layer features (what the C
        all-layers loop takes)."""
        return not (
            self.layer_attention is not None
            or self.v_norm
            or self.per_layer_input_size
            or self.layer_scalar
            or self.altup is not None
        )

    # multi-head latent attention (DeepSeek V2/V3, `pytgi.engine.models.mla`): then one kv head of
    # `head_dim` = the latent's row, `rotary_dim` its rotary part, `attn_scale` MLA's softmax scale
    mla: MLAConfig | None = None


def literal_renames(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """`DecoderConfig.weight_renames` that replace parts of a name as they are written."""
    return tuple((re.escape(old), new) for old, new in pairs)


def local_heads(cfg: DecoderConfig, layer: LayerAttention | None = None) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) on this rank: split by kv heads, each with its query group
    (`layer`: a layer's own heads, Gemma 4's)."""
    n_kv_all, head_dim = _kv_heads(cfg, layer)
    shards = qkv_shards(head_dim, cfg.num_attention_heads, n_kv_all)
    n_kv = shards[1][1] // head_dim
    return n_kv * (cfg.num_attention_heads // n_kv_all), n_kv, head_dim


def _kv_heads(cfg: DecoderConfig, layer: LayerAttention | None) -> tuple[int, int]:
    """(kv heads, head dim) of a layer, all ranks'."""
    if layer is None:
        return cfg.num_key_value_heads, cfg.head_dim
    return layer.num_key_value_heads, layer.head_dim


def layer_rope_dim(cfg: DecoderConfig, kind: str) -> int:
    """The head size the rotary tables of `kind`'s layers (FULL, SLIDING) turn: the first such layer's
    own (Gemma 4), else the model's."""
    if cfg.layer_attention is not None and cfg.layer_types is not None:
        for spec, t in zip(cfg.layer_attention, cfg.layer_types):
            if t == kind:
                return spec.head_dim
    return cfg.rotary_dim or cfg.head_dim if kind == FULL else cfg.head_dim


def layer_metadata(meta: DecoderMetadata, sliding: bool | None) -> LayerMetadata:
    """A layer's own metadata: `sliding` None for models without windows."""
    attn = meta.attn if isinstance(meta, StateMetadata) else meta  # a hybrid model's attention layers'
    if not isinstance(attn, WindowedMetadata):  # no windows: `sliding` is None
        return attn
    return attn.sliding if sliding else attn.full


def _norm(cfg: DecoderConfig, dim: int) -> RMSNorm:
    if cfg.layer_norm:
        return LayerNorm(dim, cfg.rms_norm_eps)
    return RMSNorm(dim, cfg.rms_norm_eps, offset=cfg.norm_offset)


class LayerNorm(RMSNorm):
    """LayerNorm without a bias, computed in float32 and rounded once (Cohere's). Runs in PyTorch ops
    only: the layers of a model with it never hand it to the fused kernels (`DecoderLayer`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf - xf.mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class WholeNorm(RMSNorm):
    """RMSNorm over a whole q or k projection (all heads: OLMo 2/3, MiniMax-M2). A rank holds rows
    [start, start + size) of `total`: the squares are summed over every rank's heads."""

    def __init__(self, total: int, shard: tuple[int, int], eps: float) -> None:
        super().__init__(shard[1], eps)
        self.total, self.start = total, shard[0]
        self.weight.weight_loader = lambda p, t, _: p.data.copy_(t[self.start : self.start + len(p)])  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if tp_size() > 1:
            squares = all_reduce(squares)
        xf = xf * torch.rsqrt(squares / self.total + self.eps)
        return (self.weight * xf).to(x.dtype)  # OLMo's: rounded once, after the weight


class Attention(nn.Module):
    def __init__(
        self,
        cfg: DecoderConfig,
        backend: TorchAttention,
        ops: TorchOps,
        sliding: bool | None = None,
        spec: LayerAttention | None = None,
    ) -> None:
        """sliding: whether this layer attends within the model's window (None: the model has none);
        spec: the layer's own heads and KV source (Gemma 4; None: the model's)."""
        super().__init__()
        self.sliding = sliding
        self.n_heads, self.n_kv, self.head_dim = local_heads(cfg, spec)
        self.scale = cfg.attn_scale
        self.backend, self.ops = backend, ops
        n_kv, head_dim = _kv_heads(cfg, spec)
        shards = qkv_shards(head_dim, cfg.num_attention_heads, n_kv)
        self.gated, self.rotary_dim = cfg.attn_output_gate, cfg.rotary_dim or cfg.head_dim
        # Gemma 4: a layer reading another's cache (`kv_source`) projects queries only; k == v: the
        # keys' projection is the values' too
        self.kv_source = None if spec is None else spec.kv_source
        self.k_eq_v = spec is not None and spec.k_eq_v
        self.own = spec is not None  # the PyTorch path below (`_own_qkv`) computes q, k, v
        if spec is not None:
            self.rotary_dim = head_dim
        q_rows = (
            (2 * shards[0][0], 2 * shards[0][1]) if self.gated else shards[0]
        )  # each head's q, then its gate
        kv_rows = [] if self.kv_source is not None else shards[1:2] if self.k_eq_v else shards[1:]
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_rows, *kv_rows], cfg.attention_bias)
        self.o_proj = RowParallelLinear(shards[0], cfg.hidden_size, cfg.o_proj_bias)
        per_head = cfg.qk_norm and not cfg.qk_norm_whole
        self.q_norm = _norm(cfg, head_dim) if per_head else None
        self.k_norm = _norm(cfg, head_dim) if per_head and self.kv_source is None else None
        # OLMo 2/3's and MiniMax-M2's norms of the whole projections (the checkpoint's q_norm / k_norm,
        # renamed by `load_weights`)
        self.q_norm_all: WholeNorm | None = None
        self.k_norm_all: WholeNorm | None = None
        if cfg.qk_norm_whole:
            H, KVH, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            self.q_norm_all = WholeNorm(H * D, shards[0], cfg.rms_norm_eps)
            self.k_norm_all = WholeNorm(KVH * D, shards[1], cfg.rms_norm_eps)
        self.v_norm = cfg.v_norm and self.kv_source is None  # RMSNorm without a weight
        self.eps = cfg.rms_norm_eps
        self.sinks: nn.Parameter | None = None
        if cfg.attn_sinks:  # this rank's query heads' sinks
            self.sinks = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
            first = shards[0][0] // cfg.head_dim
            self.sinks.weight_loader = lambda p, t, _: p.data.copy_(t[first : first + len(p)])  # type: ignore[attr-defined]

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_cache: LayerCache, meta: DecoderMetadata
    ) -> torch.Tensor:
        meta = layer_metadata(meta, self.sliding)
        gate = None
        qkv = self.qkv_proj(x)
        if self.q_norm_all is not None and self.k_norm_all is not None:
            nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q, k, v = qkv.split([nq, nk, nk], dim=-1)
            qkv = torch.cat([self.q_norm_all(q), self.k_norm_all(k), v], dim=-1)
        if self.own:
            q, k, v = self._own_qkv(qkv, rope)
        elif self.gated or self.rotary_dim != self.head_dim:
            q, k, v, gate = self._gated_qkv(qkv, rope)
        else:
            q, k, v = self.ops.qkv_rotary(self, qkv, rope, kv_cache, meta)
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **extra)
        o = o.reshape(x.shape[0], self.n_heads * self.head_dim)
        return self.o_proj(o if gate is None else o * torch.sigmoid(gate))

    def _own_qkv(
        self, qkv: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Gemma 4's q, k, v in PyTorch ops: q and k normed and rotated, v normed without a weight
        (`v_norm`) or the keys' projection itself (`k_eq_v`); k, v None where the layer reads another
        layer's cache (`kv_source`), whose keys and values are there already."""
        T, H, KVH, D = qkv.shape[0], self.n_heads, self.n_kv, self.head_dim
        cos, sin = (t.reshape(T, 1, D).to(qkv.dtype) for t in rope)  # (KernelOps' tables: float32 [T, D])
        q = qkv[:, : H * D].view(T, H, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rotary(q, cos, sin)
        if self.kv_source is not None:
            return q, None, None
        k = qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
        v = k if self.k_eq_v else qkv[:, (H + KVH) * D :].view(T, KVH, D)
        if self.v_norm:
            vf = v.float()
            v = (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + self.eps)).to(v.dtype)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return q, apply_rotary(k, cos, sin), v.contiguous()

    def _gated_qkv(
        self, qkv: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v with the rotary embedding on each head's first `rotary_dim` features, and the
        output's gate (None: not gated), in PyTorch ops (Qwen3-Next's attention layers; partial
        rotary embeddings, GLM-4.5's and MiniMax-M2's; q/k norms over the whole projection)."""
        T, H, KVH, D, r = qkv.shape[0], self.n_heads, self.n_kv, self.head_dim, self.rotary_dim
        nq = H * D * (2 if self.gated else 1)
        q, gate = qkv[:, :nq].view(T, H, -1), None
        if self.gated:
            q, gate = q[..., :D], q[..., D:].reshape(T, H * D)
        k = qkv[:, nq : nq + KVH * D].view(T, KVH, D)
        v = qkv[:, nq + KVH * D :].view(T, KVH, D)
        if self.q_norm is not None and self.k_norm is not None:  # (whole-projection norms ran before)
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (t.reshape(T, 1, r).to(q.dtype) for t in rope)  # (KernelOps' tables are float32 [T, r])
        q = torch.cat([apply_rotary(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([apply_rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        return q, k, v, gate


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: TorchOps, intermediate_size: int | None = None) -> None:
        """intermediate_size: this layer's, where it differs from the model's (Gemma 4)."""
        super().__init__()
        shards = merged_shards([intermediate_size or cfg.intermediate_size] * 2)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, shards, cfg.mlp_bias)
        self.down_proj = RowParallelLinear(shards[0], cfg.hidden_size, cfg.mlp_bias)
        self.ops, self.activation = ops, cfg.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_mul(self.activation, self.gate_up_proj(x)))


class PlainMLP(nn.Module):
    """An MLP without a gate, down(act(up(x))) (Nemotron-H's, act relu², in PyTorch's ops)."""

    def __init__(self, hidden: int, inter: int, activation: str, bias: bool = False) -> None:
        super().__init__()
        if activation != "relu2":
            raise ValueError(f"unknown activation {activation!r} of an MLP without a gate")
        shard = local_range(inter)
        self.up_proj = ColumnParallelLinear(hidden, [shard], bias)
        self.down_proj = RowParallelLinear(shard, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: DecoderConfig,
        backend: TorchAttention,
        ops: TorchOps,
        sliding: bool | None = None,
        sparse: bool = False,
        linear: bool = False,
        rotates: bool = True,
        spec: LayerAttention | None = None,
        ffn: bool = False,
    ) -> None:
        """linear: a recurrent layer (`linear_attn`: gated DeltaNet, Mamba-2; its KV cache entry a
        recurrent state) instead of attention (`self_attn`); rotates: False for a layer without rotary
        embedding (NoPE); spec: its attention's own heads (Gemma 4); ffn: the layer is its MLP alone
        (`FFN`, with `single_mixer`: no cache entry)."""
        super().__init__()
        self.sliding, self.sandwich, self.ops = sliding, cfg.sandwich_norms, ops
        self.rotates, self.pre_norms, self.parallel = rotates, cfg.pre_norms, cfg.parallel_block
        self.residual_scale = cfg.residual_scale
        self.single = cfg.single_mixer
        self.self_attn: Attention | MLAttention | None = None
        self.linear_attn: RecurrentMixer | None = None
        if ffn:  # no attention and no state: the layer is its MLP or experts (Nemotron-H's "-", "E")
            pass
        elif linear:
            assert cfg.linear is not None
            fused = isinstance(ops, KernelOps)  # the C kernels run this model (CPU)
            self.linear_attn = cfg.linear.build(cfg.hidden_size, cfg.rms_norm_eps, fused)
        elif cfg.mla is not None:
            self.self_attn = MLAttention(
                cfg.mla,
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.rms_norm_eps,
                cfg.attention_bias,
                cfg.attn_scale,
                backend,
            )
        else:
            self.self_attn = Attention(cfg, backend, ops, sliding, spec)
        if cfg.parallel_mixers:  # Falcon-H1: a Mamba-2 mixer beside the attention
            assert cfg.linear is not None and self.self_attn is not None
            self.linear_attn = cfg.linear.build(cfg.hidden_size, cfg.rms_norm_eps, isinstance(ops, KernelOps))
        moe = cfg.moe
        self.mlp: MLP | PlainMLP | SparseMoE | None = None
        if moe is not None and sparse and not moe.beside_dense:
            self.mlp = SparseMoE(
                cfg.hidden_size,
                moe.intermediate_size,
                moe.num_experts,
                moe.top_k,
                moe.norm_topk,
                moe.shared_intermediate_size,
                oai=moe.oai,
                routing=moe.routing,
                shared_gate=moe.shared_gate,
                activation=moe.activation,
            )
        elif self.single and not ffn:  # Nemotron-H's attention and Mamba layers have no MLP
            pass
        elif not cfg.mlp_gated:
            self.mlp = PlainMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation, cfg.mlp_bias)
        else:
            self.mlp = MLP(cfg, ops, None if spec is None else spec.intermediate_size)
        # Gemma 4's mixture of experts beside the dense MLP: the router reads the residual stream, the
        # experts its `pre_feedforward_layernorm_2`; the MLP's output and the experts' are normed
        # (`post_feedforward_layernorm_1`, `_2`) and summed before `post_feedforward_layernorm`
        self.moe: SparseMoE | None = None
        if moe is not None and sparse and moe.beside_dense:
            self.moe = SparseMoE(
                cfg.hidden_size,
                moe.intermediate_size,
                moe.num_experts,
                moe.top_k,
                moe.norm_topk,
                routing=moe.routing,
                activation=moe.activation,
                router_eps=cfg.rms_norm_eps,
            )
            self.pre_feedforward_layernorm_2 = _norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm_1 = _norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm_2 = _norm(cfg, cfg.hidden_size)
        # The checkpoints' names: Llama's post_attention_layernorm is the MLP's input norm, Gemma's
        # normalises the attention's output (its MLP's input norm is pre_feedforward_layernorm).
        # OLMo 2/3 and Exaone 4 (`pre_norms` False) have the two output norms only.
        if cfg.pre_norms:
            self.input_layernorm = _norm(cfg, cfg.hidden_size)
        if not cfg.parallel_block and not self.single:  # (Cohere's, Nemotron-H's one norm: its input's)
            self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        if self.sandwich or not cfg.pre_norms:
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        # Gemma 4: the layer's own input (`DecoderModel.per_layer_inputs`), gated by its output and
        # projected back into the residual stream; then the whole stream scaled by `layer_scalar`
        # (whole linears on every rank, on the kernels the others run: `quantize` packs them too)
        self.per_layer_input_gate: ColumnParallelLinear | None = None
        if cfg.per_layer_input_size:
            p = cfg.per_layer_input_size
            self.per_layer_input_gate = ColumnParallelLinear(cfg.hidden_size, [(0, p)])
            self.per_layer_projection = ColumnParallelLinear(p, [(0, cfg.hidden_size)])
            self.post_per_layer_input_norm = _norm(cfg, cfg.hidden_size)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False) if cfg.layer_scalar else None
        self.activation = cfg.activation

    def forward(
        self,
        residual: torch.Tensor,
        h: torch.Tensor,
        ropes: tuple[Rope, ...],
        kv_cache: LayerCache,
        meta: DecoderMetadata,
        next_norm: RMSNorm | None,
        per_layer_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: this layer's input, normed. Returns the residual stream and the next norm of it (the
        next layer's input norm, or the model's final one; None: not normed): each residual add is
        paired with the norm after it, which the C kernels do in one pass. `ropes`: the full layers',
        the sliding layers' and (models with NoPE layers) the identity's tables. per_layer_input: this
        layer's [T, per_layer_input_size] (Gemma 4)."""
        rope = ropes[2] if not self.rotates else ropes[1] if self.sliding else ropes[0]
        if self.single:  # Nemotron-H: x + mixer(norm(x)), one mixer a layer
            if self.linear_attn is not None:
                assert isinstance(meta, StateMetadata)
                a = self.linear_attn(h, rope, kv_cache, meta)
            elif self.self_attn is not None:
                a = self.self_attn(h, rope, kv_cache, meta)
            else:
                assert self.mlp is not None
                a = self.mlp(h)
            return self.ops.add_norm(a, residual, next_norm)
        assert self.mlp is not None
        if self.linear_attn is not None and self.self_attn is not None:  # Falcon-H1: both, summed
            assert isinstance(meta, StateMetadata)
            a = self.self_attn(h, rope, kv_cache[:2], meta) + self.linear_attn(h, rope, kv_cache[2:], meta)
        elif self.linear_attn is not None:
            assert isinstance(meta, StateMetadata)
            a = self.linear_attn(h, rope, kv_cache, meta)
        elif isinstance(self.self_attn, MLAttention):  # (it reads its own layer's metadata only)
            a = self.self_attn(h, rope, kv_cache, layer_metadata(meta, self.sliding))
        else:
            assert self.self_attn is not None
            a = self.self_attn(h, rope, kv_cache, meta)
        if self.residual_scale is not None:
            a = a * self.residual_scale
        if self.parallel:  # Cohere 2: x + attn(norm(x)) + mlp(norm(x)), in PyTorch ops (its LayerNorm)
            residual = residual + a + self.mlp(h)
            return residual, None if next_norm is None else next_norm(residual)
        if not self.pre_norms:  # OLMo 2/3, Exaone 4: x + norm(attn(x)), then + norm(mlp(that))
            residual, _ = self.ops.add_norm(a, residual, None, self.post_attention_layernorm)
            out = self.mlp(residual)
            return self.ops.add_norm(out, residual, next_norm, self.post_feedforward_layernorm)
        if self.sandwich:  # the sublayers' outputs are normed before they join the residual stream
            residual, mlp_in = self.ops.add_norm(
                a, residual, self.pre_feedforward_layernorm, self.post_attention_layernorm
            )
            mlp_out_norm = self.post_feedforward_layernorm
        else:
            residual, mlp_in = self.ops.add_norm(a, residual, self.post_attention_layernorm)
            mlp_out_norm = None
        assert mlp_in is not None
        out = self.mlp(mlp_in)
        if self.moe is not None:  # Gemma 4's experts beside the MLP
            routed = self.moe(self.pre_feedforward_layernorm_2(residual), router_input=residual)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        if self.residual_scale is not None:
            out = out * self.residual_scale
        if self.per_layer_input_gate is None and self.layer_scalar is None:
            return self.ops.add_norm(out, residual, next_norm, mlp_out_norm)
        residual, _ = self.ops.add_norm(out, residual, None, mlp_out_norm)
        if self.per_layer_input_gate is not None:  # Gemma 4's per-layer input, in PyTorch ops
            assert per_layer_input is not None
            g = self.per_layer_input_gate(residual)
            g = (
                F.gelu(g, approximate="tanh") if self.activation == "gelu_tanh" else F.silu(g)
            ) * per_layer_input
            residual = residual + self.post_per_layer_input_norm(self.per_layer_projection(g))
        if self.layer_scalar is not None:
            residual = residual * self.layer_scalar.to(residual.dtype)
        return residual, None if next_norm is None else next_norm(residual)


class DecoderModel(nn.Module):
    # checkpoint name part → (our parameter name part, shard index in a fused layer)
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        # MLA's kv_b_proj as a llama.cpp file splits it (`MLAttention`)
        "k_b_proj": ("kv_b_proj", 1),
        "v_b_proj": ("kv_b_proj", 2),
    }

    def __init__(self, cfg: DecoderConfig, cpu: Kernels, attention: str = "auto") -> None:
        """cpu: the kernels to run on (`Kernels.for_device`, or `Kernels.none()`: PyTorch's
        ops); attention: the attention backend's name."""
        super().__init__()
        if cfg.mla is None:  # every layer's own kv heads too (Gemma 4's full layers have fewer)
            layers = cfg.layer_attention or ()
            for n_kv in sorted({cfg.num_key_value_heads, *(a.num_key_value_heads for a in layers)}):
                check_heads(cfg.num_attention_heads, n_kv, tp_size())
        heads = local_heads(cfg) if cfg.mla is None else mla_heads(cfg.num_attention_heads, cfg.head_dim)
        self.config, self.kernels, self.ops = cfg, cpu, ops_for(cpu)
        backend = get_backend(attention, cpu, heads)
        if cfg.attn_logit_softcapping:
            backend = SoftcapAttention(cpu, local_heads(cfg), cfg.attn_logit_softcapping)
        if cfg.attn_sinks:
            backend = SinkAttention(cpu, local_heads(cfg))
        self.attention: TorchAttention | SlidingWindowBackend | StateBackend = backend
        slidings: list[bool | None] = [None] * cfg.num_hidden_layers
        if cfg.sliding_window and cfg.layer_types:
            self.attention = SlidingWindowBackend(backend, cfg.sliding_window)
            slidings = [t == SLIDING for t in cfg.layer_types]
        types = cfg.layer_types or [FULL] * cfg.num_hidden_layers
        linear = [t in RECURRENT for t in types]
        ffn = [t == FFN for t in types]
        if cfg.linear is not None:
            self.attention = StateBackend(self.attention)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        sparse = cfg.moe.sparse_layers if cfg.moe else [False] * cfg.num_hidden_layers
        rotates = cfg.rope_layers or [True] * cfg.num_hidden_layers
        specs: list[LayerAttention | None] = [None] * cfg.num_hidden_layers
        if cfg.layer_attention is not None:
            specs = list(cfg.layer_attention)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, self.ops, s, m, lin, r, spec, f)
            for s, m, lin, r, spec, f in zip(slidings, sparse, linear, rotates, specs, ffn)
        )
        for layer in self.layers:  # latent attention's per-head projections in bf16gemm.c
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.kv_b_proj.pack = cpu.bf16gemm
        # Gemma 4's per-layer inputs: a second embedding table (every layer's part side by side) and a
        # projection of the embeddings, each normed and summed (`per_layer_inputs`)
        # (a GGUF file's table stays packed where the CPU's kernels read rows: `methods.load_gguf`)
        self.embed_tokens_per_layer: VocabParallelEmbedding | None = None
        if cfg.per_layer_input_size:
            width = cfg.num_hidden_layers * cfg.per_layer_input_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(cfg.per_layer_vocab_size, width)
            self.per_layer_model_projection = ColumnParallelLinear(cfg.hidden_size, [(0, width)])
            self.per_layer_projection_norm = _norm(cfg, cfg.per_layer_input_size)
        if cfg.altup is not None:
            altup.add_modules(self, cfg.altup)
        self.norm = _norm(cfg, cfg.hidden_size)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.score_weight = (  # a sequence classifier's (`PoolHead`): its last token's labels
            nn.Parameter(torch.empty(cfg.score_labels, cfg.hidden_size), requires_grad=False)
            if cfg.score_labels
            else None
        )
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            layer_rope_dim(cfg, FULL), cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.rotary_local = (
            RotaryEmbedding(
                layer_rope_dim(cfg, SLIDING), cfg.max_position_embeddings, cfg.rope_local_theta, None
            )
            if cfg.rope_local_theta is not None
            else None
        )
        self.mrope_section: list[int] | None = None  # M-RoPE's frequencies per axis (set by Qwen2-VL)
        self.decoder_loop: DecoderLoop | None = None  # set by `quantize` where it applies
        # LoRA adapters' step context (`pytgi.engine.models.lora`), once registered
        self.lora_ctx: LoraContext | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerCache],
        meta: DecoderMetadata,
        image_rows: StepImages | None = None,
    ) -> torch.Tensor:
        """`image_rows`: a vision model's rows of images, and its M-RoPE positions (`StepImages`)."""
        cfg = self.config
        x = self.embed_tokens(input_ids)
        if cfg.embed_scale is not None:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        if image_rows is not None and len(image_rows.rows):
            x[image_rows.rows] = image_rows.values.to(x.dtype)
        rope = self.ops.rope_tables(self.rotary, positions, x.dtype)
        if image_rows is not None and image_rows.rope_rows is not None:
            assert image_rows.rope_positions is not None and self.mrope_section is not None
            cos, sin = self.rotary.mrope(image_rows.rope_positions, self.mrope_section)
            for table, rows in zip(rope, (cos, sin)):  # each step's tables are its own copies
                table[image_rows.rope_rows] = rows.reshape(len(rows), *table.shape[1:]).to(table.dtype)
        local = self.rotary_local
        ropes: tuple[Rope, ...] = (
            rope,
            rope if local is None else self.ops.rope_tables(local, positions, x.dtype),
        )
        if cfg.rope_layers is not None and not all(cfg.rope_layers):  # NoPE layers: the identity's tables
            ropes = (*ropes, (torch.ones_like(rope[0]), torch.zeros_like(rope[1])))
        if cfg.mla is not None and (q_scale := query_scales(cfg.mla, positions, x.dtype)) is not None:
            for layer in self.layers:  # Mistral 4's queries, by position
                assert isinstance(layer.self_attn, MLAttention)
                layer.self_attn.q_scale = q_scale
        # one metadata for every layer (and the sliding layers' first keys)
        whole: DecoderMetadata | None = meta
        first: np.ndarray | None = None
        if isinstance(meta, WindowedMetadata):
            whole = meta.uniform
            loop = self.decoder_loop
            if whole is None and loop is not None and loop.takes_window:
                first = meta.paged_window()
                whole = None if first is None else meta.full
        ctx = self.lora_ctx
        lora = (ctx.loop_table, ctx.row_slots) if ctx is not None and ctx.active else None
        if (
            self.decoder_loop is not None
            and whole is not None
            and (lora is None or self.decoder_loop.takes_lora)
            and (h := self.decoder_loop(x, ropes, kv_caches, whole, lora, first=first)) is not None
        ):
            return self.norm(h) if cfg.sandwich_norms else h
        # With sandwich norms the final norm runs on its own, as the C loop's caller runs it.
        final = None if cfg.sandwich_norms else self.norm
        per_layer = self.per_layer_inputs(input_ids, x)
        if cfg.altup is not None:  # Gemma 3n
            assert per_layer is not None
            return altup.forward(self, x, ropes, kv_caches, meta, per_layer)
        next_norms: list[Any] = [None] * (len(self.layers) - 1) + [final]
        if cfg.layer_norm:  # (PyTorch's ops: the fused kernels' norms are RMSNorms)
            first_norm: RMSNorm = self.layers[0].input_layernorm  # type: ignore[assignment]
            residual, h = x, first_norm(x)
            next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [final]
        elif cfg.pre_norms:
            residual, h = self.ops.add_norm(None, x, self.layers[0].input_layernorm)
            next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [final]
        else:  # each layer's input is the residual stream itself
            residual, h = x, x
        for i, (layer, kv_cache, next_norm) in enumerate(zip(self.layers, kv_caches, next_norms)):
            if per_layer is None:
                residual, h = layer(residual, h, ropes, kv_cache, meta, next_norm)
            else:
                residual, h = layer(residual, h, ropes, kv_cache, meta, next_norm, per_layer[:, i])
            if h is None and not cfg.pre_norms:
                h = residual
        if final is None:
            return self.norm(residual)
        assert h is not None
        return h

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4: each layer's own input [T, layers, per_layer_input_size] (None: the model has
        none), from the ids' rows of the per-layer table (scaled by √size; ids past that table's
        vocabulary, a multimodal model's, have zeros) and the projected embeddings `x` (scaled by
        1/√hidden, normed), summed and scaled by 1/√2."""
        table = self.embed_tokens_per_layer
        if table is None:
            return None
        cfg, T = self.config, x.shape[0]
        size = cfg.per_layer_input_size
        inside = ids < cfg.per_layer_vocab_size
        rows = table(torch.where(inside, ids, 0)) * inside.unsqueeze(-1).to(x.dtype)
        rows = rows * torch.tensor(size**0.5, dtype=x.dtype)
        proj = self.per_layer_model_projection(x) * (cfg.hidden_size**-0.5)
        proj = self.per_layer_projection_norm(proj.reshape(T, cfg.num_hidden_layers, size))
        return (proj + rows.reshape(T, cfg.num_hidden_layers, size)) * (2.0**-0.5)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.config.logit_scale is not None:
            logits = logits / self.config.logit_scale
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @property
    def head_name(self) -> str:
        """The checkpoint tensor the LM head reads: the embedding's for a tied head."""
        return EMBED if self.config.tie_word_embeddings else "lm_head.weight"

    def planned(self, plan: dict[str, str] | str) -> dict[nn.Module, tuple[str, list[str]]]:
        """The linears a quantization plan packs: each with its kind and the checkpoint names of its
        parts (q, k, v of a fused projection; the embedding's for a tied LM head)."""
        parts = {
            fused: [p for p, (f, _) in self.FUSED.items() if f == fused] for fused, _ in self.FUSED.values()
        }

        def kind(hf_names: list[str]) -> str | None:
            return merged_kind({plan} if isinstance(plan, str) else {plan.get(n) for n in hf_names})

        todo: dict[nn.Module, tuple[str, list[str]]] = {}
        for name, mod in self.named_modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                stem, _, last = name.rpartition(".")  # (Gemma 4's per_layer_model_projection: no stem)
                where = f"model.{stem}." if stem else "model."
                names = [f"{where}{p}.weight" for p in parts.get(last, [last])]
                if (k := kind(names)) is not None:
                    todo[mod] = (k, names)
        head = self.head_name
        if (k := kind([head])) is not None and k != "fp8":
            # logits are sensitive: never below 8 bits (nor FP8's 3-bit mantissa, as vLLM keeps it)
            todo[self.lm_head] = (k if k in ("int8x16", "bf16") else "int8", [head])
        return todo

    def quantize(
        self,
        plan: dict[str, str] | str,
        act_dtype: torch.dtype,
        layouts: dict[nn.Module, Callable[[str], LayoutRows | Fp8Rows]] | None = None,
        perms: dict[nn.Module, torch.Tensor] | None = None,
    ) -> None:
        """Swap each planned linear for a low-bit one (see `pytgi.engine.models.quant`) and cast the model
        to `act_dtype`. Call on float32 weights, before the model is cast, or with `layouts` (module →
        its levels and grids, `load_gguf`) for the linears whose float weights were never loaded."""
        todo = {mod: kind for mod, (kind, _) in self.planned(plan).items()}
        quantize_model(self, todo, act_dtype, self.kernels, layouts or {}, perms or {})
        # Gemma 4's experts beside the MLP: on bf16gemm.c too where the linears are (their float weights)
        if act_dtype == torch.bfloat16 and "bf16" in todo.values():
            for moe in (getattr(layer, "moe", None) for layer in self.layers):
                if isinstance(moe, SparseMoE) and not moe.packed and moe.gate_up.numel():
                    moe.pack_bf16(self.kernels)
        loop = GemmaDecoderLoop if self.config.sandwich_norms else DecoderLoop
        self.decoder_loop = loop.build(self, self.kernels)

    def _unfused(self, weights: Weights) -> Iterator[tuple[str, Weight]]:
        """The checkpoint's names rewritten by the family's rules (`weight_renames`), and the tensors
        that store q, k, v (or gate, up) as one (Phi-3, Granite-4.0-H's shared MLP) as separate ones,
        so each part reaches its shard of the fused layer."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        renames = [(re.compile(p), r) for p, r in cfg.weight_renames]
        scales = [(re.compile(p), parts) for p, parts in cfg.weight_scales]
        for name, tensor in weights:
            for pattern, replacement in renames:
                name = pattern.sub(replacement, name)
            for pattern, parts in scales:
                if pattern.search(name):
                    assert isinstance(tensor, torch.Tensor), name
                    tensor = scaled_rows(tensor, parts)
            if ".qkv_proj." in name:
                assert isinstance(tensor, torch.Tensor), name
                yield from zip(
                    [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")],
                    tensor.split([q, kv, kv]),
                )
            elif ".gate_up_proj." in name:
                assert isinstance(tensor, torch.Tensor), name
                yield from zip(
                    [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")], tensor.chunk(2)
                )
            else:
                yield name, tensor

    def load_weights(self, weights: Weights, expect_missing: set[str] | frozenset[str] = frozenset()) -> None:
        """Copy (name, tensor) pairs in Hugging Face naming into this rank's parameters (all of them but
        `expect_missing`, which another step fills)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        beside = self.config.moe is not None and self.config.moe.beside_dense
        for name, tensor in self._unfused(weights):
            if name.startswith(self.config.ignored_weights):
                continue
            name = name.removeprefix("model.").removeprefix("language_model.")  # (a VLM's, served as text)
            name = name.replace(".block_sparse_moe.", ".mlp.")
            name = name.replace(".mlp.router.", ".mlp.gate.")  # gpt-oss's router
            name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")  # DeepSeek's (ungated)
            # MiniMax-M2 keeps its router's correction bias beside the router
            name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
            name = name.replace(".conv1d.weight", ".conv1d")  # a linear-attention layer's convolution
            if beside and GEMMA4_MOE.match(name):  # Gemma 4's router and experts (`DecoderLayer.moe`)
                name = GEMMA4_MOE.sub(_gemma4_moe_name, name)
            if self.config.rope_interleaved and name.endswith(QK_ROWS):  # Cohere's pairs → rotate-half
                assert isinstance(tensor, torch.Tensor), name
                heads = (
                    self.config.num_attention_heads if ".q_proj." in name else self.config.num_key_value_heads
                )
                tensor = tensor[rotate_half_rows(len(tensor), heads)]
            if self.config.qk_norm_whole:  # OLMo 2/3's norms of the whole q and k projections
                name = name.replace(".self_attn.q_norm.", ".self_attn.q_norm_all.")
                name = name.replace(".self_attn.k_norm.", ".self_attn.k_norm_all.")
            if "rotary_emb" in name:
                continue
            if name in ("altup_projections.weight", "altup_unembed_projections.weight"):  # a GGUF file's
                assert isinstance(tensor, torch.Tensor), name  # streams' projections, stacked
                for i, part in enumerate(tensor):
                    each = f"{name.removesuffix('.weight')}.{i}.weight"
                    params[each].data.copy_(part)
                    loaded.add(each)
                continue
            if name == "score.weight" and self.score_weight is not None:
                name = "score_weight"
            if ".mlp.experts." in name or ".moe.experts." in name:  # a mixture of experts' stacked weights
                part = ".mlp." if ".mlp.experts." in name else ".moe."
                layer, rest = name.split(part, 1)
                mlp = self.get_submodule(layer + part.rstrip("."))
                assert isinstance(mlp, SparseMoE), name
                loaded.update(f"{layer}{part}{p}" for p in mlp.load_experts(rest, tensor))
                continue
            assert isinstance(tensor, torch.Tensor), f"{name}: MXFP4 codes are a mixture of experts' only"
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard = 0
            for part, (fused, idx) in self.FUSED.items():
                if f".{part}." in name and name not in params:  # (MLA's q_proj is its own)
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
        missing = {n for n in params if n not in loaded and n not in expect_missing}
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")


EMBED = "model.embed_tokens.weight"
# Gemma 4's router (proj, scale, per_expert_scale) and experts, beside the layer's MLP
GEMMA4_MOE = re.compile(
    r"^(layers\.\d+)\.(router\.proj\.|router\.scale$|router\.per_expert_scale$|experts\.)"
)
_GEMMA4_MOE_PARTS = {
    "router.proj.": "moe.gate.",
    "router.scale": "moe.router_scale",
    "router.per_expert_scale": "moe.per_expert_scale",
    "experts.": "moe.experts.",
}


def _gemma4_moe_name(m: re.Match[str]) -> str:
    return f"{m.group(1)}.{_GEMMA4_MOE_PARTS[m.group(2)]}"


QK_ROWS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
