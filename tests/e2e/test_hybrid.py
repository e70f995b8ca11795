"""A hybrid linear-attention model end to end: a tiny random Qwen3.5 (gated DeltaNet layers over the
state pool, pytgi's own code) with the tiny tokenizer, served by `pytgi serve` and asked through the
`openai` SDK and TGI's `text-generation` client: concurrent streams give what each gives alone (the
states of requests that share steps stay apart), a stream the client drops frees its state for the
next request, `/info` shows the state pool and the prefix cache, a conversation's next turn resumes from a
checkpoint of the states, and a flag the model cannot take is refused at start with the reason."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import transformers
from text_generation import Client

from tests.e2e.server import Server
from tests.model.test_qwen3_next import COMMON  # the tiny hybrid's shape
from tests.unit import tiny_tokenizer

pytestmark = pytest.mark.slow
PROMPTS = [
    "the cat sat on the mat",
    "a b c d e f g h i j k l m n o p",
    "hello",
    "one two three four five six",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3.5")
    tiny_tokenizer.build(path)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    kw = dict(COMMON, vocab_size=vocab, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    cfg = transformers.Qwen3_5TextConfig(**kw, intermediate_size=64)
    transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(path)
    srv = Server("--model-id", str(path), "--max-batch-size", "4", log=path / "server.log").wait_ready()
    yield srv, path
    srv.stop()


def _complete(client: openai.OpenAI, prompt: str) -> str:
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in out if c.choices)


def test_concurrent_streams_give_what_each_gives_alone(served):
    srv, _ = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    alone = [_complete(client, p) for p in PROMPTS]
    assert len(set(alone)) > 1
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:  # more than --max-batch-size: some wait for a slot
        together = list(pool.map(lambda p: _complete(client, p), PROMPTS * 2))
    assert together == alone * 2
    tgi = Client(srv.url)
    assert tgi.generate(PROMPTS[0], max_new_tokens=16, decoder_input_details=False).generated_text == alone[0]


def test_a_dropped_stream_frees_its_state(served):
    srv, _ = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    ref = _complete(client, PROMPTS[1])
    for _ in range(6):  # more drops than state slots: each must come back
        with httpx.stream(
            "POST",
            f"{srv.url}/v1/completions",
            json={"prompt": PROMPTS[0], "max_tokens": 500, "stream": True, "ignore_eos": True},
            timeout=30,
        ) as r:
            next(r.iter_lines())
    assert _complete(client, PROMPTS[1]) == ref


def test_info_shows_the_state_pool_and_the_prefix_cache(served):
    srv, _ = served
    info = httpx.get(f"{srv.url}/info").json()
    assert info["max_batch_size"] == 4  # one recurrent state per running request
    assert info["prefix_cache_max_pin_seconds"] == 3600.0  # the prefix cache: checkpoints of the states


def test_a_conversations_next_turn_resumes_from_a_checkpoint(served):
    """The next turn sends the last prompt, the answer and more: it is served from the checkpoint at
    the last prompt's last 64-token boundary (the usage says how many tokens), and its text is what it
    is when asked again (a second hit, from the checkpoint at its own boundary)."""
    srv, _ = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    model = client.models.list().data[0].id
    first = " ".join(PROMPTS * 12)
    ask = dict(model=model, max_tokens=8, temperature=0)
    out = client.completions.create(prompt=first, **ask)
    turn = first + out.choices[0].text + " " + " ".join(PROMPTS * 3)
    again = [client.completions.create(prompt=turn, **ask) for _ in range(2)]
    assert out.usage is not None and out.usage.prompt_tokens > 64
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in again]
    assert cached[0] > 0 and cached[0] % 64 == 0 and cached[1] > cached[0]
    assert again[0].choices[0].text == again[1].choices[0].text


def test_speculation_is_refused_at_start_with_the_reason(served):
    _, path = served
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytgi.cli",
            "serve",
            "--model-id",
            str(path),
            "--speculate",
            "2",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "--speculate" in run.stderr and "recurrent layers" in run.stderr, run.stderr[-2000:]
