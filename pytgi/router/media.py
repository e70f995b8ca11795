"""Images a request names, fetched and checked in the API process (no torch): `data:` URLs, and
`http(s)` URLs fetched with a size limit, one deadline and a content-type check, never from a loopback,
private, link-local or otherwise internal address unless its host is in --allowed-media-domains: each
hop's host is resolved once, checked, and connected to at that address (no second lookup to rebind).
Each image's header is read with Pillow here (format, dimensions, a decompression bomb refused
before any pixel is decoded); the engine decodes the pixels with the model's own image processor.
A refusal is an `InvalidRequest` that names the image (its field) and says why."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import math
import re
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

from pytgi.config import ImageLayout
from pytgi.errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_PIXELS = 64_000_000  # one image, decoded (width × height): 8000 × 8000
MAX_REDIRECTS = 3


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_images: int = 8  # --max-images-per-request
    max_bytes: int = 20 * 1024 * 1024  # one image, encoded
    max_pixels: int = MAX_PIXELS
    timeout: float = 10.0  # seconds for one URL: its wait for a slot, lookups, redirects, last byte
    allowed_domains: tuple[str, ...] = ()  # hosts fetched even at internal addresses
    slots: asyncio.Semaphore | None = field(default=None, compare=False)  # fetches at once, server-wide


@dataclass(frozen=True, slots=True)
class ImageRef:
    url: str  # a data: or http(s): URL
    where: str  # the request field that gave it (e.g. messages.[0].content.[1].image_url)


def _refuse(ref: ImageRef, why: str) -> InvalidRequest:
    return InvalidRequest(f"image `{ref.where}`: {why}", ref.where)


def _from_data_url(ref: ImageRef, limits: MediaLimits) -> bytes:
    m = re.match(r"data:([^;,]*)((?:;[^;,]*)*),", ref.url, re.IGNORECASE)
    if m is None:
        raise _refuse(ref, "a data URL is `data:image/<type>;base64,<data>`")
    mime, params = m.group(1).strip().lower(), m.group(2).lower()
    if not mime.startswith("image/"):
        raise _refuse(ref, f"the data URL's media type is {mime or 'missing'}, not image/*")
    if ";base64" not in params:
        raise _refuse(ref, "the data URL must be base64 (`;base64,`)")
    payload = ref.url[m.end() :]
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise _refuse(ref, f"the image is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(ref, "the data URL's base64 is not valid") from None


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


def _internal(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


async def _vetted_address(ref: ImageRef, url: str, limits: MediaLimits) -> str:
    """The one address a URL's host is fetched from: resolved once here, every answer checked (none
    may be internal, unless the host is in --allowed-media-domains). The fetch connects to it, not to
    the name: a second lookup could answer otherwise (DNS rebinding)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _refuse(ref, "only data:, http: and https: URLs are fetched")
    host = parts.hostname.lower()
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        raise _refuse(ref, f"cannot resolve {host}") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise _refuse(ref, f"cannot resolve {host}")
    if host not in limits.allowed_domains and any(_internal(a) for a in addresses):
        raise _refuse(
            ref, f"{host} is an internal address; list it in --allowed-media-domains to fetch from it"
        )
    return addresses[0]


def _pinned(url: str, address: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The request that fetches `url` from `address`: the URL with the address for its host, the
    name in the Host header and, for https, in TLS (the certificate is checked against the name)."""
    parts = urlsplit(url)
    netloc = f"[{address}]" if ":" in address else address
    if parts.port is not None:
        netloc += f":{parts.port}"
    target = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host = parts.netloc.rpartition("@")[2]  # host[:port], no credentials
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return target, {"Host": host}, extensions


async def _fetch(ref: ImageRef, limits: MediaLimits) -> bytes:
    """The URL's bytes: one deadline for the whole fetch (waiting for a fetch slot, every lookup,
    redirect and read), each hop connected to its vetted address."""

    async def within_a_slot() -> bytes:
        if limits.slots is None:
            return await _fetch_hops(ref, limits)
        async with limits.slots:
            return await _fetch_hops(ref, limits)

    try:
        return await asyncio.wait_for(within_a_slot(), limits.timeout)
    except asyncio.TimeoutError:
        raise _refuse(ref, f"fetching it took more than {limits.timeout:g} s") from None


async def _fetch_hops(ref: ImageRef, limits: MediaLimits) -> bytes:
    import httpx

    url = ref.url
    async with httpx.AsyncClient(follow_redirects=False, timeout=None, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            address = await _vetted_address(ref, url, limits)  # every hop: a redirect must not reach inside
            target, headers, extensions = _pinned(url, address)
            try:
                async with client.stream("GET", target, headers=headers, extensions=extensions) as r:
                    if r.is_redirect and "location" in r.headers:
                        url = urljoin(url, r.headers["location"])
                        continue
                    if r.status_code != 200:
                        raise _refuse(ref, f"fetching it answered HTTP {r.status_code}")
                    ctype = r.headers.get("content-type", "").split(";")[0].strip().lower()
                    if not ctype.startswith("image/"):
                        raise _refuse(ref, f"its content type is {ctype or 'missing'}, not image/*")
                    size = int(r.headers.get("content-length") or 0)
                    if size > limits.max_bytes:
                        raise _refuse(ref, f"the image is larger than {limits.max_bytes} bytes")
                    data = bytearray()
                    async for chunk in r.aiter_bytes():
                        data += chunk
                        if len(data) > limits.max_bytes:
                            raise _refuse(ref, f"the image is larger than {limits.max_bytes} bytes")
                    return bytes(data)
            except httpx.HTTPError as exc:
                raise _refuse(ref, f"fetching it failed: {exc}") from None
    raise _refuse(ref, f"more than {MAX_REDIRECTS} redirects")


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


def check_image(ref: ImageRef, data: bytes, limits: MediaLimits) -> None:
    decode_image(data, ref.where, limits.max_pixels)


async def load_images(refs: list[ImageRef], limits: MediaLimits) -> list[bytes]:
    """The images' bytes, in order: fetched concurrently, each checked."""
    if len(refs) > limits.max_images:
        raise InvalidRequest(
            f"{len(refs)} images in one request; at most {limits.max_images} are allowed "
            "(--max-images-per-request)",
            refs[limits.max_images].where,
        )

    async def one(ref: ImageRef) -> bytes:
        data = _from_data_url(ref, limits) if ref.url[:5].lower() == "data:" else await _fetch(ref, limits)
        await asyncio.to_thread(check_image, ref, data, limits)
        return data

    return list(await asyncio.gather(*(one(r) for r in refs)))
