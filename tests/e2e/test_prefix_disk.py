"""`--prefix-cache-dir` through the real server and clients: a conversation's prefix computed before a
restart is read back after it; the usage and the metrics say how many tokens came from disk."""

from __future__ import annotations

from anthropic import Anthropic
from openai import OpenAI

from tests.e2e.server import Server

SYSTEM = "You are a careful assistant for a team that ships an inference server. " * 12


def hits(server: Server, tier: str) -> float:
    return server.metric(f'pytgi_prefix_cache_hit_tokens_total{{tier="{tier}"}}')


def test_a_restarted_server_reads_the_conversation_back_from_disk(tmp_path):
    args = ("--prefix-cache-dir", str(tmp_path / "kv"), "--prefix-cache-verify-rate", "1")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hi."}]
    server = Server(*args, exact=False, log=tmp_path / "first.log").wait_ready()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        first = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert server.stop() == 0  # a clean stop lands the writes in flight
    assert list((tmp_path / "kv").rglob("*.kv"))

    server = Server(*args, exact=False, log=tmp_path / "second.log").wait_ready()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        again = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert again.choices[0].message.content == first.choices[0].message.content
        assert cached >= 160 and hits(server, "disk") == cached and hits(server, "ram") == 0
        assert server.metric("pytgi_prefix_cache_disk_files") > 0
        assert server.metric('pytgi_prefix_cache_disk_blocks_total{op="verified"}') == 1
        assert server.metric('pytgi_prefix_cache_disk_blocks_total{op="verify_mismatch"}') == 0
        # the next turn finds the prefix in RAM now; Anthropic's usage counts it as read from cache
        anthropic = Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
        msg = anthropic.messages.create(
            model=model, system=SYSTEM, messages=[messages[1]], max_tokens=8, extra_body={"temperature": 0}
        )
        assert msg.usage.cache_read_input_tokens >= cached and hits(server, "ram") > 0
    finally:
        server.stop()
