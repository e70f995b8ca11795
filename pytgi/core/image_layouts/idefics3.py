"""Idefics3's and SmolVLM's image positions (the model: pytgi/engine/models/idefics3.py)."""

from __future__ import annotations

from pytgi.core.image_layouts.base import LayoutBase


def fit_longest_edge(w: int, h: int, edge: int) -> tuple[int, int]:
    """An image's size once its longest edge is `edge` (the aspect kept, the other edge made even, as
    Idefics3's image processor resizes), then scaled under 4096 pixels a side."""
    if w >= h:
        w, h = edge, int(edge / (w / h))
        h += h % 2
    else:
        w, h = int(edge * (w / h)), edge
        w += w % 2
    w, h = max(w, 1), max(h, 1)
    if max(w, h) > 4096:
        w, h = (4096, max(int(4096 / (w / h)), 1)) if w >= h else (max(int(4096 * (w / h)), 1), 4096)
    return w, h


class Tiles(LayoutBase, frozen=True, kw_only=True, tag="tiles"):
    """An image is resized so that its longest edge is `longest_edge` (0: not resized), then cut into
    rows × cols tiles of `tile` pixels (0: never split); it takes rows × cols × `tile_positions`,
    `row_end` after each row of tiles but the last, `split_end` after the last, and `positions` for
    the whole image seen at one tile's size. An image of one tile takes `positions` only."""

    tile: int = 0
    longest_edge: int = 0
    tile_positions: int = 0
    row_end: int = 0
    split_end: int = 0

    def image_positions(self, width: int, height: int) -> int:
        if not self.tile:
            return self.positions
        w, h = fit_longest_edge(width, height, self.longest_edge) if self.longest_edge else (width, height)
        # the long edge goes up to a whole number of tiles, the short one follows the aspect and goes up
        # to a whole number of tiles too
        t, aspect = self.tile, w / h
        if w >= h:
            cols = -(-w // t)
            rows = -(-int(cols * t / aspect) // t)
        else:
            rows = -(-h // t)
            cols = -(-int(rows * t * aspect) // t)
        if rows == cols == 1:  # one tile: not split
            return self.positions
        return rows * cols * self.tile_positions + (rows - 1) * self.row_end + self.split_end + self.positions
