"""Speculative decoding (issue 15): single-stream decode speed with and without `--speculate N`, on
input-grounded prompts (copy or edit code, repeat or quote a passage) and open-ended ones, in one
invocation, on the same model and prompts (the default model unless --model).

Decode tokens/s is measured per request from its first token to its last (the prefill excluded),
greedy, each prompt alone; the outputs are checked to be the same with and without speculation.
With --llama-server BIN, llama.cpp's server runs the same prompts (as text, chat template applied
by pytgi's tokenizer) on the same GGUF file, without and with its n-gram speculation
(`--spec-type ngram-simple --spec-draft-n-max N`), one request at a time, and its own timings give
its decode tokens/s. Prints a table and writes benchmarks/results/speculation-<timestamp>.json. The
mixed concurrent load is `pytgi bench --peer pytgi --peer pytgi="--speculate 4"` (docs/speculation.md).

With --draft-model PATH the speculative run drafts with that model (`--draft-model-id`) instead of
n-grams; --dtype sets the model's dtype for both runs (the draft model runs its own fast path), e.g.
the exact float32 path drafted by the same GGUF's fast path:

    .venv/bin/python benchmarks/speculation.py [--speculate 4] [--max-new-tokens 256] [--llama-server BIN]
    .venv/bin/python benchmarks/speculation.py --dtype float32 --draft-model $GGUF --speculate 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: int
    customer: str
    items: list[str]
    total: float

    def to_json(self) -> str:
        return json.dumps({"order_id": self.order_id, "customer": self.customer,
                           "items": self.items, "total": self.total})


def load_orders(path: str) -> list[Order]:
    with open(path) as f:
        return [Order(**row) for row in json.load(f)]


def total_revenue(orders: list[Order]) -> float:
    return sum(order.total for order in orders)
'''
PASSAGE = ("The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
           "reefs and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 "
           "square kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. "
           "It can be seen from outer space and is the world's biggest single structure made by living "
           "organisms. This reef structure is composed of and built by billions of tiny organisms, known as "
           "coral polyps.")
GROUNDED = {
    "edit code": f"Rename the class Order to Purchase everywhere in this code and show the whole code:\n\n{CODE}",
    "copy code": f"Copy this code exactly, adding nothing:\n\n{CODE}",
    "quote passage": f"Quote the following passage word for word:\n\n{PASSAGE}",
    "repeat passage": f"Here is a passage:\n\n{PASSAGE}\n\nNow write it out again, unchanged.",
}
OPEN = {
    "poem": "Write a poem about a lighthouse in winter.",
    "explain": "Explain how a refrigerator works.",
    "story": "Tell me a short story about a fox who learns to fly.",
    "advice": "Give me five tips for learning a new language.",
}


def decode_speed(llm, prompt: list[int], params) -> tuple[float, list[int], int, int]:  # type: ignore[no-untyped-def]
    """(decode tokens/s, token ids, steps, draft tokens accepted) for one request alone."""
    eng = llm.engine
    eng.add_request("bench", prompt, params)
    ids: list[int] = []
    first = None
    steps = 0
    accepted0 = eng.scheduler.spec_accepted
    while eng.has_unfinished():
        updates = eng.step()
        if first is not None:
            steps += 1
        for u in updates:
            if u.token_id >= 0:
                ids.append(u.token_id)
        if first is None and ids:
            first = time.perf_counter()
    seconds = time.perf_counter() - first
    return (len(ids) - 1) / seconds, ids, steps, eng.scheduler.spec_accepted - accepted0


def llama_server_speeds(binary: str, texts: dict[str, str], n: int, speculate: int) -> dict[str, dict]:
    """name -> {"plain": tok/s, "spec": tok/s, "draft_n": ..., "accepted": ...} from llama-server."""
    import httpx

    from pytgi.bench.peers import LlamaServerTarget

    out: dict[str, dict] = {name: {} for name in texts}
    for mode, extra in (("plain", ""), ("spec", f" --spec-type ngram-simple --spec-draft-n-max {speculate}")):
        server = LlamaServerTarget(binary, args="-np 1 -c 4096 -t 2" + extra)
        server.prepare()
        server.start()
        try:
            server.wait_ready()
            for name, text in texts.items():
                body = {"prompt": text, "n_predict": n, "temperature": 0, "cache_prompt": True}
                httpx.post(f"{server.url}/completion", json={**body, "n_predict": 2}, timeout=600)  # warm the cache
                t = httpx.post(f"{server.url}/completion", json=body, timeout=600).json()["timings"]
                out[name][mode] = round(t["predicted_per_second"], 1)
                if mode == "spec":
                    out[name]["draft_n"], out[name]["accepted"] = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
        finally:
            server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--llama-server", default=None, help="llama-server binary to compare with")
    ap.add_argument("--draft-model", default=None, help="draft with this model (a directory or .gguf file)")
    ap.add_argument("--dtype", default="auto", help="the model's dtype (auto: its fast path)")
    args = ap.parse_args()
    from pytgi import LLM, SamplingParams
    from pytgi.bench.report import git_commit, machine_info, utc_stamp

    plain = LLM(args.model, dtype=args.dtype, max_batch_total_tokens=16384)
    spec = LLM(args.model, dtype=args.dtype, max_batch_total_tokens=16384, speculate=args.speculate,
               draft_model=args.draft_model)
    tok = plain.tokenizer
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
    rows = []
    for kind, prompts in (("grounded", GROUNDED), ("open-ended", OPEN)):
        for name, text in prompts.items():
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), False)
            for llm in (plain, spec):  # warm: the prefix cache holds the prompt for both timed runs
                llm.generate(ids, SamplingParams(max_new_tokens=2, temperature=0))
            base, base_ids, _, _ = decode_speed(plain, ids, params)
            fast, fast_ids, steps, accepted = decode_speed(spec, ids, params)
            rows.append({"kind": kind, "prompt": name, "tokens": len(base_ids), "plain_tok_s": round(base, 1),
                         "spec_tok_s": round(fast, 1), "speedup": round(fast / base, 2),
                         "tokens_per_step": round((len(fast_ids) - 1) / max(steps, 1), 2),
                         "accepted": accepted, "same_output": fast_ids == base_ids})
    texts = {name: tok.apply_chat_template([{"role": "user", "content": text}])
             for prompts in (GROUNDED, OPEN) for name, text in prompts.items()}
    plain.shutdown()
    spec.shutdown()
    llama = llama_server_speeds(args.llama_server, texts, args.max_new_tokens, args.speculate) \
        if args.llama_server else {}
    for r in rows:
        if r["prompt"] in llama:
            r["llama_server"] = llama[r["prompt"]]
    print(f"{'kind':11} {'prompt':15} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} "
          f"{'tok/step':>8} {'same':>5}")
    for r in rows:
        ls = r.get("llama_server")
        extra = f"   llama-server {ls['plain']} -> {ls['spec']} tok/s ({ls['spec'] / ls['plain']:.2f}x)" if ls else ""
        print(f"{r['kind']:11} {r['prompt']:15} {r['tokens']:>6} {r['plain_tok_s']:>11} {r['spec_tok_s']:>10} "
              f"{r['speedup']:>7}x {r['tokens_per_step']:>8} {r['same_output']!s:>5}{extra}")
    for kind in ("grounded", "open-ended"):
        sel = [r for r in rows if r["kind"] == kind]
        plain_s = sum(r["tokens"] - 1 for r in sel) / sum((r["tokens"] - 1) / r["plain_tok_s"] for r in sel)
        spec_s = sum(r["tokens"] - 1 for r in sel) / sum((r["tokens"] - 1) / r["spec_tok_s"] for r in sel)
        print(f"{kind}: {plain_s:.1f} -> {spec_s:.1f} tok/s over all its tokens = {spec_s / plain_s:.2f}x")
    path = REPO / "benchmarks" / "results" / f"speculation-{utc_stamp()}.json"
    path.write_text(json.dumps({"commit": git_commit(), "machine": machine_info(), "speculate": args.speculate,
                                "dtype": args.dtype, "draft_model": args.draft_model,
                                "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2))
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
