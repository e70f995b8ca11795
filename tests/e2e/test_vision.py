"""Images end to end: a tiny random LLaVA-1.5 (the tiny tokenizer with an `<image>` token, a template
that writes it for an image part) served by `pytgi serve`, asked through the `openai` SDK with
`data:` URLs and with `http` URLs fetched from a loopback server (allowed by --allowed-media-domains);
the refusals name the image and say why, and the server keeps serving."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import time

import numpy as np
import openai
import pytest
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer

from tests.e2e.server import Server
from tests.e2e.tiny import llama_config
from tests.unit import tiny_tokenizer

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def png(seed: int, size=(64, 48)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(b: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(b).decode()}"


def tiny_llava(path):
    tiny_tokenizer.build(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<image>"])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    torch.manual_seed(0)
    text = llama_config(tok.get_vocab_size())
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
    )
    cfg = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.token_to_id("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = transformers.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # the image must matter to greedy
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
    model.save_pretrained(path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
    ).save_pretrained(path)
    return path


class Images(http.server.BaseHTTPRequestHandler):
    """/a.png, /b.png: images; /text: not an image; /redirect: to /a.png; /trickle: an image's headers,
    then a byte a second."""

    def do_GET(self):
        if self.path == "/trickle":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(120):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(1)
            except OSError:
                pass  # the server gave up on it
            return
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        body, ctype = {
            "/a.png": (png(1), "image/png"),
            "/b.png": (png(2), "image/png"),
            "/text": (b"hello", "text/plain"),
        }.get(self.path, (b"", "text/plain"))
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    # one request at a time: a fetch that held its slot past its deadline would turn the next into a 429
    srv = Server(
        "--model-id",
        str(path),
        "--allowed-media-domains",
        "127.0.0.1",
        "--max-images-per-request",
        "2",
        "--media-fetch-timeout",
        "3",
        "--max-concurrent-requests",
        "1",
        log=path / "server.log",
    ).wait_ready()
    yield srv, str(path), f"http://127.0.0.1:{httpd.server_address[1]}"
    srv.stop()
    httpd.shutdown()


def ask(client, model, *urls, stream=False, text="What is in the picture?"):
    parts = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    kw = dict(model=model, messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0)
    if stream:
        return "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**kw, stream=True)
            if c.choices
        )
    return client.chat.completions.create(**kw)


def test_data_urls_and_fetched_urls_give_the_same_answer(served):
    srv, model, images = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-")
    a = ask(client, model, data_url(png(1)))
    assert a.usage.prompt_tokens > 16  # the image takes 16 positions of the prompt
    assert ask(client, model, f"{images}/a.png").choices[0].message.content == a.choices[0].message.content
    assert ask(client, model, f"{images}/redirect").choices[0].message.content == a.choices[0].message.content
    assert ask(client, model, data_url(png(1)), stream=True) == a.choices[0].message.content
    b = ask(client, model, data_url(png(2)))
    assert b.choices[0].message.content != a.choices[0].message.content  # the image is seen
    two = ask(client, model, f"{images}/a.png", f"{images}/b.png")
    assert two.usage.prompt_tokens == a.usage.prompt_tokens + 16


@pytest.mark.parametrize(
    "url, why",
    [
        ("data:image/png;base64,@@@", "base64 is not valid"),
        ("data:text/plain;base64,aGVsbG8=", "not image/*"),
        (data_url(b"not an image at all"), "not an image in a format pytgi reads"),
        (data_url(png(1)[:70]), "broken"),
        ("{images}/text", "content type is text/plain"),
        ("{images}/missing.png", "HTTP 404"),
        ("http://localhost:{port}/a.png", "internal address"),
        ("ftp://example.com/a.png", "only data:, http: and https: URLs"),
    ],
)
def test_bad_images_are_refused_by_field(served, url, why):
    srv, model, images = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    url = url.format(images=images, port=images.rsplit(":", 1)[1])
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, model, url)
    assert why in e.value.body["message"], e.value.body
    assert e.value.body["param"] == "messages.[0].content.[1].image_url"
    assert ask(client, model, data_url(png(1))).choices[0].finish_reason in (
        "stop",
        "length",
    )  # still serving


def test_a_trickling_image_server_is_cut_at_the_deadline_and_the_slot_freed(served):
    srv, model, images = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="took more than 3 s"):
        ask(client, model, f"{images}/trickle")
    assert time.monotonic() - t0 < 10  # one deadline for the fetch, not one per byte
    assert ask(client, model, f"{images}/a.png").choices[0].message.content  # the one slot is free


def test_image_count_and_tokens_must_agree(served):
    srv, model, _ = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="at most 2 are allowed"):
        ask(client, model, *[data_url(png(i)) for i in range(3)])
    with pytest.raises(openai.BadRequestError, match="1 image token"):  # an <image> typed as text
        ask(client, model, text="look: <image>")


def test_tgi_markdown_anthropic_blocks_and_responses_items_see_the_same_image(served):
    """TGI's `![](url)` in `inputs`, an Anthropic image block and a Responses `input_image` reach the
    model as the OpenAI part does: the same greedy answer for the same prompt."""
    import anthropic
    from text_generation import Client

    srv, model, images = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-")
    want = ask(client, model, data_url(png(1)), text="Hi").choices[0].message.content
    # TGI: the chat template's text, the image written as markdown
    prompt = "<|im_start|>user\nHi![](" + data_url(png(1)) + ")<|im_end|>\n<|im_start|>assistant\n"
    tgi = Client(srv.url).generate(prompt, max_new_tokens=12)
    assert tgi.generated_text == want
    fetched = Client(srv.url).generate(prompt.replace(data_url(png(1)), f"{images}/a.png"), max_new_tokens=12)
    assert fetched.generated_text == want
    # Anthropic: a base64 block and a URL block
    claude = anthropic.Anthropic(base_url=srv.url, api_key="-")
    for source in (
        {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(1)).decode()},
        {"type": "url", "url": f"{images}/a.png"},
    ):
        msg = claude.messages.create(
            model=model,
            max_tokens=12,
            extra_body={"temperature": 0},
            messages=[
                {  # type: ignore[misc]
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "image", "source": source}],
                }
            ],
        )
        assert msg.content[0].text == want
    n = claude.messages.count_tokens(
        model=model,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image", "source": source}]}  # type: ignore[misc]
        ],
    )
    assert n.input_tokens == ask(client, model, data_url(png(1)), text="Hi").usage.prompt_tokens
    # Responses: an input_image item part
    r = client.responses.create(
        model=model,
        max_output_tokens=12,
        temperature=0,
        input=[
            {  # type: ignore[misc]
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Hi"},
                    {"type": "input_image", "image_url": data_url(png(1))},
                ],
            }
        ],
    )
    assert r.output_text == want


def test_a_text_model_refuses_images(tmp_path):
    from tests.e2e.tiny import tiny_model

    srv = Server("--model-id", str(tiny_model(tmp_path)), log=tmp_path / "server.log").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not take images"):
            ask(client, str(tmp_path), data_url(png(1)))
        # TGI's inputs stay text for a text model: markdown is not an image there
        import httpx

        r = httpx.post(
            f"{srv.url}/generate", json={"inputs": "![](http://x/y.png)", "parameters": {"max_new_tokens": 2}}
        )
        assert r.status_code == 200
    finally:
        srv.stop()


def tiny_idefics3(path):
    """A tiny random Idefics3 (SmolVLM's architecture): the tiny tokenizer with Idefics3's image tokens,
    images resized to 224 pixels on their longest edge and cut into tiles of 56."""
    tiny_tokenizer.build(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(
        [
            "<fake_token_around_image>",
            "<image>",
            "<global-img>",
            *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
        ]
    )
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    torch.manual_seed(0)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
    )
    cfg = transformers.Idefics3Config(
        vision_config=vision,
        text_config=llama_config(tok.get_vocab_size()).to_dict(),
        scale_factor=2,
        image_token_id=tok.token_to_id("<image>"),
    )
    transformers.Idefics3ForConditionalGeneration(cfg).save_pretrained(path)
    transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 224}, max_image_size={"longest_edge": 56}
    ).save_pretrained(path)
    return path


def test_idefics3_counts_each_image_by_its_tiles(tmp_path):
    """An image's positions depend on its size (its tiles): `usage`, Anthropic's `count_tokens` and
    the --max-input-tokens check count them as the model's own processor expands the prompt."""
    import anthropic

    path = tiny_idefics3(tmp_path)
    srv = Server(
        "--model-id",
        str(path),
        "--max-input-tokens",
        "200",
        "--max-total-tokens",
        "256",
        log=tmp_path / "server.log",
    ).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        processor = transformers.Idefics3Processor(
            image_processor=transformers.AutoImageProcessor.from_pretrained(path),
            tokenizer=transformers.AutoTokenizer.from_pretrained(path),
            image_seq_len=4,
        )
        text = "<|im_start|>user\nWhat is in the picture?<image><|im_end|>\n<|im_start|>assistant\n"
        for size in ((300, 300), (64, 48), (20, 90), (56, 56)):  # 4 × 4 tiles, 4 × 3, 2 × 4, 4 × 4
            img = png(7, size)
            want = len(processor(text=[text], images=[[Image.open(io.BytesIO(img))]])["input_ids"][0])
            assert ask(client, str(path), data_url(img)).usage.prompt_tokens == want, size
        claude = anthropic.Anthropic(base_url=srv.url, api_key="-")
        source = {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(png(7, (64, 48))).decode(),
        }
        n = claude.messages.count_tokens(
            model=str(path),
            messages=[
                {  # type: ignore[misc]
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "image", "source": source}],
                }
            ],
        )
        assert (
            n.input_tokens
            == ask(client, str(path), data_url(png(7, (64, 48))), text="Hi").usage.prompt_tokens
        )
        with pytest.raises(
            openai.BadRequestError, match="must have less than 200 tokens"
        ):  # 4 × 4 tiles each
            ask(client, str(path), data_url(png(1, (300, 300))), data_url(png(2, (300, 300))))
        assert ask(client, str(path), data_url(png(1))).choices[0].finish_reason in ("stop", "length")
    finally:
        srv.stop()


def test_gemma3_tokenizes_the_blank_lines_around_each_image_as_its_processor(tmp_path):
    """Gemma 3's processor puts a blank line on each side of an image, which merges with the newlines
    beside it: `usage` and `count_tokens` count the prompt Gemma3Processor makes; the answer is the
    same asked through OpenAI's and TGI's routes."""
    import anthropic

    from tests.model.test_vision_gemma3 import build, processor

    path = build(tmp_path)
    srv = Server("--model-id", str(path), log=tmp_path / "server.log").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        text = "<start_of_turn>user\nWhat is in the picture?\n<start_of_image><end_of_turn>\n<start_of_turn>model\n"
        img = png(7)
        want = len(processor(path)(text=[text], images=[[Image.open(io.BytesIO(img))]])["input_ids"][0])
        r = ask(client, str(path), data_url(img), text="What is in the picture?\n")
        assert r.usage.prompt_tokens == want
        claude = anthropic.Anthropic(base_url=srv.url, api_key="-")
        source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(img).decode()}
        n = claude.messages.count_tokens(
            model=str(path),
            messages=[
                {  # type: ignore[misc]
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in the picture?\n"},
                        {"type": "image", "source": source},
                    ],
                }
            ],
        )
        assert n.input_tokens == want
        from text_generation import Client

        tgi = Client(srv.url).generate(
            f"{text}".replace("<start_of_image>", f"![]({data_url(img)})"),
            max_new_tokens=12,
            decoder_input_details=True,
        )
        assert len(tgi.details.prefill) == want - 17  # the prompt's tokens: the image's once, not expanded
        assert tgi.generated_text == r.choices[0].message.content
    finally:
        srv.stop()
