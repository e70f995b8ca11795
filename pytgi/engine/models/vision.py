"""What the vision-language families share: their image processors' output and loading, and the
model around the decoder."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from pytgi.core.errors import UnsupportedModel
from pytgi.engine.models.attention import LayerCache
from pytgi.engine.models.decoder import DecoderMetadata, DecoderModel, StepImages, Weight, Weights


@dataclass(frozen=True, slots=True)
class Expanded:
    """What a model's image processor (in the engine) makes of an image."""

    pixels: dict[str, torch.Tensor]  # for `model.encode_image`
    ids: list[int]  # the token ids of the positions it takes in the prompt
    grid: tuple[int, int] | None = None  # M-RoPE (Qwen2-VL): its rows as a (height, width) grid
    row_token: int | None = None  # the positions that take its rows (None: the layout's image token)
    bidirectional: bool = False  # its rows attend to each other both ways (Gemma 3)


def load_image_processor(path: Path) -> Any:
    """The checkpoint's image processor (`preprocessor_config.json`), the PIL one: the exact one."""
    from transformers import AutoImageProcessor

    with warnings.catch_warnings():  # no torchvision: the slow processor, which is the reference
        warnings.simplefilter("ignore")
        return AutoImageProcessor.from_pretrained(str(path))


# the checkpoint layout of transformers' *ForConditionalGeneration with a vision tower and a projector
# (LLaVA, Gemma 3): checkpoint prefix → part, transformers 5's names first, then the older ones
TOWER_PROJECTOR_PREFIXES = {
    "model.language_model.": "text",
    "language_model.model.": "text",
    "model.vision_tower.": "tower",
    "vision_tower.": "tower",
    "model.multi_modal_projector.": "projector",
    "multi_modal_projector.": "projector",
}
TOWER_PROJECTOR_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


class VisionLanguageModel(nn.Module):
    """A vision part in front of pytgi's `DecoderModel` (`text`): the engine's `CausalLM` for a
    vision-language model. The engine sees the decoder's config, attention and layers; `forward`
    takes the step's image rows (`StepImages`). A family names its checkpoint's parts (`PREFIXES`:
    prefix → "text" or a part), loads its parts (`load_parts`), and encodes an image's pixels into
    rows (`encode_image`)."""

    PREFIXES: ClassVar[dict[str, str]]
    HEADS: ClassVar[tuple[str, ...]] = ("lm_head.weight",)

    def __init__(self, hf: dict[str, Any], text: DecoderModel) -> None:
        super().__init__()
        self.hf, self.text = hf, text
        self.config, self.attention, self.layers = text.config, text.attention, text.layers

    def load_weights(self, weights: Weights) -> None:
        """The decoder's tensors go to `DecoderModel`, renamed as a Llama checkpoint's; the others are
        gathered by part for `load_parts` (an unknown tensor is an error)."""
        parts: dict[str, dict[str, torch.Tensor]] = {p: {} for p in self.PREFIXES.values() if p != "text"}

        def text_weights() -> Iterator[tuple[str, Weight]]:
            for name, tensor in weights:
                if name in self.HEADS:
                    yield "lm_head.weight", tensor
                    continue
                prefix = next((p for p in self.PREFIXES if name.startswith(p)), None)
                if prefix is None:
                    raise UnsupportedModel(
                        f"unexpected tensor {name!r} in a {type(self).__name__} checkpoint"
                    )
                rest, part = name[len(prefix) :], self.PREFIXES[prefix]
                if part == "text":
                    yield "model." + rest, tensor
                else:
                    assert isinstance(tensor, torch.Tensor), name
                    parts[part][rest] = tensor

        self.text.load_weights(text_weights())
        self.load_parts(parts)

    def load_parts(self, parts: dict[str, dict[str, torch.Tensor]]) -> None:
        """Each part's tensors into the module of that name (strict: none missing, none extra)."""
        for part, tensors in parts.items():
            getattr(self, part).load_state_dict(tensors, strict=True)

    def quantize(self, plan: dict[str, str] | str, act_dtype: torch.dtype) -> None:
        """Quantize the language model; the vision part runs in `act_dtype`."""
        self.text.quantize(plan, act_dtype)
        decoder = {id(m) for m in self.text.modules()}  # `layers` is the decoder's too
        for module in self.children():
            if id(module) not in decoder:
                module.to(act_dtype)
        for param in self.parameters(recurse=False):  # a family's own rows (LLaVA-NeXT's newline)
            param.data = param.data.to(act_dtype)

    def encode_image(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerCache],
        meta: DecoderMetadata,
        image_rows: StepImages | None = None,
    ) -> torch.Tensor:
        return self.text(input_ids, positions, kv_caches, meta, image_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.text.compute_logits(hidden)
