"""Fewer threads while other processes take the CPUs (issue 65).

The engine's threads meet at the end of every parallel region (hundreds a step). On a machine where
another process keeps a core busy, one of them is often waiting for a core while the others spin at
the barrier, and a step that takes 5 ms alone takes hundreds (measured: the default model's mixed load
fell from about 800 to 4 output tokens a second beside one `while True: pass` on 2 cores). With one
thread fewer per CPU the neighbour holds, the engine's threads have their cores and the step costs
about the cores lost.

`ThreadGovernor.step()` runs before each engine step; every `interval` seconds it reads the CPU time
the whole machine spent (`/proc/stat`) and what this server spent (the engine process with its
threads, its parent the API process where that is pytgi's, its child ranks), and so the CPUs other
processes used meanwhile. Where they used at least `threshold` of a CPU, the engine runs what they
leave of the CPUs this process may use, `cpus − round(others)`, at most its own count and at least 1
(an engine sharing the machine by design, a replica beside another, keeps its share while the other
runs); where they used less, all of them again. pytgi's C
kernels split rows and heads between threads, not sums: the count changes the work split, not the
bits (tests/model/test_threads.py); PyTorch's own matmuls (the transformers fallback) may round
otherwise on another count, which `--threads` rules out.
Only where the count is pytgi's own choice (no `--threads`, no `OMP_NUM_THREADS`) and the engine
runs alone (one rank; ranks wait for each other anyway).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROC = Path("/proc")
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_seconds(proc: Path = PROC) -> float:
    """CPU seconds the machine has spent busy (all CPUs: user, nice, system, irq, softirq, steal)."""
    fields = (proc / "stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICK


def process_seconds(pid: int, proc: Path = PROC) -> float:
    """CPU seconds a process has used (all its threads; 0 once it is gone)."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def children(pid: int, proc: Path = PROC) -> list[int]:
    try:
        text = (proc / str(pid) / "task" / str(pid) / "children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def is_pytgi(pid: int, proc: Path = PROC) -> bool:
    try:
        return b"pytgi" in (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False


class ThreadGovernor:
    def __init__(
        self,
        usable: int,
        cpus: int,
        set_threads,
        interval: float = 0.5,
        threshold: float = 0.6,
        proc: Path = PROC,
        clock=time.monotonic,
    ) -> None:
        """`usable`: the engine's threads when nothing else runs; `cpus`: the CPUs this process may use
        (`pytgi.core.cpus`); `set_threads(n)`: sets the engine's count."""
        self.usable, self.cpus, self.set_threads = usable, cpus, set_threads
        self.interval, self.threshold = interval, threshold
        self.proc, self.clock = proc, clock
        self.pid = os.getpid()
        parent = os.getppid()
        self.ours = [self.pid, *([parent] if is_pytgi(parent, proc) else [])]
        self.threads = usable
        self.last: tuple[float, float, float] | None = None

    def _ours_seconds(self) -> float:
        pids = [*self.ours, *children(self.pid, self.proc)]
        return sum(process_seconds(p, self.proc) for p in pids)

    def step(self) -> int:
        """Called before each engine step; returns the engine's thread count."""
        now = self.clock()
        if self.last is not None and now - self.last[0] < self.interval:
            return self.threads
        try:
            sample = (now, machine_busy_seconds(self.proc), self._ours_seconds())
        except (OSError, ValueError):  # no /proc (not Linux): the count stays as it is
            self.interval = float("inf")
            return self.threads
        if self.last is not None:
            wall = sample[0] - self.last[0]
            others = max(0.0, (sample[1] - self.last[1]) - (sample[2] - self.last[2])) / wall
            left = self.cpus - round(others)
            want = self.usable if others < self.threshold else max(1, min(self.usable, left))
            if want != self.threads:
                log.info("CPU threads: %d (other processes used %.1f CPUs)", want, others)
                self.set_threads(want)
                self.threads = want
        self.last = sample
        return self.threads
