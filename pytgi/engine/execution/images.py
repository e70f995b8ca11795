"""Images of a request, in the engine: decoded, made pixels by the model's own image processor, and
given their places in the prompt.

A prompt holds one image token per image (what the model's chat template writes for an image part).
`ImageInputs.prepare` checks that the counts agree, decodes each image
(`pytgi.core.image_geometry.decode_image`,
as the API process checked it), and runs the model's `ImageProcessor`: its pixels, and the token ids
its image token expands to (LLaVA: image tokens only; Idefics3: tile markers around them; Gemma 3:
soft tokens between begin and end markers). Each row position of the expansion (the image token,
or the family's `Expanded.row_token`) takes one of the image's rows. The model computes an image's
rows once, in the first step that reaches its positions (`ImageRows.rows`), and keeps them while a
request lives, so chunked prefill may cut through an image and a preempted request recomputes only
its keys and values.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pytgi.core.errors import InvalidRequest
from pytgi.core.image_geometry import decode_image, image_places, image_positions
from pytgi.core.image_layouts import ImageLayout
from pytgi.engine.models.decoder import StepImages
from pytgi.engine.models.vision import Expanded, VisionLanguageModel

if TYPE_CHECKING:
    from PIL.Image import Image


class ImageProcessor(Protocol):
    """A vision model's image processor, in the engine (`model.image_processor(path)`)."""

    layout: ImageLayout  # what the API process counts an image's positions by

    def __call__(self, img: Image) -> Expanded: ...


@dataclass(eq=False)  # no slots: a RowCache holds it weakly
class ImageRows:
    """One image (by content): the token ids of the positions it takes, and its rows once the model
    computed them. Every request holding the image shares it, so the tower runs once for them all."""

    digest: str  # sha256 of the image's bytes (the prefix cache keys blocks by it)
    ids: list[int]
    places: torch.Tensor  # which of its positions take its rows, in order (its image tokens)
    grid: tuple[int, int] | None  # M-RoPE: its positions' grid (height, width)
    pixels: dict[str, torch.Tensor] | None  # from the model's image processor, until the rows exist
    rows: torch.Tensor | None = None  # [len(places), hidden]
    span: tuple[int, int] | None = None  # positions [lo, hi) that attend to each other both ways


class RowCache:
    """Images by content (sha256): those some request holds now, and the `size` (--mm-cache-size)
    computed last, the least recently used out first. An image sent again, while another request
    holds it or soon after, skips its pixels and the vision tower."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[str, ImageRows] = OrderedDict()
        self._held: weakref.WeakValueDictionary[str, ImageRows] = weakref.WeakValueDictionary()
        self.hits = self.misses = 0

    def get(self, digest: str) -> ImageRows | None:
        image = self._held.get(digest) or self._kept.get(digest)
        if image is None:
            self.misses += 1
            return None
        if digest in self._kept:
            self._kept.move_to_end(digest)
        self.hits += 1
        return image

    def hold(self, image: ImageRows) -> None:
        """`image` is in a request now (weakly: it goes when no request holds it)."""
        self._held[image.digest] = image

    def put(self, image: ImageRows) -> None:
        """`image`'s rows were computed: keep it past its requests."""
        if self.size == 0:
            return
        self._kept[image.digest] = image
        self._kept.move_to_end(image.digest)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)


@dataclass(slots=True, eq=False)
class PromptImage:
    offset: int  # the prompt position of its first token
    image: ImageRows
    cache: RowCache | None = None  # where its rows go once computed

    @property
    def length(self) -> int:
        return len(self.image.ids)

    @property
    def digest(self) -> str:
        return self.image.digest

    @property
    def span(self) -> tuple[int, int] | None:
        """The prompt positions [lo, hi) whose rows attend to each other both ways (Gemma 3): a
        prefill chunk holds all of them or none (`Scheduler`), attention unmasks them (`StepLayout`)."""
        span = self.image.span
        return None if span is None else (self.offset + span[0], self.offset + span[1])


class ImageInputs:
    """The model's image processor; `prepare` turns a request's images into places in its prompt."""

    def __init__(self, processor: ImageProcessor, cache_size: int = 0) -> None:
        self.processor, self.layout, self.cache = processor, processor.layout, RowCache(cache_size)

    def prepare(
        self, prompt_ids: Sequence[int], images: Sequence[bytes]
    ) -> tuple[list[int], list[PromptImage]]:
        token = self.layout.token
        places = image_places(prompt_ids, token, len(images), "images")
        if not places:
            return list(prompt_ids), []
        out: list[PromptImage] = []
        ids: list[int] = []
        last = 0
        for k, (place, data) in enumerate(zip(places, images)):
            digest = hashlib.sha256(data).hexdigest()
            image = self.cache.get(digest)
            if image is None:
                img = decode_image(data, f"images.[{k}]")
                made = self.processor(img)
                want = image_positions(self.layout, *img.size)
                if len(made.ids) != want:  # the API process counted `want` for its limits
                    raise InvalidRequest(
                        f"image `images.[{k}]` takes {len(made.ids)} positions, not the {want} "
                        f"counted for it ({img.size[0]}×{img.size[1]} pixels)",
                        f"images.[{k}]",
                    )
                row = token if made.row_token is None else made.row_token
                at = torch.tensor([i for i, t in enumerate(made.ids) if t == row], dtype=torch.long)
                span = (int(at[0]), int(at[-1]) + 1) if made.bidirectional and len(at) else None
                image = ImageRows(digest, made.ids, at, made.grid, made.pixels, span=span)
                self.cache.hold(image)
            ids += prompt_ids[last:place]
            out.append(PromptImage(len(ids), image, self.cache))
            ids += image.ids
            last = place + 1
        ids += prompt_ids[last:]
        return ids, out


def step_rows(
    model: VisionLanguageModel, spans: Sequence[tuple[int, int, int, int, Sequence[PromptImage]]]
) -> StepImages | None:
    """The flat rows of a step that are image positions, and their image rows (computed now where not
    yet); with M-RoPE, the 3-D positions of every row of a request with images. `spans`: per request
    in the step with images, (its first flat row, the first position the step computes, how many
    prompt or decode positions it computes, its rows in the step (drafts included), its images)."""
    flat: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    rope_rows: list[torch.Tensor] = []
    rope_positions: list[torch.Tensor] = []
    for first_row, start, count, step_len, images in spans:
        for img in images:
            lo, hi = max(img.offset, start), min(img.offset + img.length, start + count)
            if lo >= hi:
                continue
            image = img.image
            at = image.places
            sel = (at >= lo - img.offset) & (at < hi - img.offset)
            if not bool(sel.any()):
                continue
            if image.rows is None:
                assert image.pixels is not None
                computed = model.encode_image(image.pixels)
                got, want = computed.shape[0], len(at)
                if got != want:  # fails this step's requests, not the server
                    raise RuntimeError(f"an image of {want} positions got {got} rows")
                image.rows, image.pixels = computed, None  # the pixels are not needed again
                if img.cache is not None:
                    img.cache.put(image)
            flat.append(first_row + img.offset - start + at[sel])
            rows.append(image.rows[sel])
        if any(img.image.grid is not None for img in images):
            rope_rows.append(torch.arange(first_row, first_row + step_len))
            rope_positions.append(mrope_positions(images, start, step_len))
    if not flat and not rope_rows:
        return None
    return StepImages(
        torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long),
        torch.cat(rows) if rows else torch.zeros(0, 0),
        torch.cat(rope_rows) if rope_rows else None,
        torch.cat(rope_positions, dim=1) if rope_positions else None,
    )


def mrope_positions(images: Sequence[PromptImage], start: int, count: int) -> torch.Tensor:
    """M-RoPE's (temporal, height, width) positions [3, count] of a request's positions `start` on
    (Qwen2-VL's rule): text counts on from the last position on all three axes; an image's rows take
    (p, p + row, p + column) of its grid from the position p where it starts, and the text after it
    goes on from p + max(height, width)."""
    index = torch.arange(start, start + count)
    pos = index.repeat(3, 1)
    shift = 0  # how far the positions lag behind the indices, from the images before
    for img in images:
        if img.image.grid is None:
            continue
        h, w = img.image.grid
        inside = (index >= img.offset) & (index < img.offset + img.length)
        j = index[inside] - img.offset
        base = img.offset - shift
        pos[:, inside] = torch.stack((torch.full_like(j, base), base + j // w, base + j % w))
        shift += img.length - max(h, w)
        after = index >= img.offset + img.length
        pos[:, after] = index[after] - shift
    return pos
