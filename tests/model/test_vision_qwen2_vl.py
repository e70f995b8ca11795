"""Qwen2-VL and Qwen2.5-VL against transformers (float32, greedy): tiny random models built in the
test from each family's config shrunk (a head of 16 split 2/3/3 between M-RoPE's axes), images made
patches by the family's own image processor at sizes that give grids of several shapes. Alone,
batched with text-only requests and with other images, cut by chunked prefill, and with text after
the images (where M-RoPE's positions lag behind the indices); and the API process's count of an
image's positions against the processor's, over many sizes."""

from __future__ import annotations

import io

import pytest
import torch
import transformers
from PIL import Image

from pytgi.core.image_geometry import image_positions
from pytgi.core.image_layouts import Merge
from tests.model.vision_util import engine_for, greedy, png

IMAGE, START, END = 150, 151, 152  # <|image_pad|>, <|vision_start|>, <|vision_end|>
NEW = 8
TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
)
FAMILIES = {
    "qwen2_5_vl": (
        transformers.Qwen2_5_VLConfig,
        transformers.Qwen2_5_VLForConditionalGeneration,
        dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
    ),
    "qwen2_vl": (
        transformers.Qwen2VLConfig,
        transformers.Qwen2VLForConditionalGeneration,
        dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            mlp_ratio=2,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
    ),
}
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16  # at most 16 rows an image


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    config_cls, model_cls, vision = FAMILIES[request.param]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    cfg = config_cls(
        text_config=TEXT,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=153,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    model = model_cls(cfg)
    with torch.no_grad():  # the image must matter to greedy: make its rows large; and the positions
        for p in model.model.visual.merger.parameters():  # too: sharp attention, fast rotary (theta 100)
            p.mul_(4.0)
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    return request.param, path


def reference(tiny, prompt: list[int], images: list[bytes]) -> list[int]:
    """transformers' generate, each image token expanded to its merged patches as the processor does."""
    family, path = tiny
    model = FAMILIES[family][1].from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[attr-defined]
    kw = {}
    ids = list(prompt)
    if images:
        processor = transformers.AutoImageProcessor.from_pretrained(path)
        out = processor(
            images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
        )
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [x for t in prompt for x in ([t] * next(counts) if t == IMAGE else [t])]
        kw = {
            "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": (torch.tensor([ids]) == IMAGE).int(),
        }
    x = torch.tensor([ids])
    with torch.no_grad():
        got = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return got[0, len(ids) :].tolist()


def run(engine, jobs):
    return greedy(engine, jobs, NEW)[0]


JOBS = [
    ([5, 17, START, IMAGE, END, 3, 99, 42, 7, 8, 9, 10], [png(1, (140, 60))]),  # a 2 × 5 grid, then text
    ([START, IMAGE, END, 8, 1, 64, 2], [png(2, (30, 90))]),  # tall: 3 × 1
    ([7, START, IMAGE, END, 9, START, IMAGE, END, 11, 12], [png(3, (100, 100)), png(4, (56, 56))]),
    ([11, 12, 13, 14], []),
]


def test_equals_transformers_alone_batched_and_chunked(tiny):
    path = tiny[1]
    want = [reference(tiny, p, imgs) for p, imgs in JOBS]
    assert reference(tiny, JOBS[0][0], [png(9, (140, 60))]) != want[0], (
        "an image that changes nothing tests nothing"
    )
    engine = engine_for(path)
    try:
        for job, w in zip(JOBS, want):  # alone
            assert run(engine, [job]) == [w]
        assert run(engine, JOBS) == want  # batched, text-only included
    finally:
        engine.shutdown()
    engine = engine_for(path, max_batch_prefill_tokens=3, enable_prefix_caching=False)  # chunks cut images
    try:
        assert run(engine, JOBS) == want
    finally:
        engine.shutdown()


SIZES = [
    (70, 45),
    (30, 90),
    (56, 56),
    (1, 1),
    (1, 150),
    (150, 1),
    (57, 56),
    (223, 224),
    (1000, 17),
    (17, 1000),
    (111, 112),
    (2, 3),
    (640, 480),
    (480, 640),
    (5000, 4000),
    (333, 167),
    (14, 14),
    (42, 41),
]


def test_the_api_counts_each_image_as_the_processor_expands_it(tiny):
    """The API process's count (no torch) equals the engine's expansion, and transformers' own count."""
    engine = engine_for(tiny[1])
    try:
        images = engine.images
        assert images is not None and isinstance(images.layout, Merge)
        for w, h in SIZES:
            made = images.processor(Image.new("RGB", (w, h)))
            assert image_positions(images.layout, w, h) == len(made.ids), (w, h)
            # what transformers itself says an image of this size takes (vLLM counts with it too)
            assert len(made.ids) == images.processor.processor.get_number_of_image_patches(h, w) // 4, (w, h)  # type: ignore[attr-defined]
    finally:
        engine.shutdown()


def test_positions_that_ignore_the_grid_give_another_answer(tiny, monkeypatch):
    """The parity above tests M-RoPE: with 1-D positions the same model answers otherwise."""
    from pytgi.engine.execution import images

    want = reference(tiny, *JOBS[0])
    monkeypatch.setattr(
        images, "mrope_positions", lambda imgs, start, n: torch.arange(start, start + n).repeat(3, 1)
    )
    engine = engine_for(tiny[1])
    try:
        assert run(engine, [JOBS[0]]) != [want]
    finally:
        engine.shutdown()


def test_two_shards_equal_one(tiny):
    """--num-shard 2: rank 0 runs the tower and sends each step's image rows and M-RoPE positions to
    rank 1 with the step; the answers are transformers' (batched, and in prefill chunks)."""
    want = [reference(tiny, p, imgs) for p, imgs in JOBS]
    engine = engine_for(tiny[1], num_shard=2, max_batch_prefill_tokens=5)
    try:
        assert run(engine, JOBS) == want
    finally:
        engine.shutdown()
