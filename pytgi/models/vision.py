"""What the vision-language families share: their image processors' output, and loading them."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Expanded:
    """What a model's image processor (in the engine) makes of an image."""

    pixels: dict[str, torch.Tensor]  # for `model.encode_image`
    ids: list[int]  # the token ids of the positions it takes in the prompt
    grid: tuple[int, int] | None = None  # M-RoPE (Qwen2-VL): its rows as a (height, width) grid


def load_image_processor(path: Path) -> Any:
    """The checkpoint's image processor (`preprocessor_config.json`), the PIL one: the exact one."""
    from transformers import AutoImageProcessor

    with warnings.catch_warnings():  # no torchvision: the slow processor, which is the reference
        warnings.simplefilter("ignore")
        return AutoImageProcessor.from_pretrained(str(path))
