"""The engine's threads from the CPUs the process may use (issue 65, point 1): the affinity mask, the
cgroup's CPU quota (v2 and v1, faked under a temporary root), `--threads` and OMP_NUM_THREADS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pytgi.core.cpus import Cpus, cgroup_quota, engine_threads


def _v2(tmp_path, path: str, limits: dict[str, str]):
    """A cgroup v2 tree: `limits` maps a directory under the root ("" for the root) to its cpu.max."""
    root = tmp_path / "cgroup"
    (root / path.strip("/")).mkdir(parents=True)  # and every directory above it
    for d, text in limits.items():
        (root / d / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


def test_a_v2_quota_is_the_smallest_along_the_path(tmp_path):
    root, proc = _v2(
        tmp_path,
        "/kubepods/pod1/ctr",
        {"": "max 100000", "kubepods": "800000 100000", "kubepods/pod1/ctr": "250000 100000"},
    )
    assert cgroup_quota(root, proc) == 2.5
    root, proc = _v2(tmp_path / "b", "/a/b", {"a": "150000 100000", "a/b": "max 100000"})
    assert cgroup_quota(root, proc) == 1.5


def test_no_quota_where_there_is_none_or_no_file(tmp_path):
    root, proc = _v2(tmp_path, "/user.slice", {"user.slice": "max 100000"})
    assert cgroup_quota(root, proc) is None
    assert cgroup_quota(tmp_path / "nowhere", tmp_path / "no-proc-file") is None


def test_inside_a_container_the_roots_files_are_its_own(tmp_path):
    """A container sees its own cgroup at the root, while /proc/self/cgroup names the host's path."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("200000 100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/system.slice/docker-abc.scope\n")
    assert cgroup_quota(root, proc) == 2.0


def test_a_v1_quota(tmp_path):
    root = tmp_path / "cgroup"
    d = root / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("300000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n")
    assert cgroup_quota(root, proc) == 3.0


@pytest.mark.parametrize(
    "affinity, quota, usable", [(64, 2.0, 2), (64, 1.5, 1), (64, 0.5, 1), (4, 8.0, 4), (8, None, 8)]
)
def test_usable_cpus_round_the_quota_down(affinity, quota, usable):
    assert Cpus(affinity, quota).usable == usable


def test_engine_threads_flag_then_environment_then_usable_cpus_shared(monkeypatch):
    cpus = Cpus(8, 6.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert engine_threads(None, 1, cpus) == 6
    assert engine_threads(None, 4, cpus) == 1  # 4 ranks or replicas on 6 CPUs
    assert engine_threads(None, 16, cpus) == 1
    assert engine_threads(3, 4, cpus) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert engine_threads(None, 2, cpus) == 5
    assert engine_threads(2, 2, cpus) == 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity masks here")
def test_an_engine_under_an_affinity_mask_of_one_cpu_runs_one_thread():
    """As under `taskset -c 0`: torch's pool (which the C kernels share) gets one thread, and the count
    is logged with where it came from."""
    code = (
        "import logging, os, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "import torch; from pytgi.engine.distributed.local_ranks import set_cpu_threads\n"
        "assert set_cpu_threads() == 1 and torch.get_num_threads() == 1\n"
        "assert set_cpu_threads(1, 3) == 3 and torch.get_num_threads() == 3\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "CPU threads: 1 (usable CPUs; 1 CPUs in the affinity mask" in done.stdout, done.stdout
    assert "CPU threads: 3 (--threads;" in done.stdout
