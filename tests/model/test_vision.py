"""LLaVA against transformers (float32, greedy): a tiny random LLaVA-1.5 (a CLIP tower, the MLP
projector, a Llama) built in the test, its images made pixels by its own image processor; alone,
batched with text-only requests and with other images, cut by chunked prefill, through the prefix
cache; and the refusals."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from pytgi.core.errors import InvalidRequest
from pytgi.core.sampling_params import SamplingParams
from tests.model.vision_util import engine_for, greedy, png
from tests.reference import hf_copy

TEXT = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=None,
    tie_word_embeddings=False,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=56,
    patch_size=14,
    projection_dim=32,
)
IMAGE = 100  # the image token
PER_IMAGE = (56 // 14) ** 2  # CLIP's patches, the CLS row dropped ("default")
NEW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llava")
    cfg = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=transformers.LlamaConfig(**TEXT),
        image_token_index=IMAGE,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = transformers.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # the image must matter to greedy: make its rows large
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
    model.save_pretrained(path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
    ).save_pretrained(path)
    return path


def reference(
    path, prompt: list[int], images: list[bytes], image: int = IMAGE, eos: int | None = None
) -> list[int]:
    """transformers' generate, the prompt's image tokens expanded as LlavaProcessor expands them (NEW
    tokens, or up to `eos`)."""
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    ids = [x for t in prompt for x in ([t] * PER_IMAGE if t == image else [t])]
    kw = {"min_new_tokens": NEW} if eos is None else {"eos_token_id": eos}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        kw["pixel_values"] = processor(images=pil, return_tensors="pt")["pixel_values"]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kw
        )
    return out[0, len(ids) :].tolist()


def run(engine, jobs):
    """jobs: (prompt, images) submitted together; each one's greedy tokens and cached prompt tokens."""
    return greedy(engine, jobs, NEW)


PROMPTS = [
    ([5, 17, IMAGE, 3, 99, 42], [png(1)]),
    ([IMAGE, 8, 1, 64, 2], [png(2, (30, 90))]),
    ([7, IMAGE, 9, IMAGE, 11], [png(3), png(4, (56, 56))]),
    ([11, 12, 13, 14], []),
]


def test_llava_equals_transformers_alone_batched_and_chunked(tiny):
    want = [reference(tiny, p, imgs) for p, imgs in PROMPTS]
    other = reference(tiny, PROMPTS[0][0], [png(9)])
    assert other != want[0], "an image that changes nothing tests nothing"
    engine = engine_for(tiny)
    try:
        for job, w in zip(PROMPTS, want):  # alone
            assert run(engine, [job])[0] == [w]
        assert run(engine, PROMPTS)[0] == want  # batched, text-only included
    finally:
        engine.shutdown()
    # prefill chunks of 5 tokens cut through the images' 16 positions
    engine = engine_for(tiny, max_batch_prefill_tokens=5, enable_prefix_caching=False)
    try:
        assert run(engine, PROMPTS)[0] == want
    finally:
        engine.shutdown()


def test_the_prefix_cache_keys_blocks_by_image_content(tiny):
    prompt = [5, 17, IMAGE, 3, 99, 42] + list(range(20, 40))
    engine = engine_for(tiny, block_size=4)
    try:
        first, _ = run(engine, [(prompt, [png(1)])])
        again, cached = run(engine, [(prompt, [png(1)])])  # the same image: a prefix hit
        assert again == first and cached[0] > 0
        other, cached = run(engine, [(prompt, [png(9)])])  # another image: no block shared
        assert cached[0] == 0 and other != first
        assert other == [reference(tiny, prompt, [png(9)])]
    finally:
        engine.shutdown()


def test_bad_images_are_refused_by_index_and_the_engine_keeps_serving(tiny):
    engine = engine_for(tiny)
    try:
        with pytest.raises(InvalidRequest, match=r"1 image token\(s\) \(id 100\) for 2 image"):
            engine.add_request("a", [1, IMAGE, 2], SamplingParams(max_new_tokens=2), images=[png(1), png(2)])
        with pytest.raises(
            InvalidRequest, match=r"image `images.\[1\]`: it is not an image in a format pytgi reads"
        ):
            engine.add_request(
                "b", [IMAGE, IMAGE], SamplingParams(max_new_tokens=2), images=[png(1), b"not a png"]
            )
        with pytest.raises(InvalidRequest, match=r"image `images.\[0\]`: it is broken"):
            engine.add_request("c", [IMAGE], SamplingParams(max_new_tokens=2), images=[png(1)[:60]])
        bomb = io.BytesIO()
        Image.new("L", (9000, 9000)).save(bomb, format="PNG")  # small file, 81 M pixels decoded
        with pytest.raises(InvalidRequest, match=r"9000×9000 pixels|not an image"):
            engine.add_request("d", [IMAGE], SamplingParams(max_new_tokens=2), images=[bomb.getvalue()])
        assert not engine.has_unfinished()
        assert run(engine, [PROMPTS[0]])[0] == [reference(tiny, *PROMPTS[0])]
    finally:
        engine.shutdown()


def test_a_text_model_refuses_images(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT)).save_pretrained(tmp_path)
    engine = engine_for(tmp_path)
    try:
        with pytest.raises(InvalidRequest, match="does not take images"):
            engine.add_request("x", [1, 2, 3], SamplingParams(max_new_tokens=2), images=[png(1)])
    finally:
        engine.shutdown()


def test_the_offline_llm_takes_image_prompts(tiny, tmp_path):
    """`LLM.generate` with `{"prompt": ids, "images": [...]}` gives transformers' answer (the tiny
    model has no tokenizer of its own: a copy of it gets the tiny one's files)."""
    import shutil

    from pytgi.llm import LLM
    from tests.unit import tiny_tokenizer

    tiny_tokenizer.build(tmp_path / "tok")
    model = shutil.copytree(tiny, tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / name, model / name)
    llm = LLM(str(model), dtype="float32", max_batch_total_tokens=2048)
    try:
        prompt, images = PROMPTS[0]
        out = llm.generate(
            {"prompt": prompt, "images": images}, SamplingParams(max_new_tokens=NEW, temperature=0)
        )
        assert list(out[0].token_ids) == reference(tiny, prompt, images)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("size", [0, 2])
def test_the_image_cache_skips_the_tower_for_an_image_seen_before(tiny, size):
    """--mm-cache-size: the same image in another request (another prompt: no prefix hit) takes the
    rows computed before, and gives what transformers gives; with 0, the tower runs again. Requests
    that hold the same image at once share it either way."""
    engine = engine_for(tiny, mm_cache_size=size, enable_prefix_caching=False)
    model: Any = engine.runner.model
    calls: list[int] = []
    encode = model.encode_image
    model.encode_image = lambda pixels: calls.append(1) or encode(pixels)
    try:
        a, b = ([5, 17, IMAGE, 3], [png(1)]), ([9, IMAGE, 8, 7, 6], [png(1)])
        assert run(engine, [a])[0] == [reference(tiny, *a)]
        assert run(engine, [b])[0] == [reference(tiny, *b)]
        assert len(calls) == (1 if size else 2)
        for seed in (2, 3, 1):  # one at a time: 2 and 3 push 1 out of a cache of 2
            run(engine, [([IMAGE, 4], [png(seed)])])
        assert len(calls) == (4 if size else 5)
        # one image in requests that run together: the tower runs once for them, cache or not
        c, d = ([5, IMAGE, 3], [png(7)]), ([8, 8, IMAGE], [png(7)])
        assert run(engine, [c, d])[0] == [reference(tiny, *c), reference(tiny, *d)]
        assert len(calls) == (5 if size else 6)
    finally:
        engine.shutdown()


# -- LLaVA-NeXT: an image's tiles by the best of the grid pinpoints, its padding cut off, newline rows
PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llava-next")
    vision = transformers.CLIPVisionConfig(**{**VISION, "image_size": 28})
    cfg = transformers.LlavaNextConfig(
        vision_config=vision,
        text_config=transformers.LlamaConfig(**TEXT),
        image_token_index=IMAGE,
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = transformers.LlavaNextForConditionalGeneration(cfg)
    with torch.no_grad():  # the image must matter to greedy: make its rows large
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
        model.model.image_newline.normal_(0, 4.0)
    model.save_pretrained(path)
    transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=PINPOINTS
    ).save_pretrained(path)
    return path


def next_features(path, images: list[bytes]):
    """transformers' LLaVA-NeXT model, its pixels and image sizes, and each image's rows."""
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    if not images:
        return model, {}, []
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    kw = {
        k: v
        for k, v in processor(images=pil, return_tensors="pt").items()
        if k in ("pixel_values", "image_sizes")
    }
    with torch.no_grad():
        feats = model.model.get_image_features(**kw).pooler_output
    return model, kw, feats


def next_reference(path, prompt: list[int], images: list[bytes]) -> list[int]:
    """transformers' generate, each image token expanded to the rows the model packs for the image."""
    model, kw, feats = next_features(path, images)
    lengths = iter(f.shape[0] for f in feats)
    ids = [x for t in prompt for x in ([t] * next(lengths) if t == IMAGE else [t])]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(ids) :].tolist()


def test_llava_next_equals_transformers_alone_batched_and_chunked(tiny_next):
    jobs = [
        ([5, 17, IMAGE, 3, 99, 42], [png(1)]),  # wide
        ([IMAGE, 8, 1, 64, 2], [png(2, (30, 90))]),  # tall
        ([7, IMAGE, 9, IMAGE, 11], [png(3), png(4, (56, 56))]),
        ([11, 12, 13, 14], []),
    ]
    want = [next_reference(tiny_next, p, imgs) for p, imgs in jobs]
    assert next_reference(tiny_next, jobs[0][0], [png(9)]) != want[0], (
        "an image that changes nothing tests nothing"
    )
    engine = engine_for(tiny_next)
    try:
        for job, w in zip(jobs, want):
            assert run(engine, [job])[0] == [w]
        assert run(engine, jobs)[0] == want
    finally:
        engine.shutdown()
    engine = engine_for(tiny_next, max_batch_prefill_tokens=7, enable_prefix_caching=False)
    try:
        assert run(engine, jobs)[0] == want
    finally:
        engine.shutdown()


def test_quantized_the_decoder_is_low_bit_and_the_vision_part_runs_in_bf16(tiny_next):
    """--quantize int8 with bf16 activations: the decoder's linears are int8, the tower, projector
    and LLaVA-NeXT's newline row are bf16, and image prompts still answer."""
    engine = engine_for(tiny_next, dtype="bfloat16", quantize="int8")
    try:
        model: Any = engine.runner.model
        assert {p.dtype for p in model.tower.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in model.projector.parameters()} == {torch.bfloat16}
        assert model.image_newline.dtype == torch.bfloat16
        assert type(model.text.layers[0].self_attn.o_proj).__name__ == "QuantizedLinear"
        got = run(engine, [([5, 17, IMAGE, 3, 99, 42], [png(1)])])[0]
        assert len(got[0]) > 0
    finally:
        engine.shutdown()


def test_llava_next_positions_are_counted_as_the_model_packs_them(tiny_next):
    """The API process's count (no torch) equals the rows transformers' model packs for an image, for
    sizes that pick each pinpoint and cut padding rows or columns off."""
    from pytgi.core.image_geometry import image_positions
    from pytgi.core.image_layouts import AnyRes

    engine = engine_for(tiny_next)
    try:
        layout = engine.images.layout
        assert isinstance(layout, AnyRes)
        for w, h in [
            (70, 45),
            (30, 90),
            (56, 56),
            (1, 1),
            (300, 7),
            (7, 300),
            (57, 56),
            (100, 33),
            (33, 100),
            (640, 480),
            (28, 84),
            (85, 28),
        ]:
            _, _, feats = next_features(tiny_next, [png(0, (w, h))])
            assert image_positions(layout, w, h) == feats[0].shape[0], (w, h)
    finally:
        engine.shutdown()


def test_llava_on_the_default_models_real_text_weights(tmp_path):
    """The default model's text weights (SmolLM2-135M, from its GGUF, in float32) behind a small random
    CLIP tower and projector: greedy output equals transformers', alone and batched with text."""
    from pytgi.core.model_files import converted_gguf_dir, default_gguf_path
    from pytgi.core.tokenizer import Tokenizer

    text_dir = converted_gguf_dir(default_gguf_path(), progress=False)
    llama = transformers.LlamaForCausalLM.from_pretrained(hf_copy(text_dir), dtype=torch.float32)
    tok = Tokenizer.from_dir(text_dir)
    image = tok.special_id("<empty_output>")  # an unused special token stands for the image
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=llama.config,
        image_token_index=image,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = transformers.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        model.model.language_model.load_state_dict(llama.model.state_dict())
        model.lm_head.weight.copy_(llama.lm_head.weight)
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)  # the image must matter to greedy
    model.save_pretrained(tmp_path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
    ).save_pretrained(tmp_path)
    del model, llama

    def chat(text: str, with_image: bool) -> list[int]:
        head = tok.encode(f"<|im_start|>user\n{text}", add_special_tokens=False)
        return (
            head  # type: ignore[return-value]
            + [image] * with_image
            + tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        )

    jobs = [
        (chat("What is in this picture?", True), [png(1)]),
        (chat("Describe it.", True), [png(2, (30, 90))]),
        (chat("What is the capital of France?", False), []),
    ]
    eos = tok.special_id("<|im_end|>")
    want = [reference(tmp_path, p, imgs, image, eos) for p, imgs in jobs]
    assert reference(tmp_path, jobs[0][0], [png(9)], image, eos) != want[0], "an image that changes nothing"
    assert all(len(w) >= 4 for w in want), want
    engine = engine_for(tmp_path, max_total_tokens=1024)
    try:
        for job, w in zip(jobs, want):
            assert run(engine, [job])[0] == [w]
        assert run(engine, jobs)[0] == want
    finally:
        engine.shutdown()
