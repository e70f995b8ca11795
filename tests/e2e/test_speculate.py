"""`pytgi serve --speculate 4` with the default (fast) flags, against a server without it: the real
clients get the same text, one stream event per token although steps verify several, and
/metrics reports the accepted draft tokens. `--draft-model-id` (the embedded model drafting for
itself) gives the same text too."""

from __future__ import annotations

import httpx
import pytest

from pytgi.core.model_files import default_gguf_path
from tests.e2e.server import Server
from tests.kernel_paths import batch_invariant

pytestmark = [pytest.mark.slow, batch_invariant]  # the same output needs invariant verification rows

CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("spec")
    plain = Server(exact=False, log=logs / "plain.log")
    spec = Server("--speculate", "4", exact=False, log=logs / "spec.log")
    draft = Server("--draft-model-id", str(default_gguf_path()), exact=False, log=logs / "draft.log")
    try:
        yield plain.wait_ready(), spec.wait_ready(), draft.wait_ready()
    finally:
        plain.stop()
        spec.stop()
        draft.stop()


def test_same_output_one_event_per_token_and_metrics(servers):
    from huggingface_hub import InferenceClient
    from text_generation import Client

    plain, spec, _ = servers
    prompt = f"<|im_start|>user\nCopy this code exactly:\n\n{CODE}<|im_end|>\n<|im_start|>assistant\n"
    want = Client(plain.url, timeout=120).generate(prompt, max_new_tokens=128)
    got = Client(spec.url, timeout=120).generate(prompt, max_new_tokens=128)
    assert got.generated_text == want.generated_text
    assert [t.id for t in got.details.tokens] == [t.id for t in want.details.tokens]
    assert [t.logprob for t in got.details.tokens] == [t.logprob for t in want.details.tokens]
    events = list(Client(spec.url, timeout=120).generate_stream(prompt, max_new_tokens=128))
    assert len(events) == got.details.generated_tokens  # several tokens a step, one event each
    # Where the answer ends depends on the CPU's kernels: an EOS token is streamed, marked special,
    # and is not part of generated_text (TGI's behaviour), whichever way this run went.
    assert "".join(e.token.text for e in events if not e.token.special) == want.generated_text
    assert [e.token.special for e in events] == [t.special for t in want.details.tokens]
    assert events[-1].details.finish_reason == want.details.finish_reason
    if want.details.finish_reason == "eos_token":
        assert events[-1].token.special and events[-1].token.text == "<|im_end|>"
    hub = InferenceClient(base_url=spec.url, timeout=120)
    hf = list(hub.text_generation(prompt, max_new_tokens=128, stream=True, details=True))
    assert "".join(e.token.text for e in hf if not e.token.special) == want.generated_text
    metrics = httpx.get(f"{spec.url}/metrics").text
    accepted = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pytgi_spec_accepted_tokens_total")
    )
    skipped = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("tgi_request_skipped_tokens_sum")
    )
    assert accepted > 10 and skipped == accepted  # every request has finished


def test_a_draft_model_gives_the_same_output(servers):
    from openai import OpenAI
    from text_generation import Client

    plain, _, draft = servers
    prompt = "<|im_start|>user\nName three rivers in Europe.<|im_end|>\n<|im_start|>assistant\n"
    want = Client(plain.url, timeout=120).generate(prompt, max_new_tokens=48)
    got = Client(draft.url, timeout=120).generate(prompt, max_new_tokens=48)
    assert [t.id for t in got.details.tokens] == [t.id for t in want.details.tokens]
    chat = [{"role": "user", "content": "Say hello in French."}]
    oa = [
        OpenAI(base_url=f"{s.url}/v1", api_key="-")
        .chat.completions.create(model="tgi", messages=chat, max_tokens=24, temperature=0)
        .choices[0]
        .message.content
        for s in (plain, draft)
    ]
    assert oa[0] == oa[1]
    metrics = httpx.get(f"{draft.url}/metrics").text
    accepted = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pytgi_spec_accepted_tokens_total")
    )
    assert accepted > 20  # the same model drafts: nearly every draft token is kept
