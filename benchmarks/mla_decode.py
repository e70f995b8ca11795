"""Multi-head latent attention's decodes in mla.c against the PyTorch ops, in one process: one stream's
decode step with the C call and without it (`MLAttention._decodes_in_c` patched to decline), runs
alternated so that both see the same machine load; prints each run's median step (wall clock, and the
process's CPU time: what a loaded machine's wall clock hides; with OMP_NUM_THREADS=1 one core's time),
the min over runs and the fastest step, and checks that the two paths' greedy tokens and logprobs are
the same bits.

    .venv/bin/python benchmarks/mla_decode.py /tmp/dsv/dsv2lite-8l-q1536-q4_k_m.gguf --runs 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pytgi import LLM, SamplingParams
from pytgi.engine.models.mla import MLAttention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(args.model, max_batch_total_tokens=16384, max_total_tokens=4096, max_input_tokens=4000)
    engine = llm.engine
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0, ignore_eos=True, top_n_tokens=2)
    fused = MLAttention._decodes_in_c
    medians: dict[str, list[float]] = {"c": [], "torch": []}
    fastest: dict[str, float] = {"c": 1e9, "torch": 1e9}
    cpu_ms: dict[str, list[float]] = {"c": [], "torch": []}
    outputs: dict[str, list] = {}
    for run in range(args.runs):
        for path in ("c", "torch"):
            MLAttention._decodes_in_c = fused if path == "c" else (lambda self, kv_cache, meta: None)  # type: ignore[method-assign]
            prompt = [(7 * j + run) % 30000 + 100 for j in range(args.prompt)]
            engine.add_request(f"{path}{run}", prompt, params)
            steps, cpu, tokens = [], [], []
            while engine.has_unfinished():
                t, c = time.perf_counter(), time.process_time()
                tokens += [(o.token_id, o.logprob, o.top) for o in engine.step()]
                steps.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            medians[path].append(1000 * statistics.median(steps[1:]))
            fastest[path] = min(fastest[path], 1000 * min(steps[1:]))
            cpu_ms[path].append(1000 * statistics.median(cpu[1:]))
            outputs.setdefault(f"{run}", []).append(tokens)
        same = outputs[f"{run}"][0] == outputs[f"{run}"][1]
        c, pt, cc, cpt = medians["c"][-1], medians["torch"][-1], cpu_ms["c"][-1], cpu_ms["torch"][-1]
        print(
            f"run {run + 1}: C {c:.2f} ms/step ({cc:.2f} CPU), PyTorch {pt:.2f} ({cpt:.2f}); same: {same}",
            flush=True,
        )
    print(f"min of the runs' medians: C {min(medians['c']):.2f} ms, PyTorch {min(medians['torch']):.2f} ms")
    print(f"fastest step: C {fastest['c']:.2f} ms, PyTorch {fastest['torch']:.2f} ms")
    c, pt = min(cpu_ms["c"]), min(cpu_ms["torch"])
    print(f"min of the runs' median CPU time a step: C {c:.2f} ms, PyTorch {pt:.2f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()
