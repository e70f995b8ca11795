"""Every common GGUF tensor type, block by block: the loader reads it as gguf-py dequantizes it,
its blocks decode to levels and grids holding exactly those values, and the fast path's packed
layout (int4, int8 or int8x16, by `kind_for_gguf_type`) holds them too, its kernel multiplying by
them; a float weight re-packed on its own grids (`_own_grid`, for other sources) keeps them as well.

The blocks are random bytes with their fp16 scale fields set to powers of two (and small integer
multiples of them), so that every value a block holds is also exact in the packed layout's fp16
scales and offsets: there, any rounding onto another grid shows as an inequality."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pytgi.core.errors import GGUFConversionError
from pytgi.engine import kernels
from pytgi.engine.loading.gguf import GGUFWeights, decode_blocks, decode_blocks_reference
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.quant import (
    FIVE_BIT_TYPES,
    SIX_BIT_TYPES,
    LayoutRows,
    QuantizedWeight,
    grid_layout,
    kind_for_gguf_type,
    quantize_int4,
    quantize_int8_groups,
    quantize_mxfp4,
    unpack_rows,
)

N, K = 32, 512  # rows, values per row: two K-quant super-blocks
# byte offsets of each type's fp16 fields in its block: (super-)scales, then mins/offsets
FP16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "MXFP4": [],  # its scale is a power of two (an e8m0 byte, at 0)
}
FLOATS = {"F32": np.float32, "F16": np.float16}


def _raw(name: str, seed: int = 0) -> np.ndarray:
    """N rows of random blocks of type `name` (uint8 [N, bytes per row]; float types: their values)."""
    rng = np.random.default_rng(seed)
    if name in FLOATS:
        return rng.standard_normal((N, K)).astype(FLOATS[name])
    if name == "BF16":  # the top halves of float32 values, as bytes
        return (
            (rng.standard_normal((N, K)).astype(np.float32).view(np.uint32) >> 16)
            .astype(np.uint16)
            .view(np.uint8)
        )
    qt = gguf.GGMLQuantizationType[name]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
    if name == "Q8_0":  # llama.cpp rounds x / (amax / 127): -128 never occurs
        raw[..., 2:][raw[..., 2:] == 0x80] = 0x81
    if name == "MXFP4":  # 2^-10 .. 2^2: a weight's scales
        raw[..., 0] = rng.integers(118, 131, (N, K // block))
    d = np.float16(2.0**-7)
    for i, off in enumerate(FP16_FIELDS[name]):
        if i == 0:  # the scale: 2^-7 (2^-8 on odd rows)
            vals = np.where(np.arange(N)[:, None] % 2 == 0, d, d / 2).astype(np.float16)
            vals = np.broadcast_to(vals, (N, K // block))
        else:  # Q4_1/Q5_1's offset (a multiple of the scale, negative), K-quants' dmin (2^-7)
            vals = (
                (-d * rng.integers(0, 16, (N, K // block))).astype(np.float16)
                if name.endswith("_1")
                else np.full((N, K // block), d, dtype=np.float16)
            )
        raw[..., off : off + 2] = np.ascontiguousarray(vals).view(np.uint8).reshape(N, K // block, 2)
    return raw.reshape(N, -1)


def _gguf_tensor(tmp_path: Path, name: str, raw: np.ndarray) -> GGUFWeights:
    """Write `raw` as one GGUF tensor of type `name` and open it as the loader does."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    qt = gguf.GGMLQuantizationType[name]
    if name in FLOATS:
        w.add_tensor("blk.0.ffn_down.weight", raw)
    else:
        w.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFWeights([path], {"model_type": "llama"})


DOWN = "model.layers.0.mlp.down_proj.weight"
TYPES = [
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "MXFP4",
]


@pytest.mark.parametrize("name", TYPES)
def test_the_loader_reads_each_type_as_gguf_py_dequantizes_it(tmp_path, name):
    raw = _raw(name)
    weights = _gguf_tensor(tmp_path, name, raw)
    [(hf_name, w)] = list(weights.dense_tensors())
    assert hf_name == DOWN and w.shape == (N, K) and w.dtype == torch.float32
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(N, K)
    assert np.array_equal(w.numpy(), ref)


@pytest.mark.parametrize("name", [t for t in TYPES if t not in ("F32", "F16", "BF16")])
def test_blocks_decode_to_their_values_and_pack_without_rounding(tmp_path, name):
    """The levels and grids read from the blocks stand for gguf-py's values exactly (random blocks with
    any fp16 scales too), and the packed layout of the type's kind holds them; the kernel multiplies by
    them, as it does by a float weight re-packed on its own grids."""
    for seed, raw in enumerate([_raw(name), _any_scales(name)]):
        ref = torch.from_numpy(
            gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(N, K).copy()
        )
        grid = _gguf_tensor(tmp_path / str(seed), name, raw).grid(DOWN)
        assert grid is not None and torch.equal(grid.dequantize(), ref)
    kind = kind_for_gguf_type(name)
    ref = torch.from_numpy(
        gguf.quants.dequantize(_raw(name), gguf.GGMLQuantizationType[name]).reshape(N, K).copy()
    )
    u, d, m = grid_layout(_gguf_tensor(tmp_path, name, _raw(name)).grid(DOWN), kind)
    group = 16 if kind == "int8x16" else 32
    low, high = {"int4": (0, 15), "mxfp4": (0, 24)}.get(kind, (1, 255))
    assert int(u.min()) >= low and int(u.max()) <= high
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float())  # fp16 scales
    deq = (u.view(N, -1, group).float() * d[..., None] + m[..., None]).view(N, K)
    assert torch.equal(deq, ref), (kind, (deq - ref).abs().max().item())
    if kernels.vnni_supported():
        cpu = Kernels.for_device(torch.device("cpu"), torch.bfloat16)
        x = torch.randn(3, K, generator=torch.Generator().manual_seed(0)).bfloat16()
        rows = LayoutRows((N, K), lambda: iter([(u[:16], d[:16], m[:16]), (u[16:], d[16:], m[16:])]))
        packed = QuantizedWeight(kind, rows, torch.bfloat16, cpu).matmul(x)
        # The float weight's own grid may be another (d, m) for the same values (a group using every
        # other level: twice the step): the sums then round apart, by at most the output's last bit.
        again = QuantizedWeight(kind, ref, torch.bfloat16, cpu).matmul(x)
        torch.testing.assert_close(packed, again, rtol=2**-7, atol=0.0)
        if name in SIX_BIT_TYPES:  # the CPU's 6-bit layout holds the same values (rows read back)
            six = QuantizedWeight(kind, LayoutRows((N, K), rows.slices, six=True), torch.bfloat16, cpu)
            assert six.bits == 6 and torch.equal(unpack_rows(six.packed, torch.arange(N), 6), ref)
            torch.testing.assert_close(six.matmul(x), packed, rtol=2**-7, atol=0.0)
        if name in FIVE_BIT_TYPES:  # and Q5_0's 5.5-bit layout (taken before the 6-bit one)
            five = QuantizedWeight(kind, LayoutRows((N, K), rows.slices, True, True), torch.bfloat16, cpu)
            assert five.bits == 7 and torch.equal(unpack_rows(five.packed, torch.arange(N), 7), ref)
            torch.testing.assert_close(five.matmul(x), packed, rtol=2**-7, atol=0.0)


@pytest.mark.parametrize("name", [t for t in TYPES if t not in ("F32", "F16", "BF16")])
def test_the_c_decoder_gives_the_reference_levels_and_grids(name):
    """gguf.c (what a load runs) against the PyTorch decoders, on blocks of wholly random bytes: every
    fp16 field any half (subnormals, infinities and NaN among them)."""
    if not kernels.available():
        pytest.skip("pytgi's C kernels are not built here")
    raw = np.random.default_rng(5).integers(0, 256, (N, _raw(name).shape[1]), dtype=np.uint8)
    raw[0, :2] = [1, 0]  # the smallest subnormal as the first block's first field
    got, want = decode_blocks(name, raw, N, K), decode_blocks_reference(name, torch.from_numpy(raw), N, K)
    assert torch.equal(got.q, want.q) and (got.group, got.zero, got.levels) == (
        want.group,
        want.zero,
        want.levels,
    )
    for a, b in [(got.d, want.d), (got.m, want.m)]:
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _any_scales(name: str) -> np.ndarray:
    """Random blocks whose fp16 fields are any finite values of a weight's size."""
    raw = _raw(name, seed=1).reshape(N, -1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]).copy()
    rng = np.random.default_rng(2)
    for off in FP16_FIELDS[name]:
        vals = rng.uniform(-0.05, 0.05, raw.shape[:2]).astype(np.float16)
        raw[..., off : off + 2] = vals.view(np.uint8).reshape(*raw.shape[:2], 2)
    if name == "MXFP4":  # every power of two whose step (half of it) and offset fp16 holds
        raw[..., 0] = rng.integers(104, 141, raw.shape[:2])
    return raw.reshape(N, -1)


@pytest.mark.parametrize("name", [t for t in TYPES if t not in ("F32", "F16", "BF16")])
def test_the_fast_path_keeps_each_types_values_exactly(name):
    w = torch.from_numpy(
        gguf.quants.dequantize(_raw(name), gguf.GGMLQuantizationType[name]).reshape(N, K).copy()
    )
    kind = kind_for_gguf_type(name)
    deq = (
        quantize_int4(w)[-1]
        if kind == "int4"
        else quantize_mxfp4(w)[-1]
        if kind == "mxfp4"
        else quantize_int8_groups(w, 16 if kind == "int8x16" else 32)[-1]
    )
    assert torch.equal(deq, w), (kind, (deq - w).abs().max().item())
    if kernels.vnni_supported():  # and the kernel multiplies by exactly them (x rounded to int8 per 32)
        qw = QuantizedWeight(kind, w, torch.bfloat16, Kernels.for_device(torch.device("cpu"), torch.bfloat16))
        x = torch.randn(3, K).bfloat16()
        g = x.float().view(3, -1, 32)
        amax = g.abs().amax(-1, keepdim=True)
        xq = (torch.round(g * (127 / amax)) * (amax / 127)).view(3, K)
        ref = xq @ w.t()
        torch.testing.assert_close(qw.matmul(x).float(), ref, atol=2e-3 * ref.abs().max().item(), rtol=8e-3)


def test_a_type_pytgi_cannot_read_is_one_clear_error(tmp_path):
    weights = _gguf_tensor(tmp_path, "Q8_0", _raw("Q8_0"))  # then claim a type gguf-py cannot dequantize
    reader, t = weights.tensors[DOWN]
    weights.tensors[DOWN] = (reader, t._replace(tensor_type=gguf.GGMLQuantizationType.Q8_K))
    assert weights.grid(DOWN) is None
    with pytest.raises(GGUFConversionError, match=r"tensor 'blk\.0\.ffn_down\.weight' is stored as Q8_K"):
        list(weights.dense_tensors())


def test_types_without_a_uniform_grid_stay_unquantized():
    """IQ and ternary types (codebooks, not grids) keep the converter's float values: no second rounding."""
    assert kind_for_gguf_type("IQ4_NL") is None and kind_for_gguf_type("TQ2_0") is None
    assert kind_for_gguf_type("F16") is None
    assert kind_for_gguf_type("MXFP4") == "mxfp4"  # a codebook, but one on a uniform grid of 25 levels
    assert [kind_for_gguf_type(t) for t in ("Q4_K", "Q5_0", "Q3_K", "Q6_K")] == [
        "int4",
        "int8",
        "int8x16",
        "int8x16",
    ]
