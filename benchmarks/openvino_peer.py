"""pytgi's offline engine against OpenVINO GenAI's continuous-batching pipeline (issue 30's table).

What it measures
    The same workloads on the same model (the default SmolLM2-135M-Instruct: pytgi on its GGUF with the
    default flags, OpenVINO on its Hugging Face copy exported by optimum-intel), the same token-id prompts
    (random ids, seeded), greedy, every request exactly its output length (EOS ignored), 2 threads:

    * ``mix``     -- 64 requests, 256 in / 128 out: total (prompt + output) tok/s;
    * ``prefill`` -- 16 requests, 1024 in / 8 out: total tok/s;
    * ``decode``  -- 64 requests, 32 in / 256 out: output tok/s;
    * ``single``  -- 1 request, 128 in / 256 out: output tok/s.

    pytgi runs in this process (`pytgi.LLM`); OpenVINO in a worker process of its own virtual environment
    (`ContinuousBatchingPipeline`, `INFERENCE_NUM_THREADS` 2), started once. Prefix caching is off on
    both sides (the repeats send the same prompts). After a warm-up of each, every workload runs
    `--repeats` times per engine, the engines alternating run by run (this VM's speed drifts by tens of
    percent over minutes, so runs far apart in time do not compare); the median wall time is reported.
    Wall time covers `generate` alone (model load and compilation excluded).

    Two more columns:

    * **fidelity**: the mean negative log-likelihood per token of a held-out text (the first 1,500
      tokens of docs/architecture.md, as benchmarks/fidelity.py) under each engine, less the same under
      float32 on the same weights (pytgi's float32 path on the GGUF's own values, which the exported
      model was made from). OpenVINO's figure comes from optimum-intel's `OVModelForCausalLM` on the
      exported model: the same weights and kernels the pipeline runs.
    * **roofline**: the multiply-adds a workload needs (the model's linears for every token through
      them, its LM head for every generated token, attention's Q·K and P·V for every token's context)
      over pytgi's wall time, as a fraction of this CPU's int8 peak: cores × clock × int8 multiply-adds
      per cycle, measured by benchmarks/peak.c (compiled here with the system C compiler). Attention
      runs in bf16, whose peak is half int8's on AVX-512, so the fraction understates it there.

Setup (once; the OpenVINO side needs its own venv, its torch and transformers differ from pytgi's)
    python3 -m venv .venv-openvino
    .venv-openvino/bin/pip install openvino-genai==2026.4.1.0 "optimum-intel[openvino]" nncf
    BASE=$(.venv/bin/python -c \
        "from pytgi.core.model_files import resolve_model; print(resolve_model(None).path)")
    .venv-openvino/bin/optimum-cli export openvino --model "$BASE" --task text-generation-with-past \\
        --weight-format int8 benchmarks/openvino-models/smollm2-int8
    # and, for the int4 row: --weight-format int4 --group-size 32 --ratio 1.0 --sym ... smollm2-int4

How to run
    .venv/bin/python benchmarks/openvino_peer.py --ov-model benchmarks/openvino-models/smollm2-int8
    .venv/bin/python benchmarks/openvino_peer.py --ov-model DIR --workloads prefill --repeats 1 --no-fidelity
A markdown table goes to stdout; the record to ``benchmarks/results/openvino-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
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
FIDELITY_TEXT, FIDELITY_CHARS, FIDELITY_TOKENS = ROOT / "docs" / "architecture.md", 6000, 1500


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


# -- the OpenVINO side (run with the OpenVINO venv's python) -------------------------------------------
def ov_worker(model: str, threads: int) -> None:
    """Serve commands from stdin, one JSON line each, answering one JSON line on stdout:
    {"run": prompts, "new": n} → wall time and outputs; {"nll": ids} → mean NLL per token."""
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    sched = genai.SchedulerConfig()
    sched.cache_size = 2  # GB of KV cache
    sched.enable_prefix_caching = False
    sched.max_num_batched_tokens = 1024
    sched.max_num_seqs = 64
    pipe = genai.ContinuousBatchingPipeline(model, sched, "CPU", {"INFERENCE_NUM_THREADS": threads})
    for line in sys.stdin:
        cmd = json.loads(line)
        if "nll" in cmd:
            import torch
            from optimum.intel import OVModelForCausalLM

            lm = OVModelForCausalLM.from_pretrained(model, ov_config={"INFERENCE_NUM_THREADS": str(threads)})
            ids = torch.tensor([cmd["nll"]])
            logits = lm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])
            answer: dict = {"nll": -lp.mean().item()}
        else:
            ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p in cmd["run"]]
            config = genai.GenerationConfig()
            config.max_new_tokens = config.min_new_tokens = cmd["new"]
            config.ignore_eos = True
            config.do_sample = False
            t0 = time.perf_counter()
            results = pipe.generate(ids, [config] * len(ids))
            outputs = [list(r.m_generation_ids[0]) for r in results]
            answer = {"time": time.perf_counter() - t0, "lengths": [len(o) for o in outputs],
                      "first": outputs[0][:16]}
        print(json.dumps(answer), flush=True)


class OpenVINO:
    """The worker process, started once."""

    def __init__(self, python: str, model: str, threads: int) -> None:
        cmd = [python, __file__, "--worker", "--ov-model", model, "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, cmd: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            sys.exit("the OpenVINO worker died (its error is above)")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# -- pytgi's side ------------------------------------------------------------------------------------------
def pytgi_run(llm, prompts: list[list[int]], new: int) -> dict:
    from pytgi.core.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return {"time": time.perf_counter() - t0, "lengths": [len(o.token_ids) for o in outs],
            "first": outs[0].token_ids[:16]}


# -- the roofline --------------------------------------------------------------------------------------
def peak(threads: int) -> dict | None:
    """benchmarks/peak.c's figures for this core, and the int8 peak of `threads` cores (MAC/s)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "peak"
        source = str(ROOT / "benchmarks" / "peak.c")
        subprocess.run([cc, "-O2", "-march=native", source, "-o", str(exe)], check=True)
        probe = json.loads(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)
    probe["int8_peak_macs"] = threads * probe["clock_ghz"] * 1e9 * probe["int8_macs_per_cycle"]
    return probe


def macs(config: dict, n: int, prompt: int, new: int) -> float:
    """Multiply-adds of n requests of `prompt` tokens in and `new` out (see the docstring)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    q = heads * head_dim
    linear = layers * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config["intermediate_size"])
    through = prompt + new - 1  # every token but the last generated one goes through the layers
    attention = layers * 2 * q * through * (through + 1) // 2  # Q·K and P·V: token p over p + 1 keys
    return n * (linear * through + attention + new * hidden * config["vocab_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ov-model", help="the exported OpenVINO model directory")
    ap.add_argument("--ov-python", default=str(ROOT / ".venv-openvino" / "bin" / "python"))
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fidelity", dest="fidelity", action="store_false", help="skip the fidelity column")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the OpenVINO side
    args = ap.parse_args()
    if args.worker:
        ov_worker(args.ov_model, args.threads)
        return
    if not args.ov_model:
        ap.error("--ov-model is required (see the setup in this file's docstring)")

    sys.path.insert(0, str(ROOT))
    from pytgi import LLM

    probe = peak(args.threads)  # first, while nothing else runs
    # no prefix cache (OpenVINO's is off too): the repeats send the same prompts
    llm = LLM(max_batch_total_tokens=98304, max_total_tokens=2048, enable_prefix_caching=False)
    config = json.loads((Path(llm.engine.model_path) / "config.json").read_text())
    vocab = llm.tokenizer.vocab_size
    peer = OpenVINO(args.ov_python, args.ov_model, args.threads)
    rows = []
    for i, name in enumerate(args.workloads):
        n, length, new, counted = WORKLOADS[name]
        prompts = prompts_for(n, length, vocab, args.seed + i)
        pytgi_run(llm, prompts[:2], new)  # warm-up
        peer.ask({"run": prompts[:2], "new": new})
        mine, theirs = [], []
        for _ in range(args.repeats):  # alternating
            mine.append(pytgi_run(llm, prompts, new))
            theirs.append(peer.ask({"run": prompts, "new": new}))
        assert all(x == new for r in mine + theirs for x in r["lengths"]), "a request missed its exact length"
        tokens = n * (new + (length if counted == "total" else 0))
        t_mine = statistics.median(r["time"] for r in mine)
        t_theirs = statistics.median(r["time"] for r in theirs)
        roof = macs(config, n, length, new) / t_mine / probe["int8_peak_macs"] if probe else None
        rows.append({"workload": name, "requests": n, "prompt": length, "new": new, "counted": counted,
                     "pytgi": tokens / t_mine, "openvino": tokens / t_theirs, "ratio": t_theirs / t_mine,
                     "pytgi_int8_peak_fraction": roof,
                     "same_first_tokens": mine[0]["first"] == theirs[0]["first"],
                     "pytgi_times": [r["time"] for r in mine], "openvino_times": [r["time"] for r in theirs]})
    fidelity = None
    if args.fidelity:
        from fidelity import mean_nll  # benchmarks/fidelity.py, beside this script

        text = FIDELITY_TEXT.read_text(encoding="utf-8")[:FIDELITY_CHARS]
        ids = llm.tokenizer.encode(text)[:FIDELITY_TOKENS]
        fast = mean_nll(llm, ids)
        llm.shutdown()
        exact_llm = LLM(dtype="float32", max_batch_total_tokens=8192, max_total_tokens=4096)
        exact = mean_nll(exact_llm, ids)
        exact_llm.shutdown()
        fidelity = {"tokens": len(ids), "float32": exact, "pytgi": fast - exact,
                    "openvino": peer.ask({"nll": ids})["nll"] - exact}
    else:
        llm.shutdown()
    peer.close()

    print(f"pytgi vs OpenVINO GenAI ({Path(args.ov_model).name}), {args.threads} threads, "
          f"median of {args.repeats} alternating runs\n")
    print("| workload | tok/s counted | pytgi | OpenVINO | ratio | pytgi, of int8 peak | same first tokens |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        roof = f"{100 * r['pytgi_int8_peak_fraction']:.0f} %" if probe else "-"
        same = "yes" if r["same_first_tokens"] else "no"
        print(f"| {r['workload']} ({r['requests']} x {r['prompt']}/{r['new']}) | {r['counted']} | "
              f"{r['pytgi']:.1f} | {r['openvino']:.1f} | {r['ratio']:.2f}x | {roof} | {same} |")
    if fidelity:
        print(f"\nfidelity over {fidelity['tokens']} tokens, nats/token above float32 "
              f"({fidelity['float32']:.4f}): pytgi {fidelity['pytgi']:+.4f}, "
              f"OpenVINO {fidelity['openvino']:+.4f}")
    if probe:
        print(f"int8 peak: {args.threads} cores x {probe['clock_ghz']:.2f} GHz x "
              f"{probe['int8_macs_per_cycle']:.0f} MAC/cycle ({probe['isa']}) = "
              f"{probe['int8_peak_macs'] / 1e9:.0f} GMAC/s")
    record = {"args": vars(args), "machine": platform.processor() or platform.machine(),
              "date": datetime.now(timezone.utc).isoformat(), "peak": probe, "fidelity": fidelity,
              "rows": rows}
    out = ROOT / "benchmarks" / "results" / f"openvino-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nrecord: {out}")


if __name__ == "__main__":
    main()
