"""Qwen2-VL's and Qwen2.5-VL's image positions (the model: pytgi/engine/models/qwen2_vl.py)."""

from __future__ import annotations

import math

from pytgi.core.errors import InvalidRequest
from pytgi.core.image_layouts.base import LayoutBase


class Merge(LayoutBase, frozen=True, kw_only=True, tag="merge"):
    """The image is resized to whole multiples of `patch` × `merge` pixels with between `min_pixels`
    and `max_pixels` pixels; it takes one position per `merge` × `merge` patches."""

    patch: int
    merge: int
    min_pixels: int
    max_pixels: int

    def resized(self, w: int, h: int) -> tuple[int, int]:
        """The (height, width) an image is resized to: each a multiple of patch × merge, the aspect
        kept as near as may be, the pixels between `min_pixels` and `max_pixels`."""
        f = self.patch * self.merge
        if max(w, h) / min(w, h) > 200:
            raise InvalidRequest(
                f"an image of {w}×{h} pixels: this model takes aspect ratios up to 200", "images"
            )
        hb, wb = round(h / f) * f, round(w / f) * f
        if hb * wb > self.max_pixels:
            beta = math.sqrt(h * w / self.max_pixels)
            hb, wb = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
        elif hb * wb < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (h * w))
            hb, wb = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
        return hb, wb

    def image_positions(self, width: int, height: int) -> int:
        h, w = self.resized(width, height)
        return (h // self.patch) * (w // self.patch) // self.merge**2
