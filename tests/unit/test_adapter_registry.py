"""The engine's LoRA adapter registry (pytgi.engine.adapter_registry) without a model: who may name what,
when weights are loaded, when an unload completes, and the snapshots the API process reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytgi.core import protocol as P
from pytgi.core.adapters import AdapterError
from pytgi.core.errors import InvalidRequest
from pytgi.engine.adapter_registry import AdapterRegistry


class FakeLora:
    def __init__(self) -> None:
        self.slots: list[str] = []
        self.calls: list[tuple[str, str]] = []

    def register(self, name, path, in_use=()):
        self.calls.append(("register", name))
        self.slots.append(name)

    def ensure(self, name, in_use=()):
        self.calls.append(("ensure", name))
        if name in self.slots:
            return False
        self.slots.append(name)
        return True

    def remove(self, name):
        self.calls.append(("remove", name))
        if name in self.slots:
            self.slots.remove(name)


class FakeRunner:
    def __init__(self) -> None:
        self.lora = FakeLora()
        self.broadcasts = 0

    def adapters(self):
        return self.lora

    def adapters_changed(self):
        self.broadcasts += 1


def adapter_dir(tmp_path: Path, name: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    return str(d)


@pytest.fixture
def registry(tmp_path):
    """A registry whose requests name the adapters in `registry.running` (a test's to set)."""
    running: set[str | None] = set()
    registry = AdapterRegistry(
        FakeRunner(), {"a": adapter_dir(tmp_path, "a")}, "base", progress=False, in_use=lambda: running
    )
    registry.running = running  # type: ignore[attr-defined]
    return registry


def test_requests_may_name_served_adapters_only(registry):
    registry.check("a")
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'b'"):
        registry.check("b")
    registry.unload("a")
    with pytest.raises(InvalidRequest, match="is being unloaded"):
        registry.check("a")


def test_prepare_loads_each_needed_adapter_once_and_tells_the_ranks_once(registry, tmp_path):
    registry.load("b", adapter_dir(tmp_path, "b"))
    runner = registry.runner
    runner.lora.slots.clear()  # both evicted
    runner.lora.calls.clear()
    runner.broadcasts = 0
    registry.running.update({"a", "b"})
    registry.prepare(["a", None, "b", "a"])
    assert runner.lora.calls == [("ensure", "a"), ("ensure", "b")]
    assert runner.broadcasts == 1
    registry.prepare(["a"])  # resident already: nothing to tell
    assert runner.broadcasts == 1
    registry.prepare([None, None])
    assert runner.lora.calls[-1] == ("ensure", "a")


def test_a_name_loaded_again_gets_a_new_cache_root(registry, tmp_path):
    first = registry.cache_root("a")
    registry.unload("a")
    assert registry.settle() == ["a"]
    registry.load("a", adapter_dir(tmp_path, "a2"))
    assert registry.cache_root("a") != first
    registry.load("c", adapter_dir(tmp_path, "c"))
    assert len({registry.cache_root("a"), registry.cache_root("c"), first}) == 3


def test_loads_refuse_taken_names_and_unloads_unknown_ones(registry, tmp_path):
    for name in ["a", "base"]:
        with pytest.raises(AdapterError, match="already served"):
            registry.load(name, adapter_dir(tmp_path, f"x{name}"))
    with pytest.raises(AdapterError, match="no LoRA adapter named 'zz'"):
        registry.unload("zz")
    with pytest.raises(AdapterError):
        registry.load("bad name!", adapter_dir(tmp_path, "y"))
    assert registry.version == 0


def test_an_unload_waits_for_its_requests_and_every_change_is_a_new_snapshot(registry):
    v0 = registry.snapshot()
    registry.unload("a")
    v1 = registry.snapshot()
    assert v1.version > v0.version and v1.unloading == ["a"] and v1.names() == {}
    assert "a" in v1.served  # still in memory for its running requests
    registry.running.update({"a", None})
    assert registry.settle() == []
    assert registry.runner.lora.calls == []
    registry.running.discard("a")
    assert registry.settle() == ["a"]
    v2 = registry.snapshot()
    assert v2.version > v1.version and v2.served == {} and v2.unloading == []
    assert registry.runner.lora.calls == [("remove", "a")]


def test_snapshots_cross_the_process_boundary():
    snap = P.AdapterSnapshot(3, {"a": "/x", "b": "/y"}, ["b"])
    got = P.from_engine.decode(P.encoder.encode(snap))
    assert got == snap and got.names() == {"a": "/x"}
    ready = P.from_engine.decode(P.encoder.encode(P.Ready(_info(), snap)))
    assert ready.adapters == snap


def _info() -> P.EngineInfo:
    from pytgi.core.config import EngineConfig

    return EngineConfig(model="m", max_batch_total_tokens=64).resolve(
        model_id="m",
        model_path="/m",
        dtype="float32",
        device_type="cpu",
        vocab_size=10,
        max_positions=32,
        kv_capacity=lambda: 64,
    )
