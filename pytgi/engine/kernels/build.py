"""Compile the C kernels with the system C compiler, once per source, flags and CPU.

The library is built with `-fopenmp` and so needs `libgomp.so.1`: in a process where torch is
loaded that is torch's own copy, so the kernels share torch's OpenMP thread pool instead of
starting a second one whose idle spinning would steal the cores. Builds are cached under
`$PYTGI_CACHE/kernels`, keyed by the sources, the compiler flags and the CPU.

The sources are compiled with `-ffast-math` but linked without it: linking with it (GCC before 13)
adds `crtfastmath.o`, whose start-up code sets flush-to-zero and denormals-are-zero for the whole
process that loads the library, torch's operations and Python's floats included. The kernels that
want those modes (paged attention) set them for their own threads and restore them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from pytgi.core.paths import cache_dir

SOURCES = [
    *["paged_attention.c", "fused.c", "qgemv.c", "bf16gemm.c", "decoder.c", "lora.c"],
    *["pack.c", "gguf.c", "moe.c"],  # load-time packing, GGUF blocks, mixture-of-experts layers
    "delta.c",  # linear attention's decodes
    "mamba.c",  # Mamba-2's decodes and prompt chunks
    "mamba1.c",  # Mamba-1's convolution and selective scan, a whole step in two calls
    "kda.c",  # Kimi Delta Attention's rule, a whole step in one call
    "encoder.c",  # the encoders: bidirectional attention, bias + GELU, bias + residual + LayerNorm
    "mla.c",  # multi-head latent attention's decodes
]
HEADERS = sorted(p.name for p in Path(__file__).parent.glob("*.h"))  # part of the cache key (each of them)
CFLAGS = ["-O3", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
LDFLAGS = ["-shared", "-fopenmp", "-lm"]  # no -ffast-math: see above


def _cflags() -> list[str]:
    """-march=native, or PYTGI_MARCH (e.g. x86-64-v3: how the kernels' portable paths are tested)."""
    return [f"-march={os.environ.get('PYTGI_MARCH') or 'native'}", *CFLAGS]


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build(compiler: str) -> Path:
    """The path of the shared library, compiled now unless a build of the same sources is cached."""
    here = Path(__file__).parent
    srcs = [here / s for s in SOURCES]
    key = hashlib.sha256()
    for part in [
        compiler,
        *_cflags(),
        *LDFLAGS,
        _cpu_id(),
        *((here / f).read_text() for f in SOURCES + HEADERS),
    ]:
        key.update(part.encode())
    out = cache_dir() / "kernels" / f"pytgi_kernels-{key.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objdir:
            objs = [str(Path(objdir) / f"{s.stem}.o") for s in srcs]
            for src, obj in zip(srcs, objs):
                subprocess.run(
                    [compiler, *_cflags(), "-c", str(src), "-o", obj],
                    check=True,
                    capture_output=True,
                    text=True,
                )
            subprocess.run([compiler, *objs, "-o", tmp, *LDFLAGS], check=True, capture_output=True, text=True)
        os.replace(tmp, out)  # atomic: concurrent builders (shards) each write their own temp file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
