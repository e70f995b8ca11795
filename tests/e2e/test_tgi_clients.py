"""The clients TGI users have — `text-generation` and `huggingface_hub` — against a real server."""

from __future__ import annotations

import asyncio

import pytest
import text_generation
from huggingface_hub import InferenceClient

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server) -> text_generation.Client:
    return text_generation.Client(server.url, timeout=120)


def test_generate_with_details(client):
    r = client.generate(PROMPT, max_new_tokens=10, decoder_input_details=True)
    assert r.generated_text.startswith(" Paris")
    d = r.details
    assert d.finish_reason == "length" and d.generated_tokens == 10 and len(d.tokens) == 10
    assert "".join(t.text for t in d.tokens) == r.generated_text
    assert d.prefill[0].logprob is None and all(t.logprob is not None for t in d.prefill[1:])
    assert len(d.prefill) == 5 and d.seed is None


def test_generate_stream_equals_generate(client):
    full = client.generate(PROMPT, max_new_tokens=12).generated_text
    events = list(client.generate_stream(PROMPT, max_new_tokens=12))
    assert "".join(e.token.text for e in events if not e.token.special) == full
    assert events[-1].generated_text == full
    assert all(e.generated_text is None for e in events[:-1])
    assert events[-1].details.finish_reason == "length" and events[-1].details.generated_tokens == 12


def test_stop_sequence_keeps_the_stop_text(client):
    r = client.generate(PROMPT, max_new_tokens=20, stop_sequences=["Paris"])
    assert r.generated_text == " Paris" and r.details.finish_reason == "stop_sequence"


def test_seed_reproduces_and_is_echoed(client):
    a = client.generate(PROMPT, max_new_tokens=16, do_sample=True, temperature=0.9, seed=1234)
    b = client.generate(PROMPT, max_new_tokens=16, do_sample=True, temperature=0.9, seed=1234)
    c = client.generate(PROMPT, max_new_tokens=16, do_sample=True, temperature=0.9, seed=4321)
    assert a.generated_text == b.generated_text != c.generated_text
    assert a.details.seed == 1234


def test_best_of_returns_other_sequences(client):
    r = client.generate(PROMPT, max_new_tokens=8, do_sample=True, best_of=2)
    assert len(r.details.best_of_sequences) == 1
    other = r.details.best_of_sequences[0]
    assert other.seed != r.details.seed and other.generated_tokens == len(other.tokens)
    # sampled without a seed: the other sequence may meet EOS before its 8 tokens
    ended = other.finish_reason == text_generation.types.FinishReason.EndOfSequenceToken
    assert other.generated_tokens == 8 or (ended and other.tokens[-1].special)


def test_top_n_tokens(client):
    r = client.generate(PROMPT, max_new_tokens=3, top_n_tokens=3)
    assert len(r.details.top_tokens) == 3 and all(len(t) == 3 for t in r.details.top_tokens)
    assert r.details.top_tokens[0][0].id == r.details.tokens[0].id  # greedy picks the top one


def test_errors_map_to_the_client_classes(client):
    with pytest.raises(text_generation.errors.ValidationError, match="`inputs` tokens \\+ `max_new_tokens`"):
        client.generate("hi " * 9000, max_new_tokens=1)
    with pytest.raises(text_generation.errors.ValidationError, match="`top_n_tokens` must be >= 0 and <= 5"):
        client.generate(PROMPT, max_new_tokens=1, top_n_tokens=6)
    with pytest.raises(
        text_generation.errors.ValidationError, match="`stop` supports up to 4 stop sequences"
    ):
        list(client.generate_stream(PROMPT, max_new_tokens=1, stop_sequences=list("abcde")))


def test_async_client(server):
    async def main():
        c = text_generation.AsyncClient(server.url, timeout=120)
        r = await c.generate(PROMPT, max_new_tokens=6)
        tokens = [e async for e in c.generate_stream(PROMPT, max_new_tokens=6)]
        return r, tokens

    r, tokens = asyncio.run(main())
    assert tokens[-1].generated_text == r.generated_text and len(tokens) == 6


def test_huggingface_hub_inference_client(server, client):
    hub = InferenceClient(base_url=server.url, timeout=120)
    text = hub.text_generation(PROMPT, max_new_tokens=10)
    assert text == client.generate(PROMPT, max_new_tokens=10).generated_text
    streamed = "".join(hub.text_generation(PROMPT, max_new_tokens=10, stream=True))
    assert streamed == text
    detailed = hub.text_generation(PROMPT, max_new_tokens=4, details=True)
    assert detailed.details.generated_tokens == 4 and detailed.details.finish_reason == "length"
