"""Building blocks of the Llama family, tensor-parallel aware (world size 1 is the plain case).

Column-parallel layers split their output features over ranks, row-parallel layers split their
input features and all-reduce the result. Each parameter has a `weight_loader(param, tensor, shard)`
that copies this rank's slice of a checkpoint tensor into place. Each linear's `finish(y)` is what
follows its local product x W^T (bias, all-reduce or gather), so that a quantized stand-in
(`pytgi.engine.models.quant.QuantizedLinear`) can compute that product with another kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from pytgi.engine.distributed import all_gather_last_dim, all_reduce, local_range, tp_rank, tp_size


def _set_loader(param: nn.Parameter, loader: Callable[..., None]) -> None:
    """How the checkpoint loader copies a tensor into `param` (this rank's part of it)."""
    param.weight_loader = loader  # type: ignore[attr-defined]


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b); W's rows are the concatenation of parts, of which this rank holds
    `shards[i] = (start, size)` rows of part i (a fused layer has several parts)."""

    def __init__(self, in_features: int, shards: list[tuple[int, int]], bias: bool = False) -> None:
        super().__init__()
        self.shards = shards
        out = sum(size for _, size in shards)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        _set_loader(self.weight, self.load_shard)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out), requires_grad=False)
            _set_loader(self.bias, self.load_shard)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        start, size = self.shards[shard]
        offset = sum(s for _, s in self.shards[:shard])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T alone: what `finish` completes."""
        return nn.functional.linear(x, self.weight)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias


def merged_shards(sizes: list[int]) -> list[tuple[int, int]]:
    """This rank's rows of each part, each part split evenly."""
    return [local_range(n) for n in sizes]


def scaled_rows(tensor: torch.Tensor, parts: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """`tensor` with its rows in segments ((rows, factor), ...; rows -1: the rest) multiplied (in
    float32, then cast back)."""
    factors = torch.cat(
        [torch.full((len(tensor) if n < 0 else n,), f, dtype=torch.float32) for n, f in parts]
    )[: len(tensor)]
    shape = (len(tensor),) + (1,) * (tensor.dim() - 1)
    return (tensor.float() * factors.view(shape)).to(tensor.dtype)


def qkv_shards(head_dim: int, n_heads: int, n_kv_heads: int) -> list[tuple[int, int]]:
    """Split by key/value heads, each with its group of query heads."""
    group = n_heads // n_kv_heads
    kv = local_range(n_kv_heads, head_dim)
    q = local_range(n_kv_heads, head_dim * group)
    return [q, kv, kv]


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns split over ranks (`in_shard` = this rank's (start, size));
    the partial sums are all-reduced."""

    def __init__(self, in_shard: tuple[int, int], out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_start, self.local_in = in_shard
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        _set_loader(self.weight, self.load_weight)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        param.data.copy_(loaded.narrow(1, self.in_start, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.product(x))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial x W^T: what `finish` sums over the ranks."""
        return nn.functional.linear(x, self.weight)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias


class PackedRows(Protocol):
    """A packed weight whose rows can be read (`pytgi.engine.models.quant.QuantizedWeight.rows`)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor: ...


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; out-of-range ids on a rank contribute zeros."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.local_vocab = math.ceil(vocab_size / tp_size())
        self.start = tp_rank() * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, dim), requires_grad=False)
        _set_loader(self.weight, self.load_weight)
        # A packed weight whose rows stand for the table (`pytgi.engine.models.quant.QuantizedWeight.rows`): a
        # GGUF model's embedding, read from its blocks, shared with a tied LM head. None: `weight`.
        self.packed: PackedRows | None = None

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        part = loaded[self.start : self.start + self.local_vocab]
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0] :].zero_()  # the last rank's rows past the vocabulary

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.rows(ids)
        return nn.functional.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self.rows(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        y = self.rows(local.clamp(0, self.local_vocab - 1))
        return all_reduce(y * inside.unsqueeze(-1))


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.finish(nn.functional.linear(hidden, self.weight))

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(y)[..., : self.vocab_size]


class RMSNorm(nn.Module):
    """x / rms(x), computed in float32 whatever the dtype, times `weight` in the model's dtype; with
    `offset` (Gemma, whose weights are offsets from 1) times `1 + weight`, in float32, then cast."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def scale(self) -> torch.Tensor:
        """What the fused kernels multiply by, in float32 (made once per weight): `1 + weight` for an
        offset norm, else the weight."""
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_scale_key", None) != key:
            w = self.weight.detach().float()
            self._scale, self._scale_key = ((1.0 + w) if self.offset else w).contiguous(), key
        return self._scale


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(medium, smoothed, out)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(
    inv_freq: torch.Tensor, scaling: dict, max_positions: int, base: float
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers computes it: each frequency blends its interpolated
    (divided by `factor`) and its original value by a linear ramp between the dimensions that turn
    `beta_fast` and `beta_slow` times over the original context; cos and sin are then scaled by the
    attention factor (given, DeepSeek's `mscale` / `mscale_all_dim` ratio, or 0.1 ln(factor) + 1)."""
    dim = 2 * len(inv_freq)
    old_ctx = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / old_ctx
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
            if mscale and all_dim
            else _yarn_mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (
        (high + 0.001 if low == high else high) - low
    )
    extrapolate = 1 - ramp.clamp(0, 1)
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention)


def _longrope(
    head_dim: int, base: float, scaling: dict, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE (Phi-3), as transformers computes it: the frequencies divided by `short_factor` for a
    sequence within `original_max_position_embeddings`, by `long_factor` beyond; cos and sin scaled by
    the attention factor (given, or sqrt(1 + ln(factor) / ln(original)))."""
    old_ctx = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / old_ctx
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim

    def inv(factors: list[float]) -> torch.Tensor:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**shape)

    return inv(scaling["short_factor"]), inv(scaling["long_factor"]), float(attention)


def long_rope(model: object) -> tuple[int, int] | None:
    """A LongRoPE model's (original context, row offset of the long table); None for any other."""
    rotary = getattr(model, "rotary", None)
    if isinstance(rotary, RotaryEmbedding) and rotary.long_after is not None:
        return rotary.long_after, rotary.long_offset
    return None


DYNAMIC_SHIFT = 32  # dynamic NTK: a position's bits above these carry the length its frequencies are for


def dynamic_rope(model: object) -> int | None:
    """A dynamic-NTK model's original context (past it, a token's frequencies depend on its
    sequence's length: `RotaryEmbedding.rows`); None for any other."""
    rotary = getattr(model, "rotary", None)
    if isinstance(rotary, RotaryEmbedding) and rotary.dynamic is not None:
        return rotary.dynamic[1]
    return None


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings with a precomputed cos/sin table (default, linear, llama3, yarn,
    longrope).

    LongRoPE has two tables, one under the other: a sequence longer than `long_after` tokens reads its
    rows `long_offset` further down (the runner adds it to such a request's positions, from the prompt's
    length or its length so far, as transformers decides per forward of one sequence).

    Dynamic NTK scales the base by the sequence's length once it is past the original context, as
    transformers does at each forward of one sequence (the prompt's forward: its length; each decode:
    its length so far); the keys already cached keep the frequencies they were made with. So a token's
    frequencies are those of max(original context, prompt length, position + 1): the runner puts
    that length above a position's low 32 bits (`DYNAMIC_SHIFT`) where it is past the original
    context, and `rows` computes those tokens' rows."""

    long_after: int | None = None  # LongRoPE: the original context, beyond which the long table applies
    long_offset: int = 0
    dynamic: tuple[float, int, float, int] | None = None  # dynamic NTK: (factor, original context, base, dim)

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        attention = 1.0  # what cos and sin are multiplied by (YaRN's attention factor)
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "proportional":  # Gemma 4: the first `partial_rotary_factor` of the angles turn,
            # over the whole head (the others' frequency is 0: cos 1, sin 0)
            turned = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
            inv_freq = torch.cat((inv_freq[:turned], torch.zeros(len(inv_freq) - turned)))
            inv_freq = inv_freq / scaling.get("factor", 1.0)
        elif kind == "yarn":
            inv_freq, attention = _yarn(inv_freq, scaling, max_positions, base)
        elif kind == "longrope":
            short, long, attention = _longrope(head_dim, base, scaling, max_positions)
            self.long_after, self.long_offset = scaling["original_max_position_embeddings"], max_positions
        elif kind == "dynamic":  # the table: the original frequencies (those of every length up to it)
            self.dynamic = (scaling["factor"], scaling["original_max_position_embeddings"], base, head_dim)
        elif kind not in ("default", "mrope"):  # M-RoPE: the default frequencies, by axis (`mrope`)
            raise ValueError(
                f"rope scaling {kind!r} is not supported (default, linear, llama3, yarn, longrope, dynamic, "
                "proportional)"
            )
        at = torch.arange(max_positions, dtype=torch.float32)
        if self.long_after is not None:
            freqs = torch.cat((torch.outer(at, short), torch.outer(at, long)))
        else:
            freqs = torch.outer(at, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention, persistent=False)
        # The sine with rotate-half's sign folded in: the first half multiplies -x2.
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        self.register_buffer("sin", sin * attention, persistent=False)
        self._axes: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # M-RoPE's, by section

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for these positions, shaped [T, 1, head_dim] to broadcast over heads."""
        cos, sin = self.rows(positions)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, signed sin [T, head_dim] for these positions (dynamic NTK: see the class)."""
        if self.dynamic is None:
            return self.cos[positions], self.sin[positions]
        lengths, at = positions >> DYNAMIC_SHIFT, positions & ((1 << DYNAMIC_SHIFT) - 1)
        cos, sin = self.cos[at], self.sin[at]
        scaled = lengths > 0
        if bool(scaled.any()):
            for length in lengths[scaled].unique().tolist():
                rows = (lengths == length).nonzero()[:, 0]
                freqs = torch.outer(at[rows].float(), self._dynamic_inv_freq(length).to(cos.device))
                cos[rows] = torch.cat((freqs, freqs), dim=-1).cos()
                sin[rows] = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return cos, sin

    def _dynamic_inv_freq(self, length: int) -> torch.Tensor:
        """transformers' dynamic-NTK frequencies for a sequence of `length`, in its float32 steps."""
        assert self.dynamic is not None
        factor, original, base, dim = self.dynamic
        seq = torch.tensor(length)
        scaled = base * ((factor * seq / original) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (scaled ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))

    def mrope(self, positions: torch.Tensor, section: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE (Qwen2-VL): float32 cos, signed sin [n, head_dim] for 3-D positions [3, n]; the
        frequencies go to the axes in `section`'s runs (temporal, height, width), in both halves."""
        axis, cols = self._mrope_axes(tuple(section))
        at = positions[axis].T  # [n, head_dim]: each column's position on its axis
        return self.cos[at, cols], self.sin[at, cols]

    def _mrope_axes(self, section: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each rotary column's axis (0, 1, 2) under `section`, and the columns (made once)."""
        if section in self._axes:
            return self._axes[section]
        half = self.cos.shape[1] // 2
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))  # [half]
        if axis.numel() != half:
            raise ValueError(f"mrope_section {list(section)} does not cover the rotary's {half} frequencies")
        self._axes[section] = torch.cat((axis, axis)), torch.arange(2 * half)
        return self._axes[section]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin with rotate_half(x) = (-x2, x1); the sign lives in `sin`, so this
    is (x1, x2)·cos + (x2, x1)·sin in four ops. Works on q and k together ([T, H + KVH, D])."""
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    return x * cos + swapped * sin


def rotate_half_rows(rows: int, n_heads: int) -> torch.Tensor:
    """The row order that turns each head's interleaved pairs (2i, 2i + 1) into rotate-half's (i,
    i + head_dim / 2): the same as undoing llama.cpp's interleaving of a "llama" file's q/k rows."""
    return torch.arange(rows).view(n_heads, rows // n_heads // 2, 2).transpose(1, 2).reshape(rows)
