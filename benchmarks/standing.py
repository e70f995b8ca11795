"""Where pytgi stands against its peers: benchmarks/standing.json as tables, and as one plot.

    .venv/bin/python benchmarks/standing.py                  # a plain table per area
    .venv/bin/python benchmarks/standing.py --markdown       # the tables of docs/benchmarks.md
    .venv/bin/python benchmarks/standing.py --plot docs/img/standing.png

standing.json holds, per area, the newest figures the docs give for pytgi and its peers, as strings
copied from the docs ("1,755", "15.10"), each with its run's date, machine, commit, command and the
section it comes from; `baseline` holds pytgi's own other configurations measured beside it. The
ratio is computed here: pytgi against the best peer (else its baseline), > 1 when pytgi is better.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

Row = dict[str, Any]
RUN = ("date", "machine", "commit", "command", "source_section")


def ratio(row: Row, against: dict[str, str]) -> float | None:
    if not against:
        return None
    values = [float(v.replace(",", "")) for v in against.values()]
    mine = float(row["pytgi"].replace(",", ""))
    return mine / max(values) if row["higher_is_better"] else min(values) / mine


def run_line(n: int, r: Row, markdown: bool) -> str:
    cmds = ", ".join(f"`{c}`" for c in (r["command"] if isinstance(r["command"], list) else [r["command"]]))
    commit = f", commit `{r['commit']}`" if r["commit"] else ""
    file, heading = r["source_section"]["file"], r["source_section"]["heading"].lstrip("# ")
    where = f"[{file}]({file.removeprefix('docs/')})" if markdown else file
    return f"[{n}] {r['date']}, {r['machine']}{commit}: {cmds} ({where}, {heading})"


def table(area: dict[str, Any], markdown: bool) -> str:
    rows: list[Row] = area["rows"]
    peers = list(dict.fromkeys(p for r in rows for p in r["peers"]))
    base = list(dict.fromkeys(b for r in rows for b in r.get("baseline", {})))
    notes = any("note" in r for r in rows)
    head = ["metric", "pytgi", *peers, *base, "ratio (> 1: pytgi better)", "run"] + ["note"] * notes
    runs: dict[str, tuple[int, Row]] = {}
    body = []
    for r in rows:
        n = runs.setdefault(json.dumps([r[k] for k in RUN]), (len(runs) + 1, r))[0]
        q, own = ratio(r, r["peers"]), ratio(r, r.get("baseline", {}))
        cell = f"{q:.2f}×" if q is not None else f"{own:.2f}× (own)" if own is not None else ""
        metric = f"{r['metric']}, {r['unit']} {'↑' if r['higher_is_better'] else '↓'}"
        cols = [r["peers"].get(p, "") for p in peers] + [r.get("baseline", {}).get(b, "") for b in base]
        body.append([metric, r["pytgi"], *cols, cell, f"[{n}]"] + [r.get("note", "")] * notes)
    lines = [f"### {area['area']}" if markdown else area["area"], ""]
    if markdown:
        lines += ["| " + " | ".join(x) + " |" for x in [head, ["---"] * len(head), *body]]
    else:
        width = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(x, width)).rstrip() for x in [head, *body]]
    lines += ["", *(("- " if markdown else "") + run_line(n, r, markdown) for n, r in runs.values())]
    return "\n".join(lines) + "\n"


def plot(areas: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels: list[str] = []
    values: list[float | None] = []
    for area in areas:
        rows = [(r["metric"], ratio(r, r["peers"])) for r in area["rows"] if r["peers"]]
        if rows:
            labels += [area["area"], *(m if len(m) <= 64 else m[:63] + "…" for m, _ in rows)]
            values += [None, *(v for _, v in rows)]
    fig, ax = plt.subplots(figsize=(11, 0.19 * len(labels) + 1.2))
    y = list(range(len(labels)))[::-1]
    for yi, v in zip(y, values):
        if v is not None:
            ax.barh(yi, v - 1, left=1, height=0.7, color="tab:green" if v >= 1 else "tab:red")
            ax.text(
                v * (1.04 if v >= 1 else 0.96),
                yi,
                f"{v:.2f}",
                va="center",
                ha="left" if v >= 1 else "right",
                fontsize=6,
            )
    ax.set_xscale("log")
    ax.set_xlim(0.18, 64)
    ticks = [0.25, 0.5, 1, 2, 4, 8, 16, 32]
    ax.set_xticks(ticks, [f"{t:g}×" for t in ticks])
    ax.axvline(1, color="black", linewidth=1)
    ax.set_yticks(y, labels, fontsize=7)
    for tick, v in zip(ax.get_yticklabels(), values):
        tick.set_fontweight("bold" if v is None else "normal")
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("pytgi ÷ its best peer, per metric (> 1: pytgi better); each row is its own run", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=str(Path(__file__).resolve().parent / "standing.json"))
    parser.add_argument("--markdown", action="store_true", help="markdown tables, as in docs/benchmarks.md")
    parser.add_argument("--plot", metavar="PATH", help="write the ratio chart to PATH (PNG)")
    args = parser.parse_args()
    areas = json.loads(Path(args.data).read_text())
    if args.plot:
        plot(areas, args.plot)
    else:
        print("\n".join(table(a, args.markdown) for a in areas), end="")


if __name__ == "__main__":
    main()
