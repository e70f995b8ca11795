"""pytgi's Ray Serve request router: `Affinity`'s policy (`pytgi.api.replicas.affinity`) over the engine
replicas. It runs in the API process, inside the deployment handle the `ReplicaClient` calls, so it
sees each request's prompt ids before the request leaves the process, and counts what it sent to
each replica and what came back (its loads). The replicas' own numbers (`record_routing_stats`:
running, waiting, KV use) reach it too, for the API process's metrics."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from pytgi.api.replicas import affinity


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.affinity = affinity.Affinity(
            kwargs.get("policy", "prefix"),
            kwargs.get("block_size", 16),
            kwargs.get("capacity", 1 << 16),
            kwargs.get("max_imbalance", 4),
        )
        self.loads: dict[str, int] = {}
        self._chains: dict[str, list[int]] = {}  # internal request id → its chain, until routed
        affinity.ROUTERS.append(self)

    def _chain(self, pr: PendingRequest) -> list[int]:
        key = pr.metadata.internal_request_id
        chain = self._chains.get(key)
        if chain is None:
            if len(self._chains) > 10_000:  # requests cancelled before they were routed
                self._chains.clear()
            chain = []
            if pr.args and isinstance(pr.args[0], bytes):
                chain = affinity.submit_chain(pr.args[0], self.affinity.block_size)
            self._chains[key] = chain
        return chain

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        chain = self._chain(pending_request) if pending_request is not None else []
        ranks = self.affinity.rank(list(by_id), self.loads, chain)
        return [[by_id[r] for r in rank] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        rid = replica_id.unique_id
        self.loads[rid] = self.loads.get(rid, 0) + 1
        chain = self._chains.pop(pending_request.metadata.internal_request_id, None)
        if chain:
            self.affinity.routed(rid, chain)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        if self.loads.get(rid, 0) > 0:
            self.loads[rid] -= 1
        self._chains.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.index.drop(replica_id.unique_id)
        self.loads.pop(replica_id.unique_id, None)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """What each live replica said of itself last (`EngineReplica.record_routing_stats`)."""
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in self.curr_replicas.items()}
