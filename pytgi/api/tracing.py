"""OpenTelemetry traces (`--otlp-endpoint`, `--otlp-service-name`, TGI's flags): one trace per HTTP
request that generates, exported over OTLP/HTTP by the OpenTelemetry SDK's batch processor.

A trace is the route's span (TGI's names: `generate`, `generate_stream`, `chat_completions`, ...,
with TGI's attributes `total_time`, `validation_time`, `queue_time`, `inference_time`,
`time_per_token`, `seed`) and, under it, per engine request: `validate`, then `infer` holding
`queued`, `prefill` and `decode`. The spans are written when the request ends, from the times the
API process and the engine recorded (`Timings`; the engine's queue time comes with the first
token), so tracing costs the request path nothing but a few clock reads. A W3C `traceparent` sent
by the client is continued: the route's span is its child. The API process only; no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("pytgi.api.tracing")
_tracer: Any = None
_provider: Any = None


def setup(endpoint: str, service_name: str) -> None:
    """Export to the OTLP/HTTP collector at `endpoint` (its base URL, or its /v1/traces URL)."""
    global _tracer, _provider
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=500))
    _provider, _tracer = provider, provider.get_tracer("pytgi")
    log.info("tracing: exporting spans to %s as %s", url, service_name)


def shutdown() -> None:
    """Flush what is left (the batch processor's queue) and stop exporting."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def _wall_ns(monotonic: float, now_mono: float, now_ns: int) -> int:
    return now_ns - int((now_mono - monotonic) * 1e9)


def record(
    route: str,
    headers: Mapping[str, str],
    arrived: float,
    validation_time: float,
    requests: Sequence[Any],
    attributes: Mapping[str, Any],
    error: str | None = None,
) -> None:
    """The trace of one HTTP request that ended now. `arrived`: its monotonic arrival; `requests`:
    per engine request, (its `Timings`, its tokens generated, its seed)."""
    if _tracer is None:
        return
    from opentelemetry.propagate import extract
    from opentelemetry.trace import Status, StatusCode, set_span_in_context

    now_mono, now_ns = time.monotonic(), time.time_ns()
    wall = lambda t: _wall_ns(t, now_mono, now_ns)
    parent = extract(dict(headers))
    root = _tracer.start_span(route, context=parent, start_time=wall(arrived), kind=_server_kind())
    ctx = set_span_in_context(root)
    validated = arrived + validation_time
    _tracer.start_span("validate", context=ctx, start_time=wall(arrived)).end(end_time=wall(validated))
    total_generated = 0
    queue_time = inference_time = 0.0
    for timings, generated, seed in requests:
        total_generated += generated
        submitted = timings.queued or validated
        first = timings.start or now_mono
        end = timings.end or now_mono
        infer = _tracer.start_span("infer", context=ctx, start_time=wall(submitted))
        ictx = set_span_in_context(infer)
        scheduled = min(submitted + timings.engine_queue, first)
        queue_time = max(queue_time, scheduled - submitted)
        inference_time = max(inference_time, end - scheduled)
        _tracer.start_span("queued", context=ictx, start_time=wall(submitted)).end(end_time=wall(scheduled))
        prefill = _tracer.start_span("prefill", context=ictx, start_time=wall(scheduled))
        prefill.end(end_time=wall(first))
        if timings.end:
            decode = _tracer.start_span("decode", context=ictx, start_time=wall(first))
            decode.set_attribute("generated_tokens", generated)
            decode.end(end_time=wall(end))
        if seed is not None:
            infer.set_attribute("seed", str(seed))
        infer.end(end_time=wall(end))
    root.set_attribute("total_time", f"{now_mono - arrived:.6f}s")
    root.set_attribute("validation_time", f"{validation_time:.6f}s")
    root.set_attribute("queue_time", f"{queue_time:.6f}s")
    root.set_attribute("inference_time", f"{inference_time:.6f}s")
    root.set_attribute("time_per_token", f"{inference_time / max(total_generated, 1):.6f}s")
    seeds = [str(seed) for _, _, seed in requests if seed is not None]
    if seeds:
        root.set_attribute("seed", ",".join(seeds))
    for key, value in attributes.items():
        if value is not None:
            root.set_attribute(key, value)
    if error is not None:
        root.set_status(Status(StatusCode.ERROR, error))
    root.end(end_time=now_ns)


def _server_kind() -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER
