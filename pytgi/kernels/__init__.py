"""Small C kernels for the CPU, compiled on first use with the system C compiler and loaded with
ctypes (no torch headers, so a build takes about a second).

The library is built with `-fopenmp` and so needs `libgomp.so.1`: in a process where torch is
loaded that is torch's own copy, so the kernels share torch's OpenMP thread pool instead of
starting a second one whose idle spinning would steal the cores. Builds are cached under
`$PYTGI_CACHE/kernels`, keyed by the source, the compiler flags and the CPU. Without a compiler
(or with PYTGI_NO_KERNELS=1) `load()` returns None and callers use their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from pytgi.models.registry import cache_dir

log = logging.getLogger(__name__)

SOURCES = ["paged_attention.c", "fused.c", "qgemv.c", "decoder.c"]
HEADERS = ["bf16.h", "amx.h"]  # part of the cache key
CFLAGS = ["-O3", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cflags() -> list[str]:
    """-march=native, or PYTGI_MARCH (e.g. x86-64-v3: how the kernels' portable paths are tested)."""
    return [f"-march={os.environ.get('PYTGI_MARCH') or 'native'}", *CFLAGS]


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    here = Path(__file__).parent
    srcs = [here / s for s in SOURCES]
    key = hashlib.sha256()
    for part in [compiler, *_cflags(), _cpu_id(), *((here / f).read_text() for f in SOURCES + HEADERS)]:
        key.update(part.encode())
    out = cache_dir() / "kernels" / f"pytgi_kernels-{key.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_cflags(), *map(str, srcs), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, out)  # atomic: concurrent builders (shards) each write their own temp file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


@cache
def load() -> ctypes.CDLL | None:
    if os.environ.get("PYTGI_NO_KERNELS", "") not in ("", "0"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention uses the (slower) torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the CPU kernels failed, using the torch path: %s", detail)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f32 = ctypes.c_float
    signatures = {
        "decode_attention": (ctypes.c_int, [ptr] * 7 + [i64] * 6 + [f32]),
        "paged_prefill": (ctypes.c_int, [ptr] * 8 + [i64] * 6 + [f32]),
        "add_rms_norm": (None, [ptr] * 4 + [i64] * 2 + [f32]),
        "silu_mul": (None, [ptr] * 2 + [i64] * 2),
        "rope_write_kv": (None, [ptr] * 7 + [i64] * 4),
    }
    lib.pytgi_paged_prefill_supported.restype, lib.pytgi_paged_prefill_supported.argtypes = ctypes.c_int, [i64] * 3
    lib.pytgi_qgemv_supported.restype, lib.pytgi_qgemv_supported.argtypes = ctypes.c_int, []
    lib.pytgi_qgemv_bf16.restype, lib.pytgi_qgemv_bf16.argtypes = ctypes.c_int, [ptr] * 3 + [i64] * 4
    lib.pytgi_qgemm_amx_supported.restype, lib.pytgi_qgemm_amx_supported.argtypes = ctypes.c_int, []
    lib.pytgi_qgemm_amx_bf16.restype, lib.pytgi_qgemm_amx_bf16.argtypes = ctypes.c_int, [ptr] * 3 + [i64] * 4
    lib.pytgi_decoder_layers_bf16.restype = ctypes.c_int
    lib.pytgi_decoder_layers_bf16.argtypes = [ptr, i64, ptr, ptr] + [i64] * 6 + [f32] * 2 + [ptr] * 7 + [i64] * 5
    for name, (restype, argtypes) in signatures.items():
        for suffix in ("f32", "bf16"):
            fn = getattr(lib, f"pytgi_{name}_{suffix}")
            fn.restype, fn.argtypes = restype, argtypes
    return lib
