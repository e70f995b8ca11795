"""LLaVA (1.5): a vision tower and a projector in front of pytgi's own Llama decoder.

An image becomes a fixed number of rows of the language model's input: the tower's hidden states of
layer `vision_feature_layer` (without the CLS row under the "default" strategy), through the
projector. The prompt holds one image token per image; the engine expands it to that many copies
(`LlavaImages`, `pytgi.engine.execution.images`), and the step that computes those positions takes the
image's rows instead of the token's embedding. The tower and the projector are transformers' modules, run
whole on this rank; the language model is `DecoderModel`, with its kernels, quantization and KV cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pytgi.core.errors import UnsupportedModel
from pytgi.core.image_layouts import AnyRes, Fixed, ImageLayout
from pytgi.engine.models.decoder import DecoderModel
from pytgi.engine.models.vision import (
    TOWER_PROJECTOR_HEADS,
    TOWER_PROJECTOR_PREFIXES,
    Expanded,
    VisionLanguageModel,
    load_image_processor,
)

if TYPE_CHECKING:
    from PIL.Image import Image


def _is_next(hf: dict[str, Any]) -> bool:
    """LLaVA-NeXT (any-resolution tiles and a row-end embedding), not LLaVA-1.5."""
    return str(hf["architectures"][0]).startswith("LlavaNext")


PREFIXES = {  # checkpoint prefix → part
    "model.image_newline": "newline",  # LLaVA-NeXT's row end
    "image_newline": "newline",
    **TOWER_PROJECTOR_PREFIXES,
}


def hf_config(hf: dict[str, Any]) -> Any:
    """transformers' config of the checkpoint (its defaults filled in: llava-hf's config.json leaves
    most of the language model's and the tower's out)."""
    from transformers import LlavaConfig, LlavaNextConfig

    config_cls: type[LlavaConfig | LlavaNextConfig] = LlavaNextConfig if _is_next(hf) else LlavaConfig
    return config_cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})


def vision_spec(hf: dict[str, Any]) -> tuple[int, int]:
    """The model's image token and how many positions an image takes (LLaVA-NeXT: the whole image's)."""
    config = hf_config(hf)
    vision = config.vision_config
    grid = vision.image_size // vision.patch_size
    strategy = config.vision_feature_select_strategy
    token = hf.get("image_token_index", hf.get("image_token_id"))
    tower = vision.model_type
    if token is None or tower not in ("clip_vision_model", "siglip_vision_model"):
        raise UnsupportedModel(f"this LLaVA checkpoint's vision tower ({tower}) is not supported")
    # CLIP's hidden states start with a CLS row; the "default" strategy drops the first row
    cls_row = tower == "clip_vision_model"
    return int(token), grid * grid + int(cls_row) - int(strategy == "default")


class LlavaImages:
    """The engine's image processor for LLaVA: every position of an image is an image token (the same
    count for every image in LLaVA-1.5; by the image's size in LLaVA-NeXT)."""

    def __init__(self, path: Path, hf: dict[str, Any]) -> None:
        token, positions = vision_spec(hf)
        self.processor = load_image_processor(path)
        self.layout: ImageLayout = Fixed(token=token, positions=positions)
        if _is_next(hf):
            crop = self.processor.crop_size
            side = crop["height"] if isinstance(crop, dict) else crop.height
            vision = hf_config(hf).vision_config
            if side != vision.image_size:
                raise UnsupportedModel(f"LLaVA-NeXT tiles of {side} pixels for a tower of another size")
            pinpoints = [list(p) for p in self.processor.image_grid_pinpoints]
            self.layout = AnyRes(
                token=token,
                positions=positions,
                tile=side,
                pinpoints=pinpoints,
                patch=vision.patch_size,
            )

    def __call__(self, img: Image) -> Expanded:
        out = self.processor(images=[img], return_tensors="pt")
        pixels = {k: out[k] for k in ("pixel_values", "image_sizes") if k in out}
        return Expanded(pixels, [self.layout.token] * self.layout.image_positions(*img.size))


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json, as a Llama checkpoint would have it."""
    text = hf_config(hf).text_config.to_dict()
    text["architectures"] = ["LlamaForCausalLM"]
    text["tie_word_embeddings"] = hf.get(
        "tie_word_embeddings", hf["text_config"].get("tie_word_embeddings", False)
    )
    return text


class LlavaModel(VisionLanguageModel):
    """The engine's `CausalLM` for LLaVA-1.5 and LLaVA-NeXT."""

    PREFIXES = PREFIXES
    HEADS = TOWER_PROJECTOR_HEADS

    def __init__(self, hf: dict[str, Any], text: DecoderModel) -> None:
        super().__init__(hf, text)
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector

        vision_spec(hf)  # refuses a tower it does not know
        self.next = _is_next(hf)
        projector_cls: type[LlavaMultiModalProjector | LlavaNextMultiModalProjector] = (
            LlavaNextMultiModalProjector if self.next else LlavaMultiModalProjector
        )
        config = hf_config(hf)
        self.tower = AutoModel.from_config(config.vision_config)
        self.projector = projector_cls(config)
        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        if self.next:  # the row that ends each row of an image's patches
            self.image_newline = nn.Parameter(torch.zeros(config.text_config.hidden_size))
            self.pinpoints = config.image_grid_pinpoints
            self.side = config.vision_config.image_size
            self.patch = config.vision_config.patch_size

    def load_parts(self, parts: dict[str, dict[str, torch.Tensor]]) -> None:
        tower = parts["tower"]
        if not any(k.startswith("vision_model.") for k in self.tower.state_dict()):
            tower = {k.removeprefix("vision_model."): v for k, v in tower.items()}
        self.tower.load_state_dict(tower, strict=True)
        self.projector.load_state_dict(parts["projector"], strict=True)
        if self.next:
            if "" not in parts["newline"]:
                raise UnsupportedModel("this LLaVA-NeXT checkpoint has no image_newline")
            self.image_newline.data.copy_(parts["newline"][""])
        elif parts["newline"]:
            raise UnsupportedModel("unexpected tensor 'image_newline' in a LLaVA-1.5 checkpoint")

    def image_processor(self, path: Path) -> LlavaImages:
        return LlavaImages(path, self.hf)

    # -- the step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows [positions, hidden] from its pixels: [1, 3, H, W] (LLaVA-1.5), or the
        whole image and its tiles [1, tiles + 1, 3, H, W] with its size (LLaVA-NeXT)."""
        dtype = self.projector.linear_1.weight.dtype
        frames = pixels["pixel_values"][0] if self.next else pixels["pixel_values"]
        out = self.tower(frames.to(dtype), output_hidden_states=True, return_dict=True)
        layers = self.feature_layer if isinstance(self.feature_layer, list) else [self.feature_layer]
        feats = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        if self.strategy == "default":
            feats = feats[:, 1:]
        rows = self.projector(feats)
        return self._pack(rows, pixels["image_sizes"][0].tolist()) if self.next else rows[0]

    def _pack(self, rows: torch.Tensor, size: list[int]) -> torch.Tensor:
        """LLaVA-NeXT: the whole image's rows, then its tiles' patches as one grid in reading order,
        the padding the fit to a pinpoint added cut off, a newline row after each row."""
        from transformers.models.llava_next.modeling_llava_next import (
            get_anyres_image_grid_shape,
            unpad_image,
        )

        whole, tiles = rows[0], rows[1:]
        side = self.side // self.patch
        grid_h, grid_w = get_anyres_image_grid_shape(size, self.pinpoints, self.side)
        x = tiles.view(grid_h, grid_w, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        x = unpad_image(x, size)  # [hidden, rows, cols]
        x = torch.cat((x, self.image_newline[:, None, None].expand(*x.shape[:-1], 1).to(x.dtype)), dim=-1)
        return torch.cat((whole, x.flatten(1, 2).transpose(0, 1)), dim=0)
