"""Limits and failures end to end: 429 over the limit, API key, a failing step, a dead engine,
graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import text_generation

from pytgi.core.model_files import resolve_model
from tests.e2e.fault_engine import FAULT_PROMPT
from tests.e2e.server import Server, argv
from tests.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """Two concurrent requests at most, an API key, a small payload limit, a fault-injecting engine."""
    srv = Server(
        "--max-concurrent-requests",
        "2",
        "--payload-limit",
        "10000",
        "--request-header-timeout",
        "1",
        "--request-body-timeout",
        "1",
        "--cors-allow-origin",
        "http://example.com",
        "--json-output",
        launcher="tests.e2e.fault_engine",
        env={"API_KEY": "sekret"},  # the key from the environment
        log=tmp_path_factory.mktemp("logs") / "guarded.log",
    ).wait_ready()
    yield srv
    srv.stop()


AUTH = {"Authorization": "Bearer sekret"}


def received(srv: Server) -> float:
    """The generation requests a route has taken so far: each took its slot then, or got its 429
    (`guarded`'s /metrics needs the key)."""
    return srv.metric("tgi_request_count_total", AUTH)


def running(srv: Server) -> float:
    """The requests in the engine's running batch."""
    return srv.metric("tgi_batch_current_size", AUTH)


def log_records(srv: Server) -> list[dict]:
    """The server's JSON log records, whole lines only (it may be writing one now)."""
    return [json.loads(line) for line in srv.log_path.read_text().split("\n")[:-1] if line.startswith("{")]


def test_api_key_guards_every_route_but_health(guarded):
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    r = httpx.post(f"{guarded.url}/generate", json=body)
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"
    r = httpx.post(f"{guarded.url}/generate", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(
        f"{guarded.url}/generate", json=body, headers={"Authorization": "Bearer sekre"}
    )  # a prefix
    assert r.status_code == 401
    assert httpx.post(f"{guarded.url}/generate", json=body, headers=AUTH).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    for path in ("/metrics", "/info", "/docs", "/openapi.json", "/v1/models", "/v1/models/tgi"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 401, path
        assert httpx.get(f"{guarded.url}{path}", headers=AUTH).status_code == 200, path
    client = text_generation.Client(guarded.url, headers=AUTH)
    assert client.generate("Hi", max_new_tokens=2).details.generated_tokens == 2


def test_cors_and_json_logs(guarded):
    r = httpx.options(
        f"{guarded.url}/generate",
        headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
    )
    assert r.headers.get("access-control-allow-origin") == "http://example.com"
    r = httpx.get(f"{guarded.url}/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    lines = [line for line in guarded.log_path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records and {"timestamp", "level", "target", "message"} <= set(records[0])
    assert any(r["target"].startswith("pytgi.engine") for r in records)  # the engine process logs JSON too


def test_payload_limit_flag(guarded):
    r = httpx.post(f"{guarded.url}/generate", json={"inputs": "x" * 20000}, headers=AUTH)
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_over_the_limit_is_429_at_once_while_admitted_requests_complete(guarded):
    long = {"inputs": "Count to one hundred:", "parameters": {"max_new_tokens": 40, "ignore_eos_token": True}}

    async def main():
        async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=120) as c:
            before = received(guarded)
            first = [asyncio.ensure_future(c.post("/generate", json=long)) for _ in range(2)]
            await async_wait_until(lambda: received(guarded) == before + 2, 30, "both requests admitted")
            t0 = time.monotonic()
            third = await c.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
            waited = time.monotonic() - t0
            return [await f for f in first], third, waited

    admitted, third, waited = asyncio.run(main())
    assert third.status_code == 429
    assert third.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert waited < 1.0
    assert all(r.status_code == 200 and r.json()["generated_text"] for r in admitted)
    assert all(r.headers["x-generated-tokens"] == "40" for r in admitted)
    # the permits came back
    assert httpx.post(f"{guarded.url}/generate", json=long, headers=AUTH, timeout=60).status_code == 200


def test_overloaded_maps_to_the_client_error(guarded):
    client = text_generation.AsyncClient(guarded.url, headers=AUTH, timeout=120)

    async def main():
        long = dict(max_new_tokens=40)
        before = received(guarded)
        busy = [asyncio.ensure_future(client.generate("Count slowly:", **long)) for _ in range(2)]
        await async_wait_until(lambda: received(guarded) == before + 2, 30, "both requests admitted")
        with pytest.raises(text_generation.errors.OverloadedError):
            await client.generate("Hi", max_new_tokens=2)
        await asyncio.gather(*busy)

    asyncio.run(main())


def test_a_failing_step_fails_only_its_requests(guarded):
    ok = {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}
    assert httpx.post(f"{guarded.url}/generate", json=ok, headers=AUTH).status_code == 200
    r = httpx.post(
        f"{guarded.url}/generate",
        json={"inputs": FAULT_PROMPT, "parameters": {"max_new_tokens": 3}},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 424 and r.json()["error_type"] == "generation"
    assert (
        r.json()["error"].startswith("Request failed during generation: ")
        and "injected fault" in r.json()["error"]
    )
    with httpx.stream(
        "POST",
        f"{guarded.url}/generate_stream",
        headers=AUTH,
        timeout=60,
        json={"inputs": FAULT_PROMPT, "parameters": {"max_new_tokens": 3}},
    ) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert events[-1]["error_type"] == "generation"
    with pytest.raises(text_generation.errors.GenerationError):
        text_generation.Client(guarded.url, headers=AUTH).generate(FAULT_PROMPT, max_new_tokens=3)
    # the server goes on serving
    assert httpx.post(f"{guarded.url}/generate", json=ok, headers=AUTH).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    failures = [
        line
        for line in httpx.get(f"{guarded.url}/metrics", headers=AUTH).text.splitlines()
        if line.startswith('tgi_request_failure_total{err="generation"}')
    ]
    assert failures and float(failures[0].rsplit(" ", 1)[1]) >= 3


def test_killed_engine_fails_requests_turns_unhealthy_and_exits_nonzero(tmp_path):
    srv = Server(log=tmp_path / "killed.log").wait_ready()
    try:
        body = {"inputs": "Count:", "parameters": {"max_new_tokens": 500, "ignore_eos_token": True}}
        with httpx.stream("POST", f"{srv.url}/generate_stream", json=body, timeout=30) as s:
            lines = s.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            engine = srv.engine_pid()
            args = argv(engine)
            inbox = Path(args[args.index("--inbox") + 1].removeprefix("ipc://"))
            sockets = inbox.parent
            assert inbox.name == "inbox" and sockets.name.startswith("pytgi-") and sockets.exists()
            os.kill(engine, signal.SIGKILL)
            t0 = time.monotonic()
            rest = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert rest[-1]["error_type"] == "generation" and time.monotonic() - t0 < 5
        health = httpx.get(f"{srv.url}/health", timeout=5)
        assert health.status_code == 503
        assert health.json() == {"error": "unhealthy", "error_type": "healthcheck"}
        r = httpx.post(f"{srv.url}/generate", json={"inputs": "Hi"}, timeout=5)
        assert r.status_code == 424 and r.json()["error_type"] == "generation"
        assert srv.proc.wait(30) != 0
        errors = [line for line in srv.tail().splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "engine process killed by SIGKILL" in errors[0], errors  # one clear line
        assert not sockets.exists()  # its /tmp/pytgi-* socket directory is gone
    finally:
        srv.stop()


def test_sigterm_finishes_in_flight_requests_and_exits_zero(tmp_path):
    srv = Server(log=tmp_path / "sigterm.log").wait_ready()
    body = {"inputs": "Count:", "parameters": {"max_new_tokens": 30, "ignore_eos_token": True}}
    with httpx.stream("POST", f"{srv.url}/generate_stream", json=body, timeout=60) as s:
        lines = s.iter_lines()
        while not next(lines).startswith("data:"):
            pass
        srv.proc.send_signal(signal.SIGTERM)
        rest = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert rest[-1]["generated_text"] is not None and rest[-1]["index"] == 30
    assert srv.proc.wait(60) == 0


def test_openai_routes_refuse_in_openai_shape(guarded):
    import openai

    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="", prompt="Hi", max_tokens=2)
    r = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "x" * 20000}, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    ok = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="sekret", max_retries=0)
    assert ok.completions.create(model="", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_failed_requests_of_every_kind_give_their_slots_back(guarded):
    """Each kind of failure, more times than there are slots (2): none may keep its slot."""
    deep = (
        '{"inputs": "Hi", "parameters": {"grammar": {"type": "json", "value": '
        + '{"a": ' * 5000
        + "1"
        + "}" * 5000
        + "}}}"
    )
    failing = [
        ("/generate", '{"inputs": "Hi", "parameters": {"stop": ["\\ud800"], "max_new_tokens": 2}}'),
        ("/generate_stream", '{"inputs": "Hi", "parameters": {"stop": ["\\ud800"], "max_new_tokens": 2}}'),
        ("/generate", '{"inputs": "Hi \\ud800 there", "parameters": {"max_new_tokens": 2}}'),
        ("/generate", deep),
        ("/generate", '{"inputs": "Hi", "parameters": {"max_new_tokens": 0}}'),
        ("/generate", '{"inputs": "Hi", "parameters": {"best_of": 2, "do_sample": true, "seed": 1}}'),
        ("/generate", json.dumps({"inputs": FAULT_PROMPT, "parameters": {"max_new_tokens": 3}})),
        ("/generate_stream", json.dumps({"inputs": FAULT_PROMPT, "parameters": {"max_new_tokens": 3}})),
        ("/v1/completions", '{"prompt": "Hi \\ud800", "max_tokens": 2}'),
        ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "stop": ["\\ud800"]}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "Hi"}], "stop": "\\udfff", "n": 2}',
        ),
        ("/v1/completions", json.dumps({"prompt": FAULT_PROMPT, "max_tokens": 3, "n": 2})),
    ]
    headers = {**AUTH, "content-type": "application/json"}
    for path, body in failing:
        for _ in range(3):
            r = httpx.post(f"{guarded.url}{path}", content=body.encode(), headers=headers, timeout=60)
            assert r.status_code != 429, (path, body[:80], r.text)
    # a client that goes away mid-stream, several times
    for _ in range(3):
        with httpx.stream(
            "POST",
            f"{guarded.url}/generate_stream",
            headers=AUTH,
            timeout=60,
            json={"inputs": "Count:", "parameters": {"max_new_tokens": 200}},
        ) as s:
            next(line for line in s.iter_lines() if line.startswith("data:"))
    wait_until(lambda: running(guarded) == 0, 10, "the server to abort the streams whose clients went away")

    async def full_capacity():
        async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=120) as c:
            body = {"inputs": "Count to ten:", "parameters": {"max_new_tokens": 20, "ignore_eos_token": True}}
            return await asyncio.gather(*(c.post("/generate", json=body) for _ in range(2)))

    assert [r.status_code for r in asyncio.run(full_capacity())] == [200, 200]


def test_slow_clients_get_408_instead_of_holding_a_socket(guarded):
    """`--request-header-timeout 1`, `--request-body-timeout 1`: a silent connection, headers that
    trickle, a body shorter than its Content-Length."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        assert s.recv(100).startswith(b"HTTP/1.1 408")
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        assert s.recv(100).startswith(b"HTTP/1.1 408")
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
            b'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"inputs":'
        )
        reply = b""
        while chunk := s.recv(1000):  # until the server closes
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    assert time.monotonic() - t0 < 10


def test_a_chunked_body_over_the_limit_is_413(guarded):
    def chunks():
        for _ in range(30):
            yield b"x" * 1000

    r = httpx.post(
        f"{guarded.url}/generate", content=chunks(), headers={**AUTH, "content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_an_abandoned_generate_is_an_info_line(guarded):
    body = json.dumps(
        {"inputs": "Count:", "parameters": {"max_new_tokens": 300, "ignore_eos_token": True}}
    ).encode()
    before = received(guarded)
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        wait_until(lambda: received(guarded) > before, 30, "the route to take the request")

    def went_away() -> bool:
        return any("client went away" in r["message"] and r["level"] == "INFO" for r in log_records(guarded))

    wait_until(went_away, 10, "an INFO line saying the client went away")
    wait_until(lambda: running(guarded) == 0, 10, "the abandoned request to be aborted")
    records = log_records(guarded)
    assert not any(
        r["target"].startswith("uvicorn") and r["level"] == "ERROR" for r in records
    )  # no traceback


def test_a_refused_model_is_one_line_and_a_nonzero_exit(tmp_path):
    """Issue 63, point 4: a model refused at start (here one whose layers keep a state between steps,
    which pytgi's fallback cannot page) says why in one line, with no traceback, and the server exits
    non-zero."""
    import transformers

    cfg = transformers.RwkvConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2)
    cfg.architectures = ["RwkvForCausalLM"]
    transformers.RwkvForCausalLM(cfg).save_pretrained(tmp_path / "rwkv")
    srv = Server("--model-id", str(tmp_path / "rwkv"), log=tmp_path / "no-tokenizer.log")
    assert srv.proc.wait(60) == 2  # a directory without a tokenizer: one line too
    assert "tokenizer" in srv.tail() and "Traceback" not in srv.tail(), srv.tail()
    tok = resolve_model(None, progress=False).path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, tmp_path / "rwkv" / name)
    srv = Server("--model-id", str(tmp_path / "rwkv"), log=tmp_path / "refused.log")
    try:
        assert srv.proc.wait(180) != 0
        log = srv.tail()
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "RwkvForCausalLM" in errors[0] and "cannot be served" in errors[0], log
        assert "Traceback" not in log and "Application startup failed" not in log, log
    finally:
        srv.stop()


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    """The HTTP port is bound before the model is fetched or the engine starts (as vLLM does): a port
    in use is a start-up error at once, in one line, and nothing the start-up spawns (the engine, Ray's
    workers with their ephemeral ports) can take the port before the server listens."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]  # the later --port wins over the one Server picks
        srv = Server(
            "--port", str(port), "--model-id", str(tmp_path / "not-fetched"), log=tmp_path / "taken.log"
        )
        start = time.monotonic()
        assert srv.proc.wait(60) == 2
        assert time.monotonic() - start < 30
        log = srv.tail()
        errors = [line for line in log.splitlines() if "ERROR" in line]
        assert len(errors) == 1 and f"port {port}" in errors[0] and "in use" in errors[0], log
        assert "Traceback" not in log and "not-fetched" not in log, log
