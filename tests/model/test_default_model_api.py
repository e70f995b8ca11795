"""The API process's uses of the default model, moved from tests/unit (which needs no model): resolving
(converting) it imports no torch, and the bench's llama-server peer serves its GGUF file by default."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pytgi.bench import peers
from tests.unit.test_layers import check_api_process_never_imports_torch


def test_resolving_the_default_model_never_imports_torch():
    check_api_process_never_imports_torch(
        "from pytgi.core.model_files import resolve_model\nresolve_model(None, progress=False)\n"
    )


def test_llama_server_target_defaults_to_the_default_gguf(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    # the default model file is the default GGUF
    from pytgi.core.errors import ModelNotFound
    from pytgi.core.model_files import default_gguf_path

    try:
        gguf = default_gguf_path()
    except ModelNotFound:
        pytest.skip("the default model is not installed")
    t = peers.LlamaServerTarget(str(binary))
    t.prepare()
    assert t.build_command(1)[:3] == [str(binary), "-m", str(gguf)]
