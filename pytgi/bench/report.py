"""Metrics from per-request timings, and the reports: a markdown table, JSON, a PNG plot."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from collections import Counter
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TypedDict

from pytgi.bench.peers import ServerInfo
from pytgi.bench.stream_client import LoadResult, RequestRecord, RequestResult

PERCENTILES = (50, 90, 99)
MAX_ERROR_MESSAGES = 5


class ErrorCount(TypedDict):
    message: str
    count: int


class Summary(TypedDict):
    """One benchmark's figures (`summarize`); each distribution is `distribution`'s."""

    requests: int
    completed: int
    errors: int
    error_messages: list[ErrorCount]
    duration_s: float
    input_tokens: int
    output_tokens: int
    requested_output_tokens: int
    reported_output_tokens: int | None
    output_len_mismatches: int
    request_throughput: float
    output_throughput: float
    total_throughput: float
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]


class Run(ServerInfo):
    """One run against one server at one load, as the JSON holds it (`pytgi.bench.command.benchmark`)."""

    model: str | None
    concurrency: int | None
    request_rate: float | None
    ignore_eos: bool
    summary: Summary
    requests: list[RequestRecord]


class MachineInfo(TypedDict):
    hostname: str
    platform: str
    cpu: str
    cpus: int | None
    python: str


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p99, min, max of `values` times `scale` (None when there are none)."""
    vals = [v * scale for v in values if v is not None]
    out: dict[str, float | None] = {"mean": sum(vals) / len(vals) if vals else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(vals, q)
    out["min"] = min(vals) if vals else None
    out["max"] = max(vals) if vals else None
    out["n"] = len(vals)
    return out


def summarize(load: LoadResult) -> Summary:
    """Throughput and latency figures of one benchmark. Output tokens are counted as `--count-tokens` says."""
    results: list[RequestResult] = load.results
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    duration = load.duration
    input_tokens = sum(r.input_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    reported = [r.reported_tokens for r in ok if r.reported_tokens is not None]
    messages = Counter(r.error or "unknown error" for r in failed)
    rate = lambda x: x / duration if duration > 0 else 0.0
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(failed),
        "error_messages": [{"message": m, "count": c} for m, c in messages.most_common(MAX_ERROR_MESSAGES)],
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r.requested_output_len for r in ok),
        "reported_output_tokens": sum(reported) if reported else None,
        "output_len_mismatches": sum(r.output_tokens != r.requested_output_len for r in ok),
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(output_tokens),
        "total_throughput": rate(input_tokens + output_tokens),
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None], 1e3),
        "itl_ms": distribution([g for r in ok for g in r.itl], 1e3),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None], 1e3),
        "e2e_ms": distribution([r.e2e for r in ok if r.e2e is not None], 1e3),
    }


# -- markdown ------------------------------------------------------------------------------------------
def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pcts(d: dict[str, float | None], scale: float = 1.0, digits: int = 1) -> str:
    values = (d[f"p{q}"] for q in PERCENTILES)
    return " / ".join(_num(None if v is None else v * scale, digits) for v in values)


def _ratio(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return "-"
    return f"{x / base:.2f}×"


def load_label(run: Run) -> str:
    if run.get("request_rate") is not None:
        rate = run["request_rate"]
        cap = f", ≤{run['concurrency']}" if run.get("concurrency") else ""
        return f"{rate:g} req/s{cap}"
    return f"c={run['concurrency']}"


def markdown_table(runs: list[Run]) -> str:
    """One row per run; ratios are against the first server run at the same load."""
    head = (
        "| server | load | ok / err | out tok/s | total tok/s | req/s | TTFT ms p50 / p90 / p99 "
        "| ITL ms p50 / p90 / p99 | TPOT ms p50 | E2E s p50 / p90 / p99 | out tok/s vs first "
        "| ITL p50 vs first | ready s | peak RSS GiB |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    firsts: dict[str, Summary] = {}
    for run in runs:
        s = run["summary"]
        label = load_label(run)
        base = firsts.setdefault(label, s)
        lines.append(
            f"| {run['server']} | {label} | {s['completed']} / {s['errors']} "
            f"| {_num(s['output_throughput'])} | {_num(s['total_throughput'])} "
            f"| {_num(s['request_throughput'], 2)} | {_pcts(s['ttft_ms'])} "
            f"| {_pcts(s['itl_ms'])} | {_num(s['tpot_ms']['p50'])} | {_pcts(s['e2e_ms'], 1e-3, 2)} "
            f"| {_ratio(s['output_throughput'], base['output_throughput'])} "
            f"| {_ratio(s['itl_ms']['p50'], base['itl_ms']['p50'])} "
            f"| {_num(run.get('ready_s'))} | {_num((run.get('peak_rss_bytes') or 0) / 2**30 or None, 2)} |"
        )
    return "\n".join(lines)


def error_lines(runs: list[Run]) -> list[str]:
    out = []
    for run in runs:
        for e in run["summary"]["error_messages"]:
            out.append(f"{run['server']} ({load_label(run)}): {e['count']}× {e['message']}")
    return out


# -- JSON and the plot --------------------------------------------------------------------------------
def machine_info() -> MachineInfo:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def git_commit(path: Path | None = None) -> str | None:
    """The pytgi checkout's commit, with `-dirty` when it has uncommitted changes."""
    where = str(path or Path(__file__).resolve().parent)
    try:
        sha = subprocess.run(
            ["git", "-C", where, "rev-parse", "HEAD"], check=False, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if not sha:
            return None
        dirty = subprocess.run(
            ["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def utc_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def default_out_path(root: Path | None = None) -> Path:
    return (root or Path("benchmarks") / "results") / f"bench-{utc_stamp()}.json"


def write_json(path: Path, doc: Mapping[str, object]) -> None:
    """`doc` (anything `json.dumps` takes) written to `path` at once: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def plot_sweep(runs: list[Run], path: Path, title: str = "") -> Path | None:
    """Throughput, TTFT and ITL against concurrency, one line per server; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    servers = list(dict.fromkeys(r["server"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("output tokens/s", lambda s: s["output_throughput"], None),
        ("TTFT ms (p50 solid, p99 dashed)", lambda s: s["ttft_ms"]["p50"], lambda s: s["ttft_ms"]["p99"]),
        (
            "inter-token latency ms (p50 solid, p99 dashed)",
            lambda s: s["itl_ms"]["p50"],
            lambda s: s["itl_ms"]["p99"],
        ),
    ]
    for ax, (label, main, tail) in zip(axes, panels):
        for i, name in enumerate(servers):
            rs = sorted(
                (r for r in runs if r["server"] == name and r.get("concurrency")),
                key=lambda r: r["concurrency"] or 0,  # (set: the filter kept those)
            )
            xs = [r["concurrency"] for r in rs]
            color = f"C{i}"
            ax.plot(xs, [main(r["summary"]) for r in rs], "o-", color=color, label=name)
            if tail is not None:
                ax.plot(xs, [tail(r["summary"]) for r in rs], "x--", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["concurrency"] or 0 for r in runs if r.get("concurrency")})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
