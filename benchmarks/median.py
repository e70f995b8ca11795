"""Medians over repeated `pytgi bench` runs: one markdown row per server (and load), each figure the
median of that figure over the given JSON files, with ratios to the first server.

    .venv/bin/python benchmarks/median.py results/mixed1.json results/mixed2.json results/mixed3.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

FIELDS = [  # (column, path in a run's summary, scale)
    ("out tok/s", ("output_throughput",), 1),
    ("total tok/s", ("total_throughput",), 1),
    ("TTFT p50 ms", ("ttft_ms", "p50"), 1),
    ("TTFT p99 ms", ("ttft_ms", "p99"), 1),
    ("ITL p50 ms", ("itl_ms", "p50"), 1),
    ("ITL p99 ms", ("itl_ms", "p99"), 1),
    ("E2E p50 s", ("e2e_ms", "p50"), 1e-3),
    ("E2E p99 s", ("e2e_ms", "p99"), 1e-3),
]


def main(paths: list[str]) -> None:
    values: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    errors: dict[tuple[str, str], int] = defaultdict(int)
    for path in paths:
        doc = json.load(open(path))
        for run in doc["runs"]:
            key = (run["server"], f"c={run['concurrency']}" if run.get("concurrency") else f"{run['request_rate']} req/s")
            s = run["summary"]
            errors[key] += s["errors"]
            for name, fpath, scale in FIELDS:
                v = s
                for p in fpath:
                    v = v.get(p) if isinstance(v, dict) else None
                if v is not None:
                    values[key][name].append(v * scale)
    rows = list(values)
    first = {name: statistics.median(values[rows[0]][name]) for name, _, _ in FIELDS if values[rows[0]][name]}
    print(f"medians of {len(paths)} run(s)\n")
    print("| server | load | runs | errors | " + " | ".join(n for n, _, _ in FIELDS) + " | out tok/s vs first |")
    print("|---" * (len(FIELDS) + 5) + "|")
    for key in rows:
        med = {n: statistics.median(v) for n, v in values[key].items()}
        cells = [f"{med[n]:.2f}" if n.startswith("E2E") else f"{med[n]:.1f}" for n, _, _ in FIELDS]
        ratio = med["out tok/s"] / first["out tok/s"]
        print(f"| {key[0]} | {key[1]} | {len(values[key]['out tok/s'])} | {errors[key]} | " + " | ".join(cells)
              + f" | {ratio:.2f}× |")


if __name__ == "__main__":
    main(sys.argv[1:])
