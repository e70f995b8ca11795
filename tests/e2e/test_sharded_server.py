"""`pytgi serve --num-shard N`: same text as one shard over HTTP; a lost rank fails requests, turns
/health to 503 and ends the server; impossible shard counts are refused at start."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from tests.e2e.server import Server, descendants, listening

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def greedy(url: str, prompt: str) -> str:
    r = httpx.post(
        f"{url}/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 32}}, timeout=120
    )
    return r.json()["generated_text"]


@pytest.fixture(scope="module", params=[2, 3])
def sharded(request, tmp_path_factory):
    srv: Any = Server("--num-shard", str(request.param), log=tmp_path_factory.mktemp("logs") / "sharded.log")
    srv.num_shard = request.param
    yield srv.wait_ready()
    srv.stop()


def test_shards_give_the_same_text_as_one(server, sharded):
    assert httpx.get(f"{sharded.url}/info").json()["num_shard"] == sharded.num_shard
    for prompt in PROMPTS:
        assert greedy(sharded.url, prompt) == greedy(server.url, prompt)


def test_the_ranks_listen_on_loopback_only(sharded):
    """torch.distributed's rendezvous store and gloo's connections, on one machine: nothing another
    machine can reach (torch's own store would listen on every interface)."""
    pids = [sharded.proc.pid, *descendants(sharded.proc.pid)]
    sockets = listening(pids)
    assert len(sockets) > 1  # the HTTP port, and the group's
    assert all(ipaddress.ip_address(a).is_loopback for a, _ in sockets), sockets


def test_a_killed_rank_fails_requests_and_health_within_seconds(tmp_path):
    srv = Server("--num-shard", "2", log=tmp_path / "kill-rank.log").wait_ready()
    try:
        body = {"inputs": "Count:", "parameters": {"max_new_tokens": 400, "ignore_eos_token": True}}
        with httpx.stream("POST", f"{srv.url}/generate_stream", json=body, timeout=60) as s:
            lines = s.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            (victim,) = srv.worker_pids()
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            rest = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert rest[-1]["error_type"] == "generation"
        assert time.monotonic() - t0 < 15
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 503
        assert srv.proc.wait(30) != 0
    finally:
        srv.stop()


def test_a_rendezvous_port_in_use_is_a_clear_start_up_error():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytgi.cli",
                "serve",
                "--num-shard",
                "2",
                "--port",
                "0",
                "--master-port",
                str(port),
                "--max-batch-total-tokens",
                "8192",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "PYTGI_DIST_TIMEOUT": "10"},
        )
    assert proc.returncode != 0
    assert "could not join the group" in proc.stderr


def test_serve_is_rank_0_and_names_the_command_of_the_others():
    proc = subprocess.run(
        [sys.executable, "-m", "pytgi.cli", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"},
    )
    assert proc.returncode == 2
    assert "`pytgi shard`" in proc.stderr


@pytest.mark.parametrize(
    "n,message",
    [("0", "num_shard must be >= 1"), ("4", "cannot shard a model with 3 key/value heads over 4 ranks")],
)
def test_impossible_shard_counts_are_refused_at_start(n, message):
    proc = subprocess.run(
        [sys.executable, "-m", "pytgi.cli", "serve", "--num-shard", n, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
