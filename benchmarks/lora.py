"""LoRA's cost on the default model's fast path: mixed-adapter traffic against base-only traffic.

What it measures
    The engine (`LLMEngine`, default flags: bf16 activations, the GGUF's int4 weights, the C kernels)
    serving the default model with four adapters made here by peft on its Hugging Face copy (random
    nonzero A and B, rank `--rank`, on all seven projections or on q and v only: `--targets`):

    * ``base x16``   -- 16 concurrent requests, no adapter;
    * ``mixed x16``  -- the same 16, spread over the four adapters and the base (4, 3, 3, 3, 3);
    * ``base x1``    -- one request alone;
    * ``adapter x1`` -- one request alone, with an adapter.

    Every request: a different chat prompt, exactly `--tokens` output tokens (EOS ignored). Reported:
    output tokens/s (wall, from the first step to the last), the median inter-token latency of the
    requests (ms), and the ratios the issue sets goals on: mixed/base tok/s ≥ 0.7 and adapter/base
    ITL ≤ 1.3. Each workload runs `--repeats` times, alternating; medians are reported.

How to run
    .venv/bin/python benchmarks/lora.py                   # rank 16, all seven projections, 128 tokens
    .venv/bin/python benchmarks/lora.py --targets qv --rank 8 --tokens 64 --repeats 1
A markdown table goes to stdout; the record to ``benchmarks/results/lora-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytgi.core.config import EngineConfig
from pytgi.core.model_files import resolve_model
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import Tokenizer
from pytgi.engine.llm_engine import LLMEngine

TARGETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "qv": ["q_proj", "v_proj"]}
QUESTIONS = ["Tell me about the sea.", "Explain rain.", "Describe a city at night.", "What is a star?",
             "Write about a forest.", "Describe winter.", "What do cats like?", "Tell a short story.",
             "Explain how bread is made.", "Describe a mountain.", "What is music?", "Write about trains.",
             "Describe a market.", "Explain the moon.", "Tell me about bees.", "Describe a river."]


def make_adapters(base: Path, out: Path, rank: int, targets: list[str]) -> dict[str, Path]:
    import peft
    import torch
    import transformers

    adapters = {}
    for i in range(4):
        torch.manual_seed(i + 1)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                                          target_modules=targets))
        lora.save_pretrained(out / f"a{i}")
        adapters[f"a{i}"] = out / f"a{i}"
    return adapters


def run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], tokens: int) -> dict:
    """All requests at once; output tok/s and the median inter-token latency."""
    times: dict[str, list[float]] = {}
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True,
                                                     adapter=a))
        times[str(i)] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for u in engine.step():
            if u.token_id >= 0:
                times[u.request_id].append(time.perf_counter())
    wall = time.perf_counter() - t0
    gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    return {"tok_s": sum(map(len, times.values())) / wall, "itl_ms": 1000 * statistics.median(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=sorted(TARGETS), default="all")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    base = resolve_model(None).path
    tok = Tokenizer.from_dir(base)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(base, Path(tmp), args.rank, TARGETS[args.targets])
        engine = LLMEngine(EngineConfig(lora_adapters=tuple(f"{n}={p}" for n, p in adapters.items()),
                                        max_batch_total_tokens=16384, max_total_tokens=2048,
                                        enable_prefix_caching=False))
        names = list(adapters)
        spread = [None if i % 5 == 0 else names[i % 5 - 1] for i in range(16)]  # 4 base, 3 per adapter
        workloads = {"base x16": (prompts, [None] * 16), "mixed x16": (prompts, spread),
                     "base x1": (prompts[:1], [None]), "adapter x1": (prompts[:1], [names[0]])}
        run(engine, prompts[:4], [None, *names[:3]], 8)  # warm-up: kernels, adapter paths
        results: dict[str, list[dict]] = {w: [] for w in workloads}
        for _ in range(args.repeats):
            for w, (ps, ads) in workloads.items():
                results[w].append(run(engine, ps, ads, args.tokens))
        engine.shutdown()
    med = {w: {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "itl_ms")} for w, rs in results.items()}
    tput = med["mixed x16"]["tok_s"] / med["base x16"]["tok_s"]
    itl = med["adapter x1"]["itl_ms"] / med["base x1"]["itl_ms"]
    print(f"LoRA rank {args.rank} on {args.targets} projections, {args.tokens} tokens a request, "
          f"median of {args.repeats}\n")
    print("| workload | output tok/s | ITL p50 (ms) |\n|---|---:|---:|")
    for w, m in med.items():
        print(f"| {w} | {m['tok_s']:.1f} | {m['itl_ms']:.2f} |")
    print(f"\nmixed / base tok/s: {tput:.2f} (goal >= 0.7); adapter / base ITL: {itl:.2f} (goal <= 1.3)")
    record = {"args": vars(args), "machine": platform.processor() or platform.machine(),
              "date": datetime.now(timezone.utc).isoformat(), "median": med, "runs": results,
              "throughput_ratio": tput, "itl_ratio": itl}
    out = Path(__file__).parent / "results" / f"lora-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"record: {out}")


if __name__ == "__main__":
    main()
