"""What `--kv-cache-dtype int8` buys and costs on this CPU, against the default cache (the model's
dtype, bf16), for one model, in one invocation:

- tokens: the KV slots the same bytes hold (`/info`'s `max_batch_total_tokens` for `--memory`);
- fidelity: the mean negative log-likelihood per token of a held-out text (as benchmarks/fidelity.py)
  and its difference from the default cache's (nats/token; issue 45's bound: 0.01);
- decode at a long context: one request with a `--context`-token prompt, then `--new` greedy tokens;
  the time per output token after the first (the context's attention dominates it) and the prefill's.

    .venv/bin/python benchmarks/kv_int8.py [--model PATH] [--quantize auto] [--context 16384]

Prints a table; writes benchmarks/results/kv_int8.json. Each cache runs in a fresh engine, one at a
time; the whole process's peak RSS is the `ru_maxrss` after the run.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity import mean_nll, text_arguments
from pytgi import LLM, SamplingParams

KV_DTYPES = ("auto", "int8")


def decode_times(llm: LLM, prompt: list[int], new: int) -> tuple[float, float]:
    """(seconds to the first token, mean seconds per token after it) of one greedy request."""
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
    t0, stamps = time.perf_counter(), []
    while engine.has_unfinished():
        if any(u.token_id >= 0 for u in engine.step()):
            stamps.append(time.perf_counter())
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main() -> None:
    ap = text_arguments(__doc__)
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--context", type=int, default=16384, help="the long request's prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="its greedy tokens")
    ap.add_argument("--memory", type=int, default=2**30, help="KV bytes for the token count")
    args = ap.parse_args()
    text = Path(args.text).read_text(encoding="utf-8")
    rows = []
    for kv in KV_DTYPES:
        common = {"quantize": args.quantize, "kv_cache_dtype": kv, "progress": False}
        with LLM(model=args.model, kv_cache_cpu_bytes=args.memory, max_total_tokens=2048, **common) as llm:
            tokens = llm.engine.info.max_batch_total_tokens
            ids = llm.tokenizer.encode(text[: args.chars])[: args.tokens]
        total = args.context + args.new + 16
        with LLM(
            model=args.model,
            max_batch_total_tokens=total,
            max_total_tokens=total,
            enable_prefix_caching=False,
            **common,
        ) as llm:
            nll = mean_nll(llm, ids)
            long = (llm.tokenizer.encode(text) * (args.context // 1000 + 1))[: args.context]
            ttft, itl = decode_times(llm, long, args.new)
        rows.append({"kv_cache_dtype": kv, "tokens": tokens, "nll": nll, "ttft_s": ttft, "itl_s": itl})
        print(f"{kv}: {rows[-1]}", flush=True)
    base = rows[0]
    print(f"\nmodel: {args.model or 'the embedded default'}; quantize {args.quantize}; "
          f"{len(ids)} tokens of {args.text}; decode after {args.context} tokens\n")  # fmt: skip
    print("| KV cache | tokens in the same bytes | NLL (nats/token) | Δ | prefill s | ms/token at context |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kv_cache_dtype']} | {r['tokens']} ({r['tokens'] / base['tokens']:.2f}×) | {r['nll']:.4f} "
            f"| {r['nll'] - base['nll']:+.4f} | {r['ttft_s']:.1f} | {1000 * r['itl_s']:.1f} |"
        )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\npeak RSS {rss:.2f} GiB")
    out = Path(__file__).parent / "results" / "kv_int8.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "peak_rss_gib": rss}, indent=1))


if __name__ == "__main__":
    main()
