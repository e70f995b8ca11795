"""Models named by their Hub id, end to end through `pytgi serve` and `pytgi download`, against a
stand-in for the Hub on loopback (tests/fake_hub.py): what is fetched, the commit reported, the cache
without the Hub (offline, unreachable), GGUF quantization tags and split files, and each refusal as
one line, a non-zero exit and no traceback, within seconds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pytgi.core.net import free_port
from tests.e2e.server import Server
from tests.fake_hub import TOKEN, FakeHub, Repo
from tests.tiny_repos import gguf_model, hf_model

pytestmark = pytest.mark.slow

HF = "test-org/tiny-llama"
GGUF = "test-org/tiny-GGUF"
NEEDED = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Repo]:
    root = tmp_path_factory.mktemp("repos")
    hf = hf_model(root / "hf")
    extra = {
        "README.md": b"# tiny",
        "onnx/model.onnx": b"not needed",
        "pytorch_model.bin": b"pickled, not needed",
    }
    for name, data in extra.items():
        (hf / name).parent.mkdir(parents=True, exist_ok=True)
        (hf / name).write_bytes(data)
    files = {p.relative_to(hf).as_posix(): p for p in hf.rglob("*") if p.is_file()}
    gg = root / "gguf"
    gg.mkdir()
    whole = gguf_model(gg / "tiny-F16.gguf")[0]
    shutil.copy(whole, gg / "tiny-Q4_K_M.gguf")  # a quantization's name; the content does not matter here
    shutil.copy(whole, gg / "mmproj-tiny-F16.gguf")  # a vision projector: never a model to serve
    gguf_model(gg / "tiny-Q8_0.gguf", parts=2)
    pickled = {"config.json": hf / "config.json", "pytorch_model.bin": hf / "pytorch_model.bin"}
    adapter = _lora_adapter(hf, root / "lora")
    return {
        "test-org/tiny-lora": Repo({p.name: p for p in adapter.iterdir()} | {"README.md": hf / "README.md"}),
        HF: Repo(files, branches={"v1": "1" * 40}),
        GGUF: Repo({p.name: p for p in gg.iterdir()}),
        "test-org/gated-llama": Repo(files, gated=True),
        "test-org/private-llama": Repo(files, private=True),
        "test-org/pickled": Repo(pickled),
    }


def _lora_adapter(base: Path, out: Path) -> Path:
    """A PEFT adapter for the tiny model, made by peft (random nonzero A and B)."""
    import torch
    import transformers

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.get_peft_model(
        model, peft.LoraConfig(r=4, init_lora_weights=False, target_modules=["q_proj"])
    ).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hub(repos):
    with FakeHub(repos) as h:
        yield h


def hub_env(url: str, home: Path, **extra: str) -> dict[str, str]:
    """The Hub's variables for a pytgi process: this endpoint and cache, no token unless given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_ENDPOINT": url, "HF_HOME": str(home), "HF_TOKEN": "", **extra}


def pytgi(*args: str, env: dict[str, str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytgi.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    return done, time.monotonic() - start


def test_serves_a_hub_model_then_from_the_cache_offline_and_without_the_hub(hub, repos, tmp_path):
    home = tmp_path / "hf"
    srv = Server("--model-id", HF, env=hub_env(hub.url, home), log=tmp_path / "online.log").wait_ready()
    try:
        info = httpx.get(f"{srv.url}/info").json()
        assert info["model_id"] == HF and info["model_sha"] == repos[HF].commit
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == [HF]
        r = httpx.post(
            f"{srv.url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, timeout=60
        )
        assert r.status_code == 200 and "generated_text" in r.json()
    finally:
        assert srv.stop() == 0
    assert sorted(hub.downloads()) == NEEDED  # not the README, the ONNX file or the pickled weights
    served = len(hub.requests)
    offline = Server(
        "--model-id", HF, env=hub_env(hub.url, home, HF_HUB_OFFLINE="1"), log=tmp_path / "offline.log"
    )
    try:
        offline.wait_ready()
        assert httpx.get(f"{offline.url}/info").json()["model_sha"] == repos[HF].commit
    finally:
        offline.stop()
    assert len(hub.requests) == served  # not a single request
    assert "HF_HUB_OFFLINE is set: serving test-org/tiny-llama from the cache" in offline.tail()
    away = Server(
        "--model-id", HF, env=hub_env(f"http://127.0.0.1:{free_port()}", home), log=tmp_path / "away.log"
    )
    try:
        away.wait_ready()
        assert httpx.get(f"{away.url}/info").json()["model_sha"] == repos[HF].commit
    finally:
        away.stop()
    said = [line for line in away.tail().splitlines() if "unreachable" in line]
    assert len(said) == 1 and "serving test-org/tiny-llama from the cache" in said[0], away.tail()


def test_serves_a_split_gguf_by_its_tag(hub, tmp_path):
    before = len(hub.downloads())
    model = f"{GGUF}:q8_0"  # case-insensitive, as llama.cpp's -hf
    srv = Server(
        "--model-id", model, env=hub_env(hub.url, tmp_path / "hf"), log=tmp_path / "gguf.log"
    ).wait_ready()
    try:
        assert httpx.get(f"{srv.url}/info").json()["model_id"] == model
        r = httpx.post(
            f"{srv.url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}, timeout=60
        )
        assert r.status_code == 200
    finally:
        srv.stop()
    assert sorted(hub.downloads()[before:]) == [
        "tiny-Q8_0-00001-of-00002.gguf",
        "tiny-Q8_0-00002-of-00002.gguf",
    ]


def test_download_picks_files_and_logs_each_one(hub, repos, tmp_path):
    env = hub_env(hub.url, tmp_path / "hf")
    done, _ = pytgi("download", GGUF, env=env)  # no tag: Q4_K_M, as llama.cpp picks
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).name == "tiny-Q4_K_M.gguf" and Path(done.stdout.strip()).is_file()
    done, _ = pytgi("download", f"{GGUF}/tiny-F16.gguf", "--json-output", env=env)
    assert done.returncode == 0 and Path(done.stdout.strip()).name == "tiny-F16.gguf"
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [(e["file"], e["repo"]) for e in lines if "file" in e] == [("tiny-F16.gguf", GGUF)]
    done, _ = pytgi("download", HF, "--revision", "v1", env=env)  # a branch: its commit's snapshot
    assert done.returncode == 0 and Path(done.stdout.strip()).name == "1" * 40
    done, _ = pytgi("download", "test-org/gated-llama", env={**env, "HF_TOKEN": TOKEN})
    assert done.returncode == 0 and (Path(done.stdout.strip()) / "model.safetensors").is_file()


REFUSALS = [
    ("test-org/gated-llama", {}, ["test-org/gated-llama is gated", "HF_TOKEN"]),
    ("test-org/private-llama", {}, ["test-org/private-llama: repository not found", "HF_TOKEN"]),
    ("test-org/nope", {"HF_TOKEN": TOKEN}, ["test-org/nope: repository not found"]),
    (HF, {"REVISION": "v9"}, ["test-org/tiny-llama: revision v9 not found"]),
    (f"{GGUF}:Q5_K_S", {}, ["no GGUF file for the tag Q5_K_S", "tags here: F16, Q4_K_M, Q8_0"]),
    ("test-org/pickled", {}, ["test-org/pickled has only pickled PyTorch weights", "safetensors"]),
    (HF, {"HF_HUB_OFFLINE": "1"}, ["test-org/tiny-llama: HF_HUB_OFFLINE is set", "not in the cache"]),
    (
        HF,
        {"HF_ENDPOINT": "closed"},
        ["test-org/tiny-llama: the Hub at", "is unreachable", "not in the cache"],
    ),
]


@pytest.mark.parametrize(
    "model, extra, said", REFUSALS, ids=[f"{m}-{'-'.join(e) or 'plain'}" for m, e, _ in REFUSALS]
)
def test_refusals_are_one_line_and_quick(hub, tmp_path, model, extra, said):
    env = hub_env(hub.url, tmp_path / "hf", **extra)
    if env["HF_ENDPOINT"] == "closed":
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    done, seconds = pytgi("serve", "--model-id", model, "--port", str(free_port()), env=env)
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert done.returncode != 0 and seconds < 30, (done.returncode, seconds)
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr
    assert all(s in errors[0] for s in said), errors[0]


def test_a_lora_adapter_by_its_hub_id(hub, tmp_path):
    before = len(hub.downloads())
    srv = Server(
        "--model-id",
        HF,
        "--lora-adapters",
        "sql=test-org/tiny-lora",
        env=hub_env(hub.url, tmp_path / "hf"),
        log=tmp_path / "lora.log",
    ).wait_ready()
    try:
        assert list(httpx.get(f"{srv.url}/info").json()["lora_adapters"]) == ["sql"]
        body = {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "adapter_id": "sql"}}
        assert httpx.post(f"{srv.url}/generate", json=body, timeout=60).status_code == 200
    finally:
        srv.stop()
    assert "adapter_model.safetensors" in hub.downloads()[before:]
    assert "README.md" not in hub.downloads()[before:]
