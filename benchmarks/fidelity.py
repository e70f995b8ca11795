"""How far the fast default path (bf16 activations, low-bit weights) is from float32: the mean
negative log-likelihood per token of a held-out text under both, for one model.

    .venv/bin/python benchmarks/fidelity.py --model /path/to/model.gguf [--text FILE] [--tokens 1500]

The text defaults to the first 6,000 characters of docs/architecture.md (prose written after every
model this is run on was trained). The figures in docs/history/ up to December 2026 used the first
6,000 characters of an unpublished design document instead.
Prints both NLLs and their difference (nats/token); writes benchmarks/results/fidelity-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytgi import LLM, SamplingParams


def mean_nll(llm: LLM, ids: list[int]) -> float:
    """The mean negative log-likelihood per token of `ids` (each token given the ones before it)."""
    out = llm.generate([ids], SamplingParams(max_new_tokens=1, prompt_logprobs=True, temperature=0))[0]
    lps = [x for x in out.prompt_logprobs if x is not None]
    return -sum(lps) / len(lps)


def nll(model: str | None, dtype: str, text: str, tokens: int) -> float:
    llm = LLM(model=model, dtype=dtype, max_batch_total_tokens=8192, max_total_tokens=4096, progress=False)
    try:
        return mean_nll(llm, llm.tokenizer.encode(text)[:tokens])
    finally:
        llm.shutdown()


def text_arguments(doc: str) -> argparse.ArgumentParser:
    """The model and held-out text options the fidelity benchmarks share."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded model)")
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "docs" / "architecture.md"))
    ap.add_argument("--chars", type=int, default=6000)
    ap.add_argument("--tokens", type=int, default=1500)
    return ap


def main() -> None:
    args = text_arguments(__doc__).parse_args()
    text = Path(args.text).read_text(encoding="utf-8")[: args.chars]
    exact, fast = nll(args.model, "float32", text, args.tokens), nll(args.model, "auto", text, args.tokens)
    print(f"float32 {exact:.4f} nats/token, fast path {fast:.4f}, difference {fast - exact:+.4f}")
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"fidelity-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"args": vars(args), "float32": exact, "fast": fast, "difference": fast - exact}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
