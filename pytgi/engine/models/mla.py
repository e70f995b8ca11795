"""Multi-head latent attention (MLA: DeepSeek V2 / V3, Kimi K2), over the paged KV cache.

A token's keys and values are made from one latent vector: `kv_a_proj_with_mqa` gives the latent
c (`kv_lora_rank` features, then `kv_a_layernorm`) and a rotary key k_pe (`qk_rope_head_dim`
features) shared by every head; each head's key is [W_UK·c, k_pe] and its value W_UV·c, where
`kv_b_proj` stacks W_UK and W_UV per head. Queries come from `q_proj`, or from `q_a_proj` →
`q_a_layernorm` → `q_b_proj` (`q_lora_rank`), each head's [q_nope, q_pe]; the rotary embedding
turns q_pe and k_pe only (DeepSeek's checkpoints pair the rotary features (x0, x1), (x2, x3), ...:
`rope_interleave`, read as transformers reads them).

The cache holds the latent only: [c, k_pe] per token and layer, one "head" of `kv_lora_rank +
qk_rope_head_dim` values, in the key cache (the value cache has no columns). Attention runs in the
latent space with the projections absorbed: q_nope·W_UK is the query against c, so each head's
query is [q_nope·W_UK, q_pe] against the cached rows as a single kv head's keys; the values are
the same rows (their first `kv_lora_rank` features are c, the rest is dropped from the output),
and the output is brought back through W_UV. So the model's attention backend (the paged C kernel,
gather + SDPA, or on CUDA Triton's paged kernel) runs MLA unchanged, with every query head in the one
kv head's group; prefill chunks and decodes alike. Triton's kernel pads the 576-wide row to 1024 and
masks the rest, takes 16 query heads a program (a group of 128 in 8 programs) and reads the key cache
as the values too: the value cache (no columns) is never touched. On a CPU with bf16gemm.c the per-head
products by W_UK and W_UV run there, reading and writing the rows in place; the paged kernel's
AVX-512 path takes rows of up to 576 values (DeepSeek's 512 + 64) and 16 query heads a kv head.

A step of decodes only, there (W_UK and W_UV packed, a bf16 cache), runs everything between the
projections and o_proj in one C call (`kernels.mla_decode`, mla.c): a decode step's ~40 small PyTorch
ops a layer cost more than their arithmetic. It computes what the PyTorch ops compute, to the bit
(each bf16 product and sum rounded where PyTorch rounds it), so a request's rows do not depend on which
path its steps took. The two norms are the exception: mla.c sums the squares in an order of its own (no
float order can match PyTorch's sum on every row), so where mla.c may run, every step's norms run in C
(`kernels.rms_norm`), prompt chunks too. Steps with a prompt chunk, an int8 cache or
Mistral 4's query scales keep the PyTorch ops for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pytgi.engine import kernels
from pytgi.engine.distributed import local_range, tp_size
from pytgi.engine.models.attention import (
    LayerCache,
    LayerMetadata,
    Rope,
    TorchAttention,
    TorchAttentionMetadata,
)
from pytgi.engine.models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, apply_rotary


@dataclass(slots=True)
class MLAConfig:
    kv_lora_rank: int  # the latent's features (c)
    qk_nope_head_dim: int  # a head's query and key features without the rotary embedding
    qk_rope_head_dim: int  # ... with it (k_pe is shared by the heads)
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj (DeepSeek V2-Lite)
    rope_interleave: bool = True  # the rotary features in pairs (x0, x1), ... (DeepSeek's checkpoints)
    # Mistral 4: queries scaled by 1 + beta · ln(1 + floor(position / context)), (beta, context)
    llama4_scale: tuple[float, int] | None = None

    @property
    def cache_row(self) -> int:
        """The values a token keeps per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class _KVB(nn.Module):
    """kv_b_proj as its layer multiplies by it: per head W_UK [nope, latent] (queries into the latent
    space) and W_UV transposed [latent, v] (the output out of it), each contiguous (a strided batch of
    matrices costs PyTorch's bf16 bmm a copy per call), in one flat parameter. Not a linear of its own:
    never quantized or swapped. A checkpoint gives kv_b_proj whole ([H · (nope + v), latent], shard 0);
    a llama.cpp file in two (`k_b_proj` shard 1: W_UK transposed, [H, latent, nope]; `v_b_proj` shard
    2: W_UV, [H, v, latent]).

    With `pack` (bf16 on a CPU that runs bf16gemm.c) the two are repacked once loaded for its per-head
    matmul (`kernels.bf16_matmul_heads`: PyTorch's bf16 bmm reads them at a third of memory speed for
    a decode, and its sums depend on the step's size) and the flat parameter is freed."""

    def __init__(self, heads: int, nope: int, v: int, latent: int, first: int = 0) -> None:
        """heads: this rank's, from the checkpoint's head `first` on."""
        super().__init__()
        self.heads, self.nope, self.v, self.latent, self.first = heads, nope, v, latent, first
        self.weight = nn.Parameter(torch.empty(heads * latent * (nope + v)), requires_grad=False)
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]
        self.pack = False  # set by the decoder where bf16gemm.c runs the model (`Kernels.bf16gemm`)
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (W_UK, W_UV) for bf16gemm.c
        self.lora: Any = None  # its LoRA adapters (`pytgi.engine.models.lora.LoraKVB`), once any is served
        self._shards: set[int] = set()

    def parts(self, w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, latent] and W_UV transposed [H, latent, v], views of the parameter."""
        w = self.weight if w is None else w
        H, r, k = self.heads, self.latent, self.heads * self.nope * self.latent
        return w[:k].view(H, self.nope, r), w[k:].view(H, r, self.v)

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        w_uk, w_uvt = self.parts(param.data)
        r, mine = self.latent, slice(self.first, self.first + self.heads)  # this rank's heads
        if shard == 0:
            kv_b = loaded.reshape(-1, self.nope + self.v, r)[mine]
            w_uk.copy_(kv_b[:, : self.nope])
            w_uvt.copy_(kv_b[:, self.nope :].transpose(1, 2))
        elif shard == 1:
            w_uk.copy_(loaded.reshape(-1, r, self.nope)[mine].transpose(1, 2))
        else:
            w_uvt.copy_(loaded.reshape(-1, self.v, r)[mine].transpose(1, 2))
        self._shards.add(shard)
        tiles = self.latent % 16 == 0 and self.v % 16 == 0 and self.nope % 2 == 0  # bf16gemm.c's shapes
        whole = 0 in self._shards or {1, 2} <= self._shards
        if self.pack and tiles and param.dtype == torch.bfloat16 and whole:
            self._repack(param)

    def _repack(self, param: nn.Parameter) -> None:
        """Each head's W_UK as a weight [latent, nope] and W_UV as one [v, latent], in bf16gemm.c's
        layout; the flat parameter emptied."""
        from pytgi.engine.models.quant import pack_bf16

        w_uk, w_uvt = self.parts(param.data)
        H, r = self.heads, self.latent
        self.packed = (
            pack_bf16(w_uk.transpose(1, 2).reshape(H * r, self.nope)),
            pack_bf16(w_uvt.transpose(1, 2).reshape(H * self.v, r)),
        )
        param.data = param.data.new_empty(0)


def _pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """Rotary features paired (x0, x1), (x2, x3), ... laid out as rotate-half's (x0, x2, ..., x1, x3,
    ...): the same rotation, and the same dot products once q and k are both laid out so."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """A layer's multi-head latent attention (`self_attn`); `n_kv`, `head_dim` and `v_head_dim` give its
    KV cache's shape: one head of the latent row, no value columns. With tensor parallelism each rank
    has its share of the query heads (q_b / q_proj rows, kv_b's heads, o_proj's columns) and computes
    the whole latent row (q_a and kv_a on every rank): every rank's cache holds the same rows."""

    def __init__(
        self,
        mla: MLAConfig,
        hidden: int,
        heads: int,
        eps: float,
        bias: bool,
        scale: float,
        backend: TorchAttention,
    ) -> None:
        super().__init__()
        first, local = local_range(heads)  # this rank's query heads (the latent is every rank's)
        self.mla, self.n_heads, self.scale, self.backend = mla, local, scale, backend
        self.n_kv, self.head_dim, self.v_head_dim = 1, mla.cache_row, 0
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ColumnParallelLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, [local_range(heads, qk)])
        else:  # q_a on every rank, q_b's rows of this rank's heads
            self.q_a_proj = ColumnParallelLinear(hidden, [(0, mla.q_lora_rank)], bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [local_range(heads, qk)])
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, [(0, mla.cache_row)], bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        # per head W_UK and W_UV: used as matrices, in the latent space
        self.kv_b_proj = _KVB(local, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank, first)
        self.o_proj = RowParallelLinear(local_range(heads, mla.v_head_dim), hidden, bias)
        # the rotary features' order (no interleaving: rotate-half's)
        self.order = _pairs_to_halves if mla.rope_interleave else (lambda x: x)
        self.q_scale: torch.Tensor | None = None  # [T]: the step's query scales (`query_scales`)

    def _decodes_in_c(self, kv_cache: LayerCache, meta: LayerMetadata) -> kernels.PagedBatch | None:
        """The step's paged batch when mla.c can take it whole: a bf16 model on a CPU with bf16gemm.c
        (W_UK, W_UV packed), every row a decode in the paged kernel, a bf16 cache (not int8), no query
        scales, the norms' weights bf16 (their products rounded as the PyTorch path rounds them)."""
        if not isinstance(meta, TorchAttentionMetadata) or self.kv_b_proj.packed is None:
            return None
        if self._kvb_adapters() is not None:  # their terms: in PyTorch ops
            return None
        p = meta.paged
        if p is None or not p.decodes_only or meta.decode is not None or meta.prefill is not None:
            return None
        plain = self._norms_in_c() and self.q_scale is None
        return p if plain and kv_cache[0].dtype == torch.bfloat16 else None

    def _kvb_adapters(self) -> Any:
        """kv_b_proj's LoRA adapters (`LoraKVB`) where a row of the step uses one, else None."""
        lora = self.kv_b_proj.lora
        return lora if lora is not None and lora.active else None

    def _norms_in_c(self) -> bool:
        """Whether the norms run in C (`kernels.rms_norm`, mla.c's), on every step: mla.c's sum of
        squares is not PyTorch's (its order is mla.c's own), so where mla.c may take a decode, every
        step's rows take the same norm, and a decode's bits do not depend on whether its step also held
        a prompt chunk (batch invariance)."""
        norms = [n for n in (self.q_a_layernorm, self.kv_a_layernorm) if n is not None]
        plain = all(n.weight.dtype == torch.bfloat16 and not n.offset for n in norms)
        return plain and self.kv_b_proj.packed is not None

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self._norms_in_c():
            return kernels.rms_norm(x.contiguous(), norm.scale(), norm.eps)
        return norm(x)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: LayerCache, meta: LayerMetadata) -> torch.Tensor:
        m, T, H = self.mla, x.shape[0], self.n_heads
        r, d = m.kv_lora_rank, m.qk_rope_head_dim
        decodes = self._decodes_in_c(kv_cache, meta)
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q_a, norm = self.q_a_proj(x), self.q_a_layernorm
            q_a = self._norm(norm, q_a)
            q = self.q_b_proj(q_a)
        if decodes is not None:  # mla.c: everything up to o_proj in one call, the same bits
            dims, packed = (m.qk_nope_head_dim, d, r, m.v_head_dim), self.kv_b_proj.packed
            kv, norm = self.kv_a_proj_with_mqa(x), self.kv_a_layernorm
            assert packed is not None  # (`_decodes_in_c`)
            o = kernels.mla_decode(
                q, kv, rope, meta.slot_mapping, norm.scale(), kv_cache[0], packed, decodes, dims,
                m.rope_interleave, norm.eps, self.scale,
            )  # fmt: skip
            return self.o_proj(o)
        q_nope, q_pe = q.view(T, H, -1).split([m.qk_nope_head_dim, d], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([r, d], dim=-1)
        cos, sin = (t.reshape(T, 1, d).to(x.dtype) for t in rope)  # (the C kernels' tables: float32 [T, d])
        q_pe = apply_rotary(self.order(q_pe), cos, sin)
        k_pe = apply_rotary(self.order(k_pe).view(T, 1, d), cos, sin)
        k_cache = kv_cache[0]
        row = torch.cat((self._norm(self.kv_a_layernorm, c).view(T, 1, r), k_pe), dim=-1)
        if kernels.kv8(k_cache):  # --kv-cache-dtype int8: the row's int8 values and bf16 scale
            kernels.write_kv8(row, row, meta.slot_mapping, k_cache, k_cache)
        else:
            k_cache.index_copy_(0, meta.slot_mapping, row.to(k_cache.dtype))
        packed = self.kv_b_proj.packed
        if packed is not None:  # the query's latent part written straight into the row
            q_row = x.new_empty(T, H, r + d)
            kernels.bf16_matmul_heads(q_nope, packed[0], r, q_row[..., :r])
            q_row[..., r:] = q_pe
        else:
            w_uk, w_uvt = self.kv_b_proj.parts()
            q_lat = torch.bmm(q_nope.transpose(0, 1).contiguous(), w_uk)  # [H, T, latent]
            q_row = torch.cat((q_lat.transpose(0, 1), q_pe), dim=-1)  # [T, H, latent + rope]
        adapters = self._kvb_adapters()
        if adapters is not None:
            adapters.add_q(q_nope, q_row[..., :r])
        if self.q_scale is not None:
            q_row = q_row * self.q_scale[:, None, None]
        # the cached rows are the keys and the values (of which the latent's features are kept)
        out = self.backend.forward(q_row, None, None, k_cache, k_cache, meta, self.scale)
        if packed is not None:
            v = m.v_head_dim
            o = kernels.bf16_matmul_heads(out[..., :r], packed[1], v, x.new_empty(T, H, v))
        else:
            o = torch.bmm(out[..., :r].transpose(0, 1).contiguous(), w_uvt).transpose(0, 1)  # [T, H, v]
        if adapters is not None:
            o = o.contiguous()
            adapters.add_o(out[..., :r], o)
        return self.o_proj(o.reshape(T, H * m.v_head_dim))


def query_scales(mla: MLAConfig, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Mistral 4's query scale per token, 1 + beta · ln(1 + floor(position / context)), as transformers
    computes it (Llama 4's); None for the other families."""
    if mla.llama4_scale is None:
        return None
    beta, context = mla.llama4_scale
    return (1 + beta * torch.log(1 + torch.floor(positions / context))).to(dtype)


def mla_heads(heads: int, cache_row: int) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of an MLA layer on this rank: its share of the query heads, all
    attending to the one latent "head"."""
    if tp_size() > heads:
        raise ValueError(f"cannot shard a model with {heads} attention heads over {tp_size()} ranks")
    return local_range(heads)[1], 1, cache_row
