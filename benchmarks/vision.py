"""Image requests through the OpenAI chat API: pytgi, and llama.cpp's llama-server with `--mmproj` as
the peer, in one invocation.

The model
    SmolVLM-256M's shape (Idefics3): the default model's real text weights (SmolLM2-135M, from its
    GGUF) with Idefics3's image tokens added, a random SigLIP-B/16 tower at 512 pixels (12 layers of
    768) and a random connector (pixel shuffle by 4: 64 rows a frame). An image is resized to 1024
    pixels on its longest edge and cut into 512-pixel tiles, so a square image is 2 × 2 tiles and
    itself at 512: five frames, 320 image positions (SmolVLM-256M's own 2048 would make 17). Both
    servers split it so (llama.cpp always adds the whole image to its slices, and at 512 pixels
    would encode two frames to transformers' one). No real SmolVLM can be fetched here; speed does
    not depend on what the weights are. llama.cpp's own converter makes the peer's
    GGUF (text in q8_0) and mmproj (f16) from the same directory; pytgi runs `--quantize int8`.

The workload
    Each request: one 448 × 448 PNG and a short question (before the image, so requests share no
    prefix past the template's system prompt), exactly `--tokens` output tokens (EOS ignored).
    * ``distinct``  -- every request a new image: nothing cached helps;
    * ``repeated``  -- every request the same image: pytgi's image cache (--mm-cache-size) skips the
      image processor and the tower; run again with --mm-cache-size 0 to see what it saves.
    At 1 client (`--requests` one after another) and at 8 (`--requests-8`, 8 at a time). Reported:
    output tok/s over the wall time, TTFT p50 / p90 (ms), and the prompt tokens the server counted.

How to run
    .venv/bin/python benchmarks/vision.py                                  # pytgi only
    .venv/bin/python benchmarks/vision.py --llama-server /path/llama-server --llama-cpp /path/llama.cpp
(`--llama-cpp`: a llama.cpp source tree, for convert_hf_to_gguf.py and gguf-py.) A markdown table
goes to stdout; the record to ``benchmarks/results/vision-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pytgi.bench.peers import LlamaServerTarget, ManagedTarget, PytgiTarget
from pytgi.core.paths import cache_dir

TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
          *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
TEMPLATE = (  # ChatML, an image part written as <image> (llama-server flattens parts to text first)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' or p['type'] == 'image_url' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTIONS = ["What is in this picture?", "Describe the image.", "What colours do you see?", "Is it a photo?",
             "What is the main object?", "Where was this taken?", "Describe it in one line.", "What stands out?"]


def make_model(out: Path) -> Path:
    """The SmolVLM-256M-shaped checkpoint (see the module's doc), written once to `out`."""
    if (out / "config.json").is_file():
        return out
    import shutil

    import torch
    import transformers
    from tokenizers import Tokenizer

    from pytgi.core.model_files import converted_gguf_dir, default_gguf_path

    text_dir = converted_gguf_dir(default_gguf_path())
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (text_dir / name).is_file():
            shutil.copy(text_dir / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(TOKENS)
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    llama = transformers.LlamaForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    llama.resize_token_embeddings(tok.get_vocab_size())
    torch.manual_seed(0)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=512, patch_size=16)
    cfg = transformers.Idefics3Config(vision_config=vision, text_config=llama.config.to_dict(), scale_factor=4,
                                      image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=True)
    model = transformers.Idefics3ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.model.text_model.load_state_dict(llama.model.state_dict())
    model.to(torch.bfloat16).save_pretrained(out)
    transformers.Idefics3ImageProcessorPil(size={"longest_edge": 1024}, max_image_size={"longest_edge": 512},
                                           do_image_splitting=True).save_pretrained(out)
    return out


def convert(model: Path, llama_cpp: Path, out: Path) -> tuple[Path, Path]:
    """llama.cpp's converter on the same directory: the text model in q8_0 and the mmproj in f16."""
    text, mmproj = out / "smolvlm-text-q8_0.gguf", out / "smolvlm-mmproj-f16.gguf"
    script = llama_cpp / "convert_hf_to_gguf.py"
    env = {"PYTHONPATH": str(llama_cpp / "gguf-py")}
    import os

    for target, extra in ((text, ["--outtype", "q8_0"]), (mmproj, ["--mmproj", "--outtype", "f16"])):
        if not target.is_file():
            subprocess.run([sys.executable, str(script), str(model), "--outfile", str(target), *extra],
                           check=True, env={**os.environ, **env})
    return text, mmproj


def png(seed: int, size: int = 448) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def one(c: httpx.AsyncClient, model: str, image: str, question: str, tokens: int) -> dict:
    body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [{"type": "text", "text": question},
                                                      {"type": "image_url", "image_url": {"url": image}}]}]}
    t0, first, prompt, out = time.perf_counter(), None, 0, 0
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                first = first or time.perf_counter() - t0
            if chunk.get("usage"):
                prompt, out = chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"]
    return {"ttft": first or time.perf_counter() - t0, "prompt_tokens": prompt, "output_tokens": out}


async def load(url: str, model: str, images: list[str], clients: int, tokens: int) -> dict:
    sem = asyncio.Semaphore(clients)
    # a connection per request: llama-server closes kept-alive ones after a stream
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        async def gated(i: int, image: str) -> dict:
            async with sem:
                return await one(c, model, image, QUESTIONS[i % len(QUESTIONS)], tokens)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(gated(i, im) for i, im in enumerate(images)))
        wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft"] for r in res)
    return {"requests": len(res), "clients": clients, "wall_s": wall,
            "tok_s": sum(r["output_tokens"] for r in res) / wall,
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
            "prompt_tokens": res[0]["prompt_tokens"]}


def measure(target: ManagedTarget, args: argparse.Namespace, label: str,
            workloads: tuple[str, ...] = ("distinct", "repeated")) -> list[dict]:
    rows = []
    with target:
        model = httpx.get(target.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(load(target.url, model, [png(10_000)], 1, 4))  # warm-up, an image seen by nobody else
        seed = 0
        for clients, n in ((1, args.requests), (8, args.requests_8)):
            for workload in workloads:
                images = [png(seed + i) for i in range(n)] if workload == "distinct" else [png(seed)] * n
                seed += n
                row = {"server": label, "workload": workload, **asyncio.run(load(target.url, model, images, clients,
                                                                                  args.tokens))}
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8, help="requests at 1 client, per workload")
    ap.add_argument("--requests-8", type=int, default=32, help="requests at 8 clients, per workload")
    ap.add_argument("--llama-server", help="llama-server binary (built with its mtmd tools)")
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--workdir", type=Path, default=cache_dir() / "bench-vision", help="the model and GGUFs")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    model = make_model(args.workdir / "smolvlm-256m-shape")
    rows = []
    pytgi_flags = f"--model-id {model} --quantize int8 --max-concurrent-requests 64"
    rows += measure(PytgiTarget(protocol="openai", extra_args=pytgi_flags), args, "pytgi")
    rows += measure(PytgiTarget(protocol="openai", extra_args=pytgi_flags + " --mm-cache-size 0"), args,
                    "pytgi, --mm-cache-size 0", ("repeated",))
    if args.llama_server and args.llama_cpp:
        text, mmproj = convert(model, args.llama_cpp, args.workdir)
        flags = f"--mmproj {mmproj} -np 8 -c 8192 -t {args.threads} --jinja --no-warmup"
        rows += measure(LlamaServerTarget(args.llama_server, text, flags, chat=True), args, "llama-server")

    print(f"\none 448×448 PNG a request, {args.tokens} output tokens, EOS ignored; "
          f"{platform.processor() or platform.machine()}\n")
    print("| server | workload | clients | requests | prompt tokens | output tok/s | TTFT p50 ms | TTFT p90 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['workload']} | {r['clients']} | {r['requests']} | {r['prompt_tokens']} | "
              f"{r['tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} |")
    out = REPO / "benchmarks" / "results" / f"vision-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
