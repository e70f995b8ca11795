"""`--kv-cache-dtype int8` under the real engine: the output follows the float cache's, stays the same
batched or alone and from the prefix cache (a row's bits depend on its token alone), holds about
twice the tokens in the same bytes, and the settings it cannot serve are refused."""

from __future__ import annotations

import pytest

from pytgi.core.config import EngineConfig
from pytgi.core.errors import ConfigError
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine
from tests.model.tiny_llama import tiny_llama

PROMPTS = [[(i * k) % 120 + 3 for i in range(n)] for k, n in ((37, 40), (11, 9), (53, 70), (7, 23))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"), max_positions=256)


@pytest.fixture(scope="module")
def tiny_gemma4(tmp_path_factory):
    """test_tiny_models' Gemma 4: int8 rows of two head sizes, two layers reading others' caches."""
    from tests.model.test_tiny_models import save_tiny_gemma4

    return save_tiny_gemma4(tmp_path_factory.mktemp("gemma4"))


def engine_for(model, **kw) -> LLMEngine:
    kw = {"max_batch_total_tokens": 1024, "block_size": 4, "progress": False, "dtype": "float32", **kw}
    return LLMEngine(EngineConfig(model=str(model), **kw))


def run(engine: LLMEngine, prompts: list[list[int]], n: int = 8) -> list[list[tuple[int, float]]]:
    """Greedy (token, logprob) pairs of each prompt, all submitted at once."""
    out: dict[str, list[tuple[int, float]]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=n, temperature=0))
        out[f"r{i}"] = []
    while engine.has_unfinished():
        for u in engine.step():
            out[u.request_id].append((u.token_id, u.logprob))
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_int8_output_follows_the_float_caches(tiny):
    ref = engine_for(tiny)
    want = run(ref, PROMPTS)
    ref.shutdown()
    int8 = engine_for(tiny, kv_cache_dtype="int8")
    got = run(int8, PROMPTS)
    int8.shutdown()
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in want]
    gap = max(abs(a[1] - b[1]) for r, s in zip(got, want) for a, b in zip(r, s))
    assert gap < 0.02, gap


def test_gemma4_int8_caches_of_two_head_sizes_follow_the_float_ones(tiny_gemma4):
    """Gemma 4's int8 rows of 16 and 32 values, its last layers reading others' caches: the logprobs
    follow the float caches' until a near tie parts the greedy tokens (its normed q and k, unscaled,
    make attention peaked: bf16 activations alone move them by up to 0.14)."""
    ref = engine_for(tiny_gemma4)
    want = run(ref, PROMPTS)
    ref.shutdown()
    int8 = engine_for(tiny_gemma4, kv_cache_dtype="int8")
    got = run(int8, PROMPTS)
    int8.shutdown()
    same = 0
    for r, s in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(r, s)) if a[0] != b[0]), len(r))
        same += n
        assert all(abs(a[1] - b[1]) < 0.1 for a, b in zip(r[: n + 1], s[: n + 1])), (r, s)
    assert same >= 16  # of 32 tokens


def test_int8_batched_equals_alone_and_a_prefix_hit_equals_a_cold_run(tiny):
    """In bf16, where the CPU's steps are batch invariant (float32's matmuls are not)."""
    int8 = engine_for(tiny, kv_cache_dtype="int8", dtype="bfloat16")
    together = run(int8, PROMPTS)
    alone = [run(int8, [p])[0] for p in PROMPTS]  # the prompts' blocks are cached by now
    int8.shutdown()
    assert alone == together
    cold = engine_for(tiny, kv_cache_dtype="int8", dtype="bfloat16", enable_prefix_caching=False)
    assert run(cold, PROMPTS) == together
    cold.shutdown()


def test_int8_holds_twice_the_tokens_in_the_same_bytes(tiny):
    sizes = {}
    for kv in ("auto", "int8"):
        engine = engine_for(
            tiny, dtype="bfloat16", kv_cache_dtype=kv, max_batch_total_tokens=None, kv_cache_cpu_bytes=2**20
        )
        sizes[kv] = engine.info.max_batch_total_tokens
        engine.shutdown()
    D = 8  # the tiny model's head size: a row is 2 D bytes in bf16, D + 2 in int8
    assert sizes["int8"] == pytest.approx(sizes["auto"] * 2 * D / (D + 2), abs=4)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"kv_cache_dtype": "bf16"}, "--dtype bfloat16"),  # the model runs in float32 here
        ({"kv_cache_dtype": "int9"}, "kv_cache_dtype must be one of"),
    ],
)
def test_what_a_kv_dtype_cannot_serve_is_refused(tiny, kw, says):
    with pytest.raises(ConfigError, match=says):
        engine_for(tiny, **kw)


def test_int8_is_refused_without_the_c_kernels(tiny, monkeypatch):
    from pytgi.engine import kernels

    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(ConfigError, match="C kernels"):
        engine_for(tiny, kv_cache_dtype="int8")


def test_int8_blocks_go_to_disk_and_come_back(tiny, tmp_path):
    """The disk tier copies an int8 pool's rows (values and scales) as they are: after a restart the
    prefix comes from disk, its restored bits equal a recomputation's, and the output is the same."""
    kw = {"kv_cache_dtype": "int8", "dtype": "bfloat16", "prefix_cache_dir": str(tmp_path)}
    first = engine_for(tiny, **kw)
    want = run(first, PROMPTS[:1])
    first.shutdown()
    second = engine_for(tiny, **kw, prefix_cache_verify_rate=1.0)
    assert run(second, PROMPTS[:1]) == want
    stats = second.disk.stats
    second.shutdown()
    assert stats.read_blocks > 0 and stats.verified_blocks == 1 and stats.verify_mismatches == 0
    assert stats.dropped_files == 0
