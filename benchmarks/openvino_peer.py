"""pytgi's offline engine against OpenVINO GenAI's continuous-batching pipeline (issue 30's table).

What it measures
    The same workloads on the same model (the default SmolLM2-135M-Instruct: pytgi on its GGUF with the
    default flags, OpenVINO on its Hugging Face copy exported by optimum-intel), the same token-id prompts
    (random ids, seeded), greedy, every request exactly its output length (EOS ignored), 2 threads:

    * ``mix``     -- 64 requests, 256 in / 128 out: total (prompt + output) tok/s;
    * ``prefill`` -- 16 requests, 1024 in / 8 out: total tok/s;
    * ``decode``  -- 64 requests, 32 in / 256 out: output tok/s;
    * ``single``  -- 1 request, 128 in / 256 out: output tok/s.

    pytgi runs in this process (`pytgi.LLM`); OpenVINO in a subprocess of its own virtual environment
    (`ContinuousBatchingPipeline`, `INFERENCE_NUM_THREADS` 2). Prefix caching is off on both sides (the
    repeats send the same prompts). Each workload runs
    `--repeats` times per engine, the engines alternating; the median wall time is reported, after a
    warm-up of each. Wall time covers `generate` alone (model load and compilation excluded).

Setup (once; the OpenVINO side needs its own venv, its torch and transformers differ from pytgi's)
    python3 -m venv .venv-openvino
    .venv-openvino/bin/pip install openvino-genai==2026.4.1.0 "optimum-intel[openvino]" nncf
    BASE=$(.venv/bin/python -c "from pytgi.models.registry import resolve_model; print(resolve_model(None).path)")
    .venv-openvino/bin/optimum-cli export openvino --model "$BASE" --task text-generation-with-past \\
        --weight-format int8 benchmarks/openvino-models/smollm2-int8
    # and, for the int4 row: --weight-format int4 --group-size 32 --ratio 1.0 ... smollm2-int4

How to run
    .venv/bin/python benchmarks/openvino_peer.py --ov-model benchmarks/openvino-models/smollm2-int8
    .venv/bin/python benchmarks/openvino_peer.py --ov-model DIR --workloads prefill single --repeats 1
A markdown table goes to stdout; the record to ``benchmarks/results/openvino-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {  # name → (requests, prompt tokens, output tokens, what tok/s counts)
    "mix": (64, 256, 128, "total"),
    "prefill": (16, 1024, 8, "total"),
    "decode": (64, 32, 256, "output"),
    "single": (1, 128, 256, "output"),
}


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


# -- the OpenVINO side (run with the OpenVINO venv's python) -------------------------------------------
def ov_worker(model: str, jobs: list[dict], threads: int) -> None:
    """Read the workloads, run each (warm-up first), print one JSON line of wall times."""
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    sched = genai.SchedulerConfig()
    sched.cache_size = 2  # GB of KV cache
    sched.enable_prefix_caching = False
    sched.max_num_batched_tokens = 1024
    sched.max_num_seqs = 64
    pipe = genai.ContinuousBatchingPipeline(model, sched, "CPU", {"INFERENCE_NUM_THREADS": threads})
    out = []
    for job in jobs:
        ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p in job["prompts"]]
        config = genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = job["new"]
        config.ignore_eos = True
        config.do_sample = False
        pipe.generate(ids[:2], [config] * min(2, len(ids)))  # warm-up
        times, outputs = [], None
        for _ in range(job["repeats"]):
            t0 = time.perf_counter()
            results = pipe.generate(ids, [config] * len(ids))
            times.append(time.perf_counter() - t0)
            outputs = [list(r.m_generation_ids[0]) for r in results]
        outputs = outputs or [[]]
        out.append({"times": times, "lengths": [len(o) for o in outputs], "first": outputs[0][:16]})
    print(json.dumps(out))


# -- pytgi's side ------------------------------------------------------------------------------------------
def pytgi_run(llm, prompts: list[list[int]], new: int, repeats: int) -> dict:
    from pytgi.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    times, outs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    return {"times": times, "lengths": [len(o.token_ids) for o in outs], "first": outs[0].token_ids[:16]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ov-model", help="the exported OpenVINO model directory")
    ap.add_argument("--ov-python", default=str(ROOT / ".venv-openvino" / "bin" / "python"))
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # the OpenVINO side: a JSON file of workloads
    args = ap.parse_args()
    if args.worker:
        ov_worker(args.ov_model, json.loads(Path(args.worker).read_text()), args.threads)
        return
    if not args.ov_model:
        ap.error("--ov-model is required (see the setup in this file's docstring)")

    sys.path.insert(0, str(ROOT))
    from pytgi import LLM

    # no prefix cache (OpenVINO's is off too): the repeats send the same prompts
    llm = LLM(max_batch_total_tokens=98304, max_total_tokens=2048, enable_prefix_caching=False)
    vocab = llm.tokenizer.vocab_size
    jobs = []
    for i, name in enumerate(args.workloads):
        n, length, new, _ = WORKLOADS[name]
        jobs.append({"name": name, "prompts": prompts_for(n, length, vocab, args.seed + i), "new": new,
                     "repeats": args.repeats})
    spec = ROOT / "benchmarks" / "results" / f".openvino-jobs-{datetime.now():%Y%m%d-%H%M%S}.json"
    spec.parent.mkdir(exist_ok=True)
    spec.write_text(json.dumps(jobs))
    mine = [pytgi_run(llm, job["prompts"], job["new"], args.repeats) for job in jobs]
    llm.shutdown()
    worker = [args.ov_python, __file__, "--worker", str(spec), "--ov-model", args.ov_model,
              "--threads", str(args.threads)]
    done = subprocess.run(worker, capture_output=True, text=True, check=False)
    spec.unlink()
    if done.returncode != 0:
        sys.exit(f"the OpenVINO side failed:\n{done.stderr[-3000:]}")
    theirs = json.loads(done.stdout.strip().splitlines()[-1])

    print(f"pytgi vs OpenVINO GenAI ({Path(args.ov_model).name}), {args.threads} threads, "
          f"median of {args.repeats}\n")
    print("| workload | tok/s counted | pytgi | OpenVINO | ratio | same first tokens |")
    print("|---|---|---:|---:|---:|---|")
    rows = []
    for job, a, b in zip(jobs, mine, theirs):
        n, length, new, counted = WORKLOADS[job["name"]]
        tokens = n * (new + (length if counted == "total" else 0))
        ours, peer = tokens / statistics.median(a["times"]), tokens / statistics.median(b["times"])
        exact = all(x == new for x in a["lengths"] + b["lengths"])
        assert exact, "a request did not produce its exact length"
        same = a["first"] == b["first"]
        rows.append({"workload": job["name"], "counted": counted, "pytgi": ours, "openvino": peer,
                     "ratio": ours / peer, "same_first_tokens": same, "pytgi_times": a["times"],
                     "openvino_times": b["times"]})
        print(f"| {job['name']} ({n} x {length}/{new}) | {counted} | {ours:.1f} | {peer:.1f} | "
              f"{ours / peer:.2f}x | {'yes' if same else 'no'} |")
    record = {"args": vars(args), "machine": platform.processor() or platform.machine(),
              "date": datetime.now(timezone.utc).isoformat(), "rows": rows}
    out = ROOT / "benchmarks" / "results" / f"openvino-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps(record, indent=2))
    print(f"\nrecord: {out}")


if __name__ == "__main__":
    main()
