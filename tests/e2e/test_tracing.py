"""Tracing end to end: `pytgi serve --otlp-endpoint` exports to a loopback OTLP/HTTP collector (a
plain HTTP server that decodes the protobuf the OpenTelemetry SDK posts to /v1/traces). One trace
per request, TGI's span names and attributes, the times nested, and a client's W3C `traceparent`
continued."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.e2e.server import Server

pytestmark = pytest.mark.slow
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector(http.server.BaseHTTPRequestHandler):
    spans: list = []  # (resource attributes, span)

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                Collector.spans.extend((resource, s) for s in ss.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
    srv = Server(
        "--otlp-endpoint",
        endpoint,
        "--otlp-service-name",
        "pytgi-test",
        log=tmp_path_factory.mktemp("logs") / "server.log",
    ).wait_ready()
    yield srv
    srv.stop()
    httpd.shutdown()


def spans_of(trace_id: bytes, want: int, timeout: float = 20.0) -> dict[str, list]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [(r, s) for r, s in Collector.spans if s.trace_id == trace_id]
        if len(found) >= want:
            by_name: dict[str, list] = {}
            for r, s in found:
                by_name.setdefault(s.name, []).append((r, s))
            return by_name
        time.sleep(0.2)
    raise TimeoutError(f"{len(found)} spans of the trace arrived, not {want}")


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value or v.int_value or v.double_value
    return out


def test_a_generate_is_one_trace_under_the_clients_traceparent(traced):
    r = httpx.post(
        f"{traced.url}/generate",
        json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}},
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        timeout=60,
    )
    assert r.status_code == 200
    spans = spans_of(bytes.fromhex(TRACE_ID), 6)
    ((resource, root),) = spans["generate"]
    assert resource["service.name"] == "pytgi-test"
    assert root.parent_span_id == bytes.fromhex(PARENT_ID)  # the client's span is the parent
    a = attrs(root)
    for key in ("total_time", "validation_time", "queue_time", "inference_time", "time_per_token"):
        assert a[key].endswith("s"), key
    assert a["generated_tokens"] == 5 and a["http.route"] == "/generate"
    ((_, validate),) = spans["validate"]
    ((_, infer),) = spans["infer"]
    assert validate.parent_span_id == root.span_id and infer.parent_span_id == root.span_id
    for name in ("queued", "prefill", "decode"):
        ((_, s),) = spans[name]
        assert s.parent_span_id == infer.span_id
        assert (
            infer.start_time_unix_nano
            <= s.start_time_unix_nano
            <= s.end_time_unix_nano
            <= infer.end_time_unix_nano
        )
    ((_, queued),) = spans["queued"]
    ((_, prefill),) = spans["prefill"]
    ((_, decode),) = spans["decode"]
    assert queued.end_time_unix_nano <= prefill.end_time_unix_nano <= decode.start_time_unix_nano + 1
    assert (
        root.start_time_unix_nano <= validate.start_time_unix_nano
        and infer.end_time_unix_nano <= root.end_time_unix_nano
    )


def test_streams_and_chat_are_traced_each_in_its_own_trace(traced):
    Collector.spans.clear()
    with httpx.stream(
        "POST",
        f"{traced.url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "tgi",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200
        r.read()
    r = httpx.post(f"{traced.url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and {"chat_completions", "generate"} - {
        s.name for _, s in Collector.spans
    }:
        time.sleep(0.2)
    roots = {s.name: s for _, s in Collector.spans if s.name in ("chat_completions", "generate")}
    assert set(roots) == {"chat_completions", "generate"}
    assert roots["chat_completions"].trace_id != roots["generate"].trace_id  # no parent: a new trace each
    assert attrs(roots["chat_completions"])["generated_tokens"] == 4
