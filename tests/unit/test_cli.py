"""The command line's refusals: one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def _pytgi(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTGI_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "pytgi.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


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
    path = _tiny_gguf(tmp_path / "other.gguf", "mamba")
    proc = _pytgi("serve", "--model-id", str(path), "--port", "1", cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert "pytgi: error: GGUF architecture 'mamba' is not supported" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_incomplete_gguf_is_one_line(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "half.gguf", "gemma3")
    proc = _pytgi("serve", "--model-id", str(path), "--port", "1", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "pytgi: error: the GGUF file has no 'gemma3.attention.head_count'" in proc.stderr


def test_a_missing_model_is_one_line(tmp_path: Path) -> None:
    proc = _pytgi("serve", "--model-id", str(tmp_path / "nowhere"), "--port", "1", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "model not found" in proc.stderr and "Traceback" not in proc.stderr
