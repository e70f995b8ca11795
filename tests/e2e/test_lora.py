"""LoRA adapters through the clients users have, on a tiny random Llama with two adapters made by peft:
TGI's `adapter_id` (`huggingface_hub`; `text-generation` 0.7 has no such argument), OpenAI's and
Anthropic's `model`, the
listings (/v1/models, /info), unknown adapters refused by name, and concurrent requests for different
adapters (and none) giving what each gives alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch
import transformers
from huggingface_hub import AsyncInferenceClient, InferenceClient

from pytgi.api.openai.lora_routes import NOT_ALLOWED
from tests.e2e.server import Server
from tests.e2e.tiny import tiny_model

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

PROMPT = "hello world, the answer is"
GREEDY = {"max_new_tokens": 8, "details": True, "decoder_input_details": True}


def adapter(base, out, seed: int, **cfg):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **cfg))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    lora.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tiny_model(tmp_path_factory.mktemp("tiny-lora"))
    a = adapter(
        base, tmp_path_factory.mktemp("a"), 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
    )
    b = adapter(
        base, tmp_path_factory.mktemp("b"), 2, r=4, target_modules=["o_proj", "gate_proj", "down_proj"]
    )
    srv = Server(
        "--model-id", str(base), "--lora-adapters", f"alpha={a},beta={b}", log=base / "server.log"
    ).wait_ready()
    yield srv, str(base), {"alpha": str(a), "beta": str(b)}
    srv.stop()


def test_adapter_id_and_model_name_choose_the_same_adapter(served):
    srv, base, adapters = served
    hf = InferenceClient(srv.url, timeout=60)
    out = {name: hf.text_generation(PROMPT, adapter_id=name, **GREEDY) for name in [None, *adapters]}
    # the adapters change the model: the prompt's logprobs differ from the base model's
    prefill = {name: [t.logprob for t in o.details.prefill[1:]] for name, o in out.items()}
    assert prefill["alpha"] != prefill[None] and prefill["beta"] != prefill[None]
    oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-")
    for name in adapters:
        assert hf.text_generation(PROMPT, adapter_id=name, max_new_tokens=8) == out[name].generated_text
        c = oai.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert c.model == name and c.choices[0].text == out[name].generated_text
    base_c = oai.completions.create(model=base, prompt=PROMPT, max_tokens=8, temperature=0)
    assert base_c.choices[0].text == out[None].generated_text
    chat = oai.chat.completions.create(
        model="beta", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
    )
    assert chat.model == "beta"
    msg = anthropic.Anthropic(base_url=srv.url, api_key="-").messages.create(
        model="alpha",
        max_tokens=5,
        messages=[{"role": "user", "content": "hello"}],
        extra_body={"temperature": 0},
    )
    want = oai.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
    )
    assert msg.model == "alpha" and (msg.content[0].text if msg.content else "") == (
        want.choices[0].message.content or ""
    )


def test_adapters_are_listed_with_their_parent(served):
    srv, base, adapters = served
    cards = httpx.get(f"{srv.url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [base, "alpha", "beta"]
    assert cards[1]["parent"] == base and cards[1]["root"] == adapters["alpha"]
    assert httpx.get(f"{srv.url}/v1/models/beta").json()["root"] == adapters["beta"]
    assert httpx.get(f"{srv.url}/info").json()["lora_adapters"] == adapters


def test_unknown_adapters_are_refused_by_name(served):
    srv, _, _ = served
    r = httpx.post(f"{srv.url}/generate", json={"inputs": "x", "parameters": {"adapter_id": "gamma"}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert (
        "`adapter_id` `gamma` is not a LoRA adapter of this server (adapters: `alpha`, `beta`)"
        in r.json()["error"]
    )
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "gamma", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "`alpha`" in r.json()["error"]["message"]
    assert (
        httpx.post(
            f"{srv.url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}
        ).status_code
        == 200
    )


def test_concurrent_requests_for_different_adapters_give_what_each_gives_alone(served):
    srv, _, _adapters = served
    names = [None, "alpha", "beta"] * 3
    prompts = [f"{PROMPT} {i}" for i in range(len(names))]
    hf = InferenceClient(srv.url, timeout=60)
    alone = [hf.text_generation(p, adapter_id=n, **GREEDY).generated_text for p, n in zip(prompts, names)]

    async def together():
        client = AsyncInferenceClient(srv.url, timeout=60)
        outs = await asyncio.gather(
            *(client.text_generation(p, adapter_id=n, **GREEDY) for p, n in zip(prompts, names))
        )
        return [o.generated_text for o in outs]

    assert asyncio.run(together()) == alone


@pytest.fixture(scope="module")
def runtime(served, tmp_path_factory):
    """A second server of the same base model with no adapters at start, an API key, and room for one
    adapter in memory."""
    _, base, adapters = served
    log = tmp_path_factory.mktemp("runtime") / "server.log"
    dirs = ",".join(str(Path(p).parent) for p in adapters.values())  # where the adapters were made
    srv = Server(
        "--model-id",
        base,
        "--api-key",
        "sekret",
        "--max-cpu-loras",
        "1",
        "--enable-lora-runtime-updates",
        "--lora-dirs",
        dirs,
        log=log,
    ).wait_ready()
    yield srv
    srv.stop()


AUTH = {"Authorization": "Bearer sekret"}


def generate(srv, adapter, **extra):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "adapter_id": adapter, **extra}}
    return httpx.post(f"{srv.url}/generate", json=body, headers=AUTH, timeout=60)


def test_adapters_load_and_unload_at_run_time(served, runtime):
    first, _, adapters = served
    want = {
        n: InferenceClient(first.url).text_generation(PROMPT, adapter_id=n, max_new_tokens=8)
        for n in adapters
    }
    load = f"{runtime.url}/v1/load_lora_adapter"
    assert httpx.post(load, json={"lora_name": "gamma", "lora_path": adapters["alpha"]}).status_code == 401
    r = httpx.post(
        load, json={"lora_name": "gamma", "lora_path": adapters["alpha"]}, headers=AUTH, timeout=60
    )
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'gamma' added successfully."
    assert generate(runtime, "gamma").json()["generated_text"] == want["alpha"]  # as if named at start
    models = httpx.get(f"{runtime.url}/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in models][1:] == ["gamma"]
    # a second adapter evicts the first from memory (--max-cpu-loras 1); asked for again, it comes back
    r = httpx.post(load, json={"lora_name": "delta", "lora_path": adapters["beta"]}, headers=AUTH, timeout=60)
    assert r.status_code == 200
    assert generate(runtime, "delta").json()["generated_text"] == want["beta"]
    assert generate(runtime, "gamma").json()["generated_text"] == want["alpha"]
    # refusals, in OpenAI's shape
    again = httpx.post(load, json={"lora_name": "gamma", "lora_path": adapters["beta"]}, headers=AUTH)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    # paths outside --lora-dirs, there or not, and Hub ids (no --allow-hub-adapters): one answer, naming nothing
    outside = Path(adapters["alpha"]).parent.parent
    for path in ["/nowhere/at/all", "/etc", str(outside), f"{adapters['alpha']}/../../..", "org/adapter"]:
        bad = httpx.post(load, json={"lora_name": "eps", "lora_path": path}, headers=AUTH, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["message"] == NOT_ALLOWED, path
        assert bad.json()["error"]["param"] == "lora_path"
    gone = httpx.post(f"{runtime.url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_adapter_not_found"


def test_without_the_flag_the_runtime_routes_are_not_there(served):
    """Off by default (vLLM's rule): a client cannot load files of its choosing or take adapters away."""
    srv, _, adapters = served
    for route, body in [
        ("load_lora_adapter", {"lora_name": "x", "lora_path": adapters["alpha"]}),
        ("unload_lora_adapter", {"lora_name": "alpha"}),
    ]:
        r = httpx.post(f"{srv.url}/v1/{route}", json=body, timeout=60)
        assert r.status_code == 404, route
        assert r.json() == httpx.post(f"{srv.url}/v1/no_such_route", json=body).json()
    assert "alpha" in [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]]


def test_unloading_waits_for_the_adapters_running_requests(served, runtime):
    _, _, adapters = served
    r = httpx.post(
        f"{runtime.url}/v1/load_lora_adapter",
        json={"lora_name": "zeta", "lora_path": adapters["beta"]},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            body = {
                "inputs": PROMPT,
                "parameters": {"max_new_tokens": 400, "adapter_id": "zeta", "ignore_eos_token": True},
            }
            tokens = 0
            async with client.stream("POST", f"{runtime.url}/generate_stream", json=body) as running:
                lines = running.aiter_lines()
                async for line in lines:  # its first token: it is running
                    if line.startswith("data:"):
                        tokens += 1
                        break
                unload = asyncio.ensure_future(
                    client.post(f"{runtime.url}/v1/unload_lora_adapter", json={"lora_name": "zeta"})
                )
                # the engine's snapshot reaches the API process: zeta is no longer listed
                while "zeta" in [
                    m["id"] for m in (await client.get(f"{runtime.url}/v1/models")).json()["data"]
                ]:
                    await asyncio.sleep(0.01)
                refused = await client.post(
                    f"{runtime.url}/generate",
                    json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "adapter_id": "zeta"}},
                )
                assert not unload.done(), "the unload answered while its adapter's request was running"
                async for line in lines:
                    tokens += line.startswith("data:")
            return tokens, await unload, refused

    tokens, unloaded, refused = asyncio.run(main())
    assert tokens == 400
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    assert refused.status_code == 422 and "zeta" in refused.json()["error"]
    assert generate(runtime, "zeta").status_code == 422
