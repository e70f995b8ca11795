"""LLaVA-NeXT's image positions (the model: pytgi/engine/models/llava.py)."""

from __future__ import annotations

from pytgi.core.image_layouts.base import LayoutBase


class AnyRes(LayoutBase, frozen=True, kw_only=True, tag="anyres"):
    """The image is fitted to the best of `pinpoints` ([height, width]), cut into tiles of `tile`
    pixels, and each tile into patches of `patch`; it takes its patches with the padding cut off, one
    newline per row of them, and `positions` for the whole image."""

    tile: int
    patch: int
    pinpoints: list[list[int]]

    def image_positions(self, width: int, height: int) -> int:
        # the pinpoint that keeps most of the image's pixels, then wastes the fewest
        w, h = width, height
        best, kept, waste = (0, 0), -1, 0
        for ph, pw in self.pinpoints:
            scale = min(pw / w, ph / h)
            effective = min(int(w * scale) * int(h * scale), w * h)
            if effective > kept or (effective == kept and ph * pw - effective < waste):
                best, kept, waste = (ph, pw), effective, ph * pw - effective
        side = self.tile // self.patch
        rows, cols = side * (best[0] // self.tile), side * (best[1] // self.tile)
        # the rows or columns of padding cut off, the aspect kept
        if w / h > cols / rows:
            rows -= (rows - int(round(h * (cols / w), 7))) // 2 * 2
        else:
            cols -= (cols - int(round(w * (rows / h), 7))) // 2 * 2
        return rows * cols + rows + self.positions
