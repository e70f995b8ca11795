"""The engine's side of the family registry (`pytgi.core.families`): a family's code, imported when a
model of it is loaded. A family names its module under `pytgi.engine.models` and, there, the function
that reads its config.json (a decoder's into a `DecoderConfig`; a vision model's into its language
model's config.json) and its model class (vision models, encoders)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pytgi.core.errors import UnsupportedModel
from pytgi.core.families import DECODER, Family, causal_lm, family_of

if TYPE_CHECKING:
    from pytgi.engine.models.decoder import DecoderConfig


def _attr(family: Family, name: str) -> Any:
    return getattr(importlib.import_module(f"pytgi.engine.models.{family.module}"), name)


def config_reader(family: Family) -> Callable[[dict[str, Any]], Any]:
    """The family's config.json reader."""
    return cast("Callable[[dict[str, Any]], Any]", _attr(family, family.config))


def model_class(family: Family) -> Any:
    """The family's model class (a vision model's, an encoder's)."""
    return _attr(family, family.model)


def family_for(architecture: str | None, path: Path) -> Family:
    """The family that runs `architecture` with pytgi's own code; `UnsupportedModel` when none does."""
    family = family_of(architecture)
    if family is None:
        raise UnsupportedModel(f"architecture {architecture!r} of {path} has no family in pytgi's own code")
    return family


def decoder_config(text: dict[str, Any], path: Path) -> DecoderConfig:
    """A language model's config.json read by its family into a `DecoderConfig` (a decoder's bare
    model or classifier has its causal LM's layers)."""
    arch = (text.get("architectures") or [None])[0]
    if (causal := causal_lm(arch)) is not None:
        text, arch = {**text, "architectures": [causal]}, causal
    family = family_for(arch, path)
    if family.kind != DECODER:
        raise UnsupportedModel(f"{path.name}: {arch} is not a decoder's language model")
    return config_reader(family)(text)
