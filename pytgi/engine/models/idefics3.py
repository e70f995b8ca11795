"""Idefics3 and SmolVLM: a SigLIP-like tower, a pixel shuffle and one linear in front of pytgi's own
Llama decoder.

The image processor resizes an image so its longest edge is `size.longest_edge`, cuts it into tiles
of `max_image_size.longest_edge` pixels and adds the whole image at one tile's size. Each frame
becomes `image_seq_len` rows: the tower's last hidden states, pixel-shuffled by `scale_factor` (4
neighbouring patches side by side), through the connector's linear. In the prompt, the image's one
`<image>` token becomes what the model's processor writes for it:

    per tile, row by row:  <fake_token_around_image> <row_r_col_c> <image> × image_seq_len
    after each row:        "\\n"   (the last row's and the next one's make "\\n\\n")
    the whole image:       <fake_token_around_image> <global-img> <image> × image_seq_len
                           <fake_token_around_image>

(an image that is one tile is only the whole-image part). The `<image>` positions take the image's
rows; the other positions are tokens like any other. The tower and the connector are transformers'
modules, run whole on this rank; the language model is `DecoderModel`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pytgi.core.errors import UnsupportedModel
from pytgi.core.image_layouts import Tiles
from pytgi.engine.models.decoder import DecoderModel
from pytgi.engine.models.vision import Expanded, VisionLanguageModel, load_image_processor

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import Idefics3Config, SmolVLMConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

PREFIXES = {"model.text_model.": "text", "model.vision_model.": "tower", "model.connector.": "connector"}


def _family(
    hf: dict[str, Any],
) -> tuple[
    type[SmolVLMConfig | Idefics3Config],
    type[SmolVLMVisionTransformer | Idefics3VisionTransformer],
    type[SmolVLMConnector | Idefics3Connector],
]:
    """transformers' config, tower and connector classes for the checkpoint's architecture."""
    if hf["architectures"][0] == "SmolVLMForConditionalGeneration":
        from transformers import SmolVLMConfig
        from transformers.models.smolvlm import modeling_smolvlm as m

        return SmolVLMConfig, m.SmolVLMVisionTransformer, m.SmolVLMConnector
    from transformers import Idefics3Config
    from transformers.models.idefics3 import modeling_idefics3 as m3

    return Idefics3Config, m3.Idefics3VisionTransformer, m3.Idefics3Connector


def _config(hf: dict[str, Any]) -> Any:
    config_cls = _family(hf)[0]
    return config_cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})


def image_seq_len(hf: dict[str, Any]) -> int:
    """Rows per frame: the tower's patches, pixel-shuffled."""
    vision = hf["vision_config"]
    return (vision["image_size"] // vision["patch_size"]) ** 2 // hf.get("scale_factor", 2) ** 2


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json, as a Llama checkpoint would have it."""
    text = _config(hf).text_config.to_dict()
    if text.get("model_type") != "llama":
        raise UnsupportedModel(f"this checkpoint's language model ({text.get('model_type')}) is not a Llama")
    text["architectures"] = ["LlamaForCausalLM"]
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text


def _size(value: object) -> int:
    """A size entry of the image processor (a dict or transformers' SizeDict): its longest edge."""
    if value is None:
        return 0
    edge = value.get("longest_edge") if isinstance(value, dict) else getattr(value, "longest_edge", None)
    return int(edge or 0)


class Idefics3Images:
    """The engine's image processor for Idefics3/SmolVLM: an image's frames (its tiles and itself), and
    the token ids of its positions, built as the model's processor writes them."""

    def __init__(self, path: Path, hf: dict[str, Any]) -> None:
        from pytgi.core.tokenizer import Tokenizer

        self.processor = load_image_processor(path)
        tokenizer = Tokenizer.from_dir(path)

        def ids(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        token = int(hf["image_token_id"])
        seq, fake, whole = image_seq_len(hf), ids("<fake_token_around_image>"), ids("<global-img>")
        if len(fake) != 1 or len(whole) != 1 or ids("<image>") != [token]:
            raise UnsupportedModel("the tokenizer lacks Idefics3's image tokens (<image>, <global-img>, ...)")
        self.whole = fake + whole + [token] * seq + fake
        self.tiles = {
            (r, c): fake + ids(f"<row_{r}_col_{c}>") + [token] * seq for r in range(1, 7) for c in range(1, 7)
        }
        self.row_end, self.split_end = ids("\n"), ids("\n\n")
        if any(len(t) != seq + 2 for t in self.tiles.values()):
            raise UnsupportedModel("the tokenizer lacks Idefics3's tile tokens (<row_1_col_1>, ...)")
        p = self.processor
        split = bool(getattr(p, "do_image_splitting", False))
        self.layout = Tiles(
            token=token,
            positions=len(self.whole),
            tile=_size(p.max_image_size) if split else 0,
            longest_edge=_size(p.size) if getattr(p, "do_resize", True) else 0,
            tile_positions=seq + 2,
            row_end=len(self.row_end),
            split_end=len(self.split_end),
        )

    def __call__(self, img: Image) -> Expanded:
        out = self.processor(images=[img], return_tensors="pt", return_row_col_info=True)
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        if max(rows, cols) > 6:
            raise UnsupportedModel(f"an image split into {rows} × {cols} tiles: at most 6 × 6 are named")
        ids: list[int] = []
        for r in range(1, rows + 1):
            for c in range(1, cols + 1):
                ids += self.tiles[(r, c)]
            ids += self.row_end if r < rows else self.split_end
        pixels = {k: out[k] for k in ("pixel_values", "pixel_attention_mask") if k in out}
        return Expanded(pixels, ids + self.whole)


class Idefics3Model(VisionLanguageModel):
    """The engine's `CausalLM` for Idefics3/SmolVLM."""

    PREFIXES = PREFIXES

    def __init__(self, hf: dict[str, Any], text: DecoderModel) -> None:
        super().__init__(hf, text)
        _, tower_cls, connector_cls = _family(hf)
        config = _config(hf)
        self.tower = tower_cls(config.vision_config)
        self.connector = connector_cls(config)
        self.patch = config.vision_config.patch_size

    def image_processor(self, path: Path) -> Idefics3Images:
        return Idefics3Images(path, self.hf)

    @torch.inference_mode()
    def encode_image(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows [frames × image_seq_len, hidden] from its frames ([1, frames, 3, H, W])."""
        dtype = self.connector.modality_projection.proj.weight.dtype
        frames = pixels["pixel_values"][0].to(dtype)
        mask = pixels.get("pixel_attention_mask")
        if mask is None:
            mask = torch.ones(frames.shape[0], *frames.shape[2:], dtype=torch.bool)
        else:
            mask = mask[0]
        p = self.patch  # a patch is attended when any of its pixels is the image's, not padding
        patches = mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0
        hidden = self.tower(pixel_values=frames, patch_attention_mask=patches).last_hidden_state
        rows = self.connector(hidden)
        return rows.reshape(-1, rows.shape[-1])
