"""Image layouts: how many prompt positions an image takes, per vision family, the same in both
processes (no torch). Each family's arithmetic is its own module, named as its model's module in
`pytgi/engine/models/`; adding a family is its module and one line in `ImageLayout` below."""

from __future__ import annotations

from pytgi.core.image_layouts.base import Fixed, LayoutBase
from pytgi.core.image_layouts.idefics3 import Tiles
from pytgi.core.image_layouts.llava_next import AnyRes
from pytgi.core.image_layouts.qwen2_vl import Merge

# The registry: every layout the engine may publish (msgspec picks the class by its `kind` tag).
ImageLayout = Fixed | Tiles | AnyRes | Merge

__all__ = ["AnyRes", "Fixed", "ImageLayout", "LayoutBase", "Merge", "Tiles"]
