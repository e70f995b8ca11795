"""The engine's thread count beside other processes (issue 65, point 2): `ThreadGovernor` on a faked
/proc (the machine's busy CPU time, this server's processes' CPU time) and a faked clock."""

from __future__ import annotations

import os

from pytgi.engine.execution.threads import TICK, ThreadGovernor, process_seconds


class FakeProc:
    """/proc/stat's first line and /proc/<pid>/stat for this process, under a temporary directory."""

    def __init__(self, root) -> None:
        self.root, self.pid = root, os.getpid()
        (root / str(self.pid) / "task" / str(self.pid)).mkdir(parents=True)
        (root / str(self.pid) / "task" / str(self.pid) / "children").write_text("")
        self.machine = self.ours = 0.0
        self.write()

    def write(self) -> None:
        busy = int(self.machine * TICK)
        (self.root / "stat").write_text(f"cpu  {busy} 0 0 1000000 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")
        fields = ["S"] + ["0"] * 10 + [str(int(self.ours * TICK)), "0"] + ["0"] * 30
        (self.root / str(self.pid) / "stat").write_text(f"{self.pid} (python (x)) " + " ".join(fields))

    def run(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` of wall time in which this server used `ours` CPUs and other processes `others`."""
        self.ours += ours * seconds
        self.machine += (ours + others) * seconds
        self.write()


def test_the_count_follows_what_other_processes_use(tmp_path):
    proc, now = FakeProc(tmp_path), [0.0]
    set_to: list[int] = []
    gov = ThreadGovernor(4, 4, set_to.append, interval=0.5, proc=tmp_path, clock=lambda: now[0])
    assert process_seconds(os.getpid(), tmp_path) == 0.0

    def tick(ours: float, others: float) -> int:
        now[0] += 0.5
        proc.run(0.5, ours, others)
        return gov.step()

    assert gov.step() == 4  # the first sample
    assert tick(4.0, 0.3) == 4  # a load generator's share: below the threshold
    assert tick(3.0, 1.0) == 3  # one busy neighbour
    assert tick(2.0, 2.2) == 2
    now[0] += 0.1
    assert gov.step() == 2  # within the interval: no new sample
    assert tick(3.9, 0.1) == 4  # gone: every thread again
    assert tick(1.0, 9.0) == 1  # at least one
    assert set_to == [3, 2, 4, 1]


def test_a_process_gone_counts_nothing_and_no_proc_changes_nothing(tmp_path):
    assert process_seconds(999_999_999, tmp_path) == 0.0
    gov = ThreadGovernor(2, 2, print, proc=tmp_path / "no-proc", clock=lambda: 0.0)
    assert gov.step() == 2 and gov.step() == 2


def test_an_engine_sharing_the_machine_by_design_keeps_its_share(tmp_path):
    """Two engines of 4 threads on 8 CPUs (replicas side by side): each sees the other use 4 CPUs and
    keeps its 4; a busy process on top takes one more away."""
    proc, now = FakeProc(tmp_path), [0.0]
    set_to: list[int] = []
    gov = ThreadGovernor(4, 8, set_to.append, interval=0.5, proc=tmp_path, clock=lambda: now[0])
    gov.step()
    for others, want in ((4.0, 4), (4.0, 4), (5.0, 3), (4.0, 4)):
        now[0] += 0.5
        proc.run(0.5, 4.0, others)
        assert gov.step() == want
    assert set_to == [3, 4]
