"""Memory sizing without a model: the KV cache's share of what is left after the weights, split over
the engines of a machine and capped by what the batch can use; a model that does not fit refused with
the numbers."""

from __future__ import annotations

import pytest
import torch

from pytgi.core.config import EngineConfig
from pytgi.core.errors import ModelTooLarge
from pytgi.engine.kv import sizing as kv_sizing

CPU = torch.device("cpu")
GIB = 1 << 30


@pytest.fixture
def available(monkeypatch):
    def set_to(n: int) -> None:
        monkeypatch.setattr(kv_sizing, "available_memory_bytes", lambda: n)

    return set_to


def test_the_kv_cache_takes_a_share_of_what_is_left(available):
    available(16 * GIB)
    per_token = 1 << 20
    assert kv_sizing.kv_capacity_tokens(CPU, per_token, None) == 4 * 1024  # 0.25 by default on CPU
    assert kv_sizing.kv_capacity_tokens(CPU, per_token, 0.5) == 8 * 1024
    assert kv_sizing.kv_capacity_tokens(CPU, per_token, 0.5, engines=4) == 2 * 1024  # ranks, replicas
    assert kv_sizing.kv_capacity_tokens(CPU, per_token, 0.5, cap_bytes=GIB) == 1024
    available(0)
    assert kv_sizing.kv_capacity_tokens(CPU, per_token, 0.5) == 0


def test_ranks_started_elsewhere_share_only_their_machine(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert kv_sizing.local_engines(4) == 4
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert kv_sizing.local_engines(4) == 2


def test_a_model_that_does_not_fit_is_refused_with_the_numbers(available):
    available(8 * GIB)
    kv_sizing.check_fits(6 * GIB, CPU, "the model (m.gguf)")  # 6 + 1.5 GiB fit in 8
    with pytest.raises(ModelTooLarge) as err:
        kv_sizing.check_fits(7 * GIB, CPU, "the model (m.gguf)")
    assert str(err.value).startswith(
        "the model (m.gguf) does not fit: it needs about 7.0 GiB for its weights "
        "and 1.5 GiB for the runtime, 8.5 GiB in all, and this machine has 8.0 GiB"
    )


def test_sized_from_memory_up_to_what_the_batch_can_use():
    def resolve(cfg: EngineConfig, capacity: int):
        return cfg.resolve(
            model_id="m",
            model_path="",
            dtype="bfloat16",
            device_type="cpu",
            vocab_size=10,
            max_positions=4096,
            kv_capacity=lambda: capacity,
        )

    info = resolve(EngineConfig(max_batch_size=4, max_total_tokens=1024), 10**9)
    assert info.max_batch_total_tokens == 4 * 1024
    assert resolve(EngineConfig(max_total_tokens=1024), 8192).max_batch_total_tokens == 8192
    assert (
        resolve(EngineConfig(max_batch_total_tokens=100_000, max_total_tokens=1024), 0).max_batch_total_tokens
        == 100_000
    )  # as asked
    # no max_total_tokens: the model's positions, as many as the KV cache holds
    small = resolve(EngineConfig(), 1000)
    assert (small.max_total_tokens, small.max_input_tokens, small.max_batch_total_tokens) == (992, 991, 992)
    assert resolve(EngineConfig(), 10**9).max_total_tokens == 4096
    with pytest.raises(ValueError, match="the KV cache holds 0 tokens: too little memory"):
        resolve(EngineConfig(), 0)
    with pytest.raises(ValueError, match="fewer than max_total_tokens"):
        resolve(EngineConfig(max_total_tokens=2048), 1000)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=1.5).validate()
