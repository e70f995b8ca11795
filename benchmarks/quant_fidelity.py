"""What each pre-quantized checkpoint format costs in fidelity: the default model's own weights written in
each format (tests/quant_checkpoints.py: GPTQ, AWQ, compressed-tensors W4A16 / W8A8 int8 / FP8, HF's
block FP8), then the mean negative log-likelihood per token of a held-out text under

- the format in float32: the checkpoint's dequantized values, exactly (what the format itself costs),
- the format in bf16 as pytgi serves it on this CPU (levels packed; FP8 dequantized to bf16; the float
  LM head in 8 bits, `pytgi.engine.models.quant.HEAD_KIND`),
- the same with the head kept bf16 (what the 8-bit head costs),

against the original float32 weights. A GGUF file of the same weights is measured by
benchmarks/fidelity.py.

    .venv/bin/python benchmarks/quant_fidelity.py [--tokens 1500] [--formats gptq-4bit-g64,...]

Prints a table (nats/token over float32); writes benchmarks/results/quant-fidelity.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity import mean_nll, text_arguments
from pytgi import LLM
from pytgi.core.model_files import resolve_model
from pytgi.engine.models import decoder
from tests.model.test_quant_default_model import FORMATS
from tests.quant_checkpoints import write
from tests.reference import hf_copy


def nll(model: str | None, dtype: str, ids: list[int], head: str = decoder.HEAD_KIND) -> float:
    decoder.HEAD_KIND, saved = head, decoder.HEAD_KIND  # (the engine's rank 0 runs in this process)
    llm = LLM(model=model, dtype=dtype, max_batch_total_tokens=8192, max_total_tokens=4096, progress=False)
    try:
        return mean_nll(llm, ids)
    finally:
        llm.shutdown()
        decoder.HEAD_KIND = saved


def main() -> None:
    ap = text_arguments(__doc__)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    source = hf_copy(resolve_model(args.model).path)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    text = Path(args.text).read_text()[: args.chars]
    probe = LLM(model=args.model, dtype="float32", max_batch_total_tokens=8192, progress=False)
    ids = probe.tokenizer.encode(text)[: args.tokens]
    probe.shutdown()
    base = nll(str(source), "float32", ids)
    rows = [{"format": "float32 (original)", "float32": 0.0, "bf16 served": nll(str(source), "bfloat16", ids) - base}]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.formats.split(","):
            method, bits, group, sym, fmt = FORMATS[name]
            out = Path(tmp) / name
            write(hf, out, method, bits, group, sym, fmt)
            for f in source.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
                    (out / f.name).write_bytes(f.read_bytes())
            rows.append({
                "format": name,
                "float32": nll(str(out), "float32", ids) - base,
                "bf16 served": nll(str(out), "bfloat16", ids) - base,
                "bf16, bf16 head": nll(str(out), "bfloat16", ids, head="bf16") - base,
            })  # fmt: skip
            print(rows[-1], flush=True)
    print(f"\nfloat32 original: {base:.4f} nats/token over {len(ids)} tokens\n")
    print("| format | float32 (the format's cost) | bf16 as served | bf16 with a bf16 head |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        cells = [f"{r[k]:+.4f}" if k in r else "" for k in ("float32", "bf16 served", "bf16, bf16 head")]
        print(f"| {r['format']} | " + " | ".join(cells) + " |")
    results = Path(__file__).resolve().parent / "results" / "quant-fidelity.json"
    results.write_text(json.dumps({"tokens": len(ids), "float32_nll": base, "rows": rows}, indent=1))
    print(f"\nwrote {results}")


if __name__ == "__main__":
    main()
