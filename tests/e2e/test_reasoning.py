"""`--reasoning-parser` against a real server: a grammar makes the default model write a
`<think>…</think>` block, and the chat route splits it off (`reasoning_content`, streamed and not),
as Anthropic's route does (`thinking` blocks); `chat_template_kwargs` reach the template."""

from __future__ import annotations

import anthropic
import pytest
from openai import OpenAI

from tests.e2e.server import Server

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THINKS = {"guided_regex": r"<think>[a-z ]{3,20}</think>[A-Z][a-z ]{2,20}\."}  # a think block, then an answer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(
        "--reasoning-parser", "qwen3", log=tmp_path_factory.mktemp("logs") / "server.log"
    ).wait_ready()
    yield srv
    srv.stop()


def test_reasoning_content_streamed_and_not(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0, extra_body=THINKS
    )
    message = r.choices[0].message
    reasoning, content = message.model_extra["reasoning_content"], message.content
    assert reasoning and "<think>" not in reasoning and content and "think>" not in content
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60, temperature=0, stream=True, extra_body=THINKS
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]  # type: ignore[attr-defined]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    # no think block: all content; the template's kwargs are taken (this template has no switch)
    plain = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert plain.choices[0].message.content and not plain.choices[0].message.model_extra.get(
        "reasoning_content"
    )


def test_anthropic_thinking_blocks(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    oai = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    want = (
        oai.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60, temperature=0, extra_body=THINKS
        )
        .choices[0]
        .message
    )
    # Anthropic's body has no grammar field: the forced think block comes from the OpenAI twin's regex
    r = client.messages.create(
        model=MODEL, messages=ASK, max_tokens=60, extra_body={"temperature": 0, **THINKS}
    )
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert (
        r.content[0].thinking == want.model_extra["reasoning_content"] and r.content[1].text == want.content
    )
