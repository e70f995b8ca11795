"""Which replica a request goes to: the one most likely to hold the longest cached prefix of its
prompt, unless that one is overloaded, then the least loaded. No Ray here: `pytgi.api.replicas.router`
runs this policy inside Ray Serve's request router, and the unit tests run it alone.

A replica's prefix cache keys full blocks of `block_size` tokens by the chain of their hashes
(`pytgi.engine.kv.blocks`). The router cannot see those caches; it keeps its own picture
(`PrefixIndex`): the block chains of the prompts it sent to each replica, the least recently sent
forgotten first past `capacity` blocks a replica (about what its KV cache holds). A prompt's match on
a replica is how many of its leading blocks that picture holds.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec

from pytgi.core import protocol as P
from pytgi.core.config import REPLICA_ROUTING

POLICIES = REPLICA_ROUTING  # what `--replica-routing` may name
# this process's routers (`pytgi.api.replicas.router`; the client reads their replicas' numbers). Here,
# not in the router's module: Ray Serve pickles that module by value, so its globals are copies.
ROUTERS: list[Any] = []
_submit = msgspec.msgpack.Decoder(P.Submit)


def submit_chain(payload: bytes, block_size: int) -> list[int]:
    """The block chain of a request as the client sends it to a replica (a msgpack `Submit`). With a
    `cache_key` (OpenAI's `prompt_cache_key`) the chain starts with the key's hash: requests that share
    the key match the replica that served it, whatever their prompts (and each other's blocks after).
    """
    sub = _submit.decode(payload)
    images = tuple(hash(i) for i in sub.images)
    chain = block_chain(sub.prompt_ids, block_size, (sub.params.adapter, images, sub.cache_key))
    return chain if sub.cache_key is None else [hash(("pytgi-key", sub.cache_key)), *chain]


def block_chain(prompt_ids: Sequence[int], block_size: int, root: object = None) -> list[int]:
    """The hash of each full block of the prompt, each one chained to the blocks before it (and to
    `root`: what else decides the cache's keys, such as the LoRA adapter)."""
    chain: list[int] = []
    h = hash(("pytgi", root))
    for i in range(0, len(prompt_ids) - block_size + 1, block_size):
        h = hash((h, tuple(prompt_ids[i : i + block_size])))
        chain.append(h)
    return chain


class PrefixIndex:
    """Per replica, the block hashes of the prompts sent to it, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def match(self, replica: str, chain: Sequence[int]) -> int:
        """How many leading blocks of `chain` the replica holds."""
        held = self._blocks.get(replica)
        if not held:
            return 0
        n = 0
        for h in chain:
            if h not in held:
                break
            n += 1
        return n

    def insert(self, replica: str, chain: Sequence[int]) -> None:
        held = self._blocks.setdefault(replica, OrderedDict())
        for h in chain:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def drop(self, replica: str) -> None:
        """A replica that died (its successor starts with an empty cache)."""
        self._blocks.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))


class Affinity:
    """The routing policy. `loads`: the requests each replica has in flight now."""

    def __init__(
        self, policy: str = "prefix", block_size: int = 16, capacity: int = 1 << 16, max_imbalance: int = 4
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown replica routing policy {policy!r} ({' | '.join(POLICIES)})")
        self.policy, self.block_size, self.max_imbalance = policy, block_size, max_imbalance
        self.index = PrefixIndex(capacity)
        self._turn = itertools.count()

    def rank(self, replicas: Sequence[str], loads: dict[str, int], chain: Sequence[int]) -> list[list[str]]:
        """`replicas` in the order to try them, one rank each. Prefix: among the replicas whose load is
        within `max_imbalance` of the least loaded's, the one holding the longest prefix of `chain`;
        when none holds any of it, the one holding the fewest blocks (so that prefixes spread over the
        caches); then the others by load. Round robin: in turn."""
        if not replicas:
            return []
        replicas = sorted(replicas)
        if self.policy == "round-robin":
            k = next(self._turn) % len(replicas)
            return [[r] for r in [*replicas[k:], *replicas[:k]]]
        load = {r: loads.get(r, 0) for r in replicas}
        least = min(load.values())
        usable = [r for r in replicas if load[r] - least < self.max_imbalance]
        match = {r: self.index.match(r, chain) for r in usable}
        if max(match.values()) > 0:  # the longest cached prefix; among equals the lighter
            best = max(usable, key=lambda r: (match[r], -load[r]))
        else:  # a new prefix: where the cache holds least (it spreads prefixes out), then the lighter
            best = min(usable, key=lambda r: (self.index.size(r), load[r]))
        rest = sorted((r for r in replicas if r != best), key=lambda r: load[r])
        return [[best], *([r] for r in rest)]

    def routed(self, replica: str, chain: Sequence[int]) -> None:
        """The request went to `replica`: its prompt's blocks will be cached there."""
        self.index.insert(replica, chain)
