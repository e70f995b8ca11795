"""Image geometry and decoding, the same in both processes: where a prompt's images sit, how many
positions each takes (each family's `ImageLayout`, pytgi.core.image_layouts), and the one decoder both
sides read images with. The API process counts positions before admission; the engine expands each
image's token to as many."""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pytgi.core.errors import InvalidRequest
from pytgi.core.image_layouts import ImageLayout

if TYPE_CHECKING:
    from PIL.Image import Image

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


def image_positions(layout: ImageLayout, width: int, height: int) -> int:
    """The prompt positions an image of `width` × `height` pixels takes (its family's layout says how).
    The engine expands the image's token to that many; the API process counts them before admission."""
    return layout.image_positions(width, height)


def added_positions(layout: ImageLayout, images: Sequence[bytes]) -> int:
    """The positions a prompt's images add to it beyond their image tokens (each image was checked by
    `decode_image`; its size is read from its header)."""
    if not layout.sized:
        return len(images) * (layout.positions - 1)
    from PIL import Image

    added = 0
    for data in images:
        with Image.open(io.BytesIO(data)) as img:
            added += image_positions(layout, *img.size) - 1
    return added


def decode_image(data: bytes, where: str, max_pixels: int = MAX_PIXELS) -> Image:
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
