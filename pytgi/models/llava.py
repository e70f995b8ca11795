"""LLaVA (1.5): a vision tower and a projector in front of pytgi's own Llama decoder.

An image becomes a fixed number of rows of the language model's input: the tower's hidden states of
layer `vision_feature_layer` (without the CLS row under the "default" strategy), through the
projector. The prompt holds one image token per image; the engine expands it to that many copies
(`LlavaImages`, `pytgi.engine.images`), and the step that computes those positions takes the image's rows
instead of the token's embedding. The tower and the projector are transformers' modules, run whole
on this rank; the language model is `DecoderModel`, with its kernels, quantization and KV cache.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pytgi.config import ImageLayout
from pytgi.errors import UnsupportedModel
from pytgi.models.decoder import DecoderModel

ARCHITECTURES = ("LlavaForConditionalGeneration",)
PREFIXES = {  # checkpoint prefix → part (transformers 5 names first, then the older ones)
    "model.language_model.": "text",
    "language_model.model.": "text",
    "model.vision_tower.": "tower",
    "vision_tower.": "tower",
    "model.multi_modal_projector.": "projector",
    "multi_modal_projector.": "projector",
}
HEADS = ("lm_head.weight", "language_model.lm_head.weight")


def vision_spec(hf: dict[str, Any]) -> tuple[int, int]:
    """The model's image token and how many positions an image takes."""
    vision = hf["vision_config"]
    grid = vision["image_size"] // vision["patch_size"]
    strategy = hf.get("vision_feature_select_strategy", "default")
    token = hf.get("image_token_index", hf.get("image_token_id"))
    tower = vision.get("model_type", "clip_vision_model")
    if token is None or tower not in ("clip_vision_model", "siglip_vision_model"):
        raise UnsupportedModel(f"this LLaVA checkpoint's vision tower ({tower}) is not supported")
    # CLIP's hidden states start with a CLS row; the "default" strategy drops the first row
    cls_row = tower == "clip_vision_model"
    return int(token), grid * grid + int(cls_row) - int(strategy == "default")


def load_image_processor(path: Path) -> Any:
    """The checkpoint's image processor (`preprocessor_config.json`), the PIL one: the exact one."""
    from transformers import AutoImageProcessor

    with warnings.catch_warnings():  # no torchvision: the slow processor, which is the reference
        warnings.simplefilter("ignore")
        return AutoImageProcessor.from_pretrained(str(path))


class LlavaImages:
    """The engine's image processor for LLaVA: every image takes the same positions, all image rows."""

    def __init__(self, path: Path, hf: dict[str, Any]) -> None:
        token, positions = vision_spec(hf)
        self.layout = ImageLayout(token=token, positions=positions)
        self.processor = load_image_processor(path)

    def __call__(self, img: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
        pixels = self.processor(images=[img], return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixels}, [self.layout.token] * self.layout.positions


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json, as a Llama checkpoint would have it."""
    text = dict(hf["text_config"])
    text["architectures"] = ["LlamaForCausalLM"]
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text


class LlavaModel(nn.Module):
    """The engine's `CausalLM` for LLaVA: `forward` takes an image's rows where it has them."""

    def __init__(self, hf: dict[str, Any], text: DecoderModel) -> None:
        super().__init__()
        from transformers import AutoModel, LlavaConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        vision_spec(hf)  # refuses a tower it does not know
        self.hf, self.text = hf, text
        config = LlavaConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
        self.tower = AutoModel.from_config(config.vision_config)
        self.projector = LlavaMultiModalProjector(config)
        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        self.config, self.attention, self.layers = text.config, text.attention, text.layers

    # -- weights -------------------------------------------------------------------------------------
    def load_weights(self, weights: Any) -> None:
        """Split the checkpoint between the language model (named as a Llama checkpoint) and the
        tower and projector (loaded strictly: a missing or unknown tensor is an error)."""
        parts: dict[str, dict[str, torch.Tensor]] = {"tower": {}, "projector": {}}

        def text_weights() -> Any:
            for name, tensor in weights:
                if name in HEADS:
                    yield "lm_head.weight", tensor
                    continue
                prefix = next((p for p in PREFIXES if name.startswith(p)), None)
                if prefix is None:
                    raise UnsupportedModel(f"unexpected tensor {name!r} in a LLaVA checkpoint")
                rest, part = name[len(prefix) :], PREFIXES[prefix]
                if part == "text":
                    yield "model." + rest, tensor
                else:
                    parts[part][rest] = tensor

        self.text.load_weights(text_weights())
        tower = parts["tower"]
        if not any(k.startswith("vision_model.") for k in self.tower.state_dict()):
            tower = {k.removeprefix("vision_model."): v for k, v in tower.items()}
        self.tower.load_state_dict(tower, strict=True)
        self.projector.load_state_dict(parts["projector"], strict=True)

    def quantize(self, plan: dict[str, str] | str, act_dtype: torch.dtype) -> None:
        """Quantize the language model; the tower and the projector run in `act_dtype`."""
        self.text.quantize(plan, act_dtype)
        self.tower.to(act_dtype)
        self.projector.to(act_dtype)

    def image_processor(self, path: Path) -> LlavaImages:
        return LlavaImages(path, self.hf)

    # -- the step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows [positions, hidden] from its pixels ([1, 3, H, W])."""
        dtype = self.projector.linear_1.weight.dtype
        out = self.tower(pixels["pixel_values"].to(dtype), output_hidden_states=True, return_dict=True)
        feats = out.hidden_states[self.feature_layer]
        if self.strategy == "default":
            feats = feats[:, 1:]
        return self.projector(feats)[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        meta: Any,
        image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`image_rows`: (flat rows, their image rows) that replace those rows' token embeddings."""
        return self.text(input_ids, positions, kv_caches, meta, image_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.text.compute_logits(hidden)
