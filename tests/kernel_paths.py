"""What a test needs of this machine's kernel path. Batch invariance and the one-call decoder loop are
properties of pytgi's C kernels (docs/batch-invariance.md): with PyTorch's kernels (no C compiler,
PYTGI_NO_KERNELS=1, or a CPU older than AVX2) a request's rows change with the step's size, so the
tests that assert those properties skip there, saying why, instead of failing on a property pytgi
does not claim. Every other test holds on every path."""

import pytest

from pytgi.engine import kernels

batch_invariant = pytest.mark.skipif(
    not kernels.vnni_supported(),
    reason="batch invariance needs pytgi's C kernels and their low-bit matmul (AVX2 or AVX-512 VNNI); "
    "this run has PyTorch's (docs/batch-invariance.md)",
)
decoder_loop = pytest.mark.skipif(
    not kernels.vnni_supported(),
    reason="the one-call decoder loop (decoder.c) runs pytgi's low-bit matmul (AVX2 or AVX-512 VNNI); "
    "this run has PyTorch's kernels",
)
