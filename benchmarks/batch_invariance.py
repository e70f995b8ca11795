"""Batch invariance (issue 14): what it holds and what it costs, both modes in one invocation.

For the default model on this CPU, with the batch-invariant default and with
`--disable-batch-invariance` (each in its own process, one after the other):
- how many of 50 greedy chat prompts give the same tokens sent together as sent one at a time;
- prefill time of fresh prompts (best of 3): 4 × 512 tokens, 1 × 2048, 1 × 4000;
- the median step of pure decode (64 steps once every request has its first token): 1 request at
  2000 tokens of context, 16 at 1000, 32 at 100.
Prints a table and writes benchmarks/results/batch-invariance-<timestamp>.json.

    .venv/bin/python benchmarks/batch_invariance.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOPICS = ["the ocean", "a red bicycle", "quantum computers", "baking bread", "the moon landing", "a lost cat",
          "winter in Norway", "learning Python", "a jazz concert", "volcanoes", "the Roman empire", "coffee",
          "a robot gardener", "chess openings", "rain forests", "the stock market", "a haunted house",
          "electric cars", "honey bees", "the Eiffel tower", "a marathon", "origami", "black holes", "tea ceremonies",
          "a pirate ship"]
PREFILLS = [(512, 4), (2048, 1), (4000, 1)]
DECODES = [(2000, 1), (1000, 16), (100, 32)]


def measure(invariant: bool) -> dict:
    from pytgi import LLM, SamplingParams

    llm = LLM(max_batch_total_tokens=65536, batch_invariant=invariant)
    tok, eng, out = llm.tokenizer, llm.engine, {}
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": k.format(t)}]), False)
             for k in ("Write a short story about {}.", "Explain {} in three sentences.") for t in TOPICS]
    greedy = SamplingParams(max_new_tokens=32, temperature=0)
    alone = [llm.generate(p, greedy)[0].token_ids for p in chats]
    together = [o.token_ids for o in llm.generate(chats, greedy)]
    out["equal"] = sum(a == b for a, b in zip(alone, together))
    text = tok.encode("The history of science is long and full of surprising turns. " * 400)
    one = SamplingParams(max_new_tokens=1, temperature=0)
    fresh = iter(range(100, 30000, 37))  # a new first token per prompt: no prefix-cache hits
    for L, n in PREFILLS:
        best = min(_timed(lambda: llm.generate([[next(fresh)] + text[i:i + L - 1] for i in range(n)], one))
                   for _ in range(3))
        out[f"prefill {n}x{L} ms"] = round(best * 1000, 1)
    for L, n in DECODES:
        params = SamplingParams(max_new_tokens=80, temperature=0, ignore_eos=True)
        for i in range(n):
            eng.add_request(f"d{L}-{i}", [next(fresh)] + text[i:i + L - 1], params)
        started: set[str] = set()
        while len(started) < n:
            started.update(u.request_id for u in eng.step())
        steps = [_timed(eng.step) for _ in range(64)]
        while eng.has_unfinished():
            eng.step()
        out[f"decode {n}x{L} ms/step"] = round(statistics.median(steps) * 1000, 2)
    llm.shutdown()
    return out


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(measure(sys.argv[2] == "on")))
        return
    from pytgi.bench.report import git_commit, machine_info, utc_stamp

    rows = {}
    for mode in ("on", "off"):  # each in a fresh process: the kernels and caches start alike
        done = subprocess.run([sys.executable, __file__, "--one", mode], check=True, capture_output=True, text=True)
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    keys = list(rows["on"])
    print(f"{'':28} {'invariant (default)':>20} {'--disable-batch-invariance':>27} {'cost':>7}")
    for k in keys:
        a, b = rows["on"][k], rows["off"][k]
        cost = "" if k == "equal" else f"{a / b:.2f}x"
        print(f"{k if k != 'equal' else 'equal of 50 (together/alone)':28} {a:>20} {b:>27} {cost:>7}")
    path = REPO / "benchmarks" / "results" / f"batch-invariance-{utc_stamp()}.json"
    path.write_text(json.dumps({"commit": git_commit(), "machine": machine_info(), "invariant": rows["on"],
                                "disabled": rows["off"]}, indent=2))
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
