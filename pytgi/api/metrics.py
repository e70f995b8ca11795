"""Prometheus metrics with TGI's names, plus pytgi's own (API process; no torch)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pytgi.core import protocol as P
from pytgi.core.config import EngineInfo

_DURATION = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.request_count = Counter("tgi_request_count", "Requests received", registry=r)
        self.request_success = Counter("tgi_request_success", "Requests that succeeded", registry=r)
        self.request_failure = Counter("tgi_request_failure", "Requests that failed", ["err"], registry=r)
        self.batch_inference_count = Counter(
            "tgi_batch_inference_count", "Engine steps", ["method"], registry=r
        )
        self.batch_inference_success = Counter(
            "tgi_batch_inference_success", "Successful engine steps", ["method"], registry=r
        )
        self.batch_inference_failure = Counter(
            "tgi_batch_inference_failure", "Failed engine steps", ["method"], registry=r
        )
        self.batch_concat = Counter(
            "tgi_batch_concat",
            "Steps that admitted new requests into a running batch",
            ["reason"],
            registry=r,
        )
        self.queue_size = Gauge("tgi_queue_size", "Requests waiting in the engine queue", registry=r)
        self.batch_current_size = Gauge("tgi_batch_current_size", "Running requests", registry=r)
        self.batch_current_max_tokens = Gauge(
            "tgi_batch_current_max_tokens", "Tokens computed in the last step", registry=r
        )
        self.request_duration = Histogram(
            "tgi_request_duration", "End-to-end request time (s)", buckets=_DURATION, registry=r
        )
        self.request_validation_duration = Histogram(
            "tgi_request_validation_duration", "Validation time (s)", buckets=_DURATION, registry=r
        )
        self.request_queue_duration = Histogram(
            "tgi_request_queue_duration", "Queue time (s)", buckets=_DURATION, registry=r
        )
        self.request_inference_duration = Histogram(
            "tgi_request_inference_duration", "Inference time (s)", buckets=_DURATION, registry=r
        )
        self.request_mean_time_per_token_duration = Histogram(
            "tgi_request_mean_time_per_token_duration",
            "Mean time per generated token (s)",
            buckets=_DURATION,
            registry=r,
        )
        self.request_input_length = Histogram(
            "tgi_request_input_length", "Prompt tokens", buckets=_TOKENS, registry=r
        )
        self.request_generated_tokens = Histogram(
            "tgi_request_generated_tokens", "Generated tokens", buckets=_TOKENS, registry=r
        )
        self.batch_inference_duration = Histogram(
            "tgi_batch_inference_duration", "Engine step time (s)", ["method"], buckets=_DURATION, registry=r
        )
        self.batch_next_size = Histogram(
            "tgi_batch_next_size", "Requests in a step", buckets=_TOKENS, registry=r
        )
        # beyond TGI
        self.time_to_first_token = Histogram(
            "pytgi_time_to_first_token_seconds", "Arrival to first token (s)", buckets=_DURATION, registry=r
        )
        self.inter_token_latency = Histogram(
            "pytgi_inter_token_latency_seconds",
            "Time between streamed tokens (s)",
            buckets=_DURATION,
            registry=r,
        )
        self.kv_cache_usage = Gauge("pytgi_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.prefix_cache_hit_rate = Gauge(
            "pytgi_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", registry=r
        )
        # the prompt tokens of successful requests, and those a cache served, by tier (ram: the KV
        # pool's prefix cache; disk: --prefix-cache-dir's files)
        self.prompt_tokens = Counter(
            "pytgi_prompt_tokens", "Prompt tokens of successful requests", registry=r
        )
        self.prefix_cache_hit_tokens = Counter(
            "pytgi_prefix_cache_hit_tokens",
            "Prompt tokens of successful requests served from a prefix cache, by tier",
            ["tier"],
            registry=r,
        )
        self.preemptions = Gauge(
            "pytgi_preemptions_total", "Requests preempted (recomputed later)", registry=r
        )
        self.pinned_blocks = Gauge(
            "pytgi_prefix_cache_pinned_blocks",
            "KV blocks clients' pins hold (Anthropic's cache_control)",
            registry=r,
        )
        self.state_checkpoints = Gauge(
            "pytgi_prefix_cache_state_checkpoints",
            "A hybrid model's recurrent states the prefix cache keeps at block boundaries",
            registry=r,
        )
        # the disk tier (--prefix-cache-dir): its size, and its counts since the engine started
        self.disk_bytes = Gauge("pytgi_prefix_cache_disk_bytes", "The disk tier's bytes", registry=r)
        self.disk_files = Gauge("pytgi_prefix_cache_disk_files", "The disk tier's block files", registry=r)
        self.disk_blocks = Gauge(
            "pytgi_prefix_cache_disk_blocks_total",
            "KV blocks the disk tier wrote, read back, skipped writing (too many in flight), evicted "
            "past its bound, dropped (a failed check), verified and found different when recomputed; a "
            "hybrid model's checkpoints' states written and read back (state_written, state_read)",
            ["op"],
            registry=r,
        )
        # speculation (--speculate): TGI's per-request histogram, and pytgi's totals
        self.request_skipped_tokens = Histogram(
            "tgi_request_skipped_tokens",
            "Tokens a request got as accepted draft tokens",
            buckets=_TOKENS,
            registry=r,
        )
        self.spec_drafted = Gauge("pytgi_spec_draft_tokens_total", "Draft tokens verified", registry=r)
        self.spec_accepted = Gauge("pytgi_spec_accepted_tokens_total", "Draft tokens accepted", registry=r)
        self.spec_acceptance = Gauge(
            "pytgi_spec_acceptance_rate", "Accepted / verified draft tokens", registry=r
        )
        # what the Gateway API Inference Extension's endpoint picker reads (docs/deploy.md): the
        # model-server protocol's queued and running requests, KV-cache use and LoRA adapters
        self.num_requests_waiting = Gauge(
            "pytgi_num_requests_waiting", "Requests in the engine's queue", registry=r
        )
        self.num_requests_running = Gauge(
            "pytgi_num_requests_running", "Requests in the running batch", registry=r
        )
        self.kv_cache_usage_perc = Gauge("pytgi_kv_cache_usage_perc", "KV-cache use (1 is full)", registry=r)
        self.lora_requests_info = Gauge(
            "pytgi_lora_requests_info",
            "LoRA adapters: served (running_lora_adapters), asked for by waiting requests; the value "
            "is when this was last updated",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        self.cache_config_info = Gauge(
            "pytgi_cache_config_info", "The KV cache's shape", ["block_size", "num_gpu_blocks"], registry=r
        )
        self.served_adapters: Callable[[], Collection[str]] = tuple
        self._lora_labels: tuple[str, str, str] | None = None

    def engine_step(self, out: P.StepOut) -> None:
        step = out.step
        if step.batch_size:
            self.batch_inference_count.labels(step.method).inc()
            (self.batch_inference_failure if step.failed else self.batch_inference_success).labels(
                step.method
            ).inc()
            self.batch_inference_duration.labels(step.method).observe(step.seconds)
            self.batch_next_size.observe(step.batch_size)
            self.batch_current_max_tokens.set(step.num_tokens)
            if step.method == "prefill" and out.stats.running > 1:
                self.batch_concat.labels("backpressure" if out.stats.waiting else "wait_exceeded").inc()
        for u in out.updates:
            if u.finish_reason is not None and u.error is None:
                self.request_skipped_tokens.observe(u.num_skipped)
        self.engine_stats(out.stats)

    def model_info(self, info: EngineInfo, served_adapters: Callable[[], Collection[str]]) -> None:
        """Once the engine is up: the KV cache's shape; `served_adapters`: the LoRA adapters now."""
        self.cache_config_info.labels(str(info.block_size), str(info.num_blocks)).set(1)
        self.served_adapters = served_adapters

    def engine_stats(self, s: P.EngineStats) -> None:
        self.queue_size.set(s.waiting)
        self.batch_current_size.set(s.running)
        self.num_requests_waiting.set(s.waiting)
        self.num_requests_running.set(s.running)
        self.kv_cache_usage_perc.set(s.kv_cache_usage)
        served = sorted(self.served_adapters())
        labels = (str(len(served)), ",".join(served), ",".join(s.waiting_adapters))
        if labels != self._lora_labels:  # one series, the current one, stamped when it changed
            self._lora_labels = labels
            self.lora_requests_info.clear()
            self.lora_requests_info.labels(*labels).set(time.time())
        self.kv_cache_usage.set(s.kv_cache_usage)
        self.prefix_cache_hit_rate.set(s.prefix_cache_hit_rate)
        self.preemptions.set(s.preemptions)
        self.pinned_blocks.set(s.pinned_blocks)
        self.state_checkpoints.set(s.state_checkpoints)
        if s.disk is not None:
            d = s.disk
            self.disk_bytes.set(d.bytes)
            self.disk_files.set(d.files)
            for op, n in (
                ("written", d.written_blocks),
                ("read", d.read_blocks),
                ("write_skipped", d.write_skipped),
                ("evicted", d.evicted_files),
                ("dropped", d.dropped_files),
                ("verified", d.verified_blocks),
                ("verify_mismatch", d.verify_mismatches),
                ("state_written", d.written_states),
                ("state_read", d.read_states),
            ):
                self.disk_blocks.labels(op).set(n)
        self.spec_drafted.set(s.spec_drafted)
        self.spec_accepted.set(s.spec_accepted)
        self.spec_acceptance.set(s.spec_accepted / s.spec_drafted if s.spec_drafted else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
