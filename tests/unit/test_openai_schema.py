"""pytgi.server.openai without an engine: error shapes and where they apply, the parameter rules,
the streaming hold-back of a possible stop string, and the decoder's stop cut for OpenAI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pytgi import protocol as P
from pytgi.metrics import Metrics
from pytgi.router.infer import StreamEvent, Token, _Decoder
from pytgi.router.validation import ValidLimits, ValidRequest
from pytgi.sampling_params import SamplingParams
from pytgi.server import openai as oai
from pytgi.server import tgi
from pytgi.server.errors import install_handlers
from pytgi.tokenizer import Tokenizer

MODEL = "org/served-model"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from pytgi.models.registry import resolve_model

    return Tokenizer.from_dir(Path(resolve_model(None)[0]))


@pytest.fixture(scope="module")
def http(tok: Tokenizer) -> TestClient:
    """The app's handlers and both routers over a stub state: requests refused before admission need
    no engine."""
    app = FastAPI()
    install_handlers(app)
    app.include_router(tgi.router)
    oai.install(app)
    app.state.pytgi = SimpleNamespace(
        config=SimpleNamespace(model_id=MODEL), metrics=Metrics(), tokenizer=tok,
        client=SimpleNamespace(info=None),
        validation=SimpleNamespace(limits=ValidLimits(max_input_tokens=32, max_total_tokens=48)), infer=None)
    return TestClient(app)


def openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


CHAT = [{"role": "user", "content": "hi"}]


def test_module_does_not_import_torch() -> None:
    code = "import sys, pytgi.server.app, pytgi.server.openai\nassert 'torch' not in sys.modules\n"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_errors_under_v1_are_openai_shaped_and_tgi_routes_keep_theirs(http: TestClient) -> None:
    err = openai_error(http.post("/v1/chat/completions", json={"messages": "x"}), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == "messages"
    err = openai_error(http.post("/v1/completions", json={}), 400)
    assert err["param"] == "prompt"
    openai_error(http.post("/v1/chat/completions", content=b"{nope",
                           headers={"content-type": "application/json"}), 400)
    openai_error(http.get("/v1/nothing-here"), 404)
    openai_error(http.get("/v1/chat/completions"), 405)
    r = http.post("/generate", json={"inputs": 5})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    r = http.get("/nothing-here")
    assert r.status_code == 404 and r.json() == {"error": "Not Found", "error_type": "http"}


def test_models_and_unknown_models(http: TestClient) -> None:
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    openai_error(http.get("/v1/models/other"), 404)
    err = openai_error(http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": CHAT}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    err = openai_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("extra,param", [
    ({"temperature": 2.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": oai.MAX_N + 1}, "n"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ({"top_logprobs": 1}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages.[0].content.[0].type"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.[0].role"),
])
def test_chat_parameter_rules(http: TestClient, extra: dict, param: str) -> None:
    err = openai_error(http.post("/v1/chat/completions", json={"messages": CHAT, **extra}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra,param", [
    ({"prompt": []}, "prompt"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"temperature": -0.5}, "temperature"),
])
def test_completion_parameter_rules(http: TestClient, extra: dict, param: str) -> None:
    err = openai_error(http.post("/v1/completions", json={"prompt": "hi", **extra}), 400)
    assert err["param"] == param


def test_tools_with_tool_choice_none_are_accepted_by_the_checks() -> None:
    body = oai.ChatCompletionRequest.model_validate(
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})
    assert oai._check_sampling(body) == 1
    assert oai._messages(body.messages) == [{"role": "user", "content": "hi"}]


def test_messages_join_text_parts_and_map_developer() -> None:
    body = oai.ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "name": "u",
         "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]})
    assert oai._messages(body.messages) == [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "a\nb", "name": "u"}]


def test_sampling_defaults_and_seeds() -> None:
    body = oai.CompletionRequest.model_validate({"prompt": "x", "seed": 5})
    sp = [oai._sampling(body, 16, ["x"], i, 0) for i in range(2)]
    assert [s.seed for s in sp] == [5, 6]
    assert all(s.sampling and s.temperature == 1.0 and not s.include_stop_str_in_output for s in sp)
    body = oai.CompletionRequest.model_validate({"prompt": "x", "temperature": 0})
    greedy = oai._sampling(body, 4, [], 0, 2)
    assert not greedy.sampling and greedy.seed is None and greedy.top_n_tokens == 2


# -- streaming hold-back -----------------------------------------------------------------------------
class _Tok:
    def id_to_piece(self, i: int) -> str:
        return f"<{i}>"


def renderer(stops: list[str], chat: bool = True) -> oai._StreamRenderer:
    st = SimpleNamespace(config=SimpleNamespace(model_id=MODEL), tokenizer=_Tok())
    return oai._StreamRenderer(st, chat, "id", 0, 1, stops, False, True, 3)  # type: ignore[arg-type]


def events(deltas: list[str], final_text: str, reason: str) -> list[StreamEvent]:
    out = [StreamEvent(index=k + 1, token=Token(k, d, -0.5)) for k, d in enumerate(deltas)]
    out[-1].generated_text, out[-1].finish_reason, out[-1].generated_tokens = final_text, reason, len(deltas)
    return out


def run(r: oai._StreamRenderer, evs: list[StreamEvent]) -> list[list[dict]]:
    return [r.event(0, ev) for ev in evs]


def test_a_possible_stop_is_held_back_and_the_stop_never_sent() -> None:
    r = renderer(["STOP"])
    # "S", "ST" could start "STOP": held; "x" rules it out; then "STOP" completes (the engine cut it)
    out = run(r, events(["a", " S", "T", "x", " ST", "OP"], "a STx ", "stop_sequence"))
    sent = [[c["choices"][0]["delta"].get("content") for c in chunks] for chunks in out]
    assert sent == [["a"], [" "], [], ["STx"], [" "], [None]]
    assert "".join(s for chunks in sent for s in chunks if s) == "a STx "
    assert out[-1][-1]["choices"][0]["finish_reason"] == "stop"
    (usage,) = r.end()
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 6,
                                                         "total_tokens": 9}


def test_without_stops_text_streams_as_it_comes() -> None:
    r = renderer([], chat=False)
    out = run(r, events(["Hel", "lo", "!"], "Hello!", "length"))
    texts = [c["choices"][0]["text"] for chunks in out for c in chunks]
    assert texts == ["Hel", "lo", "!", ""] and out[-1][-1]["choices"][0]["finish_reason"] == "length"


def test_start_chunks() -> None:
    (role,) = renderer([]).start()
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and role["usage"] is None
    assert renderer([], chat=False).start() == []


# -- the decoder's stop cut ------------------------------------------------------------------------
def decode(tok: Tokenizer, text: str, stop: str, keep: bool) -> StreamEvent:
    sp = SamplingParams(max_new_tokens=50, temperature=0, stop=[stop], include_stop_str_in_output=keep)
    prompt = tok.encode("Say:")
    req = ValidRequest(prompt, len(prompt), sp, 1, True, False, False, False, False, "Say:", None)
    d = _Decoder(tok, req)
    for tid in tok.encode(text, add_special_tokens=False):
        ev = d.token(P.TokenOut("r", tid, -0.1))
        if ev.finish_reason is not None:
            return ev
    raise AssertionError("the stop did not match")


def test_decoder_cuts_the_stop_for_openai_and_keeps_it_for_tgi(tok: Tokenizer) -> None:
    ev = decode(tok, "Hello world, and more words", "world", keep=False)
    assert ev.generated_text == "Hello " and ev.finish_reason == "stop_sequence"
    ev = decode(tok, "Hello world, and more words", "world", keep=True)
    assert ev.generated_text == "Hello world"
