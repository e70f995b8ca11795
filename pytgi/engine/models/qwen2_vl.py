"""Qwen2-VL and Qwen2.5-VL: transformers' vision transformer (its own 2-D rotary, window attention
in 2.5, and the merger of 2 × 2 patches) in front of pytgi's own Qwen2 decoder, with M-RoPE.

The image processor resizes an image to whole multiples of 28 pixels (`smart_resize`); each 2 × 2
of its 14-pixel patches becomes one row. The chat template writes
`<|vision_start|><|image_pad|><|vision_end|>` for an image; the engine expands `<|image_pad|>` to
the image's rows. Positions are 3-D (temporal, height, width): text counts on along all three; an
image's rows take their row and column in its grid from where the image starts, and the text after
it goes on from there plus the grid's longer side (`pytgi.engine.execution.images.mrope_positions`). The
rotary's frequencies are split between the three axes (`mrope_section`), so a text-only prompt
runs exactly as a Qwen2 model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pytgi.core.errors import UnsupportedModel
from pytgi.core.image_layouts import Merge
from pytgi.engine.models.decoder import DecoderModel
from pytgi.engine.models.vision import Expanded, VisionLanguageModel, load_image_processor

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

# checkpoint prefix → part: transformers 5's names, then the Hub's older ones (the decoder at `model.`)
PREFIXES = {
    "model.language_model.": "text",
    "model.visual.": "tower",
    "visual.": "tower",
    "model.": "text",
}
MROPE_SECTION = [16, 24, 24]  # transformers' default where the config names none


def _family(
    hf: dict[str, Any],
) -> tuple[
    type[Qwen2VLConfig | Qwen2_5_VLConfig],
    type[Qwen2VisionTransformerPretrainedModel | Qwen2_5_VisionTransformerPretrainedModel],
]:
    """transformers' config and vision tower classes for the checkpoint's architecture."""
    if hf["architectures"][0] == "Qwen2VLForConditionalGeneration":
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m

        return Qwen2VLConfig, m.Qwen2VisionTransformerPretrainedModel
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m25

    return Qwen2_5_VLConfig, m25.Qwen2_5_VisionTransformerPretrainedModel


def _config(hf: dict[str, Any]) -> Any:
    return _family(hf)[0](**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json, as a Qwen2 checkpoint would have it."""
    text = _config(hf).text_config.to_dict()
    text["architectures"] = ["Qwen2ForCausalLM"]
    raw = hf.get("text_config") or hf
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text


def mrope_section(text: dict[str, Any]) -> list[int]:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return list(rope.get("mrope_section") or MROPE_SECTION)


class Qwen2VLImages:
    """The engine's image processor for Qwen2-VL: the patches, and one image token per merged row."""

    def __init__(self, path: Path, hf: dict[str, Any]) -> None:
        self.processor = p = load_image_processor(path)
        size = p.size
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
        low = getattr(p, "min_pixels", None) or get("shortest_edge")
        high = getattr(p, "max_pixels", None) or get("longest_edge")
        if not low or not high:
            raise UnsupportedModel("the image processor names no min_pixels/max_pixels")
        token = hf.get("image_token_id")
        if token is None:
            raise UnsupportedModel("the checkpoint's config names no image_token_id")
        self.merge = int(p.merge_size)
        self.layout = Merge(
            token=int(token),
            positions=0,
            patch=int(p.patch_size),
            merge=self.merge,
            min_pixels=int(low),
            max_pixels=int(high),
        )

    def __call__(self, img: Image) -> Expanded:
        out = self.processor(images=[img], return_tensors="pt")
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        if t != 1:
            raise UnsupportedModel(f"an image of {t} frames")
        grid = (h // self.merge, w // self.merge)
        pixels = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        return Expanded(pixels, [self.layout.token] * (grid[0] * grid[1]), grid)


class Qwen2VLModel(VisionLanguageModel):
    """The engine's `CausalLM` for Qwen2-VL and Qwen2.5-VL."""

    PREFIXES = PREFIXES

    def __init__(self, hf: dict[str, Any], text: DecoderModel) -> None:
        super().__init__(hf, text)
        self.tower = _family(hf)[1]._from_config(_config(hf).vision_config)
        text.mrope_section = mrope_section(text_config(hf))

    def image_processor(self, path: Path) -> Qwen2VLImages:
        return Qwen2VLImages(path, self.hf)

    @torch.inference_mode()
    def encode_image(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows [grid height × grid width, hidden], in the grid's reading order."""
        dtype = next(self.tower.parameters()).dtype
        out = self.tower(pixels["pixel_values"].to(dtype), grid_thw=pixels["image_grid_thw"])
        return out.pooler_output
