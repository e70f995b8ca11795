"""`pytgi bench` without a server: prompts of exact token lengths, seeded workloads and arrivals, metrics
on synthetic timings, SSE parsing of TGI and OpenAI streams, the streaming client on mocked transports,
and the peers' command lines."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pytgi.bench import peers, report
from pytgi.bench import stream_client as bc
from pytgi.bench.workload import (
    BenchRequest,
    count_tokens,
    dataset_requests,
    exact_length_text,
    poisson_arrivals,
    synthetic_requests,
    token_pool,
)
from pytgi.core.tokenizer import Tokenizer


# -- the workload ------------------------------------------------------------------------------------------
def test_prompt_lengths_are_exact_after_reencoding(tok: Tokenizer) -> None:
    reqs = synthetic_requests(tok, 40, 1, 300, 5, 9, seed=3)
    assert len(reqs) == 40
    for r in reqs:
        assert 1 <= r.input_len <= 300 and 5 <= r.output_len <= 9
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.input_len
        assert r.prompt.strip()


@pytest.mark.parametrize("length", [1, 2, 3, 17, 128, 1024])
def test_exact_length_text(tok: Tokenizer, length: int) -> None:
    pool = token_pool(tok)
    assert not set(pool) & tok.special_ids
    for seed in range(3):
        text = exact_length_text(tok, random.Random(seed), length, pool)
        assert count_tokens(tok, text) == length


def test_lengths_cover_the_range_uniformly(tok: Tokenizer) -> None:
    reqs = synthetic_requests(tok, 200, 1, 4, 10, 11, seed=0)
    assert {r.input_len for r in reqs} == {1, 2, 3, 4}
    assert {r.output_len for r in reqs} == {10, 11}


def test_seeded_workload_is_reproducible(tok: Tokenizer) -> None:
    a = synthetic_requests(tok, 8, 16, 64, 4, 32, seed=7)
    b = synthetic_requests(tok, 8, 16, 64, 4, 32, seed=7)
    c = synthetic_requests(tok, 8, 16, 64, 4, 32, seed=8)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert [r.index for r in a] == list(range(8))


def test_shared_prefix_starts_every_prompt(tok: Tokenizer) -> None:
    reqs = synthetic_requests(tok, 6, 8, 24, 4, 8, seed=1, shared_prefix_len=100)
    ids = [tok.encode(r.prompt, add_special_tokens=False) for r in reqs]
    assert all(len(i) == r.input_len for i, r in zip(ids, reqs))
    assert all(i[:99] == ids[0][:99] for i in ids)  # the prefix's tokens (all but the seam) are shared
    assert all(100 + 8 <= r.input_len <= 100 + 1 + 24 + 1 for r in reqs)
    assert len({r.prompt[-20:] for r in reqs}) == 6


def test_bad_ranges_are_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError):
        synthetic_requests(tok, 1, 10, 5, 1, 1)
    with pytest.raises(ValueError):
        synthetic_requests(tok, 1, 1, 5, 0, 1)


def test_dataset_requests(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "Hello world", "output_len": 5}\n\n{"prompt": "Bye", "output_len": 2}\n'
        '{"prompt": "x", "output_len": 1}\n'
    )
    reqs = dataset_requests(tok, path)
    assert [(r.index, r.prompt, r.output_len) for r in reqs] == [
        (0, "Hello world", 5),
        (1, "Bye", 2),
        (2, "x", 1),
    ]
    assert reqs[0].input_len == len(tok.encode("Hello world", add_special_tokens=False))
    assert len(dataset_requests(tok, path, num=2)) == 2
    path.write_text('{"prompt": "Hello", "output_len": 0}\n')
    with pytest.raises(ValueError, match="output_len"):
        dataset_requests(tok, path)
    path.write_text('{"text": "Hello"}\n')
    with pytest.raises(ValueError, match=":1:"):
        dataset_requests(tok, path)


def test_poisson_arrivals_are_seeded() -> None:
    a = poisson_arrivals(2000, 4.0, seed=1)
    assert a == poisson_arrivals(2000, 4.0, seed=1)
    assert a != poisson_arrivals(2000, 4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.08)  # mean gap 1/rate
    # exponential gaps: the standard deviation equals the mean
    mean = sum(gaps) / len(gaps)
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert sd == pytest.approx(mean, rel=0.15)
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0)


# -- metrics -------------------------------------------------------------------------------------------------
def test_percentile_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 5, 101):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert report.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert report.percentile([], 50) is None
    assert report.distribution([])["p50"] is None


def result(
    i: int,
    ttft: float,
    gaps: list[float],
    out: int,
    requested: int | None = None,
    start: float = 0.0,
    ok: bool = True,
    error: str | None = None,
    input_len: int = 10,
) -> bc.RequestResult:
    r = bc.RequestResult(i, input_len, requested or out, ok=ok, error=error, start=start)
    if ok:
        r.ttft, r.itl, r.output_tokens, r.reported_tokens = ttft, gaps, out, requested or out
        r.e2e = ttft + sum(gaps)
    return r


def test_summary_on_synthetic_timings() -> None:
    results = [
        result(0, 0.1, [0.05] * 9, 10),  # e2e 0.55
        result(1, 0.3, [0.1, 0.1, 0.1], 4),  # e2e 0.6
        result(2, 0.2, [], 1),  # one token: no TPOT
        result(3, 0, [], 0, ok=False, error="HTTP 429: Model is overloaded"),
        result(4, 0, [], 0, ok=False, error="HTTP 429: Model is overloaded"),
        result(5, 0, [], 0, ok=False, error="ReadTimeout"),
    ]
    s = report.summarize(bc.LoadResult(results, duration=2.0))
    assert (s["requests"], s["completed"], s["errors"]) == (6, 3, 3)
    assert s["error_messages"] == [
        {"message": "HTTP 429: Model is overloaded", "count": 2},
        {"message": "ReadTimeout", "count": 1},
    ]
    assert s["output_tokens"] == 15 and s["input_tokens"] == 30
    assert s["output_throughput"] == pytest.approx(7.5)
    assert s["total_throughput"] == pytest.approx(22.5)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["itl_ms"]["n"] == 12  # gaps pooled over requests
    assert s["itl_ms"]["p50"] == pytest.approx(50.0)
    assert s["itl_ms"]["p99"] == pytest.approx(100.0)
    # TPOT = (e2e - ttft) / (tokens - 1): 0.45/9 and 0.3/3
    assert s["tpot_ms"]["n"] == 2
    assert [s["tpot_ms"]["min"], s["tpot_ms"]["max"]] == pytest.approx([50.0, 100.0])
    assert s["e2e_ms"]["max"] == pytest.approx(600.0)
    assert s["output_len_mismatches"] == 0


def test_tpot_and_mismatches() -> None:
    r = result(0, 1.0, [0.5, 0.5], 3)
    assert r.tpot == pytest.approx(0.5)
    assert result(0, 1.0, [], 1).tpot is None
    s = report.summarize(bc.LoadResult([result(0, 0.1, [0.1], 2, requested=3)], 1.0))
    assert s["output_len_mismatches"] == 1
    assert s["requested_output_tokens"] == 3 and s["reported_output_tokens"] == 3


def run_doc(server: str, out_tps: float, itl: float, conc: int = 4) -> dict:
    d = {"mean": itl, "p50": itl, "p90": itl, "p99": itl, "min": itl, "max": itl, "n": 1}
    return {
        "server": server,
        "concurrency": conc,
        "request_rate": None,
        "summary": {
            "completed": 8,
            "errors": 0,
            "output_throughput": out_tps,
            "total_throughput": 2 * out_tps,
            "request_throughput": 1.0,
            "ttft_ms": d,
            "itl_ms": d,
            "tpot_ms": d,
            "e2e_ms": d,
            "error_messages": [],
        },
    }


def test_markdown_table_has_ratios_against_the_first_server() -> None:
    table = report.markdown_table(
        [
            run_doc("pytgi", 100.0, 10.0),
            run_doc("llama-server", 50.0, 20.0),
            run_doc("pytgi", 300.0, 10.0, conc=16),
            run_doc("llama-server", 600.0, 5.0, 16),
        ]
    )
    lines = table.splitlines()
    assert len(lines) == 6 and lines[1].startswith("| --- |")
    assert lines[0].count("|") == lines[2].count("|")
    assert lines[2].endswith("| 1.00× | 1.00× | - | - |") and "| c=4 |" in lines[2]  # not started here
    assert lines[3].endswith("| 0.50× | 2.00× | - | - |")
    assert lines[5].endswith("| 2.00× | 0.50× | - | - |") and "| c=16 |" in lines[5]
    started = {**run_doc("pytgi", 100.0, 10.0), "ready_s": 12.34, "peak_rss_bytes": 3 << 29}
    assert report.markdown_table([started]).splitlines()[2].endswith("| 12.3 | 1.50 |")


def test_plot_sweep(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs = [run_doc(s, t * c, 10.0 + c, conc=c) for s, t in (("pytgi", 10), ("peer", 5)) for c in (1, 2, 4)]
    png = report.plot_sweep(runs, tmp_path / "x.png", title="t")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- SSE -----------------------------------------------------------------------------------------------------
TGI_STREAM = (
    ":\n\n"
    'data:{"index":1,"token":{"id":5,"text":"Hel","logprob":-0.1,"special":false},"generated_text":null,'
    '"details":null}\n\n'
    ":\n\n"
    'data: {"index":2,"token":{"id":6,"text":"lo","logprob":-0.2,"special":false},"generated_text":null,'
    '"details":null}\n\n'
    'data:{"index":3,"token":{"id":2,"text":"<|im_end|>","logprob":-0.3,"special":true},'
    '"generated_text":"Hello","details":{"finish_reason":"length","generated_tokens":3,"seed":null}}\n\n'
)

OPENAI_STREAM = (
    ": keep-alive\n\n"
    'data: {"id":"c","object":"text_completion",'
    '"choices":[{"index":0,"text":"Hel","finish_reason":null}]}\n\n'
    'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"","finish_reason":null}]}\n\n'
    'data: {"id":"c","object":"text_completion",'
    '"choices":[{"index":0,"text":"lo","finish_reason":"length"}]}\n\n'
    'data: {"id":"c","object":"text_completion","choices":[],'
    '"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
    "data: [DONE]\n\n"
)


def test_sse_parser_fields_comments_and_multiline() -> None:
    lines = [
        "event: message",
        "id: 1",
        "data: a",
        "data:b",
        "retry: 10",
        "",
        ": comment",
        "",
        "",
        'data:{"x": 1}\r',
        "\r",
        "data: tail-without-blank-line",
    ]
    assert list(bc.iter_sse(lines)) == ["a\nb", '{"x": 1}', "tail-without-blank-line"]


def test_tgi_stream_parsing() -> None:
    proto = bc.TGIProtocol()
    chunks = [proto.parse(d) for d in bc.iter_sse(TGI_STREAM.split("\n"))]
    assert [c.text for c in chunks] == ["Hel", "lo", ""]  # a special token has no text
    assert [c.final for c in chunks] == [False, False, True]
    assert chunks[-1].full_text == "Hello" and chunks[-1].reported_tokens == 3
    assert all(c.token_event for c in chunks)
    err = proto.parse('{"error":"Request failed during generation: boom","error_type":"generation"}')
    assert err.error == "Request failed during generation: boom (generation)" and err.final
    assert proto.parse("not json").error


def test_tgi_body() -> None:
    req = BenchRequest(0, "Hi", 1, 7)
    body = bc.TGIProtocol().body(req, ignore_eos=True)
    assert body == {
        "inputs": "Hi",
        "parameters": {"max_new_tokens": 7, "details": False, "ignore_eos_token": True},
    }
    assert "ignore_eos_token" not in bc.TGIProtocol().body(req, ignore_eos=False)["parameters"]


def test_openai_stream_parsing() -> None:
    proto = bc.OpenAIProtocol("m")
    chunks = [proto.parse(d) for d in bc.iter_sse(OPENAI_STREAM.split("\n"))]
    assert [c.text for c in chunks] == ["Hel", "", "lo", "", ""]
    assert chunks[3].reported_tokens == 2
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert proto.parse('{"error": {"message": "bad", "type": "invalid_request_error"}}').error == "bad"
    assert proto.parse('{"error": "CB worker died"}').error == "CB worker died"
    chat = bc.OpenAIProtocol("m", chat=True)
    assert chat.parse('{"choices":[{"index":0,"delta":{"role":"assistant","content":"Yo"}}]}').text == "Yo"
    assert chat.parse('{"choices":[{"index":0,"delta":{"role":"assistant"}}]}').text == ""


def test_openai_bodies() -> None:
    req = BenchRequest(0, "Hi", 1, 7)
    body = bc.OpenAIProtocol("m").body(req, ignore_eos=True)
    assert body == {
        "model": "m",
        "stream": True,
        "temperature": 0,
        "max_tokens": 7,
        "prompt": "Hi",
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    assert "ignore_eos" not in bc.OpenAIProtocol("m", send_ignore_eos=False).body(req, ignore_eos=True)
    chat = bc.OpenAIProtocol("m", chat=True)
    assert chat.path == "/v1/chat/completions"
    assert chat.body(req, True)["messages"] == [{"role": "user", "content": "Hi"}]


# -- the client on a mocked server -------------------------------------------------------------------------
def mock(
    streams: dict[str, tuple[int, str]],
    seen: list | None = None,
    delay: float = 0.0,
    in_flight: list[int] | None = None,
) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        status, text = streams[request.url.path]
        if in_flight is not None:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])

        async def body():
            try:
                for part in text.split("\n\n"):
                    if (
                        delay
                    ):  # on purpose: a server streaming at a pace, for ttft, itl and overlap to measure
                        await asyncio.sleep(delay)
                    if part:
                        yield (part + "\n\n").encode()
            finally:
                if in_flight is not None:
                    in_flight[0] -= 1

        return httpx.Response(status, content=body(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def load(
    tok: Tokenizer, proto: bc.Protocol, transport: httpx.MockTransport, n: int = 3, **kw
) -> bc.LoadResult:
    reqs = [BenchRequest(i, f"prompt {i}", 2, 3) for i in range(n)]
    kw.setdefault("concurrency", 2)
    return asyncio.run(
        bc.run_load(
            "http://test", proto, reqs, count=lambda t: count_tokens(tok, t), transport=transport, **kw
        )
    )


def test_client_tgi_stream(tok: Tokenizer) -> None:
    seen: list = []
    res = load(tok, bc.TGIProtocol(), mock({"/generate_stream": (200, TGI_STREAM)}, seen, delay=0.01))
    assert [r.index for r in res.results] == [0, 1, 2] and all(r.ok for r in res.results)
    r = res.results[0]
    assert r.text == "Hello" and r.output_tokens == count_tokens(tok, "Hello")
    assert r.reported_tokens == 3 and r.chunks == 2
    assert r.ttft is not None and r.ttft > 0 and len(r.itl) == 1 and r.e2e >= r.ttft + r.itl[0]
    assert seen[0]["parameters"]["ignore_eos_token"] is True


def test_client_tgi_token_events_count_without_details(tok: Tokenizer) -> None:
    stream = TGI_STREAM.replace(',"details":{"finish_reason":"length","generated_tokens":3,"seed":null}', "")
    res = load(tok, bc.TGIProtocol(), mock({"/generate_stream": (200, stream)}), n=1)
    assert res.results[0].ok and res.results[0].reported_tokens == 3


def test_client_openai_stream(tok: Tokenizer) -> None:
    res = load(tok, bc.OpenAIProtocol("m"), mock({"/v1/completions": (200, OPENAI_STREAM)}))
    r = res.results[1]
    assert r.ok and r.text == "Hello" and r.reported_tokens == 2 and r.chunks == 2 and len(r.itl) == 1


def test_counting_by_token_events(tok: Tokenizer) -> None:
    """`--count-tokens events`: tokens streamed as empty text (a special token, bytes of no whole
    character) are timed and counted, by the server's usage where it sends one."""
    assert [
        c.token_event for c in map(bc.OpenAIProtocol("m").parse, bc.iter_sse(OPENAI_STREAM.split("\n")))
    ] == [True, True, True, False, False]  # the usage and [DONE] events stand for no token
    for proto, path, stream, tokens in [
        (bc.OpenAIProtocol("m"), "/v1/completions", OPENAI_STREAM, 2),
        (bc.TGIProtocol(), "/generate_stream", TGI_STREAM, 3),
    ]:
        proto.by_events = True
        r = load(tok, proto, mock({path: (200, stream)}, delay=0.01), n=1).results[0]
        assert r.ok and r.text == "Hello" and r.chunks == 3 and len(r.itl) == 2 and r.output_tokens == tokens


def test_client_openai_stream_without_done(tok: Tokenizer) -> None:
    stream = OPENAI_STREAM.replace("data: [DONE]\n\n", "")  # transformers serve ends like this
    res = load(tok, bc.OpenAIProtocol("m"), mock({"/v1/completions": (200, stream)}), n=1)
    assert res.results[0].ok and res.results[0].text == "Hello"


def test_client_errors(tok: Tokenizer) -> None:
    err_event = (
        TGI_STREAM.split("\n\n")[1] + '\n\ndata:{"error":"Incomplete generation","error_type":'
        '"incomplete_generation"}\n\n'
    )
    truncated = TGI_STREAM.split("\n\n")[1] + "\n\n"
    transport = mock({"/generate_stream": (200, err_event)})
    r = load(tok, bc.TGIProtocol(), transport, n=1).results[0]
    assert not r.ok and r.error == "Incomplete generation (incomplete_generation)"
    r = load(tok, bc.TGIProtocol(), mock({"/generate_stream": (200, truncated)}), n=1).results[0]
    assert not r.ok and "ended before" in r.error
    body = '{"error":"Input validation error: `inputs` cannot be empty","error_type":"validation"}'
    r = load(tok, bc.TGIProtocol(), mock({"/generate_stream": (422, body)}), n=1).results[0]
    assert not r.ok and r.error.startswith("HTTP 422: ") and "cannot be empty" in r.error

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    r = load(tok, bc.TGIProtocol(), httpx.MockTransport(refuse), n=1).results[0]
    assert not r.ok and r.error.startswith("ConnectError")
    s = report.summarize(load(tok, bc.TGIProtocol(), httpx.MockTransport(refuse), n=4))
    assert s["errors"] == 4 and s["error_messages"][0]["count"] == 4


def test_closed_loop_keeps_concurrency_clients_busy(tok: Tokenizer) -> None:
    in_flight = [0, 0]
    res = load(
        tok,
        bc.TGIProtocol(),
        mock({"/generate_stream": (200, TGI_STREAM)}, delay=0.01, in_flight=in_flight),
        n=9,
        concurrency=3,
    )
    assert len(res.results) == 9 and all(r.ok for r in res.results)
    assert in_flight[1] == 3


def test_request_rate_follows_the_arrival_times(tok: Tokenizer) -> None:
    res = load(
        tok,
        bc.TGIProtocol(),
        mock({"/generate_stream": (200, TGI_STREAM)}),
        n=6,
        concurrency=None,
        request_rate=50.0,
        seed=4,
    )
    starts = [r.start for r in res.results]
    for got, want in zip(starts, poisson_arrivals(6, 50.0, seed=4)):
        assert got == pytest.approx(want, abs=0.05)
    assert all(b >= a - 0.01 for a, b in itertools.pairwise(starts))


# -- peers -------------------------------------------------------------------------------------------------
def test_llama_server_command() -> None:
    cmd = peers.llama_server_command("/opt/llama-server", "/m/model.gguf", 8123)
    assert cmd == [
        "/opt/llama-server",
        "-m",
        "/m/model.gguf",
        "-np",
        "16",
        "-c",
        "16384",
        "-t",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
    ]
    cmd = peers.llama_server_command("llama-server", Path("/m.gguf"), 9, "-np 4 -c 4096 -t 2 --cont-batching")
    assert cmd == [
        "llama-server",
        "-m",
        "/m.gguf",
        "-np",
        "4",
        "-c",
        "4096",
        "-t",
        "2",
        "--cont-batching",
        "--host",
        "127.0.0.1",
        "--port",
        "9",
    ]


def test_llama_server_target(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    t = peers.LlamaServerTarget(str(binary), model=tmp_path / "x.gguf", args="-np 2 -t 1")
    t.prepare()
    assert t.protocol == "openai" and t.send_ignore_eos
    assert t.build_command(5555) == [
        str(binary),
        "-m",
        str(tmp_path / "x.gguf"),
        "-np",
        "2",
        "-t",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        "5555",
    ]
    with pytest.raises(peers.PeerError, match="no executable"):
        peers.LlamaServerTarget(str(tmp_path / "missing")).prepare()
    # without a model it serves the default GGUF: tests/model/test_default_model_api.py


def test_llama_server_that_dies_is_reported(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'error: cannot load model' >&2\nexit 3\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    t = peers.LlamaServerTarget(str(binary), model=tmp_path / "x.gguf", startup_timeout=30, log_dir=tmp_path)
    with pytest.raises(peers.PeerError, match="exited with code 3(.|\n)*cannot load model"):
        t.start()
    assert t.proc is None


def test_pytgi_command() -> None:
    assert peers.pytgi_command(7, "--max-batch-size 8", python="py") == [
        "py",
        "-m",
        "pytgi.cli",
        "serve",
        "--hostname",
        "127.0.0.1",
        "--port",
        "7",
        "--max-batch-size",
        "8",
    ]


def test_transformers_serve_copy_has_no_eos(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 2, "bos_token_id": 1})
    )
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3], "bos_token_id": 1}))
    (src / "tokenizer.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    dst = peers.copy_without_eos(src, tmp_path / "dst")
    config = json.loads((dst / "config.json").read_text())
    gen = json.loads((dst / "generation_config.json").read_text())
    assert config == {"architectures": ["LlamaForCausalLM"], "eos_token_id": None, "bos_token_id": 1}
    assert gen == {"eos_token_id": None, "bos_token_id": 1}
    assert (dst / "model.safetensors").is_symlink() and (dst / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "config.json").read_text())["eos_token_id"] == 2  # the original is untouched
    (src / "generation_config.json").unlink()
    dst2 = peers.copy_without_eos(src, tmp_path / "dst2")
    assert json.loads((dst2 / "generation_config.json").read_text()) == {"eos_token_id": None}
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(peers.PeerError, match="architectures"):
        peers.copy_without_eos(src, tmp_path / "dst3")


def test_transformers_serve_command_and_target(tmp_path: Path, tokenizer_dir: Path) -> None:
    cmd = peers.transformers_serve_command(
        "/m", 8000, "python -m transformers.cli.transformers serve", "--dtype bfloat16"
    )
    assert cmd == [
        "python",
        "-m",
        "transformers.cli.transformers",
        "serve",
        "/m",
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--dtype",
        "bfloat16",
    ]
    t = peers.TransformersServeTarget(tokenizer_dir, cmd="transformers serve")
    t.prepare()
    try:
        assert t.protocol == "openai" and not t.send_ignore_eos and t.model == str(t.served_dir)
        assert json.loads((t.served_dir / "config.json").read_text())["eos_token_id"] is None
        built = t.build_command(1234)
        assert built[1:] == [
            "serve",
            str(t.served_dir),
            "--continuous-batching",
            "--host",
            "127.0.0.1",
            "--port",
            "1234",
        ]
        assert built[0].endswith("transformers")
    finally:
        t.cleanup()
    assert not t.served_dir.exists()


def test_parse_peer() -> None:
    assert peers.parse_peer("pytgi") == ("pytgi", None)
    assert peers.parse_peer("llama-server=/x/llama-server") == ("llama-server", "/x/llama-server")
    assert peers.parse_peer("transformers-serve") == ("transformers-serve", None)
    assert peers.parse_peer("openai=http://h:1") == ("openai", "http://h:1")
    for bad in ("vllm", "llama-server", "tgi="):
        with pytest.raises(ValueError):
            peers.parse_peer(bad)


# -- the command line ------------------------------------------------------------------------------------
def parse(*argv: str):
    from pytgi.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_cli_targets() -> None:
    from pytgi.bench.command import build_targets

    args = parse(
        "--peer",
        "llama-server=/bin/ls",
        "--llama-server-args",
        "-np 4 -c 4096",
        "--peer",
        "transformers-serve",
        "--sweep-concurrency",
        "1,2,4",
    )
    assert args.sweep_concurrency == [1, 2, 4]
    targets = build_targets(args)
    assert [t.name for t in targets] == ["pytgi", "llama-server", "transformers-serve"]
    assert targets[1].args == "-np 4 -c 4096" and targets[0].protocol == "tgi"  # type: ignore[attr-defined]
    targets = build_targets(
        parse("--url", "http://h:3000/", "--protocol", "openai", "--peer", "tgi=http://h:3000")
    )
    assert [(t.name, t.protocol, t.url) for t in targets] == [
        ("h:3000", "openai", "http://h:3000/"),
        ("h:3000#2", "tgi", "http://h:3000"),
    ]
    targets = build_targets(parse("--peer", "transformers-serve", "--peer", "pytgi"))
    assert [t.name for t in targets] == ["transformers-serve", "pytgi"]
    with pytest.raises(SystemExit):
        parse("--sweep-concurrency", "1,x")
    with pytest.raises(SystemExit):
        parse("--peer", "vllm")


def test_bench_never_imports_torch(tokenizer_dir: Path) -> None:
    code = (
        "import sys\nfrom pytgi.cli import build_parser\nbuild_parser()\n"
        # building the parser alone (as `pytgi serve` does) needs none of the bench's dependencies
        "assert 'httpx' not in sys.modules\n"
        "import pytgi.bench.command, pytgi.bench.peers, pytgi.bench.report, pytgi.bench.workload\n"
        f"from pytgi.bench.workload import load_tokenizer\nload_tokenizer({str(tokenizer_dir)!r})\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\nassert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_peak_rss_of_a_process_tree_counts_its_children() -> None:
    """A parent whose child holds 200 MB for a moment: the peak of the tree sees the child's pages."""
    import subprocess
    import sys

    from pytgi.bench.procs import PeakRss, tree_rss

    child = "import time; b = bytearray(200 << 20); time.sleep(1.5)"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"]
    )
    peak = PeakRss(parent.pid, every=0.05)
    parent.wait(30)
    assert peak.stop() >= 200 << 20 and tree_rss(parent.pid) == 0
