"""Where a step's time goes by module, for any model pytgi's own code runs: the offline engine with B
requests of P prompt tokens, timed around the attention projections, the attention layer, the
mixture-of-experts layers and the LM head (forward hooks; the C kernels inside them count). Prints the
prefill's totals, then the mean decode step and each module's share of it, in ms.

    .venv/bin/python benchmarks/module_times.py /tmp/llama/gptoss20b-24l-bf16.gguf --batch 1 --prompt 128
    .venv/bin/python benchmarks/module_times.py /tmp/llama/gptoss20b-24l-bf16.gguf --batch 16 --prompt 64

`attn` holds `qkv` and `o` (the projections) and the attention itself; the rest of a step (norms, the
router's top-k in Python, sampling) is the step less the listed modules.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pytgi import LLM, SamplingParams
from pytgi.engine.models.moe import SparseMoE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    llm = LLM(args.model, max_batch_total_tokens=16384, max_total_tokens=4096, max_input_tokens=4000)
    engine = llm.engine
    times: dict[str, float] = collections.defaultdict(float)

    def timed(mod, name: str) -> None:
        start: list[float] = []

        def done(m, a, o) -> None:
            times[name] += time.perf_counter() - start.pop()

        mod.register_forward_pre_hook(lambda m, a: start.append(time.perf_counter()))
        mod.register_forward_hook(done)

    for name, mod in engine.runner.model.named_modules():
        if isinstance(mod, SparseMoE):
            timed(mod, "moe")
        else:
            labels = (
                ("self_attn", "attn"),
                ("qkv_proj", "qkv"),
                ("o_proj", "o"),
                ("lm_head", "lm_head"),
                ("q_a_proj", "q_a"),  # latent attention's projections
                ("q_b_proj", "q_b"),
                ("kv_a_proj_with_mqa", "kv_a"),
                ("shared_expert", "shared"),
                ("mlp.gate", "router"),
                ("mlp", "mlp"),
            )
            for suffix, label in labels:
                if name.endswith(suffix):
                    timed(mod, label)
    params = SamplingParams(max_new_tokens=args.steps + 20, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [(7 * j + i) % 30000 + 100 for j in range(args.prompt)], params)
    t = time.perf_counter()
    while engine.scheduler.waiting or any(r.num_uncomputed > 1 for r in engine.scheduler.running):
        engine.step()
    shares = ", ".join(f"{k} {v:.2f}" for k, v in times.items())
    print(f"prefill {args.batch} x {args.prompt} tokens: {time.perf_counter() - t:.1f} s ({shares} s)")
    for _ in range(3):
        engine.step()
    times.clear()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - t) / args.steps
    shares = ", ".join(f"{k} {v / args.steps * 1e3:.1f}" for k, v in times.items())
    print(f"decode, {args.batch} streams: {step * 1e3:.1f} ms a step ({shares} ms)")
    llm.shutdown()


if __name__ == "__main__":
    main()
