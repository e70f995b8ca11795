"""What the API process's routes share: the server's configuration and state, and the admission of a
request (its claim on the concurrency slots)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from pytgi.config import EngineConfig
from pytgi.metrics import Metrics
from pytgi.router.engine_client import EngineClient
from pytgi.router.infer import Admission, Infer
from pytgi.router.validation import Validation
from pytgi.tokenizer import Tokenizer


@dataclass(slots=True)
class ServerConfig:
    engine: EngineConfig
    model_path: Path
    model_id: str
    hostname: str = "0.0.0.0"
    port: int = 3000
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    validation_workers: int = 2
    api_key: str | None = None
    api_key_exempt: tuple[str, ...] = ("health",)  # route names (pytgi.server.middleware.EXEMPTIONS)
    payload_limit: int = 2_000_000
    request_body_timeout: float = 30.0
    tls: bool = False
    cors_allow_origin: list[str] = field(default_factory=list)
    json_output: bool = False
    graceful_termination_timeout: int = 90
    model_sha: str | None = None  # the Hub commit served (or --revision for a local model)
    engine_module: str = "pytgi.engine.process"  # the engine process's entry point


@dataclass(slots=True)
class State:
    config: ServerConfig
    client: EngineClient
    tokenizer: Tokenizer
    metrics: Metrics
    infer: Infer | None = None
    validation: Validation | None = None
    on_engine_death: list[Callable[[str], None]] = field(default_factory=list)


def state_of(request: Request) -> State:
    return request.app.state.pytgi


ADMISSIONS = "pytgi.admissions"  # scope key: the admissions of one HTTP exchange


def admission(request: Request) -> Admission:
    """A new claim on the concurrency slots for this HTTP exchange;
    `pytgi.server.middleware.AdmissionMiddleware` closes it when the exchange ends
    (response sent, error raised, client gone, stream never started)."""
    st = state_of(request)
    assert st.infer is not None
    adm = st.infer.admission()
    request.scope[ADMISSIONS].append(adm)
    return adm
