"""Idefics3 and SmolVLM against transformers (float32, greedy): tiny random models built in the test
from each family's config shrunk, with a byte-level BPE tokenizer that has the families' image
tokens, and each family's own processor (image splitting into tiles, the tile markers, the pixel
shuffle). Alone, batched with text-only requests and with other images, and cut by chunked prefill;
and the API process's count of an image's positions against the processor's, over many sizes."""

from __future__ import annotations

import io

import pytest
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pytgi.core.image_geometry import image_positions
from tests.model.vision_util import engine_for, greedy, png

SPECIAL = [
    "<|endoftext|>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=56,
    patch_size=14,
)
TILE, EDGE = 56, 4 * 56  # a tile's side, and the longest edge an image is resized to before it is cut
NEW = 8
FAMILIES = {  # architecture: (config, model, image processor, processor)
    "idefics3": (
        transformers.Idefics3Config,
        transformers.Idefics3ForConditionalGeneration,
        transformers.Idefics3ImageProcessorPil,
        transformers.Idefics3Processor,
    ),
    "smolvlm": (
        transformers.SmolVLMConfig,
        transformers.SmolVLMForConditionalGeneration,
        transformers.SmolVLMImageProcessorPil,
        None,
    ),
}


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["User: what is in this picture?\n\nAssistant: a cat on a mat.\n\n"] * 50 + ["\n\n\n\n"] * 100
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", extra_special_tokens={"image_token": "<image>"}
    )


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    config_cls, model_cls, image_cls, _processor_cls = FAMILIES[request.param]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    tok = tokenizer()
    assert tok.encode("\n\n", add_special_tokens=False) != tok.encode("\n", add_special_tokens=False) * 2
    image_token = tok.convert_tokens_to_ids("<image>")
    text = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    cfg = config_cls(
        vision_config=VISION,
        text_config=text.to_dict(),
        scale_factor=2,
        image_token_id=image_token,
        tie_word_embeddings=False,
    )
    model = model_cls(cfg)
    with torch.no_grad():  # the image must matter to greedy: make its rows large
        model.model.connector.modality_projection.proj.weight.mul_(8.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    image_cls(size={"longest_edge": EDGE}, max_image_size={"longest_edge": TILE}).save_pretrained(path)
    return request.param, path, image_token


def reference(tiny, text: str, images: list[bytes]) -> list[int]:
    """transformers' generate, the prompt expanded and the pixels made by the family's processor."""
    family, path, _ = tiny
    model = FAMILIES[family][1].from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[attr-defined]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids, kw = torch.tensor([tok.encode(text)]), {}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        image_processor = FAMILIES[family][2].from_pretrained(path)
        processor_cls = FAMILIES[family][3] or transformers.Idefics3Processor  # SmolVLM's: the same prompt
        processor = processor_cls(image_processor=image_processor, tokenizer=tok, image_seq_len=4)
        out = processor(text=[text], images=[pil], return_tensors="pt")
        assert out["input_ids"].shape[1] > ids.shape[1]
        ids, kw = out["input_ids"], {k: out[k] for k in ("pixel_values", "pixel_attention_mask")}
    with torch.no_grad():
        got = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return got[0, ids.shape[1] :].tolist()


def run(tiny, engine, jobs):
    """jobs: (text, images) submitted together, the text tokenized as the API process would."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny[1])
    return greedy(engine, [(tok.encode(text), images) for text, images in jobs], NEW)[0]


JOBS = [
    ("User: what is in this picture?<image>\n\nAssistant:", [png(1)]),  # 70×45: 3 rows × 4 tiles
    ("<image>describe the image\n", [png(2, (30, 90))]),  # tall: 4 × 2
    ("a cat<image>on a mat<image>\n\nAssistant: a", [png(3), png(4, (56, 56))]),  # one tile: not split
    ("User: what is in this picture?\n", []),
]


def test_equals_transformers_alone_batched_and_chunked(tiny):
    path = tiny[1]
    want = [reference(tiny, text, imgs) for text, imgs in JOBS]
    assert reference(tiny, JOBS[0][0], [png(9)]) != want[0], "an image that changes nothing tests nothing"
    engine = engine_for(path)
    try:
        for job, w in zip(JOBS, want):  # alone
            assert run(tiny, engine, [job]) == [w]
        assert run(tiny, engine, JOBS) == want  # batched, text-only included
    finally:
        engine.shutdown()
    engine = engine_for(path, max_batch_prefill_tokens=7, enable_prefix_caching=False)  # chunks cut images
    try:
        assert run(tiny, engine, JOBS) == want
    finally:
        engine.shutdown()


SIZES = [
    (70, 45),
    (30, 90),
    (56, 56),
    (1, 1),
    (1, 300),
    (300, 1),
    (57, 56),
    (224, 223),
    (1000, 17),
    (17, 1000),
    (111, 112),
    (2, 3),
    (640, 480),
    (480, 640),
    (5000, 4000),
    (333, 167),
]


def test_the_api_counts_each_image_as_the_processor_expands_it(tiny):
    """`image_positions` (the API process's count, no torch) equals the length of the engine's
    expansion (the processor's tiles), for sizes that cross tile edges and aspect ratios."""
    _, path, _ = tiny
    engine = engine_for(path)
    try:
        images = engine.images
        assert images is not None and images.layout.tile == TILE
        for w, h in SIZES:
            ids = images.processor(Image.new("RGB", (w, h))).ids
            assert image_positions(images.layout, w, h) == len(ids), (w, h)
    finally:
        engine.shutdown()
