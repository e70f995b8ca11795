"""A real `pytgi serve` subprocess on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pytgi.bench.procs import argv, descendants
from pytgi.core.net import free_port


class Server:
    """`exact` (the default) serves in float32, where outputs equal transformers' and are batch-,
    chunk- and shard-invariant; tests that say `exact=False` run the default flags (bfloat16 + the
    GGUF's int4: batch and chunk invariant too, docs/batch-invariance.md, but not equal to float32)."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        exact: bool = True,
        launcher: str = "pytgi.cli",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = [
            sys.executable,
            "-m",
            launcher,
            "serve",
            "--hostname",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-batch-total-tokens",
            "32768",
            *(["--dtype", "float32"] if exact else []),
            *args,
        ]
        out = open(log, "wb") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 300) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready in {timeout}s: {self.tail()}")

    def tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path and self.log_path.exists() else ""

    def engine_pid(self) -> int:
        """The engine process: the one started with `--inbox` (pytgi.engine.process or a test's wrapper)."""
        (pid,) = [p for p in descendants(self.proc.pid) if "--inbox" in argv(p)]
        return pid

    def worker_pids(self) -> list[int]:
        """The tensor-parallel ranks 1.. that rank 0 started (`--num-shard`)."""
        return [p for p in descendants(self.proc.pid) if "pytgi.engine.distributed.worker" in argv(p)]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        for line in httpx.get(f"{self.url}/metrics", headers=headers).text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """The (address, port) of every listening TCP socket these processes hold, read from /proc."""
    import ipaddress

    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue  # gone, or not ours to read
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.append((str(ipaddress.ip_address(raw)), int(hexport, 16)))
    return out
