"""Gemma 3 with images: a SigLIP tower, average-pooled to `mm_tokens_per_image` rows (256), RMS-normed
and projected by one matrix, in front of pytgi's own Gemma 3 decoder.

An image is resized to the tower's square (896 pixels for the released models), whatever its size,
so it always takes the same positions. The chat template writes `<start_of_image>` for an image;
the model's processor replaces that with

    "\\n\\n" <start_of_image> <image_soft_token> × 256 <end_of_image> "\\n\\n"

and tokenizes the whole, so the blank lines may merge with newlines beside them. The API process
does the same (`LayoutBase.wrap`: the blank lines are put around the image token before the
prompt is tokenized); the engine expands `<start_of_image>` to the rest, and the soft tokens take
the image's rows.

Unlike the other families, an image's rows attend to each other both ways (transformers: causal OR
same image, then the sliding window). `Expanded.bidirectional` marks them: the scheduler never
ends a prefill chunk inside an image (`whole_images`), and attention unmasks the image's later
rows for its earlier ones (`StepLayout.spans`), on the gathered SDPA path (the paged C kernels are
causal only). Pan-and-scan crops are not taken (the processor's default): an image is one frame.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pytgi.core.errors import UnsupportedModel
from pytgi.core.image_layouts import Fixed
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


def hf_config(hf: dict[str, Any]) -> Any:
    """transformers' config of the checkpoint, its defaults filled in."""
    from transformers import Gemma3Config

    return Gemma3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json, as a Gemma 3 text checkpoint would have it."""
    text = hf_config(hf).text_config.to_dict()
    if text.get("use_bidirectional_attention"):
        raise UnsupportedModel("a Gemma 3 language model with bidirectional attention is not a decoder")
    text["architectures"] = ["Gemma3ForCausalLM"]
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return text


class Gemma3Images:
    """The engine's image processor for Gemma 3: one frame per image, the same positions for every
    image (`<start_of_image>`, the soft tokens, `<end_of_image>`)."""

    def __init__(self, path: Path, hf: dict[str, Any]) -> None:
        from pytgi.core.tokenizer import Tokenizer

        config = hf_config(hf)
        tokenizer = Tokenizer.from_dir(path)
        boi, eoi, soft = config.boi_token_index, config.eoi_token_index, config.image_token_index
        for name, token in (("<start_of_image>", boi), ("<end_of_image>", eoi)):
            if list(tokenizer.encode(name, add_special_tokens=False)) != [token]:
                raise UnsupportedModel(f"the tokenizer does not have Gemma 3's {name} as token {token}")
        self.processor = load_image_processor(path)
        self.soft = soft
        self.ids = [boi] + [soft] * config.mm_tokens_per_image + [eoi]
        self.layout = Fixed(token=boi, positions=len(self.ids), wrap="\n\n")

    def __call__(self, img: Image) -> Expanded:
        out = self.processor(images=[img], return_tensors="pt", do_pan_and_scan=False)
        pixels = {"pixel_values": out["pixel_values"]}
        return Expanded(pixels, self.ids, row_token=self.soft, bidirectional=True)


class Gemma3VisionModel(VisionLanguageModel):
    """The engine's `CausalLM` for Gemma 3 with images."""

    PREFIXES = TOWER_PROJECTOR_PREFIXES
    HEADS = TOWER_PROJECTOR_HEADS

    def __init__(self, hf: dict[str, Any], text: DecoderModel) -> None:
        super().__init__(hf, text)
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        config = hf_config(hf)
        if config.vision_config.model_type != "siglip_vision_model":
            raise UnsupportedModel(f"a Gemma 3 vision tower of type {config.vision_config.model_type}")
        self.tower = AutoModel.from_config(config.vision_config)
        self.projector = Gemma3MultiModalProjector(config)

    def image_processor(self, path: Path) -> Gemma3Images:
        return Gemma3Images(path, self.hf)

    @torch.inference_mode()
    def encode_image(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows [mm_tokens_per_image, hidden] from its pixels [1, 3, H, W]."""
        dtype = self.projector.mm_input_projection_weight.dtype
        hidden = self.tower(pixel_values=pixels["pixel_values"].to(dtype)).last_hidden_state
        return self.projector(hidden)[0]
