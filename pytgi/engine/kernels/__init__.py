"""pytgi's C kernels for the CPU, as typed Python functions: the one module that calls them.

The library is compiled on first use with the system C compiler (`pytgi.engine.kernels.build`: no torch
headers, so a build takes about a second) and loaded with ctypes; the argument and result types
of every function are read from its one header, `pytgi_kernels.h`. Without a compiler (or with
PYTGI_NO_KERNELS=1) `available()` is False and callers keep their PyTorch paths.

Tensors passed in must be contiguous, on the CPU, float32 or bfloat16 (`supports(dtype)`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from pytgi.engine.kernels.build import build

log = logging.getLogger(__name__)

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# a C argument's or result's type, as ctypes declares it
CType = type[ctypes.c_int64] | type[ctypes.c_float] | type[ctypes.c_int] | type[ctypes.c_void_p]
_CTYPES: dict[str, CType | None] = {
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "int": ctypes.c_int,
    "void": None,
}


def _signatures(header: str) -> dict[str, tuple[CType | None, list[CType | None]]]:
    """name → (result type, argument types), from the header's declarations."""
    out = {}
    for result, name, params in re.findall(r"^(int|void) (pytgi_\w+)\(([^)]*)\);", header, re.MULTILINE):
        args = (
            []
            if params.strip() == "void"
            else [ctypes.c_void_p if "*" in p else _CTYPES[p.split()[0]] for p in params.split(",")]
        )
        out[name] = (_CTYPES[result], args)
    return out


@cache
def _lib() -> ctypes.CDLL | None:
    if os.environ.get("PYTGI_NO_KERNELS", "") not in ("", "0"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: the CPU runs the (slower) PyTorch paths")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the CPU kernels failed, using the PyTorch paths: %s", detail)
        return None
    header = (Path(__file__).parent / "pytgi_kernels.h").read_text()
    for name, (result, args) in _signatures(header).items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = result, args
    return lib


def _built() -> ctypes.CDLL:
    """The library, for callers that checked `available()` (or a `*_supported()`) first."""
    lib = _lib()
    assert lib is not None, "pytgi's C kernels are not built on this machine"
    return lib


def _fn(name: str, dtype: torch.dtype) -> ctypes._NamedFuncPointer:
    return getattr(_built(), f"pytgi_{name}_{_SUFFIX[dtype]}")


def _ptr(t: torch.Tensor | np.ndarray | None) -> int | None:
    if t is None:
        return None
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data


def _check(failed: int, what: str) -> None:
    if failed:
        raise MemoryError(f"{what}: out of memory")


# -- what this machine's build can do ---------------------------------------------------------------
def available() -> bool:
    """The library built and loaded (the first call builds it: about a second, once)."""
    return _lib() is not None


def supports(dtype: torch.dtype) -> bool:
    """The fused element-wise and paged attention kernels take this dtype."""
    return dtype in _SUFFIX and available()


def vnni_supported() -> bool:
    """The low-bit matmul (`qgemv.c`) is built: AVX-512 VNNI, or AVX2."""
    return available() and bool(_built().pytgi_qgemv_supported())


def bf16gemm_supported() -> bool:
    """The bf16-weight matmul (`bf16gemm.c`) is built: AVX-512 BF16, or AVX2."""
    return available() and bool(_built().pytgi_bf16gemm_supported())


def amx_supported() -> bool:
    """AMX tiles built in, and the OS let this process use them."""
    return available() and bool(_built().pytgi_qgemm_amx_supported())


# -- fused element-wise steps (fused.c) ---------------------------------------------------------------
def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place, unless x is None); returns weight * rms_norm(residual)."""
    assert residual.is_contiguous() and (x is None or x.is_contiguous())
    out = torch.empty_like(residual)
    T, D = residual.shape
    _fn("add_rms_norm", residual.dtype)(_ptr(x), _ptr(residual), _ptr(weight), _ptr(out), T, D, eps)
    return out


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.is_contiguous()
    T, I2 = gate_up.shape
    out = gate_up.new_empty(T, I2 // 2)
    _fn(kernel, gate_up.dtype)(_ptr(gate_up), _ptr(out), T, I2 // 2)
    return out


def _check_slots(slots: torch.Tensor | int, pool: torch.Tensor) -> None:
    """The kernels write a request's state in place at its slot: one outside the pool (a request never
    given one: -1) would write past it, where PyTorch's indexing would raise or wrap."""
    low, high = (slots, slots) if isinstance(slots, int) else (int(slots.min()), int(slots.max()))
    if low < 0 or high >= pool.shape[0]:
        raise IndexError(f"state slot {low if low < 0 else high} outside a pool of {pool.shape[0]}")


def gdn_decode_layer(
    qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    conv_pool: torch.Tensor,
    rec_pool: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    nk: int,
    dk: int,
    tiled: bool,
    eps: float,
) -> None:
    """A gated DeltaNet layer's decodes after its projections (delta.c): qkv [T, C], z [T, nv, dv], b,
    a [T, nv] in the model's dtype, the decodes' flat `rows`, state `slots` and `fresh` flags; the
    convolution's pool [S, C, kernel − 1] (model dtype) and the rule's [S, nv, dk, dv] (float32) are
    updated in place; `weights`: the convolution's [C, kernel], A_log, dt_bias, the norm's weight, all
    float32. Writes the gated norm's output into out's rows [T, nv · dv]."""
    qkv, z, b, a = (t.contiguous() for t in (qkv, z, b, a))
    rows, slots, fresh = (t.to(torch.int64).contiguous() for t in (rows, slots, fresh))
    assert conv_pool.is_contiguous() and rec_pool.is_contiguous() and out.is_contiguous()
    assert rec_pool.dtype == torch.float32 and conv_pool.dtype == qkv.dtype == out.dtype
    _check_slots(slots, rec_pool)
    conv_w, A_log, dt_bias, norm_w = weights
    C, Kc = conv_w.shape
    _, nv, dk_, dv = rec_pool.shape
    assert dk_ == dk and qkv.shape[1] == C
    err = _fn("gdn_decode_layer", qkv.dtype)(
        _ptr(qkv), _ptr(z), _ptr(b), _ptr(a), _ptr(rows), _ptr(slots), _ptr(fresh), _ptr(conv_pool),
        _ptr(conv_w), _ptr(A_log), _ptr(dt_bias), _ptr(norm_w), _ptr(rec_pool), _ptr(out),
        len(rows), C, Kc, nk, nv, dk, dv, int(tiled), eps,
    )  # fmt: skip
    if err:
        raise MemoryError("gdn_decode_layer: out of memory")


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_attention.chunked_rule` in C (delta.c): L tokens of one request, q, k [L, H, K], v [L, H, V],
    g, beta [L, H] float32, from `state` [H, K, V]. Returns (o [L, H, V], the state after them)."""
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    state = state.float().contiguous().clone()
    L, H, K = q.shape
    V = v.shape[-1]
    out = torch.empty(L, H, V, dtype=torch.float32)
    _check(
        _built().pytgi_gdn_prefill_f32(
            _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(state), _ptr(out), L, H, K, V, chunk
        ),
        "gdn_prefill",
    )
    return out, state


def gdn_prefill_layer(
    qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    slot: int,
    fresh: bool,
    conv_pool: torch.Tensor,
    rec_pool: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    nk: int,
    dk: int,
    tiled: bool,
    eps: float,
    chunk: int,
) -> None:
    """One request's prompt chunk through a gated DeltaNet layer after its projections (delta.c): its
    rows of qkv [n, C], z [n, nv, dv], b, a [n, nv] (model dtype), its state `slot` (`fresh`: from zero);
    the pools as `gdn_decode_layer`'s; writes the gated norm's output into `out` [n, nv · dv] (a
    contiguous view)."""
    qkv, z, b, a = (t.contiguous() for t in (qkv, z, b, a))
    assert conv_pool.is_contiguous() and rec_pool.is_contiguous() and out.is_contiguous()
    assert rec_pool.dtype == torch.float32 and conv_pool.dtype == qkv.dtype == out.dtype
    _check_slots(slot, rec_pool)
    conv_w, A_log, dt_bias, norm_w = weights
    C, Kc = conv_w.shape
    _, nv, dk_, dv = rec_pool.shape
    assert dk_ == dk and qkv.shape[1] == C
    _check(
        _fn("gdn_prefill_layer", qkv.dtype)(
            _ptr(qkv), _ptr(z), _ptr(b), _ptr(a), len(qkv), slot, int(fresh), _ptr(conv_pool), _ptr(conv_w),
            _ptr(A_log), _ptr(dt_bias), _ptr(norm_w), _ptr(rec_pool), _ptr(out),
            C, Kc, nk, nv, dk, dv, int(tiled), eps, chunk,
        ),
        "gdn_prefill_layer",
    )  # fmt: skip


def _mamba2_args(
    conv_pool: torch.Tensor, ssm_pool: torch.Tensor, weights: tuple[torch.Tensor | None, ...], groups: int
) -> tuple[int | None, ...]:
    """The weights' pointers and the shape (H, P, G, N, kernel) a Mamba-2 kernel reads after its pools."""
    assert conv_pool.is_contiguous() and ssm_pool.is_contiguous() and ssm_pool.dtype == torch.float32
    conv_w, conv_b, dt_bias, A, D, norm_w = weights
    _, H, P, N = ssm_pool.shape
    assert conv_w is not None and conv_w.shape[0] == H * P + 2 * groups * N
    return (
        *(_ptr(t) for t in (conv_pool, conv_w, conv_b, dt_bias, A, D, norm_w, ssm_pool)),
        H, P, groups, N, conv_w.shape[1],
    )  # fmt: skip


def mamba2_decode_layer(
    proj: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    weights: tuple[torch.Tensor | None, ...],
    out: torch.Tensor,
    groups: int,
    dt_limit: tuple[float, float],
    eps: float,
) -> None:
    """A Mamba-2 layer's decodes after its input projection (mamba.c): proj [T, inner + conv_dim + H]
    (z | x B C | dt, the model's dtype), the decodes' flat `rows`, state `slots` and `fresh` flags; the
    convolution's pool [S, conv_dim, kernel − 1] (model dtype) and the SSM's [S, H, P, N] (float32) are
    updated in place; `weights`: the convolution's [conv_dim, kernel] and bias (or None), dt_bias, A
    (−exp(A_log)), D and the norm's weight, all float32. Writes the gated norm's output into out's rows
    [T, inner]."""
    proj = proj.contiguous()
    rows, slots, fresh = (t.to(torch.int64).contiguous() for t in (rows, slots, fresh))
    assert out.is_contiguous() and conv_pool.dtype == proj.dtype == out.dtype
    _check_slots(slots, ssm_pool)
    conv_pool_, conv_w, conv_b, dt_bias, A, D, norm_w, ssm_pool_, *shape = _mamba2_args(
        conv_pool, ssm_pool, weights, groups
    )
    err = _fn("mamba2_decode_layer", proj.dtype)(
        _ptr(proj), _ptr(rows), _ptr(slots), _ptr(fresh), conv_pool_, conv_w, conv_b, dt_bias, A, D, norm_w,
        ssm_pool_, _ptr(out), len(rows), *shape, *_dt_limit(dt_limit), eps,
    )  # fmt: skip
    _check(err, "mamba2_decode_layer")


def mamba2_prefill_layer(
    proj: torch.Tensor,
    slot: int,
    fresh: bool,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    weights: tuple[torch.Tensor | None, ...],
    out: torch.Tensor,
    groups: int,
    dt_limit: tuple[float, float],
    eps: float,
) -> None:
    """One request's prompt chunk through a Mamba-2 layer after its input projection (mamba.c): its rows
    of proj [n, inner + conv_dim + H], its state `slot` (`fresh`: from zero); the pools and weights as
    `mamba2_decode_layer`'s; writes the gated norm's output into `out` [n, inner] (a contiguous view)."""
    proj = proj.contiguous()
    assert out.is_contiguous() and conv_pool.dtype == proj.dtype == out.dtype
    _check_slots(slot, ssm_pool)
    conv_pool_, conv_w, conv_b, dt_bias, A, D, norm_w, ssm_pool_, *shape = _mamba2_args(
        conv_pool, ssm_pool, weights, groups
    )
    err = _fn("mamba2_prefill_layer", proj.dtype)(
        _ptr(proj), len(proj), slot, int(fresh), conv_pool_, conv_w, conv_b, dt_bias, A, D, norm_w,
        ssm_pool_, _ptr(out), *shape, *_dt_limit(dt_limit), eps,
    )  # fmt: skip
    _check(err, "mamba2_prefill_layer")


def _dt_limit(limit: tuple[float, float]) -> tuple[float, float]:
    """dt's clamp with no infinities (the kernels are built with -ffast-math, which assumes none)."""
    big = float(np.finfo(np.float32).max)
    return tuple(min(max(x, -big), big) for x in limit)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class StepRequests:
    """A step's requests as the Mamba-1 kernels read them: request r owns the flat rows [starts[r],
    starts[r + 1]), its states sit at slots[r], and fresh[r] (1) says they start from zero here."""

    starts: torch.Tensor  # [R + 1] int64
    slots: torch.Tensor  # [R] int64
    fresh: torch.Tensor  # [R] int64

    @staticmethod
    def of(query_lens: list[int], slots: torch.Tensor, fresh: list[bool]) -> StepRequests:
        starts = torch.from_numpy(np.concatenate(([0], np.cumsum(query_lens, dtype=np.int64))))
        flags = torch.tensor(fresh, dtype=torch.int64)
        return StepRequests(starts, slots.to(torch.int64).contiguous(), flags)


def causal_conv(
    xz: torch.Tensor,
    step: StepRequests,
    conv_pool: torch.Tensor,
    conv_w: torch.Tensor,
    conv_b: torch.Tensor | None,
) -> torch.Tensor:
    """The causal depthwise convolution and SiLU of a Mamba-1 or KDA layer over a step (mamba1.c): x is
    columns [0, D) of the input projection's output xz [T, W]; the pool [S, D, kernel − 1] (xz's
    dtype) is updated in place; conv_w [D, kernel] and conv_b [D] (or None) in float32. Returns the
    output [T, D] in xz's dtype."""
    assert xz.is_contiguous() and conv_pool.is_contiguous() and conv_pool.dtype == xz.dtype
    _check_slots(step.slots, conv_pool)
    D, Kc = conv_w.shape
    mixed = xz.new_empty(xz.shape[0], D)
    err = _fn("causal_conv", xz.dtype)(
        _ptr(xz), _ptr(step.starts), _ptr(step.slots), _ptr(step.fresh), _ptr(conv_pool), _ptr(conv_w),
        _ptr(conv_b), _ptr(mixed), len(step.slots), D, xz.shape[1], Kc,
    )  # fmt: skip
    _check(err, "causal_conv")
    return mixed


def mamba1_scan(
    xz: torch.Tensor,
    mixed: torch.Tensor,
    dt: torch.Tensor,
    bc: torch.Tensor,
    step: StepRequests,
    ssm_pool: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """A Mamba-1 layer's selective scan over a step (mamba1.c): mixed (the convolution's output) and dt
    (dt_proj's, before its softplus) [T, D] in xz's dtype, bc [T, 2N] (B | C, float32), the pool
    [S, D, N] (float32, in place), A = −exp(A_log) [D, N] and D [D] in float32; z is columns [D, 2D)
    of xz. Returns (y + D x) · SiLU(z) [T, D] in xz's dtype."""
    mixed, dt, bc = mixed.contiguous(), dt.contiguous(), bc.contiguous()
    assert xz.is_contiguous() and ssm_pool.is_contiguous() and ssm_pool.dtype == bc.dtype == torch.float32
    assert mixed.dtype == dt.dtype == xz.dtype
    _check_slots(step.slots, ssm_pool)
    _, d, N = ssm_pool.shape
    out = xz.new_empty(xz.shape[0], d)
    _fn("mamba1_scan", xz.dtype)(
        _ptr(xz), _ptr(mixed), _ptr(dt), _ptr(bc), _ptr(step.starts), _ptr(step.slots), _ptr(step.fresh),
        _ptr(ssm_pool), _ptr(A), _ptr(D), _ptr(out), len(step.slots), d, N, xz.shape[1],
    )  # fmt: skip
    return out


def kda_rule(
    mixed: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    gate: torch.Tensor,
    step: StepRequests,
    rec_pool: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """Kimi Delta Attention's rule over a step, its decodes and prompt chunks (kda.c): mixed [T, 3 H K]
    (q | k | v after `causal_conv`), f [T, H K] (f_b's output), b [T, H] (b_proj's), gate [T, H K]
    (g_b's), all in one dtype; the pool [S, H, K, K] (float32, in place); `weights`: A = −exp(A_log)
    [H], dt_bias [H K] and the output norm's weight [K] in float32. Returns the normed, gated output
    [T, H K] in mixed's dtype."""
    mixed, f, b, gate = (t.contiguous() for t in (mixed, f, b, gate))
    assert rec_pool.is_contiguous() and rec_pool.dtype == torch.float32
    assert mixed.dtype == f.dtype == b.dtype == gate.dtype
    _check_slots(step.slots, rec_pool)
    _, H, K, _ = rec_pool.shape
    out = mixed.new_empty(mixed.shape[0], H * K)
    A, dt_bias, norm_w = weights
    _fn("kda_rule", mixed.dtype)(
        _ptr(mixed), _ptr(f), _ptr(b), _ptr(gate), _ptr(step.starts), _ptr(step.slots), _ptr(step.fresh),
        _ptr(rec_pool), _ptr(A), _ptr(dt_bias), _ptr(norm_w), _ptr(out), len(step.slots), H, K, eps,
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from the fused [T, 2 I] gate/up output."""
    return _gated("silu_mul", gate_up)


def norm_add_norm(
    x: torch.Tensor | None,
    residual: torch.Tensor,
    wa: torch.Tensor | None,
    wb: torch.Tensor | None,
    eps: float,
) -> torch.Tensor | None:
    """Gemma's sandwich norms: residual += rms_norm(x)·wa (in place; skipped when x is None), then
    returns rms_norm(residual)·wb (None when wb is None). wa, wb: float32 (Gemma's 1 + w)."""
    assert residual.is_contiguous() and (x is None or x.is_contiguous())
    T, D = residual.shape
    out = None if wb is None else torch.empty_like(residual)
    _fn("norm_add_norm", residual.dtype)(_ptr(x), _ptr(residual), _ptr(wa), _ptr(wb), _ptr(out), T, D, eps)
    return out


def qk_norm_(
    qkv: torch.Tensor,
    qw: torch.Tensor,
    kw: torch.Tensor,
    H: int,
    KVH: int,
    D: int,
    eps: float,
    round_first: bool = False,
) -> None:
    """The per-head RMSNorm of the q and k parts of the fused qkv output, in place (float32 weights):
    Gemma's (times 1 + w, rounded once), or with `round_first` Qwen3's (the normed value rounded to the
    activations' dtype, then times w, as `pytgi.engine.models.layers.RMSNorm` computes it)."""
    assert qkv.is_contiguous()
    _fn("qk_norm", qkv.dtype)(_ptr(qkv), _ptr(qw), _ptr(kw), qkv.shape[0], H, KVH, D, eps, int(round_first))


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU-tanh(gate) * up from the fused [T, 2 I] gate/up output."""
    return _gated("gelu_tanh_mul", gate_up)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    H: int,
    KVH: int,
    D: int,
) -> torch.Tensor:
    """Rotary embedding of q and k from the fused qkv output; k and v go to their cache slots (an int8
    cache's rows: `kv8`). cos, sin: float32 [T, D]; slots: int64 [T]. Returns the rotated q, [T, H, D]."""
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and slots.is_contiguous()
    T = qkv.shape[0]
    q = qkv.new_empty(T, H, D)
    _fn("rope_write_kv", qkv.dtype)(
        _ptr(qkv),
        _ptr(cos),
        _ptr(sin),
        _ptr(slots),
        _ptr(q),
        _ptr(k_cache),
        _ptr(v_cache),
        T,
        H,
        KVH,
        D,
        int(kv8(k_cache)),
    )
    return q


# -- the int8 KV cache (kv8.h) -------------------------------------------------------------------------------
def kv8(cache: torch.Tensor) -> bool:
    """Whether a KV cache is int8 (--kv-cache-dtype int8): uint8 [slots, KVH, D + 2], each head's row
    its D values as int8 and then their bf16 scale."""
    return cache.dtype == torch.uint8


def write_kv8(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """k, v [T, KVH, D] (float32 or bf16) into the int8 cache's rows at `slots`."""
    k, v = k.contiguous(), v.contiguous()
    assert slots.is_contiguous() and kv8(k_cache) and k.dtype == v.dtype
    T, KVH, D = k.shape
    _fn("write_kv8", k.dtype)(_ptr(k), _ptr(v), _ptr(slots), _ptr(k_cache), _ptr(v_cache), T, KVH, D)


def kv8_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of int8 cache rows [..., D + 2] (any leading shape) in `dtype`: q · scale."""
    D = rows.shape[-1] - 2
    scale = rows[..., D:].contiguous().view(torch.bfloat16).float()
    return (rows[..., :D].view(torch.int8).float() * scale).to(dtype)


# -- paged attention (paged_attention.c) ----------------------------------------------------------------
@dataclass(slots=True)
class PagedBatch:
    """The requests of a step whose attention the paged kernel computes (int64 numpy arrays, kept
    referenced while the step runs)."""

    q_starts: np.ndarray  # [B] flat token index of each request's first query token
    q_lens: np.ndarray  # [B] 1 for decodes
    block_tables: np.ndarray  # [B, max_blocks]
    context_lens: np.ndarray  # [B]
    block_size: int
    decodes_only: bool  # all q_lens are 1: the decode entry point
    tiles: np.ndarray | None = None  # [B] nonzero: this request's rows use AMX tiles (None: no request does)
    first: np.ndarray | None = None  # [B] the first key each request's queries see (a window; None: 0)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    p: PagedBatch,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> None:
    """out[rows of p's requests] = attention of their queries over their cached context. `sinks`
    [H]: a logit per query head in each softmax that attends to nothing (gpt-oss)."""
    _, H, D = q.shape
    sink = None if sinks is None else sinks.detach().float().contiguous()
    common = (
        _ptr(p.block_tables),
        _ptr(p.context_lens),
        len(p.q_starts),
        p.block_tables.shape[1],
        p.block_size,
        H,
        k_cache.shape[1],
        D,
        scale,
    )
    flag = int(kv8(k_cache))
    if p.decodes_only:
        failed = _fn("decode_attention", q.dtype)(
            _ptr(q),
            _ptr(k_cache),
            _ptr(v_cache),
            _ptr(out),
            _ptr(p.q_starts),
            *common,
            flag,
            _ptr(sink),
            _ptr(p.first),
        )
    else:
        failed = _fn("paged_prefill", q.dtype)(
            _ptr(q),
            _ptr(k_cache),
            _ptr(v_cache),
            _ptr(out),
            _ptr(p.q_starts),
            _ptr(p.q_lens),
            *common[:2],
            _ptr(p.tiles),
            *common[2:],
            flag,
            _ptr(sink),
            _ptr(p.first),
        )
    _check(failed, "paged attention")


# -- the sampler's row reductions (fused.c) ----------------------------------------------------------------
def logit_stats(logits: torch.Tensor, lse: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per row of float32 [B, V] logits: (argmax, logsumexp or None, bad), each row's values the same
    whatever B (fixed pieces combined in order); `bad` rows hold a NaN or an infinity: use PyTorch."""
    assert logits.dtype == torch.float32 and logits.is_contiguous()
    B, V = logits.shape
    arg = torch.empty(B, dtype=torch.int64)
    bad = torch.empty(B, dtype=torch.int64)
    out = torch.empty(B, dtype=torch.float32) if lse else None
    _built().pytgi_logit_stats_f32(_ptr(logits), B, V, _ptr(arg), _ptr(out), _ptr(bad))
    return arg, out, bad


# -- low-bit matmuls (qgemv.c) ----------------------------------------------------------------------------
def lowbit_matmul(x: torch.Tensor, packed: torch.Tensor, N: int, bits: int, amx: bool) -> torch.Tensor:
    """bf16 x [M, K] times a packed low-bit weight [N, K] (`pytgi.engine.models.quant.pack_vnni`): with
    VNNI, or with AMX tiles when `amx`."""
    M, K = x.shape
    out = x.new_empty(M, N)
    kernel = _built().pytgi_qgemm_amx_bf16 if amx else _built().pytgi_qgemv_bf16
    _check(kernel(_ptr(x), _ptr(packed), _ptr(out), M, N, K, bits), "low-bit matmul")
    return out


@dataclass(slots=True)
class PackedExperts:
    """A mixture-of-experts layer's experts as `moe` takes them (int64 numpy arrays, per expert)."""

    gate_up: np.ndarray  # addresses of the packed gate|up weights [2 I, H] (relu² experts: up [I, H])
    down: np.ndarray  # addresses of the packed down weights [H, I]
    bits_gu: np.ndarray
    bits_down: np.ndarray
    inter: int  # I
    amx_above: int  # steps of more rows use AMX tiles (where built)
    oai: tuple[float, float] | None = None  # gpt-oss's experts: the clamped SwiGLU's (alpha, limit)
    # "silu" (SwiGLU), "gelu_tanh" (Gemma 4's GELU·up) or "relu2" (Nemotron-H's ungated relu(up)²); all
    # but SwiGLU through `moe_experts` alone
    activation: str = "silu"


def moe(
    x: torch.Tensor,
    experts: PackedExperts,
    router: torch.Tensor,
    top_k: int,
    norm_topk: bool,
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """A mixture-of-experts layer's routed part in one call: the bf16 router [E, H] picks each token's
    `top_k` experts (softmax, renormalised with `norm_topk`), then runs each expert on its tokens
    (moe.c's `pytgi_moe_experts_bf16`). gpt-oss's experts (`experts.oai`) take `biases`: the router's [E],
    the experts' gate|up [E, 2I] and down [E, H] (None on tensor-parallel ranks but the first), bf16."""
    assert x.is_contiguous() and x.dtype == torch.bfloat16 and router.dtype == torch.bfloat16
    assert router.is_contiguous()
    T, H = x.shape
    out = torch.empty_like(x)
    if experts.oai is not None:
        assert biases is not None and norm_topk
        router_bias, gu_bias, down_bias = biases
        assert all(t is None or (t.is_contiguous() and t.dtype == torch.bfloat16) for t in biases)
        alpha, limit = experts.oai
        failed = _built().pytgi_moe_oai_bf16(
            _ptr(x),
            _ptr(out),
            T,
            H,
            experts.inter,
            len(experts.gate_up),
            top_k,
            _ptr(router),
            _ptr(router_bias),
            _ptr(experts.gate_up),
            _ptr(experts.down),
            _ptr(experts.bits_gu),
            _ptr(experts.bits_down),
            experts.amx_above,
            _ptr(gu_bias),
            _ptr(down_bias),
            alpha,
            limit,
        )
        _check(failed, "experts")
        return out
    failed = _built().pytgi_moe_bf16(
        _ptr(x),
        _ptr(out),
        T,
        H,
        experts.inter,
        len(experts.gate_up),
        top_k,
        int(norm_topk),
        _ptr(router),
        _ptr(experts.gate_up),
        _ptr(experts.down),
        _ptr(experts.bits_gu),
        _ptr(experts.bits_down),
        experts.amx_above,
    )
    _check(failed, "experts")
    return out


def moe_experts(
    x: torch.Tensor, experts: PackedExperts, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """A mixture-of-experts layer's routed part for a step routed by the caller: token t goes to experts
    `chosen[t]` ([T, k]) with `weights[t]` (float32), its output their weighted sum in float32, in the
    order of the experts (moe.c's `pytgi_moe_experts_bf16`; SwiGLU, GELU·up or relu² experts, as
    `experts.activation` says)."""
    assert x.is_contiguous() and x.dtype == torch.bfloat16 and experts.oai is None
    T, H = x.shape
    E, k = len(experts.gate_up), chosen.shape[1]
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, choice) pairs by expert, token order within one
    starts = torch.zeros(E + 1, dtype=torch.int64)
    starts[1:] = torch.bincount(flat, minlength=E).cumsum(0)
    tok = (order // k).contiguous()
    wt = weights.reshape(-1)[order].float().contiguous()
    out = torch.empty_like(x)
    failed = _built().pytgi_moe_experts_bf16(
        _ptr(x),
        _ptr(out),
        T,
        H,
        experts.inter,
        E,
        _ptr(starts),
        _ptr(tok),
        _ptr(wt),
        _ptr(experts.gate_up),
        _ptr(experts.down),
        _ptr(experts.bits_gu),
        _ptr(experts.bits_down),
        experts.amx_above,
        ("silu", "gelu_tanh", "relu2").index(experts.activation),
    )
    _check(failed, "experts")
    return out


def pack_lowbit(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Levels u (uint8 [N, K]) with d and m per group ([N, groups], any float dtype: rounded to fp16)
    into `out` ([N/16, K/32, block bytes] uint8): `pytgi.engine.models.quant.pack_vnni`'s layout."""
    N, K = u.shape
    assert u.dtype == torch.uint8 and out.is_contiguous() and out.numel() * 16 * 32 >= N * K
    u, d16, m16 = u.contiguous(), d.half().contiguous(), m.half().contiguous()
    _built().pytgi_pack_lowbit(_ptr(u), _ptr(d16), _ptr(m16), _ptr(out), N, K, bits)


def gguf_decode(
    ggml_type: int, blocks: np.ndarray, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
) -> None:
    """GGUF blocks (uint8 [n_blocks, type size], a view of the file's mapping will do) → their levels
    `q` (uint8), steps `d` and offsets `m` per group (float32; None for the symmetric types), written
    in place: `pytgi.engine.loading.gguf.decode_blocks`'s values."""
    assert blocks.dtype == np.uint8 and blocks.flags.c_contiguous and q.is_contiguous() and d.is_contiguous()
    assert m is None or m.is_contiguous()
    failed = _built().pytgi_gguf_decode(ggml_type, _ptr(blocks), blocks.shape[0], _ptr(q), _ptr(d), _ptr(m))
    if failed:
        what = f"ggml type {ggml_type} is not decoded by gguf.c" if failed == 2 else "no offsets given"
        raise ValueError(what)


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> None:
    """A Hugging Face MXFP4 tensor's blocks (uint8 [..., 16]) and exponents (uint8 [...], one a block) →
    levels `q` (uint8, 32 a block) and steps `d` (float32, one a block), written in place, as
    `gguf_decode` gives a GGUF MXFP4 tensor's (offset -12·d)."""
    assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape[-1] == 16
    blocks, scales = blocks.contiguous(), scales.contiguous()
    nb = scales.numel()
    assert blocks.numel() == 16 * nb and q.numel() == 32 * nb and d.numel() == nb
    assert q.is_contiguous() and d.is_contiguous() and d.dtype == torch.float32
    _built().pytgi_mxfp4_decode(_ptr(blocks), _ptr(scales), nb, _ptr(q), _ptr(d))


def bf16_matmul(x: torch.Tensor, packed: torch.Tensor, N: int) -> torch.Tensor:
    """bf16 x [M, K] times a packed bf16 weight [N, K] (`pytgi.engine.models.quant.pack_bf16`)."""
    M, K = x.shape
    out = x.new_empty(M, N)
    _check(_built().pytgi_bf16gemm_bf16(_ptr(x), _ptr(packed), _ptr(out), M, N, K), "bf16 matmul")
    return out


def bf16_matmul_heads(x: torch.Tensor, packed: torch.Tensor, N: int, out: torch.Tensor) -> torch.Tensor:
    """Per head g: out[:, g] = x[:, g] [T, K] times packed weight g [N, K] (`pack_bf16` of the heads'
    [G · N, K] rows); x [T, G, K] and out [T, G, N] bf16 views with unit inner strides and even
    strides (slices of wider rows are fine)."""
    T, G, K = x.shape
    assert x.dtype == out.dtype == torch.bfloat16 and out.shape == (T, G, N)
    assert x.stride(2) == out.stride(2) == 1 and packed.numel() == G * N * K
    strides = (x.stride(1), x.stride(0), out.stride(1), out.stride(0))
    assert all(s % 2 == 0 for s in strides) and x.storage_offset() % 2 == 0
    failed = _built().pytgi_bf16gemm_batched_bf16(_ptr(x), _ptr(packed), _ptr(out), G, T, N, K, *strides)
    _check(failed, "bf16 matmul")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` of bf16 rows x [T, D] with its weight as float32 (`RMSNorm.scale`, of bf16 values), as
    mla.c's decodes norm: the module's steps and roundings, its sum of squares in a fixed order of mla.c's
    (within one bf16 step of the module's; a row's bits do not depend on the rows beside it)."""
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and weight.dtype == torch.float32
    out = torch.empty_like(x)
    T, D = x.shape
    _built().pytgi_rms_norm_bf16(_ptr(x), _ptr(weight), _ptr(out), T, D, eps)
    return out


def mla_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    norm_w: torch.Tensor,
    k_cache: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor],
    p: PagedBatch,
    dims: tuple[int, int, int, int],
    interleave: bool,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """Latent attention's decodes (mla.c), one token per request of `p` (decodes only), from the projections'
    bf16 rows q [T, H · (nope + rope)] and kv [T, latent + rope] to o_proj's input [T, H · v]: writes
    each token's cache row [kv_a_layernorm(c), rotary(k_pe)] at its slot and attends with the absorbed
    W_UK, W_UV (`packed`); dims (nope, rope, latent, v); `rope`: the float32 cos, sin [T, rope];
    norm_w: kv_a_layernorm's weight as float32. The same bits as `MLAttention`'s PyTorch ops."""
    nope, d, r, v = dims
    T, H = q.shape[0], q.shape[1] // (nope + d)
    cos, sin = rope
    assert p.decodes_only and len(p.q_starts) == T and q.dtype == kv.dtype == k_cache.dtype == torch.bfloat16
    assert k_cache.shape[1:] == (1, r + d) and k_cache.is_contiguous() and norm_w.dtype == torch.float32
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape[-1] == d
    q, kv, cos, sin, slots = (t.contiguous() for t in (q, kv, cos, sin, slots))
    out = q.new_empty(T, H * v)
    err = _built().pytgi_mla_decode_bf16(
        _ptr(q), _ptr(kv), _ptr(cos), _ptr(sin), _ptr(slots), _ptr(norm_w), _ptr(k_cache), k_cache.shape[0],
        _ptr(packed[0]), _ptr(packed[1]), _ptr(out), _ptr(p.q_starts), _ptr(p.block_tables),
        _ptr(p.context_lens), T, p.block_tables.shape[1], p.block_size, H, nope, d, r, v, int(interleave),
        eps, scale,
    )  # fmt: skip
    if err == 3:
        raise IndexError(f"a KV cache slot outside the cache's {k_cache.shape[0]} rows")
    if err == 2:
        raise RuntimeError("latent attention: bf16gemm.c is not built here, or a rotary part over 512")
    _check(err, "latent attention")
    return out


def encoder_attention_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `encoder_attention` runs here for the dtype and head size (else: PyTorch's SDPA)."""
    lib = _lib()
    return (
        lib is not None
        and dtype in _SUFFIX
        and bool(lib.pytgi_encoder_attention_supported(int(dtype == torch.bfloat16), head_dim))
    )


def encoder_attention(qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """One prompt's bidirectional attention on the calling thread: qkv [L, 3·H·D] (q, k, v of each
    head in turn, as the fused projection writes them) → [L, H·D]."""
    L, width = qkv.shape
    D = width // (3 * heads)
    qkv = qkv.contiguous()
    out = qkv.new_empty(L, heads * D)
    _check(_fn("encoder_attention", qkv.dtype)(_ptr(qkv), _ptr(out), L, heads, D, scale), "encoder attention")
    return out


def bias_gelu_(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """bf16 x [T, N] = GELU(x + bias) in place (erf GELU, in float32, rounded once)."""
    assert x.dtype == bias.dtype == torch.bfloat16 and x.is_contiguous() and bias.is_contiguous()
    T, N = x.shape
    _built().pytgi_bias_gelu_bf16(_ptr(x), _ptr(bias), T, N)
    return x


def bias_residual_norm(
    x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, norm: torch.nn.LayerNorm
) -> torch.Tensor:
    """bf16 LayerNorm(x + bias + residual) ([T, N] each, bias [N]), in float32, rounded once."""
    T, N = x.shape
    w, b = norm.weight, norm.bias
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (x, bias, residual, w, b))
    out = torch.empty_like(x)
    failed = _built().pytgi_bias_residual_norm_bf16(
        _ptr(x), _ptr(bias), _ptr(residual), _ptr(w), _ptr(b), _ptr(out), T, N, norm.eps
    )
    _check(failed, "bias, residual and LayerNorm")
    return out


# -- all decoder layers in one call (decoder.c): Llama's, Gemma 3's ------------------------------------------
def decoder_layers(
    table: np.ndarray,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    p: PagedBatch,
    sizes: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    vnni_max_m: int,
    lora: tuple[np.ndarray, np.ndarray] | None = None,
    kv8: bool = False,
) -> torch.Tensor:
    """Run every layer on the residual stream x (bf16 [T, hidden], updated in place) and return its
    final RMSNorm. table: int64 [layers, fields] of pointers (see decoder.c); sizes: (hidden,
    intermediate, query heads, kv heads, head dim); lora: the LoRA tables by layer and each row's
    adapter slot (decoder.c), or None."""
    h = torch.empty_like(x)
    failed = _built().pytgi_decoder_layers_bf16(
        _ptr(table),
        len(table),
        _ptr(x),
        _ptr(h),
        x.shape[0],
        *sizes,
        eps,
        scale,
        _ptr(cos),
        _ptr(sin),
        _ptr(slots),
        _ptr(p.q_starts),
        _ptr(p.q_lens),
        _ptr(p.block_tables),
        _ptr(p.context_lens),
        _ptr(p.tiles),
        len(p.q_starts),
        p.block_tables.shape[1],
        p.block_size,
        int(p.decodes_only),
        vnni_max_m,
        _ptr(lora[0]) if lora is not None else None,
        _ptr(lora[1]) if lora is not None else None,
        int(kv8),
    )
    _check(failed, "decoder layers")
    return h


def gemma_layers(
    table: np.ndarray,
    x: torch.Tensor,
    ropes,
    slots: torch.Tensor,
    p: PagedBatch,
    sizes: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    vnni_max_m: int,
    kv8: bool = False,
    first: np.ndarray | None = None,
) -> None:
    """Run every Gemma 3 layer on the residual stream x (bf16 [T, hidden], updated in place).
    ropes: ((cos, sin) of the full layers, (cos, sin) of the sliding ones), float32 [T, D]. first:
    per request the first key the sliding layers see (decodes past the window), or None."""
    (cos, sin), (cos_l, sin_l) = ropes
    failed = _built().pytgi_gemma_layers_bf16(
        _ptr(table),
        len(table),
        _ptr(x),
        x.shape[0],
        *sizes,
        eps,
        scale,
        _ptr(cos),
        _ptr(sin),
        _ptr(cos_l),
        _ptr(sin_l),
        _ptr(slots),
        _ptr(p.q_starts),
        _ptr(p.q_lens),
        _ptr(p.block_tables),
        _ptr(p.context_lens),
        _ptr(p.tiles),
        len(p.q_starts),
        p.block_tables.shape[1],
        p.block_size,
        int(p.decodes_only),
        vnni_max_m,
        int(kv8),
        _ptr(first),
    )
    _check(failed, "decoder layers")


def lora_add(y: torch.Tensor, x: torch.Tensor, slots: np.ndarray, table: np.ndarray) -> None:
    """y[t] += (x[t] · A_sᵀ) · B_sᵀ in place, s = slots[t] (< 0: none), row by row (lora.c). table:
    int64 [4, slots]: A's address, Bᵀ's, the rank, the column spans' address, by slot."""
    assert y.is_contiguous() and x.is_contiguous() and y.dtype == x.dtype and table.flags.c_contiguous
    T, K = x.shape
    failed = _fn("lora_add", y.dtype)(
        _ptr(y), _ptr(x), T, K, y.shape[1], _ptr(slots), *(_ptr(row) for row in table)
    )
    _check(failed, "lora_add")
