"""The LoRA adapters an engine serves: the one owner of their state.

The registry knows which adapters are served (name → directory), which are on their way out, and each
one's prefix-cache root (its name and its files' stamp, so that a name loaded again with other
weights never finds the old weights' blocks, in this process or, on disk, the next). It is the only
code that puts adapter weights in memory: a request names an adapter and is checked here; the
weights it needs are made resident just before a step that runs it (`prepare`), never as a side
effect of adding the request.

The API process never keeps adapter state of its own: it reads the last `AdapterSnapshot` the engine
published (at start, and after every change).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from pytgi.core.adapters import AdapterError, check_name
from pytgi.core.errors import InvalidRequest
from pytgi.core.model_files import resolve_adapter
from pytgi.core.paths import files_stamp
from pytgi.core.protocol import AdapterSnapshot

if TYPE_CHECKING:
    from pytgi.engine.execution.runner import ModelRunner


def _none_in_use() -> Collection[str | None]:
    return ()


class AdapterRegistry:
    """`in_use`: the adapters its engine's requests name now (never evicted nor removed under them)."""

    def __init__(
        self,
        runner: ModelRunner,
        served: dict[str, str],
        base_name: str,
        progress: bool,
        in_use: Callable[[], Collection[str | None]] = _none_in_use,
    ) -> None:
        self.runner, self.base_name, self.progress, self.in_use = runner, base_name, progress, in_use
        self.served = dict(served)
        self.roots = {name: _root(name, path) for name, path in served.items()}
        self.unloading: set[str] = set()  # refused to new requests, removed once none runs
        self.version = 0  # bumped at every change: the snapshot's number

    def snapshot(self) -> AdapterSnapshot:
        return AdapterSnapshot(self.version, dict(self.served), sorted(self.unloading))

    # -- requests ---------------------------------------------------------------------------------
    def check(self, name: str) -> None:
        """A new request may name `name` (`InvalidRequest` if not)."""
        if name not in self.served:
            raise InvalidRequest(f"unknown LoRA adapter {name!r}", "adapter_id")
        if name in self.unloading:
            raise InvalidRequest(f"LoRA adapter {name!r} is being unloaded", "adapter_id")

    def cache_root(self, name: str) -> tuple[str, str]:
        return self.roots[name]

    def prepare(self, needed: Collection[str | None]) -> None:
        """Before a step: the weights of every adapter in `needed` in memory (loaded back if they were
        evicted; the adapters in use are never evicted for it), and the other ranks told once."""
        names = [n for n in dict.fromkeys(needed) if n is not None]
        if not names:
            return
        in_use = self.in_use()
        lora = self.runner.adapters()
        changed = False
        try:
            for name in names:
                changed |= lora.ensure(name, in_use)
        finally:
            if changed:
                self.runner.adapters_changed()

    # -- at run time --------------------------------------------------------------------------------
    def load(self, name: str, source: str) -> None:
        """Serve the adapter at `source` (a directory or a Hub id) as `name`: its weights are read and
        checked now, so that a bad adapter is refused here and not by a request's step."""
        check_name(name)
        if name in self.served or name == self.base_name:
            raise AdapterError(f"a model or LoRA adapter named {name!r} is already served")
        path = resolve_adapter(source, self.progress)
        try:
            self.runner.adapters().register(name, path, self.in_use())
        finally:
            self.runner.adapters_changed()  # the other ranks wrap their linears even if it failed
        self.roots[name] = _root(name, str(path))
        self.served[name] = str(path)
        self.version += 1

    def unload(self, name: str) -> None:
        """Refuse `name` to new requests from now on; `settle` removes it once no request uses it."""
        if name not in self.served:
            raise AdapterError(f"no LoRA adapter named {name!r} is served")
        if name not in self.unloading:
            self.unloading.add(name)
            self.version += 1

    def settle(self) -> list[str]:
        """Remove the adapters being unloaded that no request uses any more; their names."""
        in_use = self.in_use()
        done = [name for name in sorted(self.unloading) if name not in in_use]
        if not done:
            return []
        lora = self.runner.adapters()
        for name in done:
            lora.remove(name)
            self.unloading.discard(name)
            del self.served[name], self.roots[name]
        self.runner.adapters_changed()
        self.version += 1
        return done


def _root(name: str, path: str) -> tuple[str, str]:
    stamp = repr((path, files_stamp(Path(path)))).encode()
    return (name, hashlib.blake2b(stamp, digest_size=16).hexdigest())
