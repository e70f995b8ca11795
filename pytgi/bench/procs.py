"""A server's process tree, read from /proc (Linux): what the fault tests and benchmarks use to find
and kill one part of a running `pytgi serve` (an engine process, a rank, a replica's actor)."""

from __future__ import annotations

import os
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (children, theirs, ...), from /proc/PID/task/TID/children."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # the process ended meanwhile
        return []
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def argv(pid: int) -> list[str]:
    """`pid`'s command line; [] if it has ended."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
    except OSError:
        return []


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent(pid: int) -> int:
    return int(_stat(pid)[1])


def cpu_ticks(pid: int) -> int:
    """User and system CPU time so far, in clock ticks (0 once it has ended)."""
    try:
        fields = _stat(pid)
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def engines(server_pid: int) -> list[int]:
    """The engine processes under a `pytgi serve` (one, or one per replica with --replicas)."""
    return [p for p in descendants(server_pid) if "--inbox" in argv(p)]


def busiest_engine(server_pid: int, seconds: float = 1.0) -> int:
    """The engine process that used the most CPU over `seconds` (the one serving, when the others idle)."""
    procs = engines(server_pid)
    before = {p: cpu_ticks(p) for p in procs}
    time.sleep(seconds)
    return max(procs, key=lambda p: cpu_ticks(p) - before[p])


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process under it (0 once they have ended)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


class PeakRss:
    """The largest `tree_rss(pid)` seen, sampled every `every` seconds in a thread until `stop()`."""

    def __init__(self, pid: int, every: float = 0.25) -> None:
        import threading

        self.pid, self.every, self.peak = pid, every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._done.wait(self.every)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak
