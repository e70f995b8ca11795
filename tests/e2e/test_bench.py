"""`pytgi bench` against a real `pytgi serve`: both protocols, exact output counts with EOS ignored,
the JSON report, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pytgi.bench.command import benchmark
from pytgi.bench.peers import Target
from pytgi.bench.workload import synthetic_requests

pytestmark = pytest.mark.slow

SUMMARY_KEYS = {
    "requests",
    "completed",
    "errors",
    "error_messages",
    "duration_s",
    "input_tokens",
    "output_tokens",
    "requested_output_tokens",
    "reported_output_tokens",
    "output_len_mismatches",
    "request_throughput",
    "output_throughput",
    "total_throughput",
    "ttft_ms",
    "itl_ms",
    "tpot_ms",
    "e2e_ms",
}
DIST_KEYS = {"mean", "p50", "p90", "p99", "min", "max", "n"}
RUN_KEYS = {
    "server",
    "url",
    "protocol",
    "endpoint",
    "command",
    "model",
    "concurrency",
    "request_rate",
    "ignore_eos",
    "summary",
    "requests",
}
DOC_KEYS = {
    "kind",
    "version",
    "timestamp",
    "command",
    "machine",
    "commit",
    "workload",
    "servers",
    "runs",
    "failures",
    "table",
}
REQUEST_KEYS = {
    "index",
    "input_len",
    "requested_output_len",
    "ok",
    "error",
    "start",
    "ttft",
    "e2e",
    "tpot",
    "itl",
    "output_tokens",
    "reported_tokens",
    "chunks",
}


@pytest.fixture(scope="module")
def tok():
    from pytgi.bench.workload import load_tokenizer

    return load_tokenizer(None)[0]


@pytest.fixture(scope="module")
def requests(tok):
    return synthetic_requests(tok, 6, 16, 96, 8, 16, seed=11)


def check_run(run: dict, requests) -> None:
    assert RUN_KEYS <= set(run)
    s = run["summary"]
    assert SUMMARY_KEYS <= set(s)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert DIST_KEYS <= set(s[key]) and s[key]["p50"] is not None and s[key]["p50"] > 0
    assert (s["completed"], s["errors"], s["error_messages"]) == (6, 0, [])
    assert s["output_throughput"] > 0 and s["total_throughput"] > s["output_throughput"]
    assert s["input_tokens"] == sum(r.input_len for r in requests)
    for req, res in zip(requests, run["requests"]):
        assert REQUEST_KEYS <= set(res)
        assert res["ok"] and res["index"] == req.index
        assert res["reported_tokens"] == req.output_len  # EOS ignored: every token asked for
        assert res["output_tokens"] == req.output_len  # and the text re-tokenizes to as many
        assert res["chunks"] >= 1 and res["ttft"] <= res["e2e"]
    assert s["output_tokens"] == sum(r.output_len for r in requests) and s["output_len_mismatches"] == 0


def test_tgi_protocol(server, tok, requests) -> None:
    run = benchmark(Target("pytgi", url=server.url, protocol="tgi"), requests, tok, concurrency=3)
    assert run["protocol"] == "tgi" and run["endpoint"] == "/generate_stream" and run["concurrency"] == 3
    check_run(run, requests)


def test_openai_protocol(server, tok, requests) -> None:
    probe = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    if probe.status_code == 404:
        pytest.skip("this server has no /v1/completions")
    run = benchmark(Target("pytgi", url=server.url, protocol="openai"), requests, tok, concurrency=3)
    assert run["endpoint"] == "/v1/completions"
    assert run["model"] == httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    check_run(run, requests)


def test_cli_with_url(server, tmp_path: Path) -> None:
    out = tmp_path / "r" / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytgi.cli",
            "bench",
            "--url",
            server.url,
            "--num-prompts",
            "6",
            "--concurrency",
            "3",
            "--input-min",
            "16",
            "--input-max",
            "96",
            "--output-min",
            "8",
            "--output-max",
            "16",
            "--seed",
            "11",
            "--warmup",
            "0",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| server | load |" in proc.stdout
    assert f"| {server.url.split('://')[1]} | c=3 | 6 / 0 |" in proc.stdout
    doc = json.loads(out.read_text())
    assert DOC_KEYS <= set(doc) and doc["kind"] == "pytgi-bench" and doc["failures"] == []
    assert doc["workload"]["num_prompts"] == 6 and doc["workload"]["input_range"] == [16, 96]
    assert len(doc["runs"]) == 1 and doc["runs"][0]["url"] == server.url
    assert doc["table"] in proc.stdout
    assert out.with_suffix(".md").read_text().startswith("| server |")


def test_cli_sweep_writes_a_plot(server, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytgi.cli",
            "bench",
            "--url",
            server.url,
            "--num-prompts",
            "2",
            "--input-min",
            "8",
            "--input-max",
            "16",
            "--output-min",
            "4",
            "--output-max",
            "4",
            "--sweep-concurrency",
            "1,2",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["concurrency"] for r in doc["runs"]] == [1, 2]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
