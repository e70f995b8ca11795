"""Replay the n-gram drafter offline on recorded greedy outputs: speculation does not change a greedy
output, so the tokens each step would accept follow from the output alone. With a step cost of
`--step-ms` + `--row-ms` per extra row (benchmarks/step_rows.py measures both), it predicts the
single-stream speed-up of benchmarks/speculation.py's prompts without running the model per drafter.

    .venv/bin/python benchmarks/draft_replay.py --record benchmarks/results/outputs.json   # the model, once
    .venv/bin/python benchmarks/draft_replay.py --replay benchmarks/results/outputs.json --row-ms 0.68 [--speculate 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def record(path: Path, max_new_tokens: int) -> None:
    from speculation import GROUNDED, OPEN

    from pytgi import LLM, SamplingParams

    llm = LLM(None, max_batch_total_tokens=16384)
    tok, out = llm.tokenizer, {}
    for kind, prompts in (("grounded", GROUNDED), ("open-ended", OPEN)):
        for name, text in prompts.items():
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), False)
            res = llm.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))[0]
            out[name] = {"kind": kind, "prompt": ids, "output": res.token_ids}
    llm.shutdown()
    path.write_text(json.dumps(out))


def replay(traces: dict, k: int, step_ms: float, row_ms: float) -> None:
    from pytgi.engine.speculation.ngram import Drafter

    cost = lambda rows: step_ms + row_ms * (rows - 1)
    totals: dict[str, list[float]] = {}
    print(f"{'prompt':15} {'tokens':>6} {'tok/step':>8} {'speedup':>8}")
    for name, t in traces.items():
        prompt, out = t["prompt"], t["output"]
        drafter = Drafter(k)
        req = SimpleNamespace(all_ids=prompt + out[:1], output_ids=out[:1], params=SimpleNamespace(max_new_tokens=len(out)),
                              spec=None)
        i, steps, ms = 1, 0, 0.0
        while i < len(out):
            draft = drafter.propose(req, 15)
            a = 0
            while a < len(draft) and i + a < len(out) and draft[a] == out[i + a]:
                a += 1
            if draft:
                drafter.observe(req, len(draft), a)
            steps, ms, i = steps + 1, ms + cost(1 + len(draft)), i + a + 1
            req.all_ids, req.output_ids = prompt + out[:i], out[:i]
        plain = cost(1) * (len(out) - 1)
        totals.setdefault(t["kind"], [0.0, 0.0])
        totals[t["kind"]][0] += plain
        totals[t["kind"]][1] += ms
        print(f"{name:15} {len(out):>6} {(len(out) - 1) / max(steps, 1):>8.2f} {plain / ms:>7.2f}x")
    for kind, (plain, ms) in totals.items():
        print(f"{kind}: {plain / ms:.2f}x over all its tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", type=Path)
    ap.add_argument("--replay", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--speculate", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=5.5)
    ap.add_argument("--row-ms", type=float, default=0.68)
    args = ap.parse_args()
    if args.record:
        record(args.record, args.max_new_tokens)
    if args.replay:
        replay(json.loads(args.replay.read_text()), args.speculate, args.step_ms, args.row_ms)


if __name__ == "__main__":
    main()
