"""The servers a benchmark runs against: one given by URL, or peers it starts itself on a free port —
`pytgi serve`, llama.cpp's `llama-server`, `transformers serve` — one after another, never together."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from pytgi.bench.procs import PeakRss
from pytgi.core.net import free_port

if TYPE_CHECKING:
    from typing_extensions import Unpack

PEER_KINDS = ("pytgi", "llama-server", "transformers-serve", "tgi", "openai")
DEFAULT_LLAMA_SERVER_ARGS = "-np 16 -c 16384 -t 2"
DEFAULT_TRANSFORMERS_SERVE_CMD = "transformers serve"
LOCALHOST = "127.0.0.1"


class PeerError(RuntimeError):
    pass


class _StartedInfo(TypedDict, total=False):
    ready_s: float | None  # a started peer's: from start to its first healthy answer
    peak_rss_bytes: int | None  # ... and the peak resident memory of its process tree


class ServerInfo(_StartedInfo):
    """A target as a benchmark's JSON describes it (`Target.describe`)."""

    server: str
    url: str
    protocol: str
    endpoint: str
    command: list[str] | None


class TargetOptions(TypedDict, total=False):
    """`Target`'s fields a started peer's constructor passes on to it."""

    chat: bool
    send_ignore_eos: bool
    model: str | None


class StartOptions(TypedDict, total=False):
    """How a peer this benchmark starts is started (`ManagedTarget`'s options)."""

    startup_timeout: float
    log_dir: Path | None
    env: dict[str, str] | None


class PytgiOptions(StartOptions, total=False):
    chat: bool
    model: str | None


@dataclass
class Target:
    """A server to benchmark: where it is and how to talk to it."""

    name: str
    url: str = ""
    protocol: str = "tgi"  # tgi | openai
    chat: bool = False  # OpenAI: /v1/chat/completions instead of /v1/completions
    send_ignore_eos: bool = True  # OpenAI: send the `ignore_eos` extension
    model: str | None = None  # OpenAI `model`; None: ask /v1/models
    command: list[str] = field(default_factory=list)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def describe(self) -> ServerInfo:
        return {
            "server": self.name,
            "url": self.url,
            "protocol": self.protocol,
            "endpoint": ("/v1/chat/completions" if self.chat else "/v1/completions")
            if self.protocol == "openai"
            else "/generate_stream",
            "command": self.command or None,
        }

    def __enter__(self) -> Target:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ManagedTarget(Target):
    """A server process this benchmark starts on a free port, waits for (`/health` 200) and stops."""

    health_path = "/health"

    def __init__(
        self,
        name: str,
        protocol: str,
        startup_timeout: float = 600.0,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        **kw: Unpack[TargetOptions],
    ) -> None:
        super().__init__(name=name, protocol=protocol, **kw)
        self.startup_timeout = startup_timeout
        self.log_dir = log_dir
        self.env = env or {}
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.ready_s: float | None = None  # from start to its first healthy answer
        self._rss: PeakRss | None = None  # the peak resident memory of its process tree, start to stop
        self.peak_rss: int | None = None

    def build_command(self, port: int) -> list[str]:
        raise NotImplementedError

    def prepare(self) -> None:
        """Anything to set up before the process starts."""

    def cleanup(self) -> None:
        """Anything to remove after it stopped."""

    def start(self) -> None:
        self.prepare()
        self.port = free_port()
        self.url = f"http://{LOCALHOST}:{self.port}"
        self.command = self.build_command(self.port)
        log_dir = self.log_dir or Path(tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^\w.-]+", "_", self.name)[:80]  # a peer's name may carry its flags and paths
        self.log_path = log_dir / f"pytgi-bench-{safe}-{self.port}.log"
        # its own process group: stopping it also stops the children it started (pytgi's engine)
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(
                    self.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **self.env},
                    start_new_session=True,
                )
            except OSError as e:
                raise PeerError(f"{self.name}: cannot run {shlex.join(self.command)}: {e}") from e
        t0 = time.monotonic()
        self._rss = PeakRss(self.proc.pid)
        try:
            self.wait_ready()
            self.ready_s = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(
                    f"{self.name} exited with code {self.proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.tail()}"
                )
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise PeerError(
            f"{self.name} not ready after {self.startup_timeout:.0f}s; log {self.log_path}:\n{self.tail()}"
        )

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:] if self.log_path else ""
        except OSError:
            return ""

    def describe(self) -> ServerInfo:
        peak = self._rss.peak if self._rss is not None else self.peak_rss
        return {**super().describe(), "ready_s": self.ready_s, "peak_rss_bytes": peak}

    def stop(self) -> None:
        if self._rss is not None:
            self.peak_rss, self._rss = self._rss.stop(), None
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self.cleanup()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group this benchmark created for the process (start_new_session)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


# -- pytgi ---------------------------------------------------------------------------------------------
def pytgi_command(port: int, extra_args: str | list[str] = "", python: str | None = None) -> list[str]:
    extra = shlex.split(extra_args) if isinstance(extra_args, str) else list(extra_args)
    return [
        python or sys.executable,
        "-m",
        "pytgi.cli",
        "serve",
        "--hostname",
        LOCALHOST,
        "--port",
        str(port),
        *extra,
    ]


class PytgiTarget(ManagedTarget):
    def __init__(self, protocol: str = "tgi", extra_args: str = "", **kw: Unpack[PytgiOptions]) -> None:
        super().__init__("pytgi", protocol, **kw)
        self.extra_args = extra_args

    def build_command(self, port: int) -> list[str]:
        return pytgi_command(port, self.extra_args)


# -- llama.cpp -----------------------------------------------------------------------------------------
def llama_server_command(
    binary: str | os.PathLike,
    model: str | os.PathLike,
    port: int,
    args: str | list[str] = DEFAULT_LLAMA_SERVER_ARGS,
    host: str = LOCALHOST,
) -> list[str]:
    """`llama-server -m <gguf> <args> --host H --port P` (args default: -np 16 -c 16384 -t 2)."""
    extra = shlex.split(args) if isinstance(args, str) else list(args)
    return [str(binary), "-m", str(model), *extra, "--host", host, "--port", str(port)]


class LlamaServerTarget(ManagedTarget):
    """llama.cpp's server on the same GGUF file; OpenAI protocol with `ignore_eos`."""

    def __init__(
        self,
        binary: str,
        model: str | os.PathLike | None = None,
        args: str = DEFAULT_LLAMA_SERVER_ARGS,
        chat: bool = False,
        **kw: Unpack[StartOptions],
    ) -> None:
        super().__init__("llama-server", "openai", chat=chat, **kw)
        self.binary = binary
        self.gguf = model
        self.args = args

    def prepare(self) -> None:
        if not (Path(self.binary).is_file() or shutil.which(self.binary)):
            raise PeerError(
                f"llama-server: no executable at {self.binary!r} (docs/bench.md says how to build it)"
            )
        if self.gguf is None:
            from pytgi.core.model_files import default_gguf_path

            self.gguf = default_gguf_path()

    def build_command(self, port: int) -> list[str]:
        assert self.gguf is not None
        return llama_server_command(self.binary, self.gguf, port, self.args)


# -- transformers serve ----------------------------------------------------------------------------------
def copy_without_eos(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """A copy of the model directory `src` whose config.json and generation_config.json have
    `eos_token_id: null` (so generation never stops early: `transformers serve` rejects `ignore_eos`).

    Other files are symlinked, not copied; `dst` is created."""
    src, dst = Path(src).resolve(), Path(dst)
    if not (src / "config.json").is_file():
        raise PeerError(f"{src} is not a Hugging Face model directory (no config.json)")
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if not config.get("architectures"):
        raise PeerError(f"{src}/config.json has no `architectures`: transformers serve cannot load it")
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name in ("config.json", "generation_config.json"):
            continue
        (dst / item.name).symlink_to(item)
    config["eos_token_id"] = None
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen_path = src / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
    gen["eos_token_id"] = None
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    return dst


def transformers_serve_command(
    model_dir: str | os.PathLike,
    port: int,
    cmd: str | list[str] = DEFAULT_TRANSFORMERS_SERVE_CMD,
    extra_args: str | list[str] = "",
    host: str = LOCALHOST,
) -> list[str]:
    """`transformers serve <model_dir> --continuous-batching --host H --port P <extra>`: the model given as
    the positional argument is preloaded and pinned (requests must name it or no model)."""
    base = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    if base and base[0] == "transformers" and shutil.which("transformers") is None:
        beside = Path(sys.executable).parent / "transformers"  # the venv's script, when it is not on PATH
        if beside.is_file():
            base[0] = str(beside)
    extra = shlex.split(extra_args) if isinstance(extra_args, str) else list(extra_args)
    return [*base, str(model_dir), "--continuous-batching", "--host", host, "--port", str(port), *extra]


class TransformersServeTarget(ManagedTarget):
    """`transformers serve --continuous-batching` on a copy of the model directory without EOS; OpenAI
    completions (or chat) without `ignore_eos`, which it rejects."""

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        cmd: str = DEFAULT_TRANSFORMERS_SERVE_CMD,
        extra_args: str = "",
        chat: bool = False,
        **kw: Unpack[StartOptions],
    ) -> None:
        super().__init__("transformers-serve", "openai", chat=chat, send_ignore_eos=False, **kw)
        self.model_dir = model_dir
        self.cmd = cmd
        self.extra_args = extra_args
        self.tmp: Path | None = None
        self.served_dir: Path | None = None

    def prepare(self) -> None:
        src = self.model_dir
        if src is None:
            from pytgi.core.model_files import resolve_model

            src = resolve_model(None).path
        self.tmp = Path(tempfile.mkdtemp(prefix="pytgi-bench-tf-"))
        self.served_dir = copy_without_eos(src, self.tmp / "model")
        self.model = str(self.served_dir)  # a pinned server answers only to its own name

    def build_command(self, port: int) -> list[str]:
        assert self.served_dir is not None
        return transformers_serve_command(self.served_dir, port, self.cmd, self.extra_args)

    def cleanup(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


# -- from the command line --------------------------------------------------------------------------------
def parse_peer(spec: str) -> tuple[str, str | None]:
    """`pytgi`, `pytgi=SERVE FLAGS`, `transformers-serve`, `llama-server=/path/to/llama-server`, `tgi=URL`,
    `openai=URL`."""
    kind, sep, given = spec.partition("=")
    kind = kind.strip()
    if kind not in PEER_KINDS:
        raise ValueError(f"unknown peer {kind!r}: one of {', '.join(PEER_KINDS)}")
    value = given.strip() if sep else None
    if kind in ("llama-server", "tgi", "openai") and not value:
        what = "the path of the llama-server binary" if kind == "llama-server" else "the server's URL"
        raise ValueError(f"--peer {kind}=... needs {what}")
    return kind, value or None
