"""Engine replicas on Ray Serve end to end: `pytgi serve --replicas 2` starts a local Ray cluster and
two engine replicas behind pytgi's one endpoint. Requests sharing a long system prompt go to the
replica that cached it (`x-pytgi-replica`, and the cached tokens it reports), other prompts go to
the other one; a replica killed mid-request fails that request with an error naming it, the live
replica serves meanwhile, and Ray Serve starts a new one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pytgi.bench.procs import busiest_engine, engines, parent
from pytgi.core.net import free_port
from tests.e2e.server import Server

pytestmark = pytest.mark.slow
HEADER = "x-pytgi-replica"
SYSTEM = {
    "a": "You are a careful assistant for a bakery. You answer questions about bread, flour, yeast, ovens "
    "and opening hours, politely and in one short sentence, and you never invent prices. " * 2,
    "b": "You are a terse assistant for a bicycle shop. You answer questions about tyres, brakes, chains, "
    "gears and repairs, in plain words and one short sentence, and you never invent stock. " * 2,
}


def test_joins_a_ray_cluster_by_address_and_leaves_it_running(tmp_path):
    """--ray-address: the same command against a cluster started apart (`ray start --head`, as on a
    head node); stopping pytgi takes its application off and leaves the cluster up. Runs first: it
    starts its own cluster."""
    port = free_port()
    ray = Path(sys.executable).with_name("ray")
    # Token authentication on, as a cluster should run (on a fresh machine `ray start` would otherwise
    # start without it): the token made first where there is none (~/.ray/auth_token), where pytgi
    # finds it
    subprocess.run([str(ray), "get-auth-token", "--generate"], check=True, capture_output=True, timeout=60)
    token = {**os.environ, "RAY_AUTH_MODE": "token"}
    head = subprocess.Popen(
        [
            str(ray),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        stdout=open(tmp_path / "ray.log", "wb"),
        stderr=subprocess.STDOUT,
        env=token,
    )
    try:
        deadline = time.monotonic() + 180
        while (
            subprocess.run(
                [str(ray), "status", f"--address=127.0.0.1:{port}"],
                capture_output=True,
                timeout=60,
                env=token,
            ).returncode
            != 0
        ):
            assert time.monotonic() < deadline and head.poll() is None, (tmp_path / "ray.log").read_text()[
                -2000:
            ]
            time.sleep(1.0)
        srv = Server(
            "--replicas",
            "1",
            "--min-replicas",
            "1",
            "--max-replicas",
            "2",
            "--ray-address",
            f"127.0.0.1:{port}",
            log=tmp_path / "server.log",
        )  # autoscaled: Ray takes the bounds
        try:
            srv.wait_ready(timeout=600)
            r = httpx.post(
                f"{srv.url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=60
            )
            assert r.status_code == 200 and r.headers[HEADER]
        finally:
            assert srv.stop() == 0
        assert head.poll() is None  # the cluster is still up
        status = subprocess.run(
            [str(ray), "status", f"--address=127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
            env=token,
        )
        assert status.returncode == 0, status.stderr[-2000:]
    finally:
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()


def test_an_embedding_model_on_replicas(tmp_path):
    """`--replicas 2` on all-MiniLM-L6-v2: every input is one request on one replica, and the vectors
    are sentence-transformers' whichever replica computed them."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from tests.minilm import SENTENCES, minilm_dir

    minilm = minilm_dir(tmp_path)
    srv = Server("--model-id", str(minilm), "--replicas", "2", log=tmp_path / "server.log")
    srv.wait_ready(timeout=600)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        got = np.array([d.embedding for d in client.embeddings.create(model="m", input=SENTENCES).data])
        want = SentenceTransformer(str(minilm), device="cpu").encode(SENTENCES)
        cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
        assert cos.min() >= 0.99999
        r = httpx.post(f"{srv.url}/rerank", json={"query": SENTENCES[0], "texts": SENTENCES[1:3]}, timeout=60)
        assert r.status_code == 200 and len(r.json()) == 2
    finally:
        assert srv.stop() == 0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = Server("--replicas", "2", "--max-total-tokens", "2048", log=log).wait_ready(timeout=600)
    yield srv
    assert srv.stop() == 0  # SIGTERM: a graceful stop, the replicas and the local cluster with it


def chat(srv: Server, system: str, user: str, max_tokens: int = 4):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model="tgi",
        max_tokens=max_tokens,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
    )


def test_requests_sharing_a_prefix_go_to_the_replica_that_cached_it(replicas):
    where: dict[str, set[str]] = {"a": set(), "b": set()}
    for user in ("When do you open?", "Is the rye fresh?", "Do you deliver?"):
        for key in ("a", "b"):
            raw = chat(replicas, SYSTEM[key], user)
            where[key].add(raw.headers[HEADER])
            usage = raw.parse().usage
            if len(where[key]) == 1 and user != "When do you open?":  # the system prompt is cached there
                assert usage.prompt_tokens_details.cached_tokens >= 64, usage
    assert len(where["a"]) == 1 and len(where["b"]) == 1, where
    assert where["a"] != where["b"]  # the two prefixes spread over the two replicas
    # TGI's routes and streams name the replica too
    r = httpx.post(
        f"{replicas.url}/generate",
        json={"inputs": SYSTEM["a"] + "Hello", "parameters": {"max_new_tokens": 2}},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers[HEADER] in where["a"]
    with httpx.stream(
        "POST",
        f"{replicas.url}/generate_stream",
        timeout=60,
        json={"inputs": SYSTEM["b"] + "Hi", "parameters": {"max_new_tokens": 2}},
    ) as s:
        assert s.headers[HEADER] in where["b"]
        assert "data:" in s.read().decode()
    assert HEADER not in httpx.get(f"{replicas.url}/health").headers  # no request: no replica
    metrics = httpx.get(f"{replicas.url}/metrics").text
    for name in ("pytgi_num_requests_waiting", "pytgi_num_requests_running", "pytgi_kv_cache_usage_perc"):
        assert name in metrics


def test_a_dead_replica_fails_its_requests_and_is_replaced(replicas):
    with httpx.stream(
        "POST",
        f"{replicas.url}/generate_stream",
        timeout=120,
        json={"inputs": SYSTEM["a"] + "Tell me everything.", "parameters": {"max_new_tokens": 400}},
    ) as s:
        victim = s.headers[HEADER]
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it is generating
        assert len(engines(replicas.proc.pid)) == 2
        os.kill(parent(busiest_engine(replicas.proc.pid)), signal.SIGKILL)  # the replica's actor process
        killed = time.monotonic()
        rest = "\n".join(lines)
    assert "error" in rest and "replica" in rest, rest[-500:]
    # the live replica serves meanwhile, whatever the prompt
    for key in ("a", "b"):
        raw = chat(replicas, SYSTEM[key], "Still there?")
        assert raw.http_response.status_code == 200 and raw.headers[HEADER] != victim
    # Ray Serve starts another replica: it shows up in the headers of new prefixes
    seen: set[str] = set()
    deadline = time.monotonic() + 240
    n = 0
    while time.monotonic() < deadline and len(seen - {victim}) < 2:
        n += 1
        seen.add(chat(replicas, f"Prefix number {n}. " * 20, "Hi", max_tokens=1).headers[HEADER])
        time.sleep(0.5)
    assert len(seen - {victim}) == 2, seen
    print(f"replica replaced in {time.monotonic() - killed:.1f} s")
