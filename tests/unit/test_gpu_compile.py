"""The CUDA path's Triton kernels compile for a Hopper GPU (sm_90), here, without one: Triton's own
compiler and ptxas (shipped in its wheel) turn each kernel into machine code, so a kernel that the
interpreter runs but the compiler refuses fails in CI, not on the one GPU run a change gets. The
stores and weight loads are checked to be vector-wide (docs/cuda.md: a byte-wide load ran the
low-bit kernels at a tenth of their speed). The compiles run in a child process: this one's kernels
are the interpreter's (tests/conftest.py), which the compiler cannot follow."""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

NVIDIA = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
if not os.path.exists(os.path.join(NVIDIA, "ptxas")):
    pytest.skip("this Triton has no ptxas", allow_module_level=True)
ALIGNED = {"x_ptr", "w_ptr", "s_ptr", "out_ptr", "q_ptr", "N", "K", "stride_xm"}  # as a launch specializes


def sass(kernel, types: dict[str, str], consts: dict[str, object], warps: int = 4, stages: int = 3) -> dict:
    """Compile for sm_90; the counts of its global loads and stores by width, and of its local memory
    stores (STL: registers spilled)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel
    names = list(inspect.signature(fn.fn).parameters)
    src = ASTSource(
        fn=fn,
        signature={n: "constexpr" if n in consts else types[n] for n in names},
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED & set(names)},
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pytgi-{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    out = subprocess.run(
        [os.path.join(NVIDIA, "cuobjdump"), "-sass", path], capture_output=True, text=True
    ).stdout
    os.unlink(path)
    return collections.Counter(re.findall(r"\b((?:LDG|STG)\.E[\.\w]*|STL[\.\w]*)\b", out))


TYPES = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp16", "out_ptr": "*bf16", "q_ptr": "*u8", "M": "i32",
         "N": "i32", "K": "i32", "stride_xm": "i32", "stride_s": "i32"}  # fmt: skip


def low_bit(kind: str) -> None:
    from pytgi.engine.kernels import gpu_quant

    bits, group = (4, 32) if kind == "int4" else (8, 16) if kind == "int8x16" else (8, 32)
    fp8 = kind == "fp8"
    types = TYPES | ({"s_ptr": "*fp32"} if fp8 else {})
    meta = dict(BITS=bits, GROUP=group, HALF=group // 2 if bits == 4 else group, FP8=fp8, SN=1, SK=4096,
                PER_TILE=False, NATIVE=True)  # fmt: skip
    gemv = sass(gpu_quant._lowbit_gemv_kernel, types,
                meta | dict(G=512 // group, SPLIT=2, PER_SPLIT=2048, BLOCK_N=16, BLOCK_K=512))  # fmt: skip
    assert any(w in gemv for w in ("LDG.E.64", "LDG.E.128")) and "LDG.E.U8" not in gemv, gemv
    deq = sass(gpu_quant._dequantize_kernel, types, meta | dict(G=256 // group, BLOCK_N=32, BLOCK_K=256))
    assert "STG.E.128" in deq and "LDG.E.U8" not in deq, deq
    sass(gpu_quant._lowbit_matmul_kernel, types,
         meta | dict(G=256 // group, UPCAST=False, IEEE=False, SPLIT=1, PER_SPLIT=4096, BLOCK_M=16, BLOCK_N=16,
                     BLOCK_K=256))  # fmt: skip


def attention_rotary_rows() -> None:
    from pytgi.engine.kernels import gpu, gpu_quant

    att = {"q_ptr": "*bf16", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8", "out_ptr": "*bf16", "programs_ptr": "*i32",
           "q_start_ptr": "*i32", "ctx_ptr": "*i32", "tables_ptr": "*i32", "scale": "fp32", "part_ptr": "*fp32",
           "kf_ptr": "*fp32", "vf_ptr": "*fp32"} | {f"stride_{s}": "i32" for s in ("qt", "qh", "ks", "kh", "ot", "oh", "tb")}  # fmt: skip
    base = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=128, PAGE=16, BLOCK_M=4, BLOCK_N=64, IEEE=False, UPCAST=False, SPLITS=8,
                FP8=True, D_PAD=0, PARTS=1, MIN_TILES=2)  # fmt: skip
    sass(gpu._paged_attention_kernel, att, base)
    sass(gpu._paged_attention_kernel, att, base | dict(HEAD_DIM=96, D_PAD=128))  # FP8 rows of 96 + 4 bytes
    # MLA: 576-wide latent rows (padded to 1024), values = keys, in bf16; 16 query rows and 16 keys a
    # program on 8 warps fit the registers (4 warps, 32 keys or 2 query tokens spill): prefill chunks,
    # split decodes, a group of 128 in 8 programs
    mla = base | dict(GROUP=16, GROUP_PAD=16, HEAD_DIM=576, D_PAD=1024, BLOCK_M=1, BLOCK_N=16, FP8=False,
                      MIN_TILES=4)  # fmt: skip
    bf16 = att | {"k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"}
    for variant in (dict(SPLITS=1), dict(SPLITS=8), dict(GROUP=128, PARTS=8)):
        counts = sass(gpu._paged_attention_kernel, bf16, mla | variant, warps=8)
        assert not any(k.startswith("STL") for k in counts), (variant, counts)
    merge = {"part_ptr": "*fp32", "out_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32", "H": "i32"}
    sass(gpu._merge_splits_kernel, merge, dict(SPLITS=8, HEAD_DIM=128, D_PAD=0))
    sass(gpu._merge_splits_kernel, merge, dict(SPLITS=8, HEAD_DIM=576, D_PAD=1024))
    rope = {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i64", "q_ptr": "*bf16",
            "k_cache_ptr": "*u8", "v_cache_ptr": "*u8", "kf_ptr": "*fp32", "vf_ptr": "*fp32"}  # fmt: skip
    sass(gpu._rope_write_kv_kernel, rope, dict(H=32, KVH=8, D=128, FP8=True, HALF_PAD=0))
    sass(gpu._rope_write_kv_kernel, rope, dict(H=32, KVH=8, D=96, FP8=True, HALF_PAD=64))  # halves of 48
    rows = sass(gpu_quant._quantize_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "K": "i32",
                                                  "stride_xm": "i32"}, dict(BLOCK=1024))  # fmt: skip
    assert "LDG.E.128" in rows, rows


def _child(call: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        f"import sys; sys.path.insert(0, {os.getcwd()!r}); from tests.unit.test_gpu_compile import *; {call}"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("kind", ["int4", "int8x16", "fp8"])
def test_low_bit_kernels_compile_with_wide_loads(kind):
    _child(f"low_bit({kind!r})")


def test_attention_rotary_and_row_kernels_compile():
    _child("attention_rotary_rows()")
