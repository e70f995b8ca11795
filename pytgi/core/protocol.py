"""Messages between the API process and the engine process (msgspec, no torch).

API → engine: `Submit`, `Abort`, `Shutdown`, `AdapterOp`. Engine → API: `Ready` (or `StartupFailed`)
once, then one `StepOut` per engine step with every request's new token, `Heartbeat`s while idle, and
an `AdapterSnapshot` (then `AdapterDone`) when the LoRA adapters served change.
"""

from __future__ import annotations

from typing import TypedDict

import msgspec

from pytgi.core.config import EngineInfo
from pytgi.core.sampling_params import SamplingParams


class PoolParams(msgspec.Struct, frozen=True):
    """A pooling request's (an embedding model's): what comes back for its prompt."""

    tokens: bool = False  # every token's hidden state (TEI's /embed_all), not the pooled vector
    normalize: bool | None = None  # None: the model's own default (a sentence-transformers Normalize)
    dimensions: int | None = None  # Matryoshka: the first `dimensions` values, normalized after the cut
    pair_at: int | None = None  # a cross-encoder's pair: where its second text's tokens start (segment 1)


class Submit(msgspec.Struct, tag="submit"):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    images: list[bytes] = []  # encoded images for the prompt's image tokens, in order (a vision model's)
    cache_key: str | None = None  # the replica router's (OpenAI's prompt_cache_key); engines ignore it
    pool: PoolParams | None = None  # a pooling model's request (`params` unused)


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class TokenOut(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one step: made by the runner for a sampled token, completed by the
    scheduler, sent as is."""

    request_id: str
    token_id: int = -1  # -1: no token (an error, or prompt logprobs only)
    logprob: float = 0.0
    top: list[tuple[int, float]] = []
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list[float | None] | None = None
    num_cached_tokens: int = 0
    num_skipped: int = 0  # on a request's last update: its tokens that came as accepted draft tokens
    queue_time: float = 0.0  # on a request's first token: seconds it waited in the engine's queue
    num_disk_tokens: int = 0  # of the cached tokens, those read back from the disk tier


class PoolOut(msgspec.Struct, array_like=True):
    """A pooling request's result: `rows` float32 vectors (little-endian bytes), in one step."""

    request_id: str
    data: bytes
    rows: int
    num_tokens: int  # the prompt's
    queue_time: float = 0.0


class DiskCacheStats(msgspec.Struct, array_like=True):
    """The prefix cache's disk tier (pytgi.engine.kv.disk_tier): its size now, its counts since start."""

    bytes: int = 0
    files: int = 0
    written_blocks: int = 0
    read_blocks: int = 0
    write_skipped: int = 0  # new blocks not written: too many writes in flight
    write_errors: int = 0
    evicted_files: int = 0  # past --prefix-cache-disk-bytes
    dropped_files: int = 0  # failed a check: header, checksum, or a recomputed block's bits
    verified_blocks: int = 0  # restored blocks recomputed and found equal (--prefix-cache-verify-rate)
    verify_mismatches: int = 0
    written_states: int = 0  # a hybrid model's checkpoints: their states' files
    read_states: int = 0


class EngineStats(msgspec.Struct, array_like=True):
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    preemptions: int
    failed_steps: int
    spec_drafted: int = 0  # draft tokens verified, since start
    spec_accepted: int = 0  # ... and accepted
    waiting_adapters: list[str] = []  # the LoRA adapters waiting requests ask for
    disk: DiskCacheStats | None = None  # with --prefix-cache-dir
    pinned_blocks: int = 0  # KV blocks clients' pins hold now (Anthropic's cache_control)
    state_checkpoints: int = 0  # a hybrid model's recurrent states kept at block boundaries now


class _EngineStatsExtras(TypedDict, total=False):
    spec_drafted: int
    spec_accepted: int
    waiting_adapters: list[str]
    disk: DiskCacheStats | None
    pinned_blocks: int
    state_checkpoints: int


class EngineStatsFields(_EngineStatsExtras):
    """An engine's `stats()`: `EngineStats`' fields by name (those after `failed_steps` may be left out)."""

    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    preemptions: int
    failed_steps: int


class StepInfo(msgspec.Struct, array_like=True):
    """What one engine step did, for the metrics."""

    seconds: float = 0.0
    batch_size: int = 0  # 0: nothing ran (the metrics skip it)
    num_tokens: int = 0
    method: str = "decode"  # "prefill" when the step computed prompt (or recompute) chunks
    failed: bool = False


class StepOut(msgspec.Struct, tag="step"):
    updates: list[TokenOut]
    stats: EngineStats
    step: StepInfo
    pooled: list[PoolOut] = []  # a pooling model's results (its errors come as `updates`)


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    stats: EngineStats


class AdapterSnapshot(msgspec.Struct, tag="adapters"):
    """The LoRA adapters the engine serves, as its registry (pytgi.engine.adapter_registry) has them now: sent
    with `Ready` and after every change. The API process keeps only the last one."""

    version: int
    served: dict[str, str] = {}  # name → directory, those being unloaded included
    unloading: list[str] = []  # refused to new requests; removed once their requests are done

    def names(self) -> dict[str, str]:
        """The adapters a new request may name: name → directory."""
        if not self.unloading:
            return self.served
        return {n: p for n, p in self.served.items() if n not in self.unloading}


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo  # the engine's resolved configuration (pytgi.core.config)
    adapters: AdapterSnapshot


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    message: str


class AdapterOp(msgspec.Struct, tag="adapter"):
    """Load (`source`: a directory or a Hub id) or unload a LoRA adapter at run time."""

    op_id: str
    name: str
    source: str | None = None  # None: unload


class AdapterDone(msgspec.Struct, tag="adapter_done"):
    op_id: str
    error: str | None  # why it failed (the adapters are then as they were); the new snapshot came first


ToEngine = Submit | Abort | Shutdown | AdapterOp
FromEngine = StepOut | Heartbeat | Ready | StartupFailed | AdapterDone | AdapterSnapshot

encoder = msgspec.msgpack.Encoder()
to_engine = msgspec.msgpack.Decoder(ToEngine)
from_engine = msgspec.msgpack.Decoder(FromEngine)
