"""A GGUF file's tensors, read one at a time through a memory map, as pytgi runs them.

The loader never makes a float copy of a quantized model: each tensor of a GGUF file is read from
the file's pages and turned straight into what the engine keeps, then its pages are let go
(`madvise(MADV_DONTNEED)`, so the file does not stay in the process's resident memory).

- A tensor of a type on a uniform grid (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K..Q6_K)
  is *decoded*, not dequantized: `grid()` returns its levels and, per group of 16 or 32 values, the
  step and offset of its grid (`Grid`: w = d·q + m), from which `pytgi.engine.models.quant` packs the
  low-bit layouts of the CPU kernels without rounding the levels again.
- Every tensor can also be read `dense()`: dequantized with the `gguf` package a slice of rows at a
  time, into the dtype the model keeps (float32 for the exact path, bf16 for tensors that stay
  dense: norms, the embedding table, types on no uniform grid).

Names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`): the conversion of names, the
un-interleaving of llama.cpp's Q/K rows and Gemma's `1 + w` norms are applied here, so the rest of
pytgi sees the checkpoint transformers would.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from pytgi.core.errors import GGUFConversionError
from pytgi.core.families import gguf_of_model_type
from pytgi.core.gguf_convert import (
    DELTANET_TYPES,
    KDA_TYPES,
    MAMBA1_TYPES,
    MAMBA_TYPES,
    SOURCE_FILE,
    hf_tensor_name,
    mtp_tensor,
)
from pytgi.engine import kernels

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

ROWS_PER_SLICE = 1024  # rows dequantized or decoded at a time: bounds the transient float32


@dataclass
class Grid:
    """Rows of a tensor on their GGUF grids: w[n, k] = d[n, g]·q[n, k] + m[n, g] with g = k // group.
    `zero`: for the symmetric types, m = -zero·d exactly (then `m` is None)."""

    q: torch.Tensor  # uint8 [N, K], levels 0 .. 2^bits - 1
    d: torch.Tensor  # float32 [N, K / group]
    m: torch.Tensor | None  # float32 [N, K / group], or None when `zero` says it
    group: int  # 32, or 16 for Q2_K, Q3_K, Q6_K
    zero: int | None
    levels: int  # 16 for 4-bit levels: what the int4 layout can hold

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the values the grid stands for."""
        return group_values(self.q, self.d, self.m if self.m is not None else -float(self.zero or 0) * self.d)

    def cols(self, start: int, size: int) -> Grid:
        """Columns start .. start + size, on whole groups."""
        assert start % self.group == 0 and size % self.group == 0
        g = slice(start // self.group, (start + size) // self.group)
        m = None if self.m is None else self.m[:, g]
        return Grid(self.q[:, start : start + size], self.d[:, g], m, self.group, self.zero, self.levels)

    def rows(self, index: torch.Tensor | slice) -> Grid:
        m = None if self.m is None else self.m[index]
        return Grid(self.q[index], self.d[index], m, self.group, self.zero, self.levels)


def group_values(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of levels q [N, K] with a step d and an offset m per group ([N, groups])."""
    N, K = q.shape
    return (q.view(N, d.shape[1], -1).float() * d[..., None] + m[..., None]).view(N, K)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as float32 [nb, 1]."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """Bytes in runs of `chunk`: each run's low nibbles, then its high nibbles."""
    nb = qs.shape[0]
    qs = qs.reshape(nb, -1, 1, chunk)
    return torch.cat([qs & 15, qs >> 4], dim=2).reshape(nb, -1)


def _bits(b: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """Fields of `width` bits of each byte, lowest first: [..., count, bytes]."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8).view(count, 1)
    return (b.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins of 8 sub-blocks → (scales, mins) [nb, 8]."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=1)
    mn = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=1)
    return sc.float(), mn.float()


def _q4_0(b):
    return _nibbles(b[:, 2:18], 16), _f16(b, 0), None


def _q4_1(b):
    return _nibbles(b[:, 4:20], 16), _f16(b, 0), _f16(b, 2)


def _q5(b, at):
    high = _bits(b[:, at : at + 4], 8).transpose(1, 2).reshape(-1, 32)  # bit j of the word: value j
    return _nibbles(b[:, at + 4 : at + 20], 16) | (high << 4)


def _q5_0(b):
    return _q5(b, 2), _f16(b, 0), None


def _q5_1(b):
    return _q5(b, 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    return b[:, 2:34] ^ 128, _f16(b, 0), None  # int8 + 128


# MXFP4's e2m1 codes (sign, then magnitude 0 0.5 1 1.5 2 3 4 6) as levels 12 + 2·value: a uniform grid
# of 25 with a step of half the block's power of two (2^(e - 128)) and zero at level 12
FP4_LEVELS = (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)


def _mxfp4(b):
    lut = torch.tensor(FP4_LEVELS, dtype=torch.uint8)
    codes = _nibbles(b[:, 1:17], 16).long()
    return lut[codes], torch.ldexp(torch.ones(len(b), 1), b[:, :1].int() - 128), None


def _q4_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    return _nibbles(b[:, 16:144], 32), _f16(b, 0) * sc, -_f16(b, 2) * mn


def _q5_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    high = _bits(b[:, 16:48], 8).reshape(-1, 256)  # bit j of byte l: value l of sub-block j
    return _nibbles(b[:, 48:176], 32) | (high << 4), _f16(b, 0) * sc, -_f16(b, 2) * mn


def _q6_k(b):
    low = _nibbles(b[:, 0:128], 64)
    high = _bits(b[:, 128:192].reshape(-1, 2, 32), 4, 2).reshape(-1, 256)
    scales = b[:, 192:208].view(torch.int8).float()
    return low | (high << 4), _f16(b, 208) * scales, None


def _q3_k(b):
    low = _bits(b[:, 32:96].reshape(-1, 2, 32), 4, 2).reshape(-1, 256)
    high = _bits(b[:, 0:32], 8).reshape(-1, 256)
    s = b[:, 96:108]
    lo = torch.cat([s[:, 0:8] & 15, s[:, 0:8] >> 4], dim=1)
    hi = _bits(s[:, 8:12], 4, 2).reshape(-1, 16)
    scales = ((lo | (hi << 4)).float() - 32).view(-1, 16)
    return low | (high << 2), _f16(b, 108) * scales, None


def _q2_k(b):
    q = _bits(b[:, 16:80].reshape(-1, 2, 32), 4, 2).reshape(-1, 256)
    s = b[:, 0:16]
    return q, _f16(b, 80) * (s & 15).float(), -_f16(b, 82) * (s >> 4).float()


TYPE_SIZES = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q8_0": 34,
    "Q2_K": 84,
    "Q3_K": 110,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
    "MXFP4": 17,
}  # bytes of a block (32 values, 256 for K-quants)
# GGUF type → (decoder of [nb, type size] block bytes → (q, d, m), levels of q, values per group, zero:
# m = -zero·d for the symmetric types, whose decoders give no m)
BlockDecoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
DECODERS: dict[str, tuple[BlockDecoder, int, int, int | None]] = {
    "Q4_0": (_q4_0, 16, 32, 8),
    "Q4_1": (_q4_1, 16, 32, None),
    "Q4_K": (_q4_k, 16, 32, None),
    "Q5_0": (_q5_0, 32, 32, 16),
    "Q5_1": (_q5_1, 32, 32, None),
    "Q5_K": (_q5_k, 32, 32, None),
    "Q8_0": (_q8_0, 256, 32, 128),
    "Q6_K": (_q6_k, 64, 16, 32),
    "Q3_K": (_q3_k, 8, 16, 4),
    "Q2_K": (_q2_k, 4, 16, None),
    "MXFP4": (_mxfp4, 25, 32, 12),
}


def decode_blocks(kind: str, blocks: np.ndarray, n: int, k: int) -> Grid:
    """`n` rows of `k` values as GGUF block bytes (uint8, `n` rows of whole blocks; a view of the file's
    mapping will do) → their `Grid`: decoded by `pytgi/engine/kernels/gguf.c` where the kernels are
    built, else by the PyTorch decoders above (its reference)."""
    if not kernels.available():
        return decode_blocks_reference(kind, torch.from_numpy(blocks.copy()), n, k)
    from gguf import GGMLQuantizationType

    _, levels, group, zero = DECODERS[kind]
    q = torch.empty(n, k, dtype=torch.uint8)
    d = torch.empty(n, k // group)
    m = torch.empty(n, k // group) if zero is None else None
    kernels.gguf_decode(GGMLQuantizationType[kind].value, blocks.reshape(-1, TYPE_SIZES[kind]), q, d, m)
    return Grid(q, d, m, group, zero, levels)


def decode_blocks_reference(kind: str, blocks: torch.Tensor, n: int, k: int) -> Grid:
    """`decode_blocks` in PyTorch's operations."""
    decoder, levels, group, zero = DECODERS[kind]
    q, d, m = decoder(blocks.reshape(-1, TYPE_SIZES[kind]))
    g = k // group
    return Grid(
        q.reshape(n, k),
        d.reshape(n, g).float(),
        None if m is None else m.reshape(n, g).float(),
        group,
        zero,
        levels,
    )


def unpermute_rows(rows: int, n_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's interleaving of Q/K rows (back to rotate-half's)."""
    return torch.arange(rows).view(n_heads, rows // n_heads // 2, 2).transpose(1, 2).reshape(rows)


class TensorInfo(NamedTuple):
    """Where a tensor lies in a GGUF file, read from the file's header."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data_offset: int  # bytes from the file's start
    n_bytes: int


# GGUF metadata value types → their size in bytes (8: string, 9: array)
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_tensor_index(buf: mmap.mmap | bytes) -> list[TensorInfo]:
    """The tensors of a GGUF file (a buffer over its bytes), from its header alone: the metadata is
    stepped over, not decoded (gguf's reader decoding the default model's 49k-token vocabulary was 7.7 s
    of an 11 s profiled load)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if bytes(buf[:4]) != b"GGUF":
        raise GGUFConversionError("not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise GGUFConversionError(f"GGUF version {version} is too old (2 or later)")
    at, alignment = 24, 32

    def string() -> str:
        nonlocal at
        (n,) = struct.unpack_from("<Q", buf, at)
        at += 8 + n
        return bytes(buf[at - n : at]).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal at
        if kind == 8:
            (n,) = struct.unpack_from("<Q", buf, at)
            at += 8 + n
        elif kind == 9:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _VALUE_SIZES:
                at += count * _VALUE_SIZES[item]
            else:
                for _ in range(count):
                    skip(item)
        else:
            at += _VALUE_SIZES[kind]

    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, at)
        at += 4
        if key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", buf, at)
        skip(kind)
    raw = []
    for _ in range(n_tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", buf, at)
        shape = struct.unpack_from(f"<{dims}Q", buf, at + 4)
        kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        raw.append((name, GGMLQuantizationType(kind), tuple(int(s) for s in shape), offset))
    start = -(-at // alignment) * alignment
    out = []
    for name, qtype, shape, offset in raw:
        block, size = GGML_QUANT_SIZES[qtype]
        out.append(TensorInfo(name, qtype, shape, start + offset, math.prod(shape) // block * size))
    return out


class GGUFWeights:
    """The tensors of a GGUF file (or of the parts of a split one), by Hugging Face name."""

    def __init__(self, parts: list[Path], config: dict[str, Any]) -> None:

        self.config = config
        self.tensors: dict[str, tuple[mmap.mmap, TensorInfo]] = {}  # the file's mapping, where in it
        for part in parts:
            with open(part, "rb") as f:  # read-only: a file bigger than the memory maps too
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            for t in read_tensor_index(mm):
                if not mtp_tensor(t.name, config):  # a multi-token-prediction block's: not read
                    self.tensors[hf_tensor_name(t.name, config["model_type"])] = (mm, t)
        model_type = config["model_type"]
        gguf_name = gguf_of_model_type(model_type)
        self._permute = gguf_name is not None and gguf_name.permuted_qk  # llama.cpp interleaved q/k rows
        # Gemma 2 and 3's norms are stored as 1 + w (Gemma 3n's and 4's as they are)
        self._gemma = model_type.startswith("gemma") and model_type not in ("gemma3n_text", "gemma4_text")
        self._hybrid = model_type in DELTANET_TYPES
        # A_log stored as −exp(A_log): gated DeltaNet's, KDA's, Mamba-2's and Mamba-1's decays
        self._neg_exp_a = model_type in DELTANET_TYPES | KDA_TYPES | MAMBA_TYPES | MAMBA1_TYPES

    def names(self) -> list[str]:
        return list(self.tensors)

    def type_name(self, name: str) -> str:
        return self.tensors[name][1].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The Hugging Face shape: [rows, columns] for a matrix, [E, rows, columns] for stacked experts."""
        shape = tuple(reversed(self.tensors[name][1].shape))
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            return (1, shape[0])
        return shape

    def _heads(self, name: str) -> int | None:
        """For llama.cpp's interleaved Q/K rows: the number of heads to un-interleave by."""
        if not self._permute:
            return None
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return int(self.config["num_attention_heads"])
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return int(self.config["num_key_value_heads"])
        return None

    def _data(self, name: str) -> np.ndarray:
        """The tensor's bytes in the file (a view of the mapping): uint8, or its float values."""
        from gguf import GGMLQuantizationType as T

        mm, t = self.tensors[name]
        floats = {T.F32: np.float32, T.F16: np.float16}
        dtype = floats.get(t.tensor_type, np.uint8)
        count = t.n_bytes // np.dtype(dtype).itemsize
        return np.frombuffer(mm, dtype=dtype, count=count, offset=t.data_offset)

    def _release(self, name: str, begin: int = 0, end: int | None = None) -> None:
        """Let the tensor's file pages (bytes begin .. end of it) go from this process's resident
        memory: they stay in the page cache, for the next start (a page shared with bytes still to
        read is read again from there)."""
        mm, t = self.tensors[name]
        first = t.data_offset + begin
        last = t.data_offset + (t.n_bytes if end is None else end)
        start = (first // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, last - start)
        except (OSError, ValueError, AttributeError):
            pass

    def grid(self, name: str, start: int = 0, stop: int | None = None) -> Grid | None:
        """Rows start .. stop of the tensor (rows in Hugging Face's order; a stack of experts' rows
        run on from one expert to the next) as levels and grids, or None for a type on no uniform
        grid (floats, IQ*, TQ*). Only those rows' blocks are read."""
        kind = self.type_name(name)
        if kind not in DECODERS:
            return None
        shape = self.shape(name)
        n, k = math.prod(shape[:-1]), shape[-1]
        stop = n if stop is None else stop
        heads = self._heads(name)
        if heads is not None:  # Q/K rows interleaved within each head: all read (a small tensor), then picked
            return self._decode(name, kind, 0, n, k).rows(unpermute_rows(n, heads)[start:stop])
        return self._decode(name, kind, start, stop, k)

    def _decode(self, name: str, kind: str, start: int, stop: int, k: int) -> Grid:
        blocks = self._data(name).reshape(math.prod(self.shape(name)[:-1]), -1)
        out = [
            decode_blocks(kind, blocks[at : min(at + ROWS_PER_SLICE, stop)], n, k)
            for at in range(start, stop, ROWS_PER_SLICE)
            if (n := min(ROWS_PER_SLICE, stop - at))
        ]
        row = blocks.shape[1]
        self._release(name, start * row, stop * row)
        if len(out) == 1:
            return out[0]
        return Grid(
            torch.cat([g.q for g in out]),
            torch.cat([g.d for g in out]),
            None if out[0].m is None else torch.cat([g.m for g in out if g.m is not None]),
            out[0].group,
            out[0].zero,
            out[0].levels,
        )

    def dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor's values in `dtype` (dequantized a slice of rows at a time), Hugging Face's shape."""
        from gguf import dequantize

        t = self.tensors[name][1]
        shape = self.shape(name)
        n = math.prod(shape[:-1])
        out = torch.empty(n, shape[-1], dtype=dtype)
        data = self._data(name).reshape(n, -1)
        for at in range(0, n, ROWS_PER_SLICE):
            try:
                part = dequantize(data[at : at + ROWS_PER_SLICE], t.tensor_type)
            except NotImplementedError:
                raise GGUFConversionError(
                    f"tensor {t.name!r} is stored as {t.tensor_type.name}, a GGUF type pytgi "
                    "cannot read yet; use a file quantized to another type"
                ) from None
            part = np.array(part, dtype=np.float32)  # a copy: float types come as views of the mapping
            out[at : at + len(part)] = torch.from_numpy(part).reshape(len(part), -1)
        self._release(name)
        if (self._gemma or self._hybrid) and name.endswith("norm.weight") and ".linear_attn." not in name:
            out -= 1  # llama.cpp stores Gemma's and Qwen3-Next's offset norms as 1 + w
        if self._neg_exp_a and name.endswith(".A_log"):
            out = torch.log(-out)  # llama.cpp stores −exp(A_log)
        heads = self._heads(name)
        if heads is not None:
            out = out[unpermute_rows(n, heads)]
        return out.view(shape)

    def dense_tensors(
        self, dtype: torch.dtype = torch.float32, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every tensor not in `skip`, in the file's order, one at a time."""
        for name in self.tensors:
            if name not in skip:  # (a router's correction bias stays float32: `moe.Router`)
                yield (
                    name,
                    self.dense(name, torch.float32 if name.endswith("e_score_correction_bias") else dtype),
                )


def open_gguf(model_dir: Path) -> GGUFWeights | None:
    """The GGUF weights a converted model directory stands for (None for a Hugging Face directory)."""
    source = Path(model_dir) / SOURCE_FILE
    if not source.is_file():
        return None
    parts = [Path(p) for p in json.loads(source.read_text())["parts"]]
    if missing := [str(p) for p in parts if not p.is_file()]:
        raise GGUFConversionError(
            f"{model_dir} was made from {', '.join(missing)}, which is gone: serve the GGUF file again"
        )
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return GGUFWeights(parts, config)


def export_float(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A converted GGUF directory as a self-contained Hugging Face directory with float32 safetensors
    (the values `--dtype float32` serves), for transformers and other tools. Holds the float32 model
    in memory: for small models."""
    from safetensors.torch import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    weights = open_gguf(model_dir)
    if weights is None:
        raise GGUFConversionError(f"{model_dir} is not a converted GGUF model directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out_dir / name)
    tensors = {name: t.contiguous() for name, t in weights.dense_tensors()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
