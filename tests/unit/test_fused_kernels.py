"""The fused CPU kernels (element-wise steps, gated DeltaNet's) against the PyTorch ops they replace."""

import numpy as np
import pytest
import torch

from pytgi.engine import kernels
from pytgi.engine.models.attention import StepLayout, TorchAttention
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.kda import KdaConfig, KimiDeltaAttention
from pytgi.engine.models.layers import RMSNorm, RotaryEmbedding, apply_rotary
from pytgi.engine.models.linear_attention import (
    GatedDeltaNet,
    LinearAttnConfig,
    StateMetadata,
    chunked_rule,
    l2norm,
)
from pytgi.engine.models.mamba1 import PLAIN, WEIGHTED, Mamba1Config, Mamba1Mixer
from pytgi.engine.models.mamba2 import Mamba2Config, Mamba2Mixer
from pytgi.engine.models.mla import MLAConfig, MLAttention

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# each recurrent layer's projections whose outputs go through a sigmoid or a SiLU in the kernels
GATES = {
    "GatedDeltaNet": ("in_proj_z.weight", "in_proj_b.weight"),
    "Mamba2Mixer": ("in_proj.weight",),
    "Mamba1Mixer": ("in_proj.weight",),
    "KimiDeltaAttention": ("g_b_proj.weight", "b_proj.weight"),
}


def _paths_agree(
    layers, pools, x, meta, dtype, float32_tol: float | None = None, saturated: bool = False
) -> None:
    """Two layers (the PyTorch ops', the C kernel's) on one step, each on its own copy of the state pool:
    their outputs and their pools after the step agree within the dtype's tolerance (or `float32_tol`,
    atol and rtol, where float32 sums run in another order). `saturated`: the gates' projections scaled
    by 300 first, so that sigmoids and SiLUs see inputs far below −88, where e^−x overflows (under
    -ffast-math a division by 1 + inf is NaN, not 0): both paths stay finite."""
    if saturated:
        with torch.no_grad():
            for layer in layers:
                for name in GATES[type(layer).__name__]:
                    layer.get_parameter(name).mul_(300)
    outs = [layer(x, None, pool, meta) for layer, pool in zip(layers, pools)]
    if saturated:  # (outputs in the hundreds: compared relative to their largest)
        assert outs[0].isfinite().all() and outs[1].isfinite().all()
        scale = outs[0].abs().max().float()
        outs = [o.float() / scale for o in outs]
    tol = (
        TOL[dtype]
        if float32_tol is None or dtype != torch.float32
        else dict(atol=float32_tol, rtol=float32_tol)
    )
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for ref, got in zip(*pools):
        if saturated:
            scale = ref.abs().max().float().clamp(min=1)
            ref, got = ref.float() / scale, got.float() / scale
        torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 9])
def test_add_rms_norm(dtype, T):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(64)).to(dtype)
    x, residual = torch.randn(T, 64).to(dtype), torch.randn(T, 64).to(dtype)
    expected_residual = residual + x
    expected = norm(expected_residual)
    out = kernels.add_rms_norm(x, residual, norm.weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, **TOL[dtype])
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(
        kernels.add_rms_norm(None, residual, norm.weight, 1e-5), expected, **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gu = torch.randn(5, 2 * 48).to(dtype)
    gu[0, :48] = torch.linspace(-300, 60, 48)  # far past expf's range: -0, not NaN (-ffast-math)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gu), torch.nn.functional.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv(dtype):
    torch.manual_seed(0)
    T, H, KVH, D = 6, 4, 2, 16
    rope = RotaryEmbedding(D, 64, 10000.0, None)
    positions = torch.tensor([0, 5, 6, 7, 30, 63])
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(dtype)
    slots = torch.tensor([9, 2, 3, 4, 17, 0])
    k_cache, v_cache = torch.zeros(20, KVH, D, dtype=dtype), torch.zeros(20, KVH, D, dtype=dtype)
    q = kernels.rope_write_kv(
        qkv, rope.cos[positions], rope.sin[positions], slots, k_cache, v_cache, H, KVH, D
    )
    cos, sin = rope(positions, dtype)
    qk = apply_rotary(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)
    torch.testing.assert_close(q, qk[:, :H], **TOL[dtype])
    torch.testing.assert_close(k_cache[slots], qk[:, H:], **TOL[dtype])
    torch.testing.assert_close(v_cache[slots], qkv[:, (H + KVH) * D :].view(T, KVH, D))
    assert k_cache[1].abs().sum() == 0  # untouched slots stay untouched


def _gemma_norm(dim: int, dtype: torch.dtype):
    norm = RMSNorm(dim, 1e-6, offset=True)
    norm.weight.data = (0.5 * torch.randn(dim)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 9])
def test_gemma_norm_add_norm(dtype, T):
    """Gemma's sandwich: residual += post(x); out = pre(residual), with (1 + w) norms; and each half alone."""
    torch.manual_seed(0)
    post, pre = _gemma_norm(64, dtype), _gemma_norm(64, dtype)
    x, residual = torch.randn(T, 64).to(dtype), torch.randn(T, 64).to(dtype)
    expected_residual = residual + post(x)
    expected = pre(expected_residual)
    out = kernels.norm_add_norm(x, residual, post.scale(), pre.scale(), 1e-6)
    torch.testing.assert_close(residual, expected_residual, **TOL[dtype])
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(
        kernels.norm_add_norm(None, residual, None, pre.scale(), 1e-6), expected, **TOL[dtype]
    )
    assert kernels.norm_add_norm(x, residual, post.scale(), None, 1e-6) is None
    torch.testing.assert_close(residual, expected_residual + post(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_qk_norm_in_place(dtype):
    torch.manual_seed(0)
    T, H, KVH, D = 3, 4, 1, 32
    qn, kn = _gemma_norm(D, dtype), _gemma_norm(D, dtype)
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(dtype)
    q, k, v = (
        qkv[:, : H * D].view(T, H, D),
        qkv[:, H * D : (H + KVH) * D].view(T, KVH, D),
        qkv[:, (H + KVH) * D :],
    )
    expected_q, expected_k, expected_v = qn(q), kn(k), v.clone()
    kernels.qk_norm_(qkv, qn.scale(), kn.scale(), H, KVH, D, 1e-6)
    torch.testing.assert_close(q, expected_q, **TOL[dtype])
    torch.testing.assert_close(k, expected_k, **TOL[dtype])
    assert torch.equal(qkv[:, (H + KVH) * D :], expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_qk_norm_in_place(dtype):
    """Qwen3's norms (times w, the normed value rounded first): as RMSNorm computes them."""
    torch.manual_seed(1)
    T, H, KVH, D = 3, 4, 2, 32
    qn, kn = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
    for n in (qn, kn):
        n.weight.data = (1 + 0.5 * torch.randn(D)).to(dtype)
    qkv = (3 * torch.randn(T, (H + 2 * KVH) * D)).to(dtype)
    q, k = qkv[:, : H * D].view(T, H, D), qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
    expected_q, expected_k = qn(q), kn(k)
    kernels.qk_norm_(qkv, qn.scale(), kn.scale(), H, KVH, D, 1e-6, round_first=True)
    torch.testing.assert_close(q, expected_q, **TOL[dtype])
    torch.testing.assert_close(k, expected_k, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul(dtype):
    gu = (3 * torch.randn(5, 2 * 48)).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(kernels.gelu_tanh_mul(gu), expected, **TOL[dtype])


def test_loading_the_kernels_leaves_the_process_float_mode_alone():
    """Linking with -ffast-math would add crtfastmath.o, which sets flush-to-zero for the whole
    process on load: torch's and Python's subnormal floats would become 0 (a 1e-320 sampling
    parameter then failed validation in the engine)."""
    import subprocess
    import sys

    code = "import sys; from pytgi.engine import kernels; assert kernels.available(); print(sys.float_info.min * 0.5 > 0)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("saturated", [False, True])
def test_gated_deltanet_layer(dtype, tiled, saturated):
    """delta.c's layer (`GatedDeltaNet._fused`) equals the layer's PyTorch ops, outputs and states, on a
    step of decodes (one starting here) and prompt chunks (one starting here, one continuing past a
    64-token chunk of the rule), at scattered slots of the pools."""
    g = torch.Generator().manual_seed(0)
    cfg = LinearAttnConfig(2, 4, 16, 8, 4, fused_qkvz=False, tiled_v_heads=tiled)
    layers = [GatedDeltaNet(cfg, 32, 1e-6, fused) for fused in (False, True)]
    for p in layers[0].parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)
    layers[1].load_state_dict(layers[0].state_dict())
    for layer in layers:
        layer.to(dtype)
    lens = [1, 7, 1, 70, 1]
    fresh = [False, True, True, False, False]
    slots = torch.tensor([7, 0, 3, 8, 2])
    pools = [(torch.randn(9, 96, 3, generator=g).to(dtype), torch.randn(9, 4, 16, 8, generator=g) * 0.3)]
    pools.append(tuple(t.clone() for t in pools[0]))
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    dec = [i for i, n in enumerate(lens) if n == 1]
    meta = StateMetadata(
        attn=None,
        slots=slots,
        query_lens=lens,
        fresh=fresh,
        decodes=torch.tensor(dec),
        decode_rows=torch.tensor(starts[dec]),
        reset=slots[[i for i in dec if fresh[i]]],
        decode_fresh=torch.tensor([fresh[i] for i in dec], dtype=torch.int64),
    )
    x = torch.randn(sum(lens), 32, generator=g).to(dtype)
    # (float32: the chunked rule's sums in another order, over 70 tokens)
    _paths_agree(layers, pools, x, meta, dtype, float32_tol=1e-4, saturated=saturated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("saturated", [False, True])
def test_mamba2_layer(dtype, bias, saturated):
    """mamba.c's layer (`Mamba2Mixer._fused`) equals the layer's PyTorch ops, outputs and states, on a
    step of decodes (one starting here) and prompt chunks (one starting here, one continuing past a
    64-token chunk of the PyTorch scan), at scattered slots of the pools; without a convolution bias
    dt is clamped (Granite-4.0-H's and Bamba's dt_limit stays infinite; the clamp's own path here)."""
    g = torch.Generator().manual_seed(1)
    limit = (0.0, float("inf")) if bias else (0.05, 0.6)
    cfg = Mamba2Config(4, 8, 2, 16, 4, conv_bias=bias, dt_limit=limit)
    layers = [Mamba2Mixer(cfg, 32, 1e-5, fused) for fused in (False, True)]
    assert layers[1].fused
    for p in layers[0].parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)
    layers[1].load_state_dict(layers[0].state_dict())
    for layer in layers:
        layer.to(dtype)
    lens = [1, 7, 1, 70, 1]
    fresh = [False, True, True, False, False]
    slots = torch.tensor([7, 0, 3, 8, 2])
    pools = [(torch.randn(9, 96, 3, generator=g).to(dtype), torch.randn(9, 4, 8, 16, generator=g) * 0.3)]
    pools.append(tuple(t.clone() for t in pools[0]))
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    dec = [i for i, n in enumerate(lens) if n == 1]
    meta = StateMetadata(
        attn=None,
        slots=slots,
        query_lens=lens,
        fresh=fresh,
        decodes=torch.tensor(dec),
        decode_rows=torch.tensor(starts[dec]),
        reset=slots[[i for i in dec if fresh[i]]],
        decode_fresh=torch.tensor([fresh[i] for i in dec], dtype=torch.int64),
    )
    x = torch.randn(sum(lens), 32, generator=g).to(dtype)
    # (float32: the scan's sums in another order than the chunked form's, over 70 tokens)
    _paths_agree(layers, pools, x, meta, dtype, float32_tol=1e-4, saturated=saturated)


def _step_meta(lens: list[int], fresh: list[bool], slots: torch.Tensor) -> StateMetadata:
    """A step's metadata: requests of `lens` tokens (1: a decode) at `slots`."""
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    dec = [i for i, n in enumerate(lens) if n == 1]
    return StateMetadata(
        attn=None,
        slots=slots,
        query_lens=lens,
        fresh=fresh,
        decodes=torch.tensor(dec, dtype=torch.int64),
        decode_rows=torch.tensor(starts[dec], dtype=torch.int64),
        reset=slots[[i for i in dec if fresh[i]]] if any(fresh[i] for i in dec) else None,
        decode_fresh=torch.tensor([fresh[i] for i in dec], dtype=torch.int64),
    )


def _mamba1_layers(dtype, norms, bias, seed=2):
    """A Mamba-1 layer (40 channels: two full blocks of 16 and a partial one) on PyTorch's ops and the
    same weights on mamba1.c's kernels."""
    g = torch.Generator().manual_seed(seed)
    cfg = Mamba1Config(40, 8, 6, 4, conv_bias=bias, proj_bias=bias, bcdt_norms=norms)
    layers = [Mamba1Mixer(cfg, 32, fused) for fused in (False, True)]
    for p in layers[0].parameters():  # (without norms, bigger weights give states in the hundreds)
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.25)
    layers[1].load_state_dict(layers[0].state_dict())
    return [layer.to(dtype) for layer in layers], g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norms, bias", [(None, True), (WEIGHTED, False), (PLAIN, True)])
@pytest.mark.parametrize("saturated", [False, True])
def test_mamba1_layer(dtype, norms, bias, saturated):
    """mamba1.c's convolution and scan (`Mamba1Mixer._fused`) equal the layer's PyTorch ops, outputs and
    states, on a step of decodes (one starting here) and prompt chunks (one starting here, one shorter
    than the convolution's window), at scattered slots of the pools; Mamba's, Jamba's and
    FalconMamba's norms."""
    layers, g = _mamba1_layers(dtype, norms, bias)
    lens, fresh = [1, 7, 1, 2, 30, 1], [False, True, True, False, False, False]
    meta = _step_meta(lens, fresh, torch.tensor([7, 0, 3, 5, 8, 2]))
    pools = [(torch.randn(9, 40, 3, generator=g).to(dtype), torch.randn(9, 40, 8, generator=g) * 0.3)]
    pools.append(tuple(t.clone() for t in pools[0]))
    x = torch.randn(sum(lens), 32, generator=g).to(dtype)
    _paths_agree(layers, pools, x, meta, dtype, saturated=saturated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba1_kernels_give_one_answer_however_a_prompt_is_cut(dtype):
    """The same prompt through mamba1.c whole, in chunks (one shorter than the convolution's window)
    and token by token as decodes, beside other requests: the same outputs and states to the bit, the
    prefix cache's checkpoints at any token (the projections between the kernels are the caller's:
    fixed inputs here)."""
    g = torch.Generator().manual_seed(3)
    D, N, K, L = 40, 8, 4, 29
    xz = torch.randn(L, 2 * D, generator=g).to(dtype)
    dt = (torch.randn(L, D, generator=g) - 1).to(dtype)
    bc = torch.randn(L, 2 * N, generator=g)
    conv_w, conv_b = torch.randn(D, K, generator=g), torch.randn(D, generator=g)
    A, Dskip = -torch.rand(D, N, generator=g) * 2, torch.randn(D, generator=g)

    def run(cuts: list[int]) -> tuple[torch.Tensor, ...]:
        pools = torch.zeros(3, D, K - 1, dtype=dtype), torch.zeros(3, D, N)
        outs, start = [], 0
        for i, n in enumerate(cuts):
            other = torch.randn(3, 2 * D, generator=g).to(dtype)  # another request's 3 rows, slot 0
            rows = torch.cat([other, xz[start : start + n]]).contiguous()
            step = kernels.StepRequests.of([3, n], torch.tensor([0, 2]), [True, i == 0])
            mixed = kernels.causal_conv(rows, step, pools[0], conv_w, conv_b)
            mine = slice(3, 3 + n)
            rows_dt = torch.cat([torch.zeros(3, D, dtype=dtype), dt[start : start + n]])
            rows_bc = torch.cat([torch.zeros(3, 2 * N), bc[start : start + n]])
            out = kernels.mamba1_scan(rows, mixed, rows_dt, rows_bc, step, pools[1], A, Dskip)
            outs.append((mixed[mine], out[mine]))
            start += n
        mixed, out = (torch.cat(t) for t in zip(*outs))
        return mixed, out, pools[0][2], pools[1][2]

    whole = run([L])
    for cuts in ([2, 16, 11], [1] * L):
        for a, b in zip(whole, run(cuts)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("saturated", [False, True])
def test_kda_layer(dtype, saturated):
    """kda.c's rule after mamba1.c's convolution (`KimiDeltaAttention._fused`) equals the layer's
    PyTorch ops, outputs and states, on a step of decodes (one starting here) and prompt chunks (one
    starting here, one past a 32-token chunk of the PyTorch rule), at scattered slots of the pools."""
    g = torch.Generator().manual_seed(4)
    layers = [KimiDeltaAttention(KdaConfig(3, 16, 4), 32, 1e-5, fused) for fused in (False, True)]
    for p in layers[0].parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)
    layers[1].load_state_dict(layers[0].state_dict())
    layers = [layer.to(dtype) for layer in layers]
    lens, fresh = [1, 7, 1, 2, 40, 1], [False, True, True, False, False, False]
    meta = _step_meta(lens, fresh, torch.tensor([7, 0, 3, 5, 8, 2]))
    pools = [(torch.randn(9, 144, 3, generator=g).to(dtype), torch.randn(9, 3, 16, 16, generator=g) * 0.3)]
    pools.append(tuple(t.clone() for t in pools[0]))
    x = torch.randn(sum(lens), 32, generator=g).to(dtype)
    # (float32: the recurrence token by token against the PyTorch path's chunked form)
    _paths_agree(layers, pools, x, meta, dtype, float32_tol=1e-4, saturated=saturated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_rule_gives_one_answer_however_a_prompt_is_cut(dtype):
    """The same prompt through kda.c whole, in chunks and token by token as decodes, beside another
    request: the same outputs and state to the bit."""
    g = torch.Generator().manual_seed(5)
    H, K, L = 2, 16, 37
    rows = [torch.randn(L, n, generator=g).to(dtype) for n in (3 * H * K, H * K, H, H * K)]
    weights = (-torch.rand(H, generator=g), torch.randn(H * K, generator=g), torch.randn(K, generator=g))

    def run(cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pool, outs, start = torch.zeros(3, H, K, K), [], 0
        for i, n in enumerate(cuts):
            step = kernels.StepRequests.of([2, n], torch.tensor([0, 2]), [True, i == 0])
            ins = [
                torch.cat([torch.randn(2, t.shape[1], generator=g).to(dtype), t[start : start + n]])
                for t in rows
            ]
            mixed, f, b, gate = ins
            outs.append(kernels.kda_rule(mixed, f, b, gate, step, pool, weights, 1e-5)[2:])
            start += n
        return torch.cat(outs), pool[2]

    whole = run([L])
    for cuts in ([3, 30, 4], [1] * L):
        for a, b in zip(whole, run(cuts)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_gated_deltanet_prompt_chunk(length):
    """delta.c's chunked rule equals the PyTorch one (`chunked_rule`), chunk ends and a partial
    chunk included, from a state that is not zero."""
    g = torch.Generator().manual_seed(length)
    H, K, V = 3, 16, 8
    q, k = (l2norm(torch.randn(length, H, K, generator=g)) for _ in range(2))
    v = torch.randn(length, H, V, generator=g)
    decay = -torch.rand(length, H, generator=g) * 0.5
    beta = torch.rand(length, H, generator=g)
    s0 = torch.randn(H, K, V, generator=g)
    ref, ref_state = chunked_rule(q, k, v, decay, beta, s0.clone(), chunk=16)
    out, state = kernels.gdn_prefill(q, k, v, decay, beta, s0, 16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("D", [48, 512, 1536, 300_000])
def test_rms_norm_is_the_modules_within_its_last_bit(D):
    """mla.c's RMSNorm sums the squares in a fixed order of its own: the module's values within one bf16
    step, for rows shorter than its partial sums and far longer; the MLA layer takes this norm on every
    step where mla.c may run (`MLAttention._norms_in_c`). A row's output does not depend on the rows
    beside it."""
    g = torch.Generator().manual_seed(D)
    norm = RMSNorm(D, 1e-6)
    norm.weight.data = (1 + 0.3 * torch.randn(D, generator=g)).bfloat16()
    x = (torch.randn(64, D, generator=g) * torch.rand(64, 1, generator=g) * 40).bfloat16()
    got = kernels.rms_norm(x, norm.scale(), norm.eps)
    torch.testing.assert_close(got, norm(x), rtol=2**-6, atol=0.0)  # (one bf16 step)
    assert all(
        torch.equal(kernels.rms_norm(x[i : i + 1], norm.scale(), norm.eps)[0], got[i]) for i in range(64)
    )


def _mla_layer(q_lora: int | None, interleave: bool, dtype: torch.dtype) -> MLAttention:
    """A small MLA layer with random weights, W_UK and W_UV packed for bf16gemm.c where it runs."""
    g = torch.Generator().manual_seed(1)
    cfg = MLAConfig(64, 16, 32, 32, q_lora_rank=q_lora, rope_interleave=interleave)
    backend = TorchAttention(Kernels(fused=True), (4, 1, cfg.cache_row))
    layer = MLAttention(cfg, 64, 4, 1e-6, False, 0.2, backend)
    for name, p in layer.named_parameters():
        if "layernorm" in name:
            p.data.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif "kv_b" not in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    layer.to(dtype)
    kv_b = layer.kv_b_proj
    kv_b.pack = kernels.bf16gemm_supported()
    kv_b.load(kv_b.weight, torch.randn(4 * (16 + 32), 64, generator=g).to(dtype))
    return layer


@pytest.mark.parametrize("q_lora, interleave", [(48, True), (None, False)])
def test_latent_attention_decodes_give_the_pytorch_ops_bits(q_lora, interleave):
    """mla.c's decodes (`MLAttention` with bf16 W_UK, W_UV packed, a step of decodes only) equal the
    layer's PyTorch ops to the bit: output and cache rows, five requests of different lengths (a first
    token, block edges, several blocks) in scattered blocks. A float32 layer (nothing packed) and a
    step with a prompt chunk keep the PyTorch path."""
    if not kernels.bf16gemm_supported():
        pytest.skip("bf16gemm.c is not built here: W_UK and W_UV are never packed")
    g = torch.Generator().manual_seed(2)
    layer = _mla_layer(q_lora, interleave, torch.bfloat16)
    assert layer.kv_b_proj.packed is not None
    bs, ctx = 16, np.array([1, 17, 40, 16, 70])
    tables = np.full((5, 5), 0, dtype=np.int64)
    free = list(np.random.default_rng(0).permutation(np.arange(1, 30)))
    for b, n in enumerate(ctx):
        tables[b, : (n + bs - 1) // bs] = [free.pop() for _ in range((n + bs - 1) // bs)]
    slots = np.array([tables[b, (n - 1) // bs] * bs + (n - 1) % bs for b, n in enumerate(ctx)])
    layout = StepLayout(np.ones(5, dtype=np.int64), ctx, tables, slots, bs)
    meta = layer.backend.prepare(layout, torch.device("cpu"))
    assert meta.paged is not None and meta.paged.decodes_only
    cache = torch.randn(30 * bs, 1, layer.mla.cache_row, generator=g).bfloat16()
    x = torch.randn(5, 64, generator=g).bfloat16()
    rope = (torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g))
    assert layer._decodes_in_c((cache,), meta) is meta.paged
    caches = [cache.clone(), cache.clone()]
    got = layer(x, rope, (caches[0], caches[0]), meta)
    layer._decodes_in_c = lambda kv_cache, meta: None  # type: ignore[method-assign]
    want = layer(x, rope, (caches[1], caches[1]), meta)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[1])
    assert not torch.equal(caches[0], cache)  # (the rows were written)
    del layer._decodes_in_c
    chunk = np.concatenate([slots[:4], slots[4] - [2, 1, 0]])  # the last request's last 3 tokens
    mixed = layer.backend.prepare(
        StepLayout(np.array([1, 1, 1, 1, 3]), ctx, tables, chunk, bs), torch.device("cpu")
    )
    assert layer._decodes_in_c((cache,), mixed) is None
    assert _mla_layer(q_lora, interleave, torch.float32)._decodes_in_c((cache.float(),), meta) is None
