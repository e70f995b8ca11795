"""The API process's image references: data URLs, which addresses count as internal, the limits."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import socket
import threading
import time

import pytest
from PIL import Image

from pytgi.api.frontend.media import (
    ImageRef,
    MediaLimits,
    _from_data_url,
    _internal,
    check_image,
    load_images,
)
from pytgi.core.errors import InvalidRequest


def png(size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    "address, internal",
    [
        ("127.0.0.1", True),
        ("10.1.2.3", True),
        ("192.168.0.1", True),
        ("172.16.5.4", True),
        ("169.254.169.254", True),
        ("0.0.0.0", True),
        ("::1", True),
        ("fe80::1%eth0", True),
        ("fd00::1", True),
        ("::ffff:127.0.0.1", True),
        ("224.0.0.1", True),
        ("100.64.0.1", True),
        ("8.8.8.8", False),
        ("2606:4700:4700::1111", False),
    ],
)
def test_internal_addresses(address, internal):
    assert _internal(address) is internal


def test_data_urls():
    ref = ImageRef(f"data:image/png;base64,{base64.b64encode(png()).decode()}", "x")
    assert _from_data_url(ref, MediaLimits()) == png()
    with pytest.raises(InvalidRequest, match="larger than 10 bytes"):
        _from_data_url(ref, MediaLimits(max_bytes=10))
    for url, why in [
        ("data:image/png,abc", "must be base64"),
        ("data:;base64,AAAA", "missing, not image"),
        ("data:image/png;base64", "is `data:image"),
        ("data:image/png;base64,A", "not valid"),
    ]:
        with pytest.raises(InvalidRequest, match=why) as e:
            _from_data_url(ImageRef(url, "messages.[0]"), MediaLimits())
        assert e.value.param == "messages.[0]"


def test_pixel_bound_and_count_bound():
    with pytest.raises(InvalidRequest, match="8×8 pixels, more than the 63 allowed"):
        check_image(ImageRef("-", "x"), png(), MediaLimits(max_pixels=63))
    refs = [ImageRef(f"data:image/png;base64,{base64.b64encode(png()).decode()}", f"p{i}") for i in range(3)]
    assert len(asyncio.run(load_images(refs, MediaLimits(max_images=3)))) == 3
    with pytest.raises(InvalidRequest, match="3 images in one request; at most 2") as e:
        asyncio.run(load_images(refs, MediaLimits(max_images=2)))
    assert e.value.param == "p2"


def test_image_positions_by_layout():
    """The API process's count of an image's positions, per family's layout (the model tests check
    each against its processor over many sizes; these pin a few by hand)."""
    from pytgi.core.image_geometry import added_positions, image_positions
    from pytgi.core.image_layouts import AnyRes, Fixed, Merge, Tiles

    fixed = Fixed(token=5, positions=576)
    assert image_positions(fixed, 10, 9999) == 576
    assert added_positions(fixed, [b"", b""]) == 2 * 575  # not read: every image takes the same
    # Idefics3 at SmolVLM's sizes: 1000 × 500 → 2048 × 1024 → 4 × 2 tiles of 512, 64 rows each
    tiles = Tiles(
        token=5,
        positions=67,
        tile=512,
        longest_edge=2048,
        tile_positions=66,
        row_end=1,
        split_end=1,
    )
    assert image_positions(tiles, 1000, 500) == 8 * 66 + 1 + 1 + 67
    # Qwen2-VL: 448 × 448 is 32 × 32 patches of 14, 16 × 16 rows once merged 2 × 2
    merge = Merge(token=5, positions=0, patch=14, merge=2, min_pixels=3136, max_pixels=12845056)
    assert image_positions(merge, 448, 448) == 256
    assert image_positions(merge, 10, 10) == 4  # brought up to min_pixels: 56 × 56
    with pytest.raises(InvalidRequest, match="aspect ratios up to 200"):
        image_positions(merge, 3000, 10)
    # LLaVA-NeXT at 336 pixels: 800 × 600 fits 672 × 672 best (2 × 2 tiles, 48 × 48 patches); at
    # 4:3 the image fills 36 of the 48 rows, so 6 rows of padding go at each edge
    anyres = AnyRes(
        token=5,
        positions=576,
        tile=336,
        patch=14,
        pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    )
    assert image_positions(anyres, 800, 600) == 36 * 48 + 36 + 576


def test_image_layouts_cross_the_process_boundary_by_their_tag():
    """The engine publishes its layout in `EngineInfo`; the API process reads back the same family."""
    import msgspec

    from pytgi.core.image_layouts import AnyRes, Fixed, ImageLayout, Merge, Tiles

    for layout in [
        Fixed(token=1, positions=3, wrap="\n\n"),
        Tiles(token=1, positions=3, tile=512, longest_edge=2048, tile_positions=66, row_end=1, split_end=1),
        AnyRes(token=1, positions=3, tile=336, patch=14, pinpoints=[[336, 672]]),
        Merge(token=1, positions=0, patch=14, merge=2, min_pixels=1, max_pixels=2),
    ]:
        raw = msgspec.msgpack.encode(layout)
        assert msgspec.msgpack.decode(raw, type=ImageLayout) == layout
        assert type(msgspec.msgpack.decode(raw, type=ImageLayout | None)) is type(layout)


# -- fetching: pinned to the vetted address, one deadline, a cap ---------------------------------------
class _Images(http.server.BaseHTTPRequestHandler):
    """/a.png: an image; /trickle: an image's headers, then a byte every 0.2 s; every request's Host
    header recorded."""

    hosts: list[str] = []

    def do_GET(self):
        type(self).hosts.append(self.headers.get("Host", ""))
        body = png()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body) if self.path == "/a.png" else 10_000))
        self.end_headers()
        try:
            if self.path == "/a.png":
                self.wfile.write(body)
                return
            for _ in range(300):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass  # the client gave up

    def log_message(self, *args):
        pass


@pytest.fixture
def images():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Images.hosts = []
    yield httpd.server_address[1]
    httpd.shutdown()


def _resolving(answers: dict[str, list[str]]):
    """Run a coroutine with the loop's resolver answering from `answers` (name → the addresses of each
    successive lookup, the last repeated): a DNS server whose answers change, TTL 0."""

    async def run(coro):
        loop = asyncio.get_running_loop()
        seen: dict[str, int] = {}

        async def getaddrinfo(host, port, *args, **kwargs):
            if host not in answers:
                raise OSError("unknown host")
            n = seen[host] = seen.get(host, 0) + 1
            address = answers[host][min(n, len(answers[host])) - 1]
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            return [(family, socket.SOCK_STREAM, 6, "", (address, port or 0))]

        loop.getaddrinfo = getaddrinfo  # type: ignore[method-assign]
        return await coro

    return run


def test_a_fetch_connects_to_the_address_that_was_checked(images, monkeypatch):
    """A name that resolves to a public address when checked and to loopback afterwards (rebinding)
    is fetched from the public address, never from loopback: the connection's host is the address
    checked, the name only in the Host header."""
    import httpx

    connected: list[tuple[str, str]] = []

    async def record(self, request):  # the transport's connection, recorded instead of made
        connected.append((request.url.host, request.headers["host"]))
        raise httpx.ConnectError("not connecting in a test")

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", record)
    run = _resolving({"rebind.test": ["93.184.216.34", "127.0.0.1"]})
    ref = ImageRef(f"http://rebind.test:{images}/a.png", "image")
    with pytest.raises(InvalidRequest, match="fetching it failed"):
        asyncio.run(run(load_images([ref], MediaLimits(timeout=5))))
    assert connected == [("93.184.216.34", f"rebind.test:{images}")] and _Images.hosts == []


def test_a_pinned_fetch_reaches_its_server_by_name(images):
    """An allowed internal host, fetched at its checked address with its name as the Host header."""
    run = _resolving({"images.internal": ["127.0.0.1"]})
    ref = ImageRef(f"http://images.internal:{images}/a.png", "image")
    limits = MediaLimits(allowed_domains=("images.internal",), timeout=5)
    assert asyncio.run(run(load_images([ref], limits))) == [png()]
    assert _Images.hosts == [f"images.internal:{images}"]
    run = _resolving({"images.internal": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    with pytest.raises(InvalidRequest, match="other.test is an internal address"):
        asyncio.run(run(load_images([ImageRef(f"http://other.test:{images}/a.png", "image")], limits)))


def test_a_trickling_server_is_cut_at_one_deadline(images):
    """One deadline for the whole fetch, not per read: a server sending a byte every 0.2 s is cut at
    1.5 s (a per-read timeout never fires on it)."""
    ref = ImageRef(f"http://127.0.0.1:{images}/trickle", "image")
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match="took more than 1.5 s"):
        asyncio.run(load_images([ref], MediaLimits(allowed_domains=("127.0.0.1",), timeout=1.5)))
    assert time.monotonic() - t0 < 4


def test_fetches_wait_for_a_slot_within_their_deadline(images):
    """With one fetch slot, a fetch behind a trickling one waits, and its deadline counts the wait."""

    async def main():
        limits = MediaLimits(allowed_domains=("127.0.0.1",), timeout=1.0, slots=asyncio.Semaphore(1))
        slow = ImageRef(f"http://127.0.0.1:{images}/trickle", "slow")
        fast = ImageRef(f"http://127.0.0.1:{images}/a.png", "fast")
        return await asyncio.gather(
            load_images([slow], limits), load_images([fast], limits), return_exceptions=True
        )

    slow, fast = asyncio.run(main())
    assert isinstance(slow, InvalidRequest) and "took more than 1 s" in str(slow)
    assert isinstance(fast, InvalidRequest) and "took more than 1 s" in str(fast)  # it never got the slot
    assert len(_Images.hosts) == 1
