"""pytgi.api.openai without an engine: error shapes and where they apply, the parameter rules,
the streaming hold-back of a possible stop string, and the output processor's stop cut for OpenAI."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pytgi.api import tgi
from pytgi.api.chat import tools
from pytgi.api.chat.language import Message
from pytgi.api.chat.requests import choices
from pytgi.api.error_handlers import install_handlers
from pytgi.api.frontend.infer import Infer
from pytgi.api.frontend.validation import Validation, ValidLimits
from pytgi.api.metrics import Metrics
from pytgi.api.middleware import AdmissionMiddleware
from pytgi.api.openai import render, schema
from pytgi.api.openai import routes as oai
from pytgi.api.state import State
from pytgi.core import protocol as P
from pytgi.core.outputs import OutputProcessor
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import Tokenizer
from tests.unit.test_validation import validate

MODEL = "org/served-model"


class _NoEngine:
    def submit(self, *args: object) -> None:
        raise AssertionError("a refused request reached the engine")


@pytest.fixture(scope="module")
def val(tok: Tokenizer):
    v = Validation(tok, ValidLimits(max_input_tokens=1000, max_total_tokens=1048), workers=1)
    yield v
    v.close()


@pytest.fixture(scope="module")
def http(tok: Tokenizer, val: Validation) -> TestClient:
    """The app's handlers and both routers over a stub state whose engine may never be reached: every
    request here is refused by the checks."""
    app = FastAPI()
    install_handlers(app)
    app.include_router(tgi.router)
    config = SimpleNamespace(
        model_id=MODEL,
        reasoning_parser=None,
        enable_lora_runtime_updates=False,
        responses_store_size=10,
        responses_store_bytes=1 << 20,
    )
    oai.install(app, config)
    app.add_middleware(AdmissionMiddleware)
    app.state.pytgi = State(
        config=config,
        metrics=Metrics(),
        tokenizer=tok,
        client=SimpleNamespace(info=None, adapters=P.AdapterSnapshot(-1)),
        validation=val,
        infer=Infer(_NoEngine(), tok, 8),
    )
    return TestClient(app)


def openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


CHAT = [{"role": "user", "content": "hi"}]


def test_module_does_not_import_torch() -> None:
    code = "import sys, pytgi.api.app, pytgi.api.openai\nassert 'torch' not in sys.modules\n"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_errors_under_v1_are_openai_shaped_and_tgi_routes_keep_theirs(http: TestClient) -> None:
    err = openai_error(http.post("/v1/chat/completions", json={"messages": "x"}), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == "messages"
    err = openai_error(http.post("/v1/completions", json={}), 400)
    assert err["param"] == "prompt"
    openai_error(
        http.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}), 400
    )
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


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"temperature": 2.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": schema.MAX_N + 1}, "n"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"1000000": 1}}, "logit_bias"),  # past the vocabulary
        ({"min_p": 1.5}, "min_p"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),  # OpenAI allows up to 20
        ({"top_logprobs": 1}, "top_logprobs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.[0].function.name"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages.[0].content.[0].type",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.[0].role"),
    ],
)
def test_chat_parameter_rules(http: TestClient, extra: dict, param: str) -> None:
    err = openai_error(http.post("/v1/chat/completions", json={"messages": CHAT, **extra}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"prompt": []}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"temperature": -0.5}, "temperature"),
    ],
)
def test_completion_parameter_rules(http: TestClient, extra: dict, param: str) -> None:
    err = openai_error(http.post("/v1/completions", json={"prompt": "hi", **extra}), 400)
    assert err["param"] == param


def test_tools_with_tool_choice_none_are_accepted_by_the_checks() -> None:
    body = schema.ChatCompletionRequest.model_validate(
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
    )
    assert schema.check_sampling(body) == 1
    assert schema.to_chat(body)[0].messages == [Message("user", "hi")]


def test_messages_join_text_parts_and_map_developer() -> None:
    body = schema.ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "name": "u",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        }
    )
    assert tools.template_messages(schema.chat_messages(body.messages), None, "hermes")[0] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "u"},
    ]


def test_sampling_defaults_and_seeds(val: Validation) -> None:
    body = schema.CompletionRequest.model_validate({"prompt": "x", "seed": 5, "n": 2, "stop": "x"})
    req = validate(val, schema.to_input(body, "x", 16, None, 20))
    sp = [r.sampling for r in choices(req, 2, body.seed)]
    assert [s.seed for s in sp] == [5, 6]
    assert all(s.sampling and s.temperature == 1.0 and not s.include_stop_str_in_output for s in sp)
    body = schema.CompletionRequest.model_validate({"prompt": "x", "temperature": 0})
    greedy = validate(val, schema.to_input(body, "x", 4, 2, 5)).sampling
    assert not greedy.sampling and greedy.seed is None and greedy.top_n_tokens == 2


def test_top_logprobs_up_to_openais_bound(val: Validation) -> None:
    body = schema.ChatCompletionRequest.model_validate(
        {"messages": CHAT, "logprobs": True, "top_logprobs": 20}
    )
    req = validate(val, schema.to_input(body, "hi", 4, body.top_logprobs, schema.MAX_CHAT_TOP_LOGPROBS))
    assert req.sampling.top_n_tokens == 20  # above the server's --max-top-n-tokens (5), as OpenAI allows


# -- streaming hold-back -----------------------------------------------------------------------------
class _Tok:
    """Token k is the k-th piece of `pieces`; no special tokens."""

    special_ids: set[int] = set()
    eos_token_ids: list[int] = []

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)

    def id_to_piece(self, i: int) -> str:
        return f"<{i}>"


def renderer(chat: bool = True) -> render.StreamRenderer:
    head = render.head("chat.completion.chunk" if chat else "text_completion", "id", 0, MODEL)
    return render.StreamRenderer(chat, head, 1, False, True, 3, _Tok([]).id_to_piece)


def run(r: render.StreamRenderer, pieces: list[str], stops: list[str], last_reason: str) -> list[list[dict]]:
    """Each piece as one token through the output processor, then into the renderer."""
    sp = SamplingParams(max_new_tokens=50, temperature=0, stop=stops, include_stop_str_in_output=False)
    proc = OutputProcessor(_Tok(pieces), [], sp)
    out = []
    for k in range(len(pieces)):
        delta = proc.process(
            P.TokenOut("r", k, -0.5, finish_reason=last_reason if k == len(pieces) - 1 else None)
        )
        assert delta is not None
        out.append(r.delta(0, delta))
        if proc.finished:
            break
    return out


def test_a_possible_stop_is_held_back_and_the_stop_never_sent() -> None:
    r = renderer()
    # "S", "ST" could start "STOP": held; "x" rules it out; then "STOP" completes and is cut
    out = run(r, ["a", " S", "T", "x", " ST", "OP"], ["STOP"], "length")
    sent = [[c["choices"][0]["delta"].get("content") for c in chunks] for chunks in out]
    assert sent == [["a"], [" "], [], ["STx"], [" "], [None]]
    assert "".join(s for chunks in sent for s in chunks if s) == "a STx "
    assert out[-1][-1]["choices"][0]["finish_reason"] == "stop"
    (usage,) = r.end()
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_without_stops_text_streams_as_it_comes() -> None:
    r = renderer(chat=False)
    out = run(r, ["Hel", "lo", "!"], [], "length")
    texts = [c["choices"][0]["text"] for chunks in out for c in chunks]
    assert texts == ["Hel", "lo", "!", ""] and out[-1][-1]["choices"][0]["finish_reason"] == "length"


def test_start_chunks() -> None:
    (role,) = renderer().start()
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and role["usage"] is None
    assert renderer(chat=False).start() == []


# -- the output processor's stop cut -----------------------------------------------------------------
def decode(tok: Tokenizer, text: str, stop: str, keep: bool) -> OutputProcessor:
    sp = SamplingParams(max_new_tokens=50, temperature=0, stop=[stop], include_stop_str_in_output=keep)
    proc = OutputProcessor(tok, tok.encode("Say:"), sp)
    for tid in tok.encode(text, add_special_tokens=False):
        proc.process(P.TokenOut("r", tid, -0.1))
        if proc.finished:
            return proc
    raise AssertionError("the stop did not match")


def test_output_cuts_the_stop_for_openai_and_keeps_it_for_tgi(tok: Tokenizer) -> None:
    out = decode(tok, "Hello world, and more words", "world", keep=False)
    assert out.text == "Hello " and out.finish_reason == "stop_sequence" and out.stopped
    out = decode(tok, "Hello world, and more words", "world", keep=True)
    assert out.text == "Hello world"


def test_kept_special_tokens_are_text_but_the_end_of_sequence_is_not(tok: Tokenizer) -> None:
    """Mistral's tool calls keep special tokens in the text (`[TOOL_CALLS]`); the EOS that ends the answer
    still is no text."""
    marker, eos = tok.special_id("<reponame>"), tok.eos_token_ids[0]
    assert marker is not None
    for skip, text in ((True, "hello"), (False, "<reponame>hello")):
        sp = SamplingParams(max_new_tokens=50, temperature=0, skip_special_tokens=skip)
        proc = OutputProcessor(tok, tok.encode("Say:"), sp)
        for tid in [marker, *tok.encode("hello", add_special_tokens=False)]:
            proc.process(P.TokenOut("r", tid, -0.1))
        proc.process(P.TokenOut("r", eos, -0.1, finish_reason="eos_token"))
        assert proc.text == text and proc.finish_reason == "eos_token"
    # a grammar that is complete ends its request on its last token, which is text
    proc = OutputProcessor(tok, [], SamplingParams(max_new_tokens=50, temperature=0))
    (brace,) = tok.encode("}", add_special_tokens=False)
    proc.process(P.TokenOut("r", brace, -0.1, finish_reason="eos_token"))
    assert proc.text == "}"


def test_logit_bias_min_p_and_20_logprobs_reach_the_engine(val: Validation) -> None:
    body = schema.CompletionRequest.model_validate(
        {"prompt": "x", "logit_bias": {"5": -100, "17": 2.5}, "min_p": 0.05, "logprobs": 20}
    )
    sp = validate(val, schema.to_input(body, "x", 4, body.logprobs, schema.MAX_COMPLETION_LOGPROBS)).sampling
    assert sp.logit_bias == {5: -100.0, 17: 2.5} and sp.min_p == 0.05 and sp.top_n_tokens == 20


def test_detokenize_is_vllms_route(http: TestClient, tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 422 and "token ids must be" in r.json()["error"]
