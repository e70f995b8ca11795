"""The API process's image references: data URLs, which addresses count as internal, the limits."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from pytgi.errors import InvalidRequest
from pytgi.router.media import ImageRef, MediaLimits, _from_data_url, _internal, check_image, load_images


def png(size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("address, internal", [
    ("127.0.0.1", True), ("10.1.2.3", True), ("192.168.0.1", True), ("172.16.5.4", True), ("169.254.169.254", True),
    ("0.0.0.0", True), ("::1", True), ("fe80::1%eth0", True), ("fd00::1", True), ("::ffff:127.0.0.1", True),
    ("224.0.0.1", True), ("100.64.0.1", True), ("8.8.8.8", False), ("2606:4700:4700::1111", False),
])
def test_internal_addresses(address, internal):
    assert _internal(address) is internal


def test_data_urls():
    ref = ImageRef(f"data:image/png;base64,{base64.b64encode(png()).decode()}", "x")
    assert _from_data_url(ref, MediaLimits()) == png()
    with pytest.raises(InvalidRequest, match="larger than 10 bytes"):
        _from_data_url(ref, MediaLimits(max_bytes=10))
    for url, why in [("data:image/png,abc", "must be base64"), ("data:;base64,AAAA", "missing, not image"),
                     ("data:image/png;base64", "is `data:image"), ("data:image/png;base64,A", "not valid")]:
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
    from pytgi.config import ImageLayout
    from pytgi.router.media import added_positions, image_positions

    fixed = ImageLayout(token=5, positions=576)
    assert image_positions(fixed, 10, 9999) == 576
    assert added_positions(fixed, [b"", b""]) == 2 * 575  # not read: every image takes the same
    # Idefics3 at SmolVLM's sizes: 1000 × 500 → 2048 × 1024 → 4 × 2 tiles of 512, 64 rows each
    tiles = ImageLayout(token=5, positions=67, kind="tiles", tile=512, longest_edge=2048, tile_positions=66,
                        row_end=1, split_end=1)
    assert image_positions(tiles, 1000, 500) == 8 * 66 + 1 + 1 + 67
    # Qwen2-VL: 448 × 448 is 32 × 32 patches of 14, 16 × 16 rows once merged 2 × 2
    merge = ImageLayout(token=5, positions=0, kind="merge", patch=14, merge=2, min_pixels=3136,
                        max_pixels=12845056)
    assert image_positions(merge, 448, 448) == 256
    assert image_positions(merge, 10, 10) == 4  # brought up to min_pixels: 56 × 56
    with pytest.raises(InvalidRequest, match="aspect ratios up to 200"):
        image_positions(merge, 3000, 10)
    # LLaVA-NeXT at 336 pixels: 800 × 600 fits 672 × 672 best (2 × 2 tiles, 48 × 48 patches); at
    # 4:3 the image fills 36 of the 48 rows, so 6 rows of padding go at each edge
    anyres = ImageLayout(token=5, positions=576, kind="anyres", tile=336, patch=14,
                         pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])
    assert image_positions(anyres, 800, 600) == 36 * 48 + 36 + 576
