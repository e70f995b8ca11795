"""pytgi.api.frontend.validation: TGI's request models, rules, messages, order and the engine mapping."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from pytgi.api.frontend.validation import (
    CompatGenerateRequest,
    GenerateParameters,
    GenerateRequest,
    Validation,
    ValidLimits,
    ValidRequest,
)
from pytgi.core.errors import InvalidRequest
from pytgi.core.tokenizer import Tokenizer

MAX_INPUT = 32
MAX_TOTAL = 48


@pytest.fixture(scope="module")
def val(tok: Tokenizer):
    v = Validation(tok, ValidLimits(max_input_tokens=MAX_INPUT, max_total_tokens=MAX_TOTAL), workers=2)
    yield v
    v.close()


def validate(v: Validation, r, stream: bool = False) -> ValidRequest:
    """`Validation.validate` from a test without an event loop."""
    return asyncio.run(v.validate(r, stream))


def tokenize(v: Validation, text: str) -> list[dict]:
    return asyncio.run(v.validate_tokenize(text))


def req(inputs: str = "Hello world", **params) -> GenerateRequest:
    return GenerateRequest.model_validate({"inputs": inputs, "parameters": params})


def err(val: Validation, r: GenerateRequest, stream: bool = False) -> str:
    with pytest.raises(InvalidRequest) as e:
        validate(val, r, stream)
    assert e.value.message == str(e.value)
    return e.value.message


def n_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text))


# --- process hygiene ---------------------------------------------------------------------------


def test_module_does_not_import_torch(tokenizer_dir: Path) -> None:
    code = (
        "import sys, asyncio\n"
        "import pytgi.api.frontend.validation as v\n"
        "from pytgi.core.tokenizer import Tokenizer\n"
        f"t = Tokenizer.from_dir({str(tokenizer_dir)!r})\n"
        "val = v.Validation(t, v.ValidLimits(max_input_tokens=16, max_total_tokens=32))\n"
        "r = asyncio.run(val.validate(v.GenerateRequest(inputs='hi'), stream=False))\n"
        "assert r.input_length > 0\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# --- the pydantic models -----------------------------------------------------------------------


def test_defaults_match_tgi() -> None:
    p = GenerateParameters()
    assert p.do_sample is False and p.max_new_tokens is None and p.stop == []
    assert p.details is False and p.decoder_input_details is False and p.watermark is False
    for name in (
        "best_of",
        "temperature",
        "repetition_penalty",
        "frequency_penalty",
        "top_k",
        "top_p",
        "typical_p",
        "return_full_text",
        "truncate",
        "seed",
        "top_n_tokens",
        "grammar",
        "adapter_id",
    ):
        assert getattr(p, name) is None, name
    r = GenerateRequest.model_validate({"inputs": "x"})
    assert r.parameters == GenerateParameters() and r.add_special_tokens is True
    c = CompatGenerateRequest.model_validate({"inputs": "x"})
    assert c.stream is False and c.to_generate_request().inputs == "x"


@pytest.mark.parametrize(
    "body",
    [
        {"inputs": 5},
        {"inputs": None},
        {},
        {"inputs": "x", "parameters": {"max_new_tokens": "ten"}},
        {"inputs": "x", "parameters": {"max_new_tokens": "10"}},  # serde does not coerce strings
        {"inputs": "x", "parameters": {"max_new_tokens": 10.5}},
        {"inputs": "x", "parameters": {"max_new_tokens": -1}},  # u32
        {"inputs": "x", "parameters": {"max_new_tokens": 2**32}},
        {"inputs": "x", "parameters": {"temperature": "hot"}},
        {"inputs": "x", "parameters": {"temperature": True}},
        {"inputs": "x", "parameters": {"do_sample": "yes"}},
        {"inputs": "x", "parameters": {"do_sample": 1}},
        {"inputs": "x", "parameters": {"do_sample": None}},  # bool, not Option<bool>
        {"inputs": "x", "parameters": {"stop": "a"}},
        {"inputs": "x", "parameters": {"stop": [1]}},
        {"inputs": "x", "parameters": {"stop": None}},
        {"inputs": "x", "parameters": {"seed": -1}},
        {"inputs": "x", "parameters": {"top_n_tokens": -1}},
        {"inputs": "x", "parameters": {"best_of": -2}},
        {"inputs": "x", "parameters": {"truncate": "5"}},
        {"inputs": "x", "parameters": {"grammar": {"type": "xml", "value": "<a/>"}}},
        {"inputs": "x", "parameters": {"grammar": "json"}},
        {"inputs": "x", "parameters": []},
        {"inputs": "x", "stream": "no"},
    ],
)
def test_wrong_types_fail_model_validation(body: dict) -> None:
    model = CompatGenerateRequest if "stream" in body else GenerateRequest
    with pytest.raises(pydantic.ValidationError):
        model.model_validate(body)
    with pytest.raises(pydantic.ValidationError):
        model.model_validate_json(json.dumps(body))


def test_lenient_where_tgi_is() -> None:
    # nulls for Option fields, integers for floats, unknown fields ignored (TGI has no deny_unknown_fields)
    body = {
        "inputs": "x",
        "stream": True,  # sent to /generate by some clients
        "parameters": {
            "temperature": 1,
            "top_p": None,
            "seed": None,
            "max_new_tokens": None,
            "return_full_text": None,
            "adapter_id": "lora",
            "not_a_field": 3,
            "grammar": None,
            "top_k": 5,
        },
    }
    r = GenerateRequest.model_validate_json(json.dumps(body))
    assert r.parameters.temperature == 1.0 and isinstance(r.parameters.temperature, float)
    assert r.parameters.top_k == 5 and r.parameters.adapter_id == "lora"
    assert not hasattr(r.parameters, "not_a_field") and not hasattr(r, "stream")


# --- each rule with its exact message ----------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"temperature": 0.0}, "`temperature` must be strictly positive"),
        ({"temperature": -1}, "`temperature` must be strictly positive"),
        ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
        ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"frequency_penalty": -2.01}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"top_k": -3}, "`top_k` must be strictly positive"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"top_p": 0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"typical_p": -0.5}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"truncate": 0}, f"`truncate` must be strictly positive and less than {MAX_INPUT}. Given: 0"),
        (
            {"truncate": MAX_INPUT + 1},
            f"`truncate` must be strictly positive and less than {MAX_INPUT}. Given: {MAX_INPUT + 1}",
        ),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
        ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ({"best_of": 0}, "`best_of` must be > 0 and <= 2. Given: 0"),
    ],
)
def test_parameter_rules(val: Validation, params: dict, message: str) -> None:
    assert err(val, req(**params)) == message


def test_boundaries_pass(val: Validation) -> None:
    ok = req(
        frequency_penalty=2.0,
        top_p=0.999,
        typical_p=0.01,
        top_k=1,
        top_n_tokens=5,
        stop=["a", "b", "c", "d"],
        truncate=MAX_INPUT,
        max_new_tokens=1,
        repetition_penalty=0.01,
    )
    assert isinstance(validate(val, ok), ValidRequest)
    assert validate(val, req(frequency_penalty=-2.0, top_n_tokens=0)).sampling.top_n_tokens == 0
    r = validate(val, req(best_of=2, do_sample=True))
    assert r.best_of == 2 and r.sampling.sampling
    # TGI's router counts a *given* temperature as sampling for best_of, even 1.0
    assert validate(val, req(best_of=2, temperature=1.0)).best_of == 2


def test_streaming_rules(val: Validation) -> None:
    assert err(val, req(best_of=2, do_sample=True), stream=True) == (
        "`best_of` != 1 is not supported when streaming tokens"
    )
    assert err(val, req(best_of=0), stream=True) == "`best_of` != 1 is not supported when streaming tokens"
    assert err(val, req(decoder_input_details=True), stream=True) == (
        "`decoder_input_details` == true is not supported when streaming tokens"
    )
    assert validate(val, req(decoder_input_details=True), stream=False).sampling.prompt_logprobs
    r = validate(val, req(best_of=1), stream=True)
    assert r.stream and r.best_of == 1


def test_best_of_disabled(tok: Tokenizer) -> None:
    v = Validation(tok, ValidLimits(max_input_tokens=8, max_total_tokens=16, max_best_of=1), workers=1)
    try:
        assert err(v, req(best_of=2, do_sample=True)) == "`best_of` != 1 is not allowed for this endpoint"
        assert validate(v, req(best_of=1)).best_of == 1
    finally:
        v.close()


def test_limits_are_configurable(tok: Tokenizer) -> None:
    v = Validation(tok, ValidLimits(10, 20, max_best_of=4, max_stop_sequences=1, max_top_n_tokens=2))
    try:
        assert err(v, req(stop=["a", "b"])) == "`stop` supports up to 1 stop sequences. Given: 2"
        assert err(v, req(top_n_tokens=3)) == "`top_n_tokens` must be >= 0 and <= 2. Given: 3"
        assert err(v, req(best_of=5, do_sample=True)) == "`best_of` must be > 0 and <= 4. Given: 5"
        assert err(v, req(truncate=11)) == "`truncate` must be strictly positive and less than 10. Given: 11"
    finally:
        v.close()
    with pytest.raises(ValueError):
        ValidLimits(max_input_tokens=20, max_total_tokens=20)


def test_empty_inputs(val: Validation) -> None:
    assert err(val, req("")) == "`inputs` cannot be empty"


def test_input_too_long(val: Validation, tok: Tokenizer) -> None:
    text = "hello " * 60
    n = n_tokens(tok, text)
    assert MAX_INPUT < n
    # with max_new_tokens absent the fill is max(total - n, 0), so the total check fires first when n > total
    assert n > MAX_TOTAL
    assert err(val, req(text)) == (
        f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}. Given: {n} `inputs` tokens and 0 "
        "`max_new_tokens`"
    )
    text = "hello " * 34
    n = n_tokens(tok, text)
    assert MAX_INPUT < n < MAX_TOTAL
    too_long = f"`inputs` must have less than {MAX_INPUT} tokens. Given: {n}"
    assert err(val, req(text, max_new_tokens=1)) == too_long
    # absent max_new_tokens fills to max_total, so only the input bound can fail
    assert err(val, req(text)) == too_long


def test_total_tokens(val: Validation, tok: Tokenizer) -> None:
    n = n_tokens(tok, "Hello world")
    m = MAX_TOTAL - n + 1
    assert err(val, req(max_new_tokens=m)) == (
        f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}. Given: {n} `inputs` tokens and {m} "
        "`max_new_tokens`"
    )
    assert validate(val, req(max_new_tokens=m - 1)).sampling.max_new_tokens == m - 1


def test_max_input_checked_after_truncation(val: Validation, tok: Tokenizer) -> None:
    text = "hello " * 34
    assert n_tokens(tok, text) > MAX_INPUT
    r = validate(val, req(text, truncate=MAX_INPUT, max_new_tokens=4))
    assert r.input_length == MAX_INPUT == len(r.input_ids)
    # the total bound uses the truncated length too
    assert err(val, req(text, truncate=MAX_INPUT, max_new_tokens=MAX_TOTAL - MAX_INPUT + 1)).startswith(
        f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}. Given: {MAX_INPUT} `inputs` tokens"
    )


# --- TGI's order -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "inputs", "stream", "first"),
    [
        # route-level stream checks come before everything
        ({"best_of": 2, "decoder_input_details": True, "temperature": 0}, "x", True, "`best_of` != 1"),
        ({"decoder_input_details": True, "temperature": 0}, "x", True, "`decoder_input_details`"),
        # non-stream: best_of bound before the sampling rule
        ({"best_of": 3}, "x", False, "`best_of` must be > 0"),
        ({"best_of": 2, "temperature": 0}, "x", False, "`temperature`"),  # temperature given = sampling
        ({"best_of": 2, "repetition_penalty": 0}, "x", False, "you must use sampling"),
        ({"temperature": 0, "repetition_penalty": 0}, "x", False, "`temperature`"),
        ({"repetition_penalty": 0, "frequency_penalty": 3}, "x", False, "`repetition_penalty`"),
        ({"frequency_penalty": 3, "top_p": 2}, "x", False, "`frequency_penalty`"),
        ({"top_p": 2, "typical_p": 2}, "x", False, "`top_p`"),
        ({"typical_p": 2, "top_k": 0}, "x", False, "`typical_p`"),
        ({"top_k": 0, "max_new_tokens": 0}, "x", False, "`top_k`"),
        ({"max_new_tokens": 0, "stop": list("abcde")}, "x", False, "`max_new_tokens`"),
        ({"stop": list("abcde"), "best_of": 2, "do_sample": True, "seed": 3}, "x", False, "`stop`"),
        ({"best_of": 2, "do_sample": True, "seed": 3, "top_n_tokens": 9}, "x", False, "`seed`"),
        ({"top_n_tokens": 9}, "", False, "`top_n_tokens`"),
        ({"truncate": 0}, "", False, "`inputs` cannot be empty"),
        ({"truncate": 0, "max_new_tokens": 10**6}, "x", False, "`truncate`"),
        (
            {"max_new_tokens": 10**6, "grammar": {"type": "regex", "value": "("}},
            "x",
            False,
            "`inputs` tokens",
        ),
    ],
)
def test_order(val: Validation, params: dict, inputs: str, stream: bool, first: str) -> None:
    assert err(val, req(inputs, **params), stream).startswith(first)


# --- defaults and the engine mapping -----------------------------------------------------------


def test_max_new_tokens_fills_to_max_total(val: Validation, tok: Tokenizer) -> None:
    r = validate(val, req("Hello world"))
    n = n_tokens(tok, "Hello world")
    assert r.input_length == n and r.input_ids == tok.encode("Hello world")
    assert r.sampling.max_new_tokens == MAX_TOTAL - n
    assert validate(val, req(max_new_tokens=7)).sampling.max_new_tokens == 7


@pytest.mark.parametrize(
    ("params", "samples"),
    [
        ({}, False),
        ({"do_sample": True}, True),
        ({"do_sample": False, "temperature": 0.7}, True),  # a warper makes TGI sample anyway
        ({"do_sample": False, "temperature": 1.0}, False),  # temperature 1 warps nothing: greedy
        ({"top_k": 10}, True),
        ({"top_p": 0.9}, True),
        ({"typical_p": 0.9}, True),
        ({"repetition_penalty": 1.2, "frequency_penalty": 0.5}, False),  # penalties are not warpers
        ({"do_sample": True, "temperature": 1.0}, True),
    ],
)
def test_do_sample_semantics(val: Validation, params: dict, samples: bool) -> None:
    s = validate(val, req(**params)).sampling
    assert s.sampling is samples
    if samples:
        assert isinstance(s.seed, int)  # drawn so it can be echoed in details


def test_sampling_params_mapping(val: Validation) -> None:
    r = validate(
        val,
        req(
            temperature=0.5,
            top_k=7,
            top_p=0.8,
            typical_p=0.95,
            repetition_penalty=1.3,
            frequency_penalty=-0.5,
            seed=1234,
            stop=["\n\n", "END"],
            max_new_tokens=9,
            top_n_tokens=3,
            ignore_eos_token=True,
            decoder_input_details=True,
            details=True,
            return_full_text=True,
            watermark=True,
        ),
    )
    s = r.sampling
    assert (s.temperature, s.top_k, s.top_p, s.typical_p) == (0.5, 7, 0.8, 0.95)
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (1.3, -0.5, 0.0)
    assert s.seed == 1234 and s.max_new_tokens == 9 and s.top_n_tokens == 3
    assert s.stop == ["\n\n", "END"] and s.include_stop_str_in_output is True  # TGI keeps the stop text
    assert s.ignore_eos is True and s.prompt_logprobs is True
    assert r.details and r.decoder_input_details and r.return_full_text and r.watermark
    assert r.stream is False and r.best_of == 1 and r.inputs == "Hello world" and r.truncate is None
    d = validate(val, req()).sampling
    assert (d.temperature, d.top_k, d.top_p, d.typical_p, d.repetition_penalty, d.frequency_penalty) == (
        1.0,
        0,
        1.0,
        1.0,
        1.0,
        0.0,
    )
    assert d.stop == [] and d.ignore_eos is False and d.top_n_tokens == 0 and d.prompt_logprobs is False
    r = validate(val, req())
    assert not (r.details or r.decoder_input_details or r.return_full_text or r.watermark)


def test_seed_kept_when_given(val: Validation) -> None:
    assert validate(val, req(do_sample=True, seed=0)).sampling.seed == 0
    assert validate(val, req(do_sample=True, seed=2**64 - 1)).sampling.seed == 2**64 - 1


def test_empty_stop_string_refused(val: Validation) -> None:
    assert err(val, req(stop=[""])) == "`stop` must be a list of non-empty strings"


def test_truncate_keeps_last_tokens(val: Validation, tok: Tokenizer) -> None:
    text = "one two three four five six seven eight nine ten"
    ids = tok.encode(text)
    r = validate(val, req(text, truncate=4, max_new_tokens=2))
    assert r.input_ids == ids[-4:] and r.input_length == 4
    assert r.inputs == text and r.truncate == 4  # the original text stays
    r = validate(val, req("hi", truncate=MAX_INPUT, max_new_tokens=2))  # truncate longer than input
    assert r.input_ids == tok.encode("hi")


def test_add_special_tokens_false(tok: Tokenizer) -> None:
    # the tokenizers here add no BOS, so check the flag reaches the tokenizer through a stub
    seen = []

    class Stub:
        def encode(self, text, add_special_tokens=True):
            seen.append(add_special_tokens)
            return [1, 2, 3]

    v = Validation(Stub(), ValidLimits(8, 16), workers=1)
    try:
        r = validate(v, GenerateRequest(inputs="x", add_special_tokens=False))
        assert r.input_ids == [1, 2, 3] and seen == [False]
    finally:
        v.close()


def test_tokenizer_error_is_validation_error() -> None:
    class Broken:
        def encode(self, text, add_special_tokens=True):
            raise RuntimeError("boom")

    v = Validation(Broken(), ValidLimits(8, 16), workers=1)
    try:
        assert err(v, req("x")) == "tokenizer error boom"
    finally:
        v.close()


# --- grammar -----------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}}


@pytest.mark.parametrize(
    ("grammar", "field", "expected"),
    [
        ({"type": "json", "value": SCHEMA}, "json_schema", SCHEMA),
        ({"type": "json", "value": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
        ({"type": "json_object", "value": SCHEMA}, "json_schema", SCHEMA),
        (
            {"type": "json", "value": {"type": "array"}},
            "json_schema",
            {"type": "array"},
        ),  # no `properties` needed
        ({"type": "json_schema", "value": {"name": "person", "schema": SCHEMA}}, "json_schema", SCHEMA),
        ({"type": "regex", "value": r"\d{3}-[a-z]+"}, "regex", r"\d{3}-[a-z]+"),
        ({"type": "choice", "value": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"type": "grammar", "value": 'root ::= "a" | "b"'}, "grammar", 'root ::= "a" | "b"'),
    ],
)
def test_valid_grammar_constrains_the_engine_request(
    val: Validation, grammar: dict, field: str, expected
) -> None:
    sampling = validate(val, req(grammar=grammar)).sampling
    assert getattr(sampling, field) == expected


@pytest.mark.parametrize(
    ("grammar", "detail"),
    [
        ({"type": "json", "value": "{not json"}, ""),
        ({"type": "json", "value": {"type": "nonsense"}}, "nonsense"),
        ({"type": "json", "value": [1, 2]}, "must be an object"),
        ({"type": "json", "value": None}, ""),
        ({"type": "json_schema", "value": SCHEMA}, "`schema`"),
        ({"type": "regex", "value": "(unclosed"}, "regex"),
        ({"type": "regex", "value": 5}, "string"),
        ({"type": "choice", "value": []}, "non-empty"),
        ({"type": "grammar", "value": "root ::= undefined_rule"}, "undefined_rule"),
    ],
)
def test_invalid_grammar(val: Validation, grammar: dict, detail: str) -> None:
    msg = err(val, req(grammar=grammar))
    assert msg.startswith("grammar is not valid: ") and detail in msg


# --- async and /tokenize -----------------------------------------------------------------------


def test_async_validate(tok: Tokenizer) -> None:
    v = Validation(tok, ValidLimits(MAX_INPUT, MAX_TOTAL), workers=2)

    async def main() -> list:
        good = [v.validate(req(f"request number {i}", max_new_tokens=3), stream=False) for i in range(8)]
        out = await asyncio.gather(*good)
        with pytest.raises(InvalidRequest, match="`top_k` must be strictly positive"):
            await v.validate(req(top_k=0), stream=False)
        with pytest.raises(InvalidRequest, match="when streaming"):
            await v.validate(req(decoder_input_details=True), stream=True)
        return out

    try:
        out = asyncio.run(main())
        assert [r.input_ids for r in out] == [tok.encode(f"request number {i}") for i in range(8)]
    finally:
        v.close()


def test_async_matches_sync(val: Validation) -> None:
    r = req("Deterministic check", max_new_tokens=5, seed=3, do_sample=True)
    a = asyncio.run(val.validate(r, stream=True))
    b = validate(val, r, stream=True)
    assert a == b


def test_tokenize(val: Validation, tok: Tokenizer) -> None:
    text = "héllo wörld ☃ x"
    toks = tokenize(val, text)
    assert [t["id"] for t in toks] == tok.encode(text)
    assert all(set(t) == {"id", "text", "start", "stop"} for t in toks)
    raw = text.encode("utf-8")
    for t in toks:  # byte offsets into the UTF-8 input, as TGI (Rust) reports them
        assert raw[t["start"] : t["stop"]].decode("utf-8") == t["text"]
    assert toks[0] == {"id": toks[0]["id"], "text": "h", "start": 0, "stop": 1}
    assert toks[1]["text"] == "é" and (toks[1]["start"], toks[1]["stop"]) == (1, 3)
    assert asyncio.run(val.validate_tokenize(text)) == toks
    assert tokenize(val, "") == []


def test_compat_request_validates(val: Validation, tok: Tokenizer) -> None:
    c = CompatGenerateRequest.model_validate(
        {"inputs": "Hello", "parameters": {"max_new_tokens": 2}, "stream": True}
    )
    r = validate(val, c, stream=c.stream)
    assert r.stream and r.input_ids == tok.encode("Hello")
    assert validate(val, c.to_generate_request(), stream=True).input_ids == r.input_ids


def test_floats_are_checked_as_the_engine_reads_them(val: Validation) -> None:
    """1e-320 passes `> 0` in Python but is 0.0 in the engine (float32 sampling, FTZ/DAZ kernels): it
    must fail here like 0 does, not crash the engine; past float32's range is refused."""
    assert "`repetition_penalty` must be strictly positive" in err(val, req(repetition_penalty=1e-320))
    assert "`top_p` must be > 0.0" in err(val, req(top_p=1e-40))
    assert "`temperature` must be strictly positive" in err(val, req(temperature=1e-39))  # 0.0 in float32
    with pytest.raises(pydantic.ValidationError, match="out of range for a 32-bit float"):
        req(temperature=1e39)
    assert validate(val, req(top_p=0.8)).sampling.top_p == 0.8  # in range: the value as sent


def test_lone_surrogates_in_inputs_are_refused(val: Validation) -> None:
    assert "`inputs` must be valid Unicode" in err(val, req(inputs="a\ud800b"))
