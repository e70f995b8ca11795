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
import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

from pytgi.core.errors import InvalidRequest
from pytgi.core.image_geometry import MAX_PIXELS, decode_image

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
