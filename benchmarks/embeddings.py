"""Embeddings serving benchmark: pytgi against sentence-transformers, llama.cpp's server and fastembed.

What it measures
    One seeded workload of synthetic English-like sentences (default 10,000), their lengths spread evenly
    over 8..256 tokens as all-MiniLM-L6-v2's own tokenizer counts them ([CLS] and [SEP] included). Each
    selected peer embeds them all, on the same model, one peer at a time:

    * ``pytgi``                 -- `pytgi serve --model-id MODEL --dtype float32`, OpenAI `/v1/embeddings`;
    * ``pytgi-bf16``            -- the same with `--dtype bfloat16` (bf16 weights and activations);
    * ``llama-server``          -- llama.cpp's server `--embedding --pooling mean` on a GGUF of the same
                                   weights (f32 by default), its OpenAI-compatible `/v1/embeddings`;
    * ``sentence-transformers`` -- in-process `SentenceTransformer(MODEL).encode(all, batch_size=32)`;
    * ``fastembed``             -- in-process fastembed (ONNX Runtime) on an ONNX export of the model,
                                   `embed(all, batch_size=32)`, mean pooling + L2 norm as fastembed does.

    Servers get `--concurrency` (16) async clients, each sending one sentence per request; reported:
    sentences/s, p50/p99 request latency, then a second pass over the first `--latency-sentences` at
    `--latency-concurrency` (4) clients for its p99. In-process peers (run in a subprocess of their own,
    so their memory is theirs alone) report sentences/s over the whole `encode` call; they have no request
    latency (n/a). For every peer: start time (process start to /health 200, or to the model loaded),
    the peak RSS of its process tree (sampled every 0.25 s), and fidelity -- the mean and min cosine of
    its vectors against sentence-transformers' float32 ones over the first 200 sentences. The clients
    run on the same machine as the servers (their JSON parsing takes CPU from them too).

Setup (once): the GGUFs with llama.cpp's converter, the ONNX export, and a venv for fastembed
    python3 -m venv /tmp/embbench/venv
    /tmp/embbench/venv/bin/pip install onnxruntime fastembed onnx onnxscript
    .venv/bin/python benchmarks/embeddings.py --make-artifacts      # GGUF f32 + f16, ONNX, into /tmp/embbench
    (the GGUFs come from llama.cpp's convert_hf_to_gguf.py run by `--convert-python`, a python with its
    requirements; the ONNX export runs here, on this venv's torch, borrowing `onnx` from that venv)

How to run
    .venv/bin/python benchmarks/embeddings.py                            # every available peer, 10k sentences
    .venv/bin/python benchmarks/embeddings.py --num-sentences 300 --peer pytgi      # a quick look
    .venv/bin/python benchmarks/embeddings.py --peer llama-server --gguf /tmp/embbench/minilm-f16.gguf
A markdown table goes to stdout; the record to ``benchmarks/results/embeddings-<timestamp>.json`` (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORK = Path("/tmp/embbench")
LLAMA_CPP = Path("/tmp/llama_cpp_python-0.3.36")
PEERS = ("sentence-transformers", "pytgi", "pytgi-bf16", "llama-server", "fastembed")  # the reference first
SERVERS = ("pytgi", "pytgi-bf16", "llama-server")
# each slot holds one sentence (<= 256 tokens, 512 per slot); one ubatch may carry several slots' inputs
# but never splits one (a BERT's input must fit one ubatch)
DEFAULT_LLAMA_ARGS = "--embedding --pooling mean -np 16 -c 8192 -b 2048 -ub 2048"
FIDELITY_N = 200
BATCH = 32


# -- workload -----------------------------------------------------------------------------------------
VOCAB = """
det: the a this that every one some another each no
adj: small old bright quiet heavy narrow distant careful modern ancient simple strange warm cold green
adj: broken hidden public local final useful rapid gentle steady
noun: river engineer village report market teacher window garden machine letter bridge station committee
noun: farmer harbour library storm kitchen mountain doctor question budget signal record forest festival
verb: found moved watched built opened crossed painted described repaired ignored measured followed
verb: visited carried explained replaced checked noticed protected reviewed
adv: quickly slowly often rarely quietly suddenly carefully finally again nearly
prep: near under behind across beside inside after before during through
join: , ; and but while because so
filler: then also still very just
"""  # filler: one token each, pads a sentence to its exact length
W: dict[str, list[str]] = {}
for _line in VOCAB.strip().splitlines():
    _kind, _, _words = _line.partition(": ")
    W.setdefault(_kind, []).extend(_words.split())


def clause(rng: random.Random) -> list[str]:
    def some(kind: str, p: float = 1.0) -> list[str]:
        return [rng.choice(W[kind])] if rng.random() < p else []

    ws = some("det") + some("adj", 0.6) + some("noun") + some("adv", 0.3) + some("verb") + some("det")
    ws += some("adj", 0.5) + some("noun")
    return ws + (some("prep") + some("det") + some("noun") if rng.random() < 0.7 else [])


def make_sentences(n: int, tokenizer_json: Path, seed: int, lo: int = 8, hi: int = 256) -> list[str]:
    """`n` sentences, each exactly a uniformly drawn 8..256 tokens long ([CLS] and [SEP] included).

    A WordPiece tokenizer splits on spaces and punctuation first, so a sentence's token count is the sum
    of its words' counts: words are added while they fit, then one-token fillers close the gap."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.no_padding()  # all-MiniLM-L6-v2's file pads (and truncates) to 128
    tok.no_truncation()
    cost = {w: len(tok.encode(w, add_special_tokens=False).ids) for ws in W.values() for w in [*ws, "."]}
    assert all(cost[w] == 1 for w in [*W["filler"], "."]), "fillers must be one token each"
    rng, out, targets = random.Random(seed), [], []
    for _ in range(n):
        targets.append(rng.randint(lo, hi))
        target = targets[-1] - 3  # [CLS], [SEP] and the final "."
        picked: list[str] = []
        used = 0
        full = False
        while not full:
            for w in ([rng.choice(W["join"])] if picked else []) + clause(rng):
                if used + cost[w] > target:
                    full = True
                    break
                picked.append(w)
                used += cost[w]
        while used < target:
            picked.insert(rng.randint(1, max(1, len(picked) - 1)), rng.choice(W["filler"]))
            used += 1
        text = " ".join(picked).replace(" ,", ",").replace(" ;", ";") + "."
        out.append(text[0].upper() + text[1:])
    lengths = [len(e.ids) for e in tok.encode_batch(out)]
    assert lengths == targets, "a sentence's tokens are not its words' tokens"
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def cosines(vecs: list[list[float]], ref: list[list[float]]) -> dict[str, float]:
    cos = []
    for a, b in zip(vecs, ref, strict=True):
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        cos.append(dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))))
    return {"mean": sum(cos) / len(cos), "min": min(cos)}


def summary(ready: float, wall: float, cpu: float, n: int, lat: list[float], low: list[float]) -> dict:
    """One peer's figures (latencies in seconds in, milliseconds out; None where it has none)."""
    pairs = (("", lat), ("_low", low))
    ms = {f"p{q}_ms{tag}": (1e3 * pct(xs, q) if xs else None) for tag, xs in pairs for q in (50, 99)}
    return {"ready_s": ready, "wall_s": wall, "cpu_s": cpu, "sent_per_s": n / wall, **ms}


# -- servers --------------------------------------------------------------------------------------------
async def drive(url: str, sentences: list[str], concurrency: int) -> tuple[float, list[float]]:
    """`concurrency` clients, each posting one sentence at a time until none is left."""
    import httpx

    todo, latencies = iter(sentences), []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one_client() -> None:
            for text in todo:  # shared: each sentence goes to whichever client is free first
                t0 = time.perf_counter()
                r = await client.post("/v1/embeddings", json={"input": text, "encoding_format": "float"})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)
                if not r.json()["data"][0]["embedding"]:
                    raise RuntimeError(f"empty embedding from {url}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies


def server_vectors(url: str, sentences: list[str], chunk: int = 25) -> list[list[float]]:
    import httpx

    vecs: list[list[float]] = []
    for i in range(0, len(sentences), chunk):
        r = httpx.post(url + "/v1/embeddings", json={"input": sentences[i : i + chunk]}, timeout=600)
        r.raise_for_status()
        vecs += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    return vecs


def run_server(args: argparse.Namespace, name: str, sentences: list[str]) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from pytgi.bench.peers import LlamaServerTarget, PytgiTarget
    from pytgi.bench.procs import cpu_ticks, descendants

    if name.startswith("pytgi"):
        more = args.pytgi_bf16_args if name == "pytgi-bf16" else args.pytgi_args
        flags = f"--model-id {shlex.quote(args.model)} {more}"
        target = PytgiTarget(extra_args=flags, log_dir=WORK / "logs")
    else:
        flags = f"{args.llama_args} -t {args.threads}"
        target = LlamaServerTarget(args.llama_server, args.gguf, flags, log_dir=WORK / "logs")
    with target:
        print(f"[{name}] healthy after {target.ready_s:.1f}s: {shlex.join(target.command)}", flush=True)
        vecs = server_vectors(target.url, sentences[:FIDELITY_N])  # also the warm-up
        assert target.proc is not None
        tree = [target.proc.pid, *descendants(target.proc.pid)]
        ticks = sum(map(cpu_ticks, tree))
        wall, lat = asyncio.run(drive(target.url, sentences, args.concurrency))
        cpu = (sum(map(cpu_ticks, tree)) - ticks) / os.sysconf("SC_CLK_TCK")
        few = sentences[: args.latency_sentences]
        _, lat4 = asyncio.run(drive(target.url, few, args.latency_concurrency))
        info = target.describe()
    row = summary(target.ready_s or 0.0, wall, cpu, len(sentences), lat, lat4)
    return {
        **row,
        "peak_rss_bytes": target.peak_rss,
        "command": info["command"],
        "log": str(target.log_path),
        "vectors": vecs,
    }


# -- in-process peers, each in a subprocess of its own ----------------------------------------------------
def worker(kind: str, job_path: str, born: float) -> None:
    """Runs in the child: load, embed the fidelity slice (the warm-up), then time one pass over all."""
    job = json.loads(Path(job_path).read_text())
    sentences, threads = job["sentences"], job["threads"]
    if kind == "sentence-transformers":
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        dtype = job["st_dtype"]
        kwargs = {} if dtype == "auto" else {"model_kwargs": {"dtype": getattr(torch, dtype)}}
        model = SentenceTransformer(job["model"], device="cpu", **kwargs)

        def embed(xs: list[str]) -> list[list[float]]:
            return model.encode(xs, batch_size=BATCH, convert_to_numpy=True).tolist()
    else:
        from fastembed import TextEmbedding
        from fastembed.common.model_description import ModelSource, PoolingType

        name = "pytgi-bench/all-MiniLM-L6-v2-onnx"
        TextEmbedding.add_custom_model(
            name,
            pooling=PoolingType.MEAN,
            normalization=True,
            sources=ModelSource(hf=name),
            dim=384,
            model_file="model.onnx",
        )
        model = TextEmbedding(name, specific_model_path=job["onnx_dir"], threads=threads)

        def embed(xs: list[str]) -> list[list[float]]:
            return [v.tolist() for v in model.embed(xs, batch_size=BATCH)]

    ready = time.time() - born
    vecs = embed(sentences[:FIDELITY_N])
    t0, cpu = time.perf_counter(), time.process_time()
    n = len(embed(sentences))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    Path(job["result"]).write_text(
        json.dumps({"ready_s": ready, "wall_s": wall, "cpu_s": cpu, "n": n, "vectors": vecs})
    )


def run_inprocess(args: argparse.Namespace, name: str, sentences: list[str]) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from pytgi.bench.procs import PeakRss

    python = sys.executable if name == "sentence-transformers" else args.fastembed_python
    with tempfile.TemporaryDirectory(prefix="embbench-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        given = {k: getattr(args, k) for k in ("threads", "model", "onnx_dir", "st_dtype")}
        job.write_text(json.dumps({"sentences": sentences, "result": str(result), **given}))
        cmd = [python, __file__, "--worker", name, str(job), str(time.time())]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # fastembed and transformers: never the Hub
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        rss = PeakRss(proc.pid)
        try:
            rc = proc.wait()
        finally:
            peak = rss.stop()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if rc != 0:
            raise RuntimeError(f"{name} worker exited with {rc}: {shlex.join(cmd)}")
        out = json.loads(result.read_text())
    row = summary(out["ready_s"], out["wall_s"], out["cpu_s"], out["n"], [], [])
    return {**row, "peak_rss_bytes": peak, "command": cmd[:4], "vectors": out["vectors"]}


# -- artifacts ------------------------------------------------------------------------------------------
def make_artifacts(args: argparse.Namespace) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    convert = LLAMA_CPP / "vendor/llama.cpp/convert_hf_to_gguf.py"
    for outtype in ("f32", "f16"):
        out = WORK / f"minilm-{outtype}.gguf"
        if not out.exists():
            cmd = [args.convert_python, str(convert), args.model, "--outtype", outtype, "--outfile", str(out)]
            subprocess.run(cmd, check=True)
        print(f"GGUF: {out}")
    onnx_dir = Path(args.onnx_dir)
    if not (onnx_dir / "model.onnx").exists():
        export_onnx(Path(args.model), onnx_dir, Path(args.fastembed_python))
    print(f"ONNX: {onnx_dir / 'model.onnx'}")


def export_onnx(model_dir: Path, out: Path, peer_python: Path) -> None:
    """transformers' BertModel -> ONNX (last_hidden_state; pooling and norm are fastembed's), with the
    legacy TorchScript exporter. It needs the `onnx` package, borrowed from the fastembed venv."""
    import shutil

    site = next((peer_python.parent.parent / "lib").glob("python3*/site-packages"))
    sys.path.append(str(site))  # after this venv's own packages: its numpy and torch win
    import torch
    from transformers import AutoModel

    class Hidden(torch.nn.Module):  # BertModel's forward takes no positional mask: named here
        def __init__(self) -> None:
            super().__init__()
            self.bert = AutoModel.from_pretrained(model_dir).eval()

        def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def]
            return self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    out.mkdir(parents=True, exist_ok=True)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    ids = torch.ones(2, 8, dtype=torch.long)
    torch.onnx.export(
        Hidden(),
        (ids, ids, torch.zeros_like(ids)),
        str(out / "model.onnx"),
        dynamo=False,
        input_names=names,
        output_names=["last_hidden_state"],
        opset_version=17,
        dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "last_hidden_state"]},
    )
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(model_dir / f, out / f)


# -- main -----------------------------------------------------------------------------------------------
def unavailable(args: argparse.Namespace, name: str) -> str | None:
    """Why `name` cannot run here, or None."""
    if name == "llama-server" and not Path(args.llama_server).is_file():
        return f"no llama-server binary at {args.llama_server}"
    if name == "llama-server" and not Path(args.gguf).is_file():
        return f"no GGUF at {args.gguf} (run --make-artifacts)"
    if name == "fastembed" and not Path(args.fastembed_python).is_file():
        return f"no python at {args.fastembed_python} (a venv with fastembed and onnxruntime)"
    if name == "fastembed" and not (Path(args.onnx_dir) / "model.onnx").is_file():
        return f"no {args.onnx_dir}/model.onnx (run --make-artifacts)"
    return None


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    c, lc = args.concurrency, args.latency_concurrency
    head = ["peer", "start s", f"sent/s @{c}", f"p50 ms @{c}", f"p99 ms @{c}", f"p99 ms @{lc}", "cores used"]
    head += ["peak RSS MiB", "cos mean", "cos min"]
    print("\n| " + " | ".join(head) + " |\n|---" + "|---:" * (len(head) - 1) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['peer']} | {r['error'][:100]} |" + " |" * (len(head) - 2))
            continue
        fid = r.get("fidelity") or {}
        lat = [fmt(r[k]) for k in ("p50_ms", "p99_ms", "p99_ms_low")]
        use = [f"{r['cpu_s'] / r['wall_s']:.2f}", f"{r['peak_rss_bytes'] / 2**20:.0f}"]
        cos = [fmt(fid.get(k), ".6f") for k in ("mean", "min")]
        cells = [r["peer"], f"{r['ready_s']:.1f}", f"{r['sent_per_s']:.1f}", *lat, *use, *cos]
        print("| " + " | ".join(cells) + " |")
    print(f"\nin-process peers: one encode() over all sentences, batch {BATCH}, no request latency (n/a)")
    print(
        f"cores used: the peer's CPU seconds over the @{c} pass / its wall time ({os.cpu_count()} cores here;"
    )
    print("far below --threads while the machine is busy = starved by other processes: rerun)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", action="append", choices=PEERS, help="repeatable; default: all available")
    ap.add_argument("--num-sentences", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--latency-concurrency", type=int, default=4)
    ap.add_argument("--latency-sentences", type=int, default=2000, help="sent again at --latency-concurrency")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server, torch, ORT")
    ap.add_argument("--model", default="/tmp/minilm", help="the sentence-transformers directory")
    ap.add_argument(
        "--st-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="sentence-transformers' dtype (auto: the checkpoint's, as it loads it by default)",
    )
    ap.add_argument("--pytgi-args", default="--dtype float32", help="more `pytgi serve` flags")
    ap.add_argument("--pytgi-bf16-args", default="--dtype bfloat16", help="... for the pytgi-bf16 peer")
    ap.add_argument("--llama-server", default=str(LLAMA_CPP / "build/bin/llama-server"))
    ap.add_argument("--gguf", default=str(WORK / "minilm-f32.gguf"))
    ap.add_argument("--llama-args", default=DEFAULT_LLAMA_ARGS, help="llama-server flags (-t from --threads)")
    ap.add_argument("--fastembed-python", default=str(WORK / "venv/bin/python"))
    ap.add_argument("--onnx-dir", default=str(WORK / "minilm-onnx"))
    ap.add_argument("--convert-python", default="/tmp/llama/venv/bin/python", help="has gguf-py's deps")
    ap.add_argument("--make-artifacts", action="store_true", help="make the GGUFs and the ONNX export, exit")
    ap.add_argument("--out", type=Path, help="the JSON record (default benchmarks/results/embeddings-*.json)")
    ap.add_argument("--worker", nargs=3, metavar=("KIND", "JOB", "BORN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], float(args.worker[2]))
        return 0
    if args.make_artifacts:
        make_artifacts(args)
        return 0

    # a `kill` unwinds like Ctrl-C: the servers and workers started so far are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also where a shell started it ignoring ^C
    sentences = make_sentences(args.num_sentences, Path(args.model) / "tokenizer.json", args.seed)
    print(f"{len(sentences)} sentences (seed {args.seed}), e.g. {sentences[0][:100]!r}", flush=True)
    wanted = args.peer or list(PEERS)
    rows: list[dict[str, Any]] = []
    ref: list[list[float]] | None = None
    for name in sorted(set(wanted), key=PEERS.index):
        if why := unavailable(args, name):
            print(f"[{name}] skipped: {why}", flush=True)
            rows.append({"peer": name, "error": f"skipped: {why}"})
            continue
        print(f"[{name}] running ...", flush=True)
        try:
            run = run_server if name in SERVERS else run_inprocess
            row = {"peer": name, **run(args, name, sentences)}
            vecs = row.pop("vectors")
            if name == "sentence-transformers":
                ref = vecs
            elif ref is None:  # not selected: a reference-only pass over the fidelity slice
                ref = run_inprocess(args, "sentence-transformers", sentences[:FIDELITY_N])["vectors"]
        except Exception as e:  # noqa: BLE001 - one peer failing does not lose the others' figures
            print(f"[{name}] failed: {e}", flush=True)
            rows.append({"peer": name, "error": f"failed: {str(e).splitlines()[0]}"})
            continue
        row["fidelity"] = cosines(vecs, ref)
        print(
            f"[{name}] {row['sent_per_s']:.1f} sentences/s; cosine vs sentence-transformers over "
            f"{len(vecs)}: mean {row['fidelity']['mean']:.6f}, min {row['fidelity']['min']:.6f}",
            flush=True,
        )
        rows.append(row)

    print_table(rows, args)
    record = {
        "benchmark": "embeddings",
        "time": datetime.now(timezone.utc).isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "lengths": "uniform 8..256 tokens, [CLS] and [SEP] included",
        "rows": rows,
    }
    out = args.out or REPO / f"benchmarks/results/embeddings-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"record: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
