"""The C kernels built for older x86-64s, as on many CPU servers and laptops: AVX-512 without VNNI and
BF16 (x86-64-v4, Skylake-SP: the low-bit matmul's AVX2 path, attention's float32 AVX-512 path for
bf16 too), AVX2 without AVX-512 (x86-64-v3: the low-bit matmul's AVX2 path, the portable attention)
and SSE4 only (x86-64-v2: PyTorch's low-bit kernels).
Their portable paths run, and the kernel tests pass on them. Runs those tests in a subprocess
with PYTGI_MARCH (the kernel build's -march) and a cache of its own."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pytgi.engine import kernels

HERE = Path(__file__).parent
# what each -march needs of the CPU that runs its code (a build for a newer CPU dies of SIGILL here)
NEEDS = {"x86-64-v4": {"avx512f", "avx512bw", "avx512vl"}, "x86-64-v3": {"avx2", "fma"}, "x86-64-v2": set()}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


@pytest.mark.skipif(
    not kernels.available() or platform.machine() != "x86_64", reason="needs an x86-64 C compiler"
)
@pytest.mark.parametrize(
    "march, qgemv", [("x86-64-v4", "True"), ("x86-64-v3", "True"), ("x86-64-v2", "False")]
)
def test_kernel_tests_pass_on_the_portable_paths(tmp_path, march, qgemv):
    if not NEEDS[march] <= _cpu_flags():
        pytest.skip(f"this CPU cannot run {march} code (no {', '.join(sorted(NEEDS[march] - _cpu_flags()))})")
    env = dict(os.environ, PYTGI_MARCH=march, PYTGI_CACHE=str(tmp_path))
    files = [
        "test_attention_kernel.py",
        "test_fused_kernels.py",
        "test_quant.py",
        "test_encoder_kernels.py",
    ]
    probe = "from pytgi.engine import kernels; print(kernels.vnni_supported(), kernels.amx_supported())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [qgemv, "False"], out.stdout + out.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(HERE / f) for f in files)],
        env=env,
        capture_output=True,
        text=True,
        cwd=HERE.parent.parent,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
