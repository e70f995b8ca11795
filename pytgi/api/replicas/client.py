"""The API process's handle on N engine replicas deployed with Ray Serve (`pytgi serve --replicas N`):
what `EngineClient` is for one engine process, for a deployment of them.

`start` joins a Ray cluster (`--ray-address`) or starts one on this machine, deploys `EngineReplica`
with pytgi's request router (`PrefixAffinityRouter`) and Ray Serve's autoscaler bounds, and waits
for a replica's engine. Each `submit` streams the request from the replica the router picks;
the first message names it (`routed`: the `x-pytgi-replica` header). A replica that dies fails only
its own requests, with an error that names it; Ray Serve starts another, and the router sends new
requests to the live ones meanwhile. No torch here, as in the rest of the API process.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from pytgi.core import protocol as P
from pytgi.core.adapters import AdapterError
from pytgi.core.config import EngineConfig
from pytgi.core.cpus import engine_threads
from pytgi.core.errors import EngineDead
from pytgi.core.sampling_params import SamplingParams

log = logging.getLogger("pytgi.api.replicas")
APP = "pytgi"


@dataclass
class ReplicaNote:
    """One HTTP exchange's replicas, for its `x-pytgi-replica` header (`ReplicaHeaderMiddleware`)."""

    replicas: list[str] = field(default_factory=list)
    pending: int = 0  # requests submitted whose replica is not known yet
    known: asyncio.Event = field(default_factory=asyncio.Event)

    def expect(self) -> None:
        self.pending += 1
        self.known.clear()

    def settle(self, replica: str | None) -> None:
        if replica is not None and replica not in self.replicas:
            self.replicas.append(replica)
        self.pending = max(self.pending - 1, 0)
        if not self.pending:
            self.known.set()


_ready = msgspec.msgpack.Decoder(P.Ready)
NOTE: contextvars.ContextVar[ReplicaNote | None] = contextvars.ContextVar("pytgi_replica_note", default=None)


@dataclass(frozen=True)
class ReplicaOptions:
    replicas: int
    min_replicas: int | None = None
    max_replicas: int | None = None
    ray_address: str | None = None
    policy: str = "prefix"
    target_ongoing_requests: float = 8.0  # the autoscaler's aim, requests in flight a replica
    max_ongoing_requests: int = 256


def deployment_options(o: ReplicaOptions, config: EngineConfig) -> dict[str, Any]:
    """The engine deployment's Ray Serve options: a fixed number of replicas, or the autoscaler's
    bounds (starting from `replicas`, scaling on requests in flight per replica); pytgi's router."""
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from pytgi.api.replicas.router import PrefixAffinityRouter

    lo, hi = o.min_replicas, o.max_replicas
    scaling: dict[str, Any] = {"num_replicas": o.replicas}
    if lo is not None or hi is not None:
        scaling = {
            "autoscaling_config": AutoscalingConfig(
                min_replicas=lo if lo is not None else 1,
                max_replicas=hi if hi is not None else max(o.replicas, lo or 1),
                initial_replicas=o.replicas,
                target_ongoing_requests=o.target_ongoing_requests,
            )
        }
    router: dict[str, Any] = {
        "request_router_class": PrefixAffinityRouter,
        "request_router_kwargs": {
            "policy": o.policy,
            "block_size": config.block_size,
            # what the router remembers of a replica's cache: about what its KV cache holds
            "capacity": (config.max_batch_total_tokens or 1 << 20) // config.block_size,
        },
        "request_routing_stats_period_s": 1.0,  # the replicas' numbers, each second
    }
    return {
        "name": "engine",
        "max_ongoing_requests": o.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": 0},  # the engines share the cores as the OS sees fit
        "health_check_period_s": 1.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 5.0,
        "logging_config": {"enable_access_log": False},  # a line per request: pytgi logs its own
        "request_router_config": RequestRouterConfig(**router),
        **scaling,
    }


def _has_ray_token() -> bool:
    """Whether Ray's token (token authentication, on by default since Ray 2.5x) is at hand."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return "RAY_AUTH_TOKEN" in os.environ or os.path.isfile(path)


class ReplicaClient:
    """`EngineClient`'s interface over a Ray Serve deployment of engine replicas."""

    def __init__(
        self, config: EngineConfig, options: ReplicaOptions, engine_module: str = "pytgi.engine.process"
    ):
        self.config, self.options, self.engine_module = config, options, engine_module
        self.info: P.EngineInfo | None = None
        self.adapters = P.AdapterSnapshot(-1)  # every replica's, as at start (no run-time loads here)
        self.stats: P.EngineStats | None = None
        self.healthy = False
        self.dead_reason: str | None = None
        self.on_step: Callable[[P.StepOut], None] | None = None  # not fed: steps stay in the replicas
        self.on_stats: Callable[[P.EngineStats], None] | None = None
        self.on_death: Callable[[str], None] | None = None
        self.proc = None
        self._handle: Any = None
        self._pumps: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._started_ray = False

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self, timeout: float = 900.0) -> P.EngineInfo:
        await asyncio.to_thread(self._deploy)
        deadline = time.monotonic() + timeout
        while True:
            try:
                raw = await asyncio.wait_for(self._handle.engine_info.remote(), 30)
                break
            except Exception as exc:  # noqa: BLE001 - retried until the deadline
                if time.monotonic() > deadline:
                    raise EngineDead(f"no engine replica started within {timeout:.0f}s: {exc}") from None
                await asyncio.sleep(1.0)
        ready = _ready.decode(raw)
        self.info, self.adapters = ready.info, ready.adapters
        self.healthy = True
        self._tasks = [asyncio.create_task(self._poll_stats())]
        return self.info

    def _deploy(self) -> None:
        o = self.options
        # Ray's C++ failure handler would catch SIGTERM and abort (exit -6) mid graceful shutdown
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        if o.ray_address and "RAY_AUTH_MODE" not in os.environ and _has_ray_token():
            # a cluster `ray start` made asks for its token (Ray reads this when it is imported)
            os.environ["RAY_AUTH_MODE"] = "token"
        import ray
        from ray import serve
        from ray.serve.config import HTTPOptions, ProxyLocation

        from pytgi.api.replicas.deployment import EngineReplica

        if not ray.is_initialized():
            if o.ray_address is None:  # a cluster of this machine, for this server
                ray.init(address="local", namespace="pytgi", include_dashboard=False)
                self._started_ray = True
            else:
                ray.init(address=o.ray_address, namespace="pytgi")
        serve.start(http_options=HTTPOptions(location=ProxyLocation.Disabled))
        deployment = serve.deployment(EngineReplica).options(  # type: ignore[attr-defined]
            **deployment_options(o, self.config)
        )
        # on a cluster started here, the replicas share this machine's cores and memory
        threads = engine_threads(self.config.threads, max(o.replicas, 1)) if self._started_ray else None
        config = asdict(self.config)
        if self._started_ray:
            config["local_replicas"] = max(o.replicas, o.max_replicas or 0, 1)
        app = deployment.bind(config, self.engine_module, threads)
        self._handle = serve.run(app, name=APP, route_prefix=None, blocking=False)

    async def stop(self, timeout: float = 5.0) -> None:
        for task in [*self._tasks, *self._pumps.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._pumps.values(), return_exceptions=True)
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            if self._started_ray:
                serve.shutdown()
                ray.shutdown()
            else:  # a cluster we joined: take our application off it
                serve.delete(APP)
        except Exception:
            log.exception("stopping the replicas")

    # -- requests --------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        images: list[bytes] | None = None,
        cache_key: str | None = None,
        pool: P.PoolParams | None = None,
    ) -> asyncio.Queue:
        if not self.healthy:
            raise EngineDead(self.dead_reason or "the replicas are not running")
        submit = P.Submit(request_id, prompt_ids, params, images or [], cache_key, pool)
        payload = P.encoder.encode(submit)
        queue: asyncio.Queue = asyncio.Queue()
        note = NOTE.get()
        if note is not None:
            note.expect()
        self._pumps[request_id] = asyncio.ensure_future(self._pump(request_id, payload, queue, note))
        return queue

    async def _pump(self, rid: str, payload: bytes, queue: asyncio.Queue, note: ReplicaNote | None) -> None:
        from pytgi.api.replicas.deployment import Failed, Routed, decoder

        replica: str | None = None
        stream = self._handle.options(stream=True).generate.remote(payload)
        try:
            async for raw in stream:
                msg = decoder.decode(raw)
                if isinstance(msg, Routed):
                    replica = msg.replica
                    if note is not None:
                        note.settle(replica)
                        note = None
                elif isinstance(msg, Failed):
                    queue.put_nowait(EngineDead(msg.error))
                    return
                else:
                    queue.put_nowait(msg.out)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - the replica died, or Ray could not reach it
            where = f"replica {replica}" if replica else "the replicas"
            log.warning("request %s: %s failed: %s", rid, where, exc)
            queue.put_nowait(EngineDead(f"{where} failed ({type(exc).__name__}); retry the request"))
        finally:
            if note is not None:
                note.settle(None)
            self._pumps.pop(rid, None)

    async def adapter(self, name: str, source: str | None) -> None:
        raise AdapterError(
            "loading LoRA adapters at run time is not supported with --replicas (use --lora-adapters)"
        )

    def abort(self, request_id: str) -> None:
        task = self._pumps.pop(request_id, None)
        if task is not None:
            task.cancel()

    def release(self, request_id: str) -> None:
        self._pumps.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._pumps)

    # -- stats -----------------------------------------------------------------------------------
    def replica_stats(self) -> dict[str, dict[str, Any]]:
        from pytgi.api.replicas.affinity import ROUTERS

        out: dict[str, dict[str, Any]] = {}
        for router in ROUTERS:
            out.update(router.replica_stats())
        return out

    async def _poll_stats(self) -> None:
        """The replicas' numbers summed (KV use: their mean) as one engine's, for /metrics; /health
        fails while every replica that reports says its engine is gone."""
        while True:
            await asyncio.sleep(1.0)
            reported = self.replica_stats()
            if reported:
                self.healthy = any(s.get("healthy", True) for s in reported.values())
            stats = [s for s in reported.values() if "running" in s]
            if not stats:
                continue
            total = P.EngineStats(
                running=sum(s["running"] for s in stats),
                waiting=sum(s["waiting"] for s in stats),
                kv_cache_usage=sum(s["kv_cache_usage"] for s in stats) / len(stats),
                prefix_cache_hit_rate=sum(s["prefix_cache_hit_rate"] for s in stats) / len(stats),
                preemptions=sum(s["preemptions"] for s in stats),
                failed_steps=sum(s["failed_steps"] for s in stats),
                spec_drafted=sum(s.get("spec_drafted", 0) for s in stats),
                spec_accepted=sum(s.get("spec_accepted", 0) for s in stats),
                waiting_adapters=sorted({a for s in stats for a in s.get("waiting_adapters", ())}),
                pinned_blocks=sum(s.get("pinned_blocks", 0) for s in stats),
                state_checkpoints=sum(s.get("state_checkpoints", 0) for s in stats),
            )
            self.stats = total
            if self.on_stats is not None:
                self.on_stats(total)
