"""OpenAI's API with the official `openai` SDK against a real server: chat and completions, streamed
and not, equal to the offline engine; n, seeds, stops, logprobs, usage; errors as the SDK's classes;
limits, failures and disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.fault_engine import FAULT_PROMPT
from tests.e2e.server import Server
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOL = 1e-4


def sdk(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return sdk(server.url)


@pytest.fixture(scope="module")
def llm():
    from pytgi import LLM

    return LLM(dtype="float32", max_batch_total_tokens=4096, max_total_tokens=2048)


def chat_ids(llm, messages) -> list[int]:
    return llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )


def offline(llm, prompt, n: int, **kw):
    from pytgi import SamplingParams

    kw.setdefault("temperature", 0)
    return llm.generate(prompt, SamplingParams(max_new_tokens=n, **kw))[0]


def openai_finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def sse_lines(server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        return [line for line in s.iter_lines() if line]


# -- models --------------------------------------------------------------------------------------
def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.owned_by
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


# -- equal to the offline engine -------------------------------------------------------------------
def test_chat_greedy_equals_offline_engine(client, llm):
    ids = chat_ids(llm, CHAT)
    want = offline(llm, ids, 20)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.system_fingerprint.startswith("pytgi-") and abs(r.created - time.time()) < 60
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert choice.finish_reason == openai_finish(want.finish_reason)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == len(ids) + len(want.token_ids)
    # content as text parts; "tgi" and no model name the served model too
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    r2 = client.chat.completions.create(model="tgi", messages=parts, max_tokens=20, temperature=0)
    assert r2.choices[0].message.content == want.text
    r3 = client.chat.completions.create(model="", messages=CHAT, max_completion_tokens=5, temperature=0)
    assert r3.usage.completion_tokens == 5 and r3.choices[0].finish_reason == "length"


def test_chat_without_max_tokens_runs_to_eos(client, llm):
    messages = [{"role": "user", "content": "Reply with just the word OK."}]
    want = offline(llm, chat_ids(llm, messages), 64)
    assert want.finish_reason == "eos_token"  # the premise: a short answer
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(want.token_ids)


def test_completions_greedy_equal_offline_engine(client, llm):
    prompts = [PROMPT, "def add(a, b):"]
    wants = [offline(llm, p, 12) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == wants[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(wants[0].prompt_token_ids) and r.usage.completion_tokens == 12
    # a list of prompts, as strings and as token ids; echo prepends the prompt
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == [w.text for w in wants]
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in wants)
    assert r.usage.completion_tokens == 24
    ids = [w.prompt_token_ids for w in wants]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, echo=True)
    assert [c.text for c in r.choices] == [p + w.text for p, w in zip(prompts, wants)]
    r = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == wants[0].text
    # the default max_tokens is 16
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)
    assert r.usage.completion_tokens == 16


# -- streaming -------------------------------------------------------------------------------------
def test_chat_stream_structure_and_text(client, server):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    first, *middle, last_choice, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.choices[0].finish_reason is None and c.choices[0].delta.content for c in middle)
    assert "".join(c.choices[0].delta.content for c in middle) == full.choices[0].message.content
    assert last_choice.choices[0].finish_reason == full.choices[0].finish_reason
    assert last_choice.choices[0].delta.content is None and last_choice.choices[0].delta.role is None
    assert usage.choices == [] and usage.usage.model_dump() == full.usage.model_dump()
    # on the wire: `data: ` events, [DONE] last; no usage chunk unless asked
    lines = sse_lines(server, "/v1/chat/completions", {**kw, "stream": True})
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == full.choices[0].finish_reason
    assert events[-1]["choices"][0]["delta"] == {}
    assert all("usage" not in e or e["usage"] is None for e in events)


def test_completion_stream_equals_non_stream(client, server):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    *texts, usage = chunks
    assert "".join(c.choices[0].text for c in texts) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in texts][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in texts[:-1])
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    echoed = list(client.completions.create(**kw, stream=True, echo=True))
    assert "".join(c.choices[0].text for c in echoed) == PROMPT + full.choices[0].text
    lines = sse_lines(server, "/v1/completions", {**kw, "stream": True})
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_async_client_concurrent_requests(server):
    async def main():
        c = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(model=MODEL, max_tokens=10, temperature=0)

        async def streamed_chat(messages):
            s = await c.chat.completions.create(messages=messages, stream=True, **kw)
            return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

        async def chat(messages):
            return (await c.chat.completions.create(messages=messages, **kw)).choices[0].message.content

        async def completion(prompt):
            return (await c.completions.create(prompt=prompt, **kw)).choices[0].text

        msgs = [[{"role": "user", "content": q}] for q in ("Name a fruit.", "Name a color.", "What is 2+2?")]
        jobs = [streamed_chat(m) for m in msgs] + [chat(m) for m in msgs] + [completion(PROMPT)]
        try:
            return await asyncio.gather(*jobs)
        finally:
            await c.close()

    out = asyncio.run(main())
    assert out[:3] == out[3:6] and all(out)
    assert out[6]


# -- n, seeds, stops -------------------------------------------------------------------------------
def test_n_choices_and_seeds_are_reproducible(client, llm):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # choice i samples with seed + i
    assert a.usage.completion_tokens == 24
    assert a.usage.prompt_tokens == len(llm.tokenizer.encode("Once upon a time"))
    # the same samples as the offline engine with the same seeds
    for i, choice in enumerate(a.choices):
        want = offline(llm, "Once upon a time", 12, temperature=1.0, do_sample=True, seed=7 + i)
        assert choice.text == want.text
    # chat, streamed: two choices, each with its role chunk and its finish chunk
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2, seed=3, stream=True)
    )
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
    greedy = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=3, temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1 and greedy.usage.completion_tokens == 18


def test_stop_cuts_before_the_stop_text(client, llm, server):
    full = offline(llm, PROMPT, 16).text
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    want = full[: full.find(stop)]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    r = client.completions.create(**kw, stop=[stop, "never appears"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    r = client.completions.create(**kw, stop=stop)
    assert r.choices[0].text == want
    # streamed: the stop's start is held back, never sent
    chunks = list(client.completions.create(**kw, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    # chat
    answer = offline(llm, chat_ids(llm, CHAT), 16).text
    cstop = answer[3:7]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stop=cstop)
    assert r.choices[0].message.content == answer[: answer.find(cstop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stop=cstop, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    # TGI's routes keep the stop text
    tgi = httpx.post(
        f"{server.url}/generate",
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 16, "stop": [stop]}},
        timeout=120,
    ).json()
    assert tgi["generated_text"] == want + stop


# -- logprobs --------------------------------------------------------------------------------------
def test_chat_logprobs_equal_the_engine(client, llm):
    want = offline(llm, chat_ids(llm, CHAT), 8, top_n_tokens=3)
    piece = llm.tokenizer.id_to_piece
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids) == r.usage.completion_tokens
    for entry, tid, lp, top in zip(content, want.token_ids, want.logprobs, want.top_logprobs):
        assert entry.token == piece(tid) and entry.bytes == list(piece(tid).encode())
        assert abs(entry.logprob - lp) < TOL
        assert [t.token for t in entry.top_logprobs] == [piece(i) for i, _ in top]
        assert all(abs(t.logprob - v) < TOL for t, (_, v) in zip(entry.top_logprobs, top))
    # streamed: the same entries, spread over the chunks
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, content))
    # logprobs without top_logprobs: no alternatives; none asked: none given
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None
    # up to OpenAI's 20 alternatives, whatever --max-top-n-tokens says for TGI's routes
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, logprobs=True, top_logprobs=20
    )
    assert all(len(e.top_logprobs) == 20 for e in r.choices[0].logprobs.content)


def test_completion_logprobs_equal_the_engine(client, llm):
    want = offline(llm, PROMPT, 8, top_n_tokens=2)
    piece = llm.tokenizer.id_to_piece
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [piece(i) for i in want.token_ids] and "".join(lp.tokens) == r.choices[0].text
    assert all(abs(a - b) < TOL for a, b in zip(lp.token_logprobs, want.logprobs, strict=True))
    for d, tid, top in zip(lp.top_logprobs, want.token_ids, want.top_logprobs):
        assert set(d) == {piece(i) for i, _ in top} | {piece(tid)}
        assert all(abs(d[piece(i)] - v) < TOL for i, v in top)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    # echo: the prompt's tokens first, the first one without a logprob
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True
    )
    lp = r.choices[0].logprobs
    n_prompt = len(want.prompt_token_ids)
    assert len(lp.tokens) == n_prompt + 2 and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[n_prompt] == len(PROMPT)
    # streamed: the same tokens and values
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, stream=True
        )
    )
    toks = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert toks == [piece(i) for i in want.token_ids]
    assert all(abs(a - b) < TOL for a, b in zip(lps, want.logprobs, strict=True))


def test_logit_bias_min_p_and_20_logprobs_equal_the_engine(client, llm):
    greedy = offline(llm, PROMPT, 6)
    banned = {str(greedy.token_ids[0]): -100}
    want = offline(llm, PROMPT, 6, logit_bias={greedy.token_ids[0]: -100.0})
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias=banned)
    assert r.choices[0].text == want.text and want.token_ids[0] != greedy.token_ids[0]
    (yes,) = llm.tokenizer.encode("yes")
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logit_bias={str(yes): 100}
    )  # one token forced
    assert chat.choices[0].message.content == "yes" * 3
    want = offline(llm, PROMPT, 8, temperature=0.9, seed=7, min_p=0.2)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=7, extra_body={"min_p": 0.2}
    )
    assert r.choices[0].text == want.text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=20)
    assert all(len(d) >= 20 for d in r.choices[0].logprobs.top_logprobs)


def test_detokenize(server, llm):
    ids = llm.tokenizer.encode("Hello, world!")
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": ids, "model": MODEL}, timeout=60)
    assert r.status_code == 200 and r.json() == {"prompt": "Hello, world!"}


# -- errors ----------------------------------------------------------------------------------------
CHAT_ERRORS = [
    dict(temperature=2.5),
    dict(top_p=0),
    dict(n=0),
    dict(n=9),
    dict(presence_penalty=3),
    dict(frequency_penalty=-3),
    dict(max_tokens=0),
    dict(max_tokens=9000),
    dict(stop=["a", "b", "c", "d", "e"]),
    dict(logprobs=True, top_logprobs=21),  # over OpenAI's bound (20)
    dict(top_logprobs=2),  # without logprobs
    dict(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    ),
    dict(extra_body={"guided_regex": "("}),
    dict(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice={"type": "function", "function": {"name": "g"}},
    ),
    dict(tool_choice="required"),  # without tools
    dict(messages=[]),
    dict(
        messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
        ]
    ),
    dict(messages=[{"role": "wizard", "content": "hi"}]),
    dict(messages="hello"),  # a malformed body
]


@pytest.mark.parametrize("kw", CHAT_ERRORS)
def test_invalid_chat_requests_are_bad_request_errors(client, kw):
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    err = e.value.body
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]


COMPLETION_ERRORS = [
    dict(prompt=""),
    dict(prompt=[]),
    dict(prompt="hi " * 9000),
    dict(prompt=[10**9]),
    dict(logprobs=21),  # over the bound (20, as chat's)
    dict(logit_bias={"hello": 1}),
    dict(logit_bias={"5": 101}),
    dict(logit_bias={str(10**7): 1}),  # past the vocabulary
    dict(extra_body={"min_p": 1.5}),
    dict(temperature=-1),
    dict(max_tokens=-1),
    dict(stop=""),
]


@pytest.mark.parametrize("kw", COMPLETION_ERRORS)
def test_invalid_completion_requests_are_bad_request_errors(client, kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **kw})
    assert e.value.body["type"] == "invalid_request_error"


def test_error_shapes_on_the_wire(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "gpt-4", "messages": CHAT}, timeout=60)
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": r.json()["error"]["message"],
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 9000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{server.url}/v1/nope", timeout=60)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # TGI's routes keep TGI's shape
    r = httpx.post(f"{server.url}/generate", json={"inputs": 5}, timeout=60)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="davinci-002", prompt=PROMPT, max_tokens=2)


def test_metrics_count_openai_requests(client, server):
    before = server.metric("tgi_request_success_total")
    count = server.metric("tgi_request_count_total")
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=5)
    assert server.metric("tgi_request_success_total") == before + 2
    assert server.metric("tgi_request_count_total") == count + 3


# -- disconnects -----------------------------------------------------------------------------------
def wait_batch_empty(server) -> None:
    wait_until(
        lambda: server.metric("tgi_batch_current_size") == 0,
        10,
        "the running batch to empty after the disconnect",
    )


def test_a_closed_stream_frees_its_slot(client, server):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert server.metric("tgi_batch_current_size") >= 1
    stream.close()
    wait_batch_empty(server)


def test_non_streaming_disconnect_aborts_too(server):
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=2)
    wait_batch_empty(server)


# -- limits and engine failures (a second server) ----------------------------------------------------
@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """One concurrent request at most, a fault-injecting engine."""
    srv = Server(
        "--max-concurrent-requests",
        "1",
        launcher="tests.e2e.fault_engine",
        log=tmp_path_factory.mktemp("logs") / "limited.log",
    ).wait_ready()
    yield srv
    srv.stop()


def test_overloaded_is_a_rate_limit_error(limited):
    client = sdk(limited.url)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert e.value.status_code == 429
    stream.close()
    wait_batch_empty(limited)

    def admitted() -> bool:  # the permit comes back once the server sees the disconnect
        try:
            return bool(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices)
        except openai.RateLimitError:
            return False

    wait_until(admitted, 10, "the closed stream's slot to come back", interval=0.2)
    with pytest.raises(openai.RateLimitError):  # n=2 needs two permits
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=2)


def test_engine_failures_are_server_errors(limited):
    client = sdk(limited.url)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt=FAULT_PROMPT, max_tokens=3)
    assert e.value.body["type"] == "server_error" and "injected fault" in e.value.body["message"]
    with pytest.raises(openai.APIError, match="injected fault"):
        list(client.completions.create(model=MODEL, prompt=FAULT_PROMPT, max_tokens=3, stream=True))
    lines = sse_lines(limited, "/v1/completions", {"prompt": FAULT_PROMPT, "max_tokens": 3, "stream": True})
    assert json.loads(lines[-1][6:])["error"]["type"] == "server_error" and "data: [DONE]" not in lines
    # the server goes on serving
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
