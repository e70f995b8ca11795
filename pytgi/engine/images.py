"""Images of a request, in the engine: decoded, made pixels by the model's own image processor, and
given their places in the prompt.

A prompt holds one image token per image (what the model's chat template writes for an image part).
`ImageInputs.prepare` checks that the counts agree, decodes each image (`pytgi.router.media.decode_image`,
as the API process checked it), runs the model's image processor
(`preprocessor_config.json`), and expands each image token to the positions the image takes
(`VisionSpec.tokens_per_image`). The model computes an image's rows once, in the first step that
reaches its positions (`PromptImage.rows`), and keeps them while the request lives, so chunked
prefill may cut through an image and a preempted request recomputes only its keys and values.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytgi.models.llava import VisionSpec
from pytgi.router.media import decode_image, image_places


class RowCache:
    """Images' rows by content (sha256), the least recently used out past `size` (--mm-cache-size):
    an image sent again, in another request, skips its pixels and the vision tower."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, digest: str) -> torch.Tensor | None:
        rows = self._rows.get(digest)
        if rows is None:
            self.misses += 1
            return None
        self._rows.move_to_end(digest)
        self.hits += 1
        return rows

    def put(self, digest: str, rows: torch.Tensor) -> None:
        if self.size == 0:
            return
        self._rows[digest] = rows
        self._rows.move_to_end(digest)
        while len(self._rows) > self.size:
            self._rows.popitem(last=False)


@dataclass(slots=True, eq=False)
class PromptImage:
    offset: int  # the prompt position of its first token
    length: int  # positions it takes
    pixels: torch.Tensor | None  # [1, 3, H, W] from the model's image processor (None: rows cached)
    digest: str  # sha256 of the image's bytes (the prefix cache keys blocks by it)
    rows: torch.Tensor | None = None  # [length, hidden] once the model computed them
    cache: RowCache | None = None  # where its rows go once computed


class ImageInputs:
    """The model's image processor and image token; `prepare` turns a request's images into places in
    its prompt."""

    def __init__(self, model_path: Path, spec: VisionSpec, cache_size: int = 0) -> None:
        from transformers import AutoImageProcessor

        self.spec, self.cache = spec, RowCache(cache_size)
        with warnings.catch_warnings():  # the slow (PIL) processor is the exact one; no torchvision
            warnings.simplefilter("ignore")
            self.processor = AutoImageProcessor.from_pretrained(str(model_path))

    def prepare(
        self, prompt_ids: Sequence[int], images: Sequence[bytes]
    ) -> tuple[list[int], list[PromptImage]]:
        token, n = self.spec.image_token_id, self.spec.tokens_per_image
        places = image_places(prompt_ids, token, len(images), "images")
        if not places:
            return list(prompt_ids), []
        out: list[PromptImage] = []
        ids: list[int] = []
        last = 0
        for k, (place, data) in enumerate(zip(places, images)):
            digest = hashlib.sha256(data).hexdigest()
            rows = self.cache.get(digest)
            pixels = None
            if rows is None:
                img = decode_image(data, f"images.[{k}]")
                pixels = self.processor(images=[img], return_tensors="pt")["pixel_values"]
            ids += prompt_ids[last:place]
            out.append(PromptImage(len(ids), n, pixels, digest, rows, self.cache))
            ids += [token] * n
            last = place + 1
        ids += prompt_ids[last:]
        return ids, out


def step_rows(
    model: Any, spans: Sequence[tuple[int, int, int, Sequence[PromptImage]]]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The flat rows of a step that are image positions, and their image rows. `spans`: per request in
    the step with images, (its first flat row, the first position the step computes, how many it
    computes, its images)."""
    flat: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    for first_row, start, count, images in spans:
        for img in images:
            lo, hi = max(img.offset, start), min(img.offset + img.length, start + count)
            if lo >= hi:
                continue
            if img.rows is None:
                assert img.pixels is not None
                img.rows = model.encode_image(img.pixels)
                img.pixels = None  # the rows are kept; the pixels are not needed again
                if img.cache is not None:
                    img.cache.put(img.digest, img.rows)
            flat.append(torch.arange(first_row + lo - start, first_row + hi - start))
            rows.append(img.rows[lo - img.offset : hi - img.offset])
    if not flat:
        return None
    return torch.cat(flat), torch.cat(rows)
