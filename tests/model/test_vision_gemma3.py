"""Gemma 3 with images against transformers (float32, greedy): a tiny random model built in the test
from Gemma 3's config shrunk (a SigLIP tower, 16 rows an image, a sliding window shorter than an
image), a byte-level BPE tokenizer with Gemma 3's image tokens and merged newlines, and
transformers' own `Gemma3Processor`. Alone, batched with text-only requests and with other
images, cut by chunked prefill (which must not end inside an image: its rows attend to each other
both ways), after a prefix-cache hit that ends inside an image, and on two shards."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pytgi.core.image_geometry import wrap_images
from pytgi.core.sampling_params import SamplingParams
from tests.model.vision_util import engine_for, greedy, png

SPECIAL = [
    "<eos>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "<start_of_turn>",
    "<end_of_turn>",
]
NEW = 8
ROWS = 16  # rows an image (a 8 × 8 patch grid pooled 2 × 2)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    max_position_embeddings=1024,
    sliding_window=12,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
    },
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=112,
    patch_size=14,
)


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["<start_of_turn>user\nwhat is in this picture?\n\nmodel\na cat on a mat.\n"] * 50 + [
        "\n\n\n",
        "\n\n\n\n",
    ] * 100
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )


TEMPLATE = (  # Gemma 3's, shortened: an image part is <start_of_image>
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build(tmp_path_factory.mktemp("tiny-gemma3"))


def build(path):
    """A tiny random Gemma 3 with images in `path`: weights, tokenizer (with a chat template) and the
    image processor."""
    torch.manual_seed(0)
    tok = tokenizer()
    tok.chat_template = TEMPLATE
    ids = tok.convert_tokens_to_ids
    # the processor's blank lines merge with a newline beside them: the API must tokenize them together
    assert (
        len(tok.encode("user\n\n\n", add_special_tokens=False))
        == len(tok.encode("user", add_special_tokens=False)) + 1
    )
    cfg = transformers.Gemma3Config(  # type: ignore[call-arg]
        text_config={**TEXT, "vocab_size": len(tok)},
        vision_config=VISION,
        mm_tokens_per_image=ROWS,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        eos_token_id=None,
    )
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # the image must matter to greedy, and how its rows see each other too
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0)  # zeros at init
        for layer in model.model.language_model.layers:  # sharp attention (queries and keys are normed
            layer.self_attn.q_norm.weight.fill_(3.0)  # per head, then scaled by 1 + weight), whose
            layer.self_attn.k_norm.weight.fill_(3.0)  # output weighs more than the residual
            layer.post_attention_layernorm.weight.fill_(2.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    transformers.Gemma3ImageProcessorPil(size={"height": 112, "width": 112}).save_pretrained(path)
    return path


def processor(path) -> transformers.Gemma3Processor:
    return transformers.Gemma3Processor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        image_seq_length=ROWS,
    )


def reference(path, text: str, images: list[bytes]) -> list[int]:
    """transformers' generate on what Gemma3Processor makes of the prompt and its images."""
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    out = processor(path)(text=[text], images=[pil] if pil else None, return_tensors="pt")
    kw = {k: out[k] for k in ("pixel_values", "token_type_ids") if k in out}
    with torch.no_grad():
        got = model.generate(
            out["input_ids"],
            attention_mask=out["attention_mask"],
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return got[0, out["input_ids"].shape[1] :].tolist()


def prompt_ids(engine, text: str) -> list[int]:
    """The prompt as the API process tokenizes it: each image token with the blank lines around it."""
    layout = engine.images.layout
    tok = transformers.AutoTokenizer.from_pretrained(engine.config.model)
    return tok.encode(wrap_images(text, layout, "<start_of_image>"), add_special_tokens=False)


def run(engine, jobs):
    return greedy(engine, [(prompt_ids(engine, text), images) for text, images in jobs], NEW)[0]


JOBS = [
    ("<start_of_turn>user\n<start_of_image>what is in this picture?<end_of_turn>\n", [png(1)]),
    ("<start_of_image>\n\ndescribe the image\n", [png(2, (30, 90))]),
    ("a cat<start_of_image>on a mat<start_of_image>\nmodel\na", [png(3), png(4, (56, 56))]),
    ("<start_of_turn>user\nwhat is in this picture?\n", []),
]


def test_the_engine_expands_the_prompt_as_the_processor_does(tiny):
    """The API's tokens with the engine's expansion are exactly Gemma3Processor's input ids: the blank
    lines merged with the newlines beside them."""
    engine = engine_for(tiny)
    try:
        for text, images in JOBS:
            ids, placed = engine.images.prepare(prompt_ids(engine, text), images)
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
            want = processor(tiny)(text=[text], images=[pil] if pil else None)["input_ids"][0]
            assert ids == list(want)
            assert all(img.length == ROWS + 2 for img in placed)  # the API's count (a fixed layout)
    finally:
        engine.shutdown()


def test_equals_transformers_alone_batched_chunked_and_after_a_cache_hit(tiny):
    want = [reference(tiny, text, imgs) for text, imgs in JOBS]
    assert reference(tiny, JOBS[0][0], [png(9)]) != want[0], "an image that changes nothing tests nothing"
    engine = engine_for(tiny)  # blocks of 16
    try:
        for job, w in zip(JOBS, want):  # alone
            assert run(engine, [job]) == [w]
        # again, batched: the prefix cache gives each image prompt whole blocks, ending inside its image
        got, cached = greedy(engine, [(prompt_ids(engine, t), imgs) for t, imgs in JOBS], NEW)
        assert got == want
        _, placed = engine.images.prepare(prompt_ids(engine, JOBS[0][0]), JOBS[0][1])
        assert placed[0].span[0] < cached[0] < placed[0].span[1]
    finally:
        engine.shutdown()
    engine = engine_for(
        tiny, max_batch_prefill_tokens=7, enable_prefix_caching=False
    )  # chunks smaller than an image
    try:
        assert run(engine, JOBS) == want
    finally:
        engine.shutdown()


def prompt_logprobs(engine, text: str, images: list[bytes]) -> torch.Tensor:
    """pytgi's logprob of each prompt token after the first."""
    engine.add_request(
        "p", prompt_ids(engine, text), SamplingParams(max_new_tokens=1, prompt_logprobs=True), images=images
    )
    got = None
    while engine.has_unfinished():
        for u in engine.step():
            got = u.prompt_logprobs if u.prompt_logprobs is not None else got
    assert got is not None
    return torch.tensor(got[1:])


def reference_prompt_logprobs(path, text: str, images: list[bytes]) -> torch.Tensor:
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    out = processor(path)(text=[text], images=[pil], return_tensors="pt")
    with torch.no_grad():
        logits = model(**out).logits[0, :-1].log_softmax(-1)
    return logits.gather(1, out["input_ids"][0, 1:, None])[:, 0]


def test_causal_image_rows_give_another_answer(tiny, monkeypatch):
    """The parity above tests the image's two-way attention: every prompt token's logprob after the
    image is transformers', and with causal image rows it is not, nor is the greedy answer."""
    from pytgi.engine.models import gemma3_vision

    text, images = JOBS[0]
    want = reference_prompt_logprobs(tiny, text, images)
    engine = engine_for(tiny)
    try:
        torch.testing.assert_close(prompt_logprobs(engine, text, images), want, rtol=0, atol=1e-4)
    finally:
        engine.shutdown()
    call = gemma3_vision.Gemma3Images.__call__
    monkeypatch.setattr(
        gemma3_vision.Gemma3Images,
        "__call__",
        lambda self, img: dataclasses.replace(call(self, img), bidirectional=False),
    )
    engine = engine_for(tiny)
    try:
        assert (prompt_logprobs(engine, text, images) - want).abs().max() > 0.05
        assert run(engine, [JOBS[0]]) != [reference(tiny, text, images)]
    finally:
        engine.shutdown()


def test_two_shards_equal_one(tiny):
    """--num-shard 2: rank 1 gets each step's two-way spans with the step."""
    want = [reference(tiny, text, imgs) for text, imgs in JOBS]
    engine = engine_for(tiny, num_shard=2, max_batch_prefill_tokens=7)
    try:
        assert run(engine, JOBS) == want
    finally:
        engine.shutdown()
