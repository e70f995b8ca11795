"""What the API process's routes share: the server's configuration and state, and the admission of a
request (its claim on the concurrency slots)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from pytgi.api.frontend.engine_client import Engine
from pytgi.api.frontend.infer import Admission, Infer
from pytgi.api.frontend.media import ImageRef, MediaLimits, load_images
from pytgi.api.frontend.validation import Validation
from pytgi.api.metrics import Metrics
from pytgi.core.config import ServerConfig
from pytgi.core.errors import InvalidRequest, UnknownModel
from pytgi.core.tokenizer import Tokenizer

MODEL_ALIASES = ("", "tgi")  # also served: what TGI's OpenAI routes accept


@dataclass(slots=True)
class State:
    config: ServerConfig
    client: Engine
    tokenizer: Tokenizer
    metrics: Metrics
    infer: Infer | None = None
    validation: Validation | None = None
    on_engine_death: list[Callable[[str], None]] = field(default_factory=list)
    start_failed: str | None = None  # why the engine did not start (logged once, as one line)
    media_slots: asyncio.Semaphore | None = None  # image URLs fetched at once (made on first use)

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters a request may name: name → directory, as the engine's last snapshot has
        them (none before the engine is up; those being unloaded left out)."""
        return self.client.adapters.names()

    @property
    def takes_images(self) -> bool:
        info = self.client.info
        return info is not None and info.image_layout is not None

    def image_token_text(self) -> str:
        """The image token as the chat template and TGI's inputs write it (e.g. `<image>`)."""
        info = self.client.info
        assert info is not None and info.image_layout is not None
        return self.tokenizer.id_to_piece(info.image_layout.token)

    def media_limits(self) -> MediaLimits:
        cfg = self.config
        if self.media_slots is None:
            self.media_slots = asyncio.Semaphore(max(cfg.max_concurrent_media_fetches, 1))
        return MediaLimits(
            max_images=cfg.max_images_per_request,
            timeout=cfg.media_fetch_timeout,
            allowed_domains=tuple(d.lower() for d in cfg.allowed_media_domains),
            slots=self.media_slots,
        )

    async def load_images(self, refs: list[ImageRef]) -> list[bytes]:
        """The images a request names, fetched and checked; refused for a model without images."""
        if not refs:
            return []
        if not self.takes_images:
            model = self.client.info.model_id if self.client.info is not None else "served"
            raise InvalidRequest(f"the model `{model}` does not take images", refs[0].where)
        return await load_images(refs, self.media_limits())

    def check_model(self, model: str | None) -> None:
        """`model` (an OpenAI or Anthropic body's) names the served model (or an alias of it) or one
        of its LoRA adapters."""
        served, adapters = self.config.model_id, self.adapters
        if not (model is None or model in MODEL_ALIASES or model == served or model in adapters):
            also = "".join(f", `{a}`" for a in sorted(adapters))
            raise UnknownModel(f"The model `{model}` does not exist: this server serves `{served}`{also}")

    def adapter_of(self, model: str | None) -> str | None:
        """The adapter an OpenAI or Anthropic `model` names; None: the base model."""
        return model if model is not None and model in self.adapters else None


def state_of(request: Request) -> State:
    return request.app.state.pytgi


ADMISSIONS = "pytgi.admissions"  # scope key: the admissions of one HTTP exchange


def admission(request: Request) -> Admission:
    """A new claim on the concurrency slots for this HTTP exchange;
    `pytgi.api.middleware.AdmissionMiddleware` closes it when the exchange ends
    (response sent, error raised, client gone, stream never started)."""
    st = state_of(request)
    assert st.infer is not None
    adm = st.infer.admission()
    request.scope[ADMISSIONS].append(adm)
    return adm
