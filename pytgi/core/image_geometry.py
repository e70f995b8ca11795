"""Image geometry and decoding, the same in both processes: where a prompt's images sit, how many
positions each takes for a vision family (`ImageLayout`), and the one decoder both sides read images
with. The API process counts positions before admission; the engine expands each image's token to as
many."""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Sequence
from typing import Any

from pytgi.core.config import ImageLayout
from pytgi.core.errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_PIXELS = 64_000_000  # one image, decoded (width × height): 8000 × 8000


def image_places(ids: Sequence[int], token: int | None, images: int, param: str) -> list[int]:
    """The prompt positions of its image tokens, which must be one per image (none for a model
    without images: `token` None). One rule for the API's validation and the engine alike."""
    if token is None:
        if images:
            raise InvalidRequest("this model does not take images", param)
        return []
    places = [i for i, t in enumerate(ids) if t == token] if images or token in ids else []
    if len(places) != images:
        raise InvalidRequest(
            f"the prompt holds {len(places)} image token(s) (id {token}) for {images} image(s)", param
        )
    return places


def wrap_images(text: str, layout: ImageLayout | None, token_text: str) -> str:
    """The prompt's text as the model's processor tokenizes it: each image token (`token_text`) with
    `layout.wrap` on both sides (Gemma 3's blank lines, which merge with newlines next to them)."""
    if layout is None or not layout.wrap or token_text not in text:
        return text
    return text.replace(token_text, layout.wrap + token_text + layout.wrap)


def _fit_longest_edge(w: int, h: int, edge: int) -> tuple[int, int]:
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


def _anyres_positions(layout: ImageLayout, w: int, h: int) -> int:
    """LLaVA-NeXT: the pinpoint that keeps most of the image's pixels (then wastes the fewest), its
    patch grid, the rows or columns of padding cut off (the aspect kept), plus a newline per row."""
    best, kept, waste = (0, 0), -1, 0
    for ph, pw in layout.pinpoints:
        scale = min(pw / w, ph / h)
        effective = min(int(w * scale) * int(h * scale), w * h)
        if effective > kept or (effective == kept and ph * pw - effective < waste):
            best, kept, waste = (ph, pw), effective, ph * pw - effective
    side = layout.tile // layout.patch
    rows, cols = side * (best[0] // layout.tile), side * (best[1] // layout.tile)
    if w / h > cols / rows:
        rows -= (rows - int(round(h * (cols / w), 7))) // 2 * 2
    else:
        cols -= (cols - int(round(w * (rows / h), 7))) // 2 * 2
    return rows * cols + rows + layout.positions


def _merge_resize(layout: ImageLayout, w: int, h: int) -> tuple[int, int]:
    """Qwen2-VL: the (height, width) an image is resized to: each a multiple of patch × merge, the
    aspect kept as near as may be, the pixels between `min_pixels` and `max_pixels`."""
    f = layout.patch * layout.merge
    if max(w, h) / min(w, h) > 200:
        raise InvalidRequest(
            f"an image of {w}×{h} pixels: this model takes aspect ratios up to 200", "images"
        )
    hb, wb = round(h / f) * f, round(w / f) * f
    if hb * wb > layout.max_pixels:
        beta = math.sqrt(h * w / layout.max_pixels)
        hb, wb = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
    elif hb * wb < layout.min_pixels:
        beta = math.sqrt(layout.min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
    return hb, wb


def image_positions(layout: ImageLayout, width: int, height: int) -> int:
    """The prompt positions an image of `width` × `height` pixels takes (`ImageLayout` says how). The
    engine expands the image's token to that many; the API process counts them before admission."""
    if layout.kind == "anyres":
        return _anyres_positions(layout, width, height)
    if layout.kind == "merge":
        h, w = _merge_resize(layout, width, height)
        return (h // layout.patch) * (w // layout.patch) // layout.merge**2
    if layout.kind != "tiles" or not layout.tile:
        return layout.positions
    w, h = _fit_longest_edge(width, height, layout.longest_edge) if layout.longest_edge else (width, height)
    # then the long edge goes up to a whole number of tiles, the short one follows the aspect and goes
    # up to a whole number of tiles too
    t, aspect = layout.tile, w / h
    if w >= h:
        cols = -(-w // t)
        rows = -(-int(cols * t / aspect) // t)
    else:
        rows = -(-h // t)
        cols = -(-int(rows * t * aspect) // t)
    if rows == cols == 1:  # one tile: not split
        return layout.positions
    return (
        rows * cols * layout.tile_positions
        + (rows - 1) * layout.row_end
        + layout.split_end
        + layout.positions
    )


def added_positions(layout: ImageLayout, images: Sequence[bytes]) -> int:
    """The positions a prompt's images add to it beyond their image tokens (each image was checked by
    `decode_image`; its size is read from its header)."""
    if layout.kind == "fixed":
        return len(images) * (layout.positions - 1)
    from PIL import Image

    added = 0
    for data in images:
        with Image.open(io.BytesIO(data)) as img:
            added += image_positions(layout, *img.size) - 1
    return added


def decode_image(data: bytes, where: str, max_pixels: int = MAX_PIXELS) -> Any:
    """The image as a PIL image in RGB: a format in FORMATS, at most `max_pixels` pixels (checked from
    the header, before decoding: a decompression bomb is refused), not truncated or corrupt; else an
    `InvalidRequest` naming `where`. The API process checks each image with it before admission, the
    engine decodes with it. Blocking: the API process runs it in a thread."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover - a vision model's install has it (pytgi[vision])
        raise InvalidRequest(
            f"image `{where}`: this server cannot read images: install Pillow (pip install pytgi[vision])",
            where,
        ) from None

    def refuse(why: str) -> InvalidRequest:
        return InvalidRequest(f"image `{where}`: {why}", where)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            fmt, (w, h) = img.format, img.size
            if fmt not in FORMATS:
                raise refuse(f"it is {fmt}; the formats read are {', '.join(FORMATS)}")
            if w * h > max_pixels:
                raise refuse(f"it is {w}×{h} pixels, more than the {max_pixels} allowed")
            img.load()
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise refuse("it is not an image in a format pytgi reads") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise refuse(f"it is broken ({exc})") from None
    return img.convert("RGB")
