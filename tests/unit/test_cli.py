"""The command line's refusals: one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def _pytgi(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTGI_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "pytgi.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def _tiny_gguf(path: Path, arch: str) -> Path:
    """A GGUF file with one block count and one tensor: not a model anyone can serve."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unsupported_gguf_is_one_line(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "other.gguf", "rwkv7")
    proc = _pytgi("serve", "--model-id", str(path), "--port", "1", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]  # the launcher's one line
    assert len(errors) == 1 and "GGUF architecture 'rwkv7' is not supported" in errors[0]


def test_an_incomplete_gguf_is_one_line(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "half.gguf", "gemma3")
    proc = _pytgi("serve", "--model-id", str(path), "--port", "1", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "the GGUF file has no 'gemma3.attention.head_count'" in errors[0]


def test_a_missing_model_is_one_line(tmp_path: Path) -> None:
    proc = _pytgi("serve", "--model-id", str(tmp_path / "nowhere"), "--port", "1", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "model not found" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_api_key_exemptions_and_half_tls_are_one_line(tmp_path: Path) -> None:
    proc = _pytgi("serve", "--api-key-exempt", "health,secrets", "--port", "1", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--api-key-exempt: unknown route name(s) secrets" in proc.stderr
    proc = _pytgi("serve", "--ssl-keyfile", "k.pem", "--port", "1", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "HTTPS needs both --ssl-keyfile and --ssl-certfile" in proc.stderr


def test_replica_flags_that_do_not_fit_are_one_line(tmp_path: Path) -> None:
    cases = [
        (["--min-replicas", "2"], "need --replicas N"),
        (["--ray-address", "127.0.0.1:6379"], "need --replicas N"),
        (["--replicas", "2", "--replica-routing", "random"], "--replica-routing: unknown 'random'"),
        (["--replicas", "1", "--min-replicas", "3", "--max-replicas", "2"], "is above --max-replicas 2"),
        (["--replicas", "5", "--max-replicas", "4"], "outside the autoscaling bounds"),
        (["--replicas", "-1"], "--replicas must be >= 0"),
    ]
    for flags, why in cases:
        proc = _pytgi("serve", *flags, "--port", "1", cache=tmp_path / "cache")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, flags
        assert why in proc.stderr, (flags, proc.stderr[-500:])


def test_a_containers_hostname_does_not_become_the_bind_address(monkeypatch) -> None:
    """Docker and Kubernetes set HOSTNAME to the container's name; TGI reads HOSTNAME as the address."""
    import argparse

    from pytgi.api import launcher

    for env, expected in [("4b1c9e0d2f3a", "0.0.0.0"), ("127.0.0.1", "127.0.0.1"), ("::1", "::1")]:
        monkeypatch.setenv("HOSTNAME", env)
        launcher.IGNORED_ENV.clear()
        parser = argparse.ArgumentParser()
        launcher.add_serve_arguments(parser)
        assert parser.parse_args([]).hostname == expected
        assert bool(launcher.IGNORED_ENV) == (expected == "0.0.0.0")
    assert parser.parse_args(["--hostname", "localhost"]).hostname == "localhost"
