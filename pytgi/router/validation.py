"""Request validation for TGI's routes: the body's models, TGI's rules and messages, tokenization.

Runs in the API process, which never imports torch: stdlib, pydantic v2, `pytgi.tokenizer` and
`pytgi.sampling_params` only.

The rules, their messages and their order follow TGI's router (`router/src/validation.rs`,
`Validation::validate` and `validate_input`, plus the checks `router/src/server.rs` and
`router/src/infer` make before it):

 0. route level, before `validate`:
    streaming:     `best_of` != 1  -> BestOfStream, then `decoder_input_details` -> PrefillDetailsStream
    not streaming: `best_of` > 1   -> `validate_best_of` (BestOfDisabled when max_best_of == 1, BestOf)
 1. `best_of` > 1 without sampling  (sampling here = do_sample or temperature/top_k/top_p/typical_p *given*)
 2. temperature  3. repetition_penalty  4. frequency_penalty  5. top_p  6. typical_p  7. top_k
 8. max_new_tokens == 0  9. number of stop sequences  10. seed with best_of > 1  11. top_n_tokens
12. empty inputs  13. truncate
14. tokenize; input_length = min(len, truncate); inputs + max_new_tokens <= max_total_tokens;
    then input_length <= max_input_tokens (so the input bound is checked after truncation)
15. grammar
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pytgi.sampling_params import SamplingParams

__all__ = [
    "GenerateParameters",
    "GenerateRequest",
    "CompatGenerateRequest",
    "GrammarType",
    "ValidationError",
    "ValidLimits",
    "ValidRequest",
    "Validation",
    "GRAMMAR_UNSUPPORTED",
]

# Refusal for a well-formed grammar: the engine has no constrained decoding yet.
GRAMMAR_UNSUPPORTED = "grammar is not supported yet: this server has no constrained decoding"

# --- JSON types as TGI's serde structs declare them -------------------------------------------
# Strict: serde_json rejects "10" or 10.5 for an integer and "true" or 1 for a bool, so these do too
# (pydantic's lax mode would coerce them). A float field accepts a JSON integer, like serde's f32.
_U32 = Annotated[int, Field(strict=True, ge=0, le=2**32 - 1)]
_U64 = Annotated[int, Field(strict=True, ge=0, le=2**64 - 1)]
_USIZE = _U64
_I32 = Annotated[int, Field(strict=True, ge=-(2**31), le=2**31 - 1)]
_F32 = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_Bool = Annotated[bool, Field(strict=True)]
_Str = Annotated[str, Field(strict=True)]


class _Body(BaseModel):
    # Unknown fields are IGNORED, not rejected: TGI's request structs are plain serde derives without
    # `#[serde(deny_unknown_fields)]`, so TGI drops fields it does not know. Clients rely on it (e.g. a
    # `stream` key posted to /generate, fields of newer TGI versions). Wrong types still fail.
    model_config = ConfigDict(extra="ignore")


class GrammarType(_Body):
    """`{type, value}`: json (a JSON schema, or a string holding one; `json_object` is TGI's alias),
    json_schema (`{name?, schema}`), regex (a pattern)."""

    type: Literal["json", "json_object", "json_schema", "regex"]
    value: Any = None


class GenerateParameters(_Body):
    """TGI's `GenerateParameters`, with TGI's defaults (None = not given)."""

    best_of: Optional[_USIZE] = None
    temperature: Optional[_F32] = None
    repetition_penalty: Optional[_F32] = None
    frequency_penalty: Optional[_F32] = None
    top_k: Optional[_I32] = None
    top_p: Optional[_F32] = None
    typical_p: Optional[_F32] = None
    do_sample: _Bool = False
    # TGI >= 3: absent (or null) fills up to max_total_tokens; see Validation.
    max_new_tokens: Optional[_U32] = None
    return_full_text: Optional[_Bool] = None
    stop: list[_Str] = Field(default_factory=list)
    truncate: Optional[_USIZE] = None
    watermark: _Bool = False
    details: _Bool = False
    decoder_input_details: _Bool = False
    seed: Optional[_U64] = None
    top_n_tokens: Optional[_U32] = None
    grammar: Optional[GrammarType] = None
    adapter_id: Optional[_Str] = None  # accepted and ignored (no LoRA adapters here)
    ignore_eos_token: _Bool = False  # pytgi: keep generating past EOS (benchmarks)


class GenerateRequest(_Body):
    """Body of /generate, /generate_stream and /tokenize."""

    inputs: _Str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    add_special_tokens: _Bool = True  # TGI's field (default true)


class CompatGenerateRequest(_Body):
    """Body of `POST /` and /invocations: a GenerateRequest plus `stream`."""

    inputs: _Str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: _Bool = False

    def to_generate_request(self) -> GenerateRequest:
        return GenerateRequest(inputs=self.inputs, parameters=self.parameters)


class ValidationError(Exception):
    """A request TGI answers with 422; `message` lacks the "Input validation error: " prefix."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass
class ValidLimits:
    """The server's bounds (TGI's launcher flags). Required fields first, so it also builds positionally."""

    max_input_tokens: int
    max_total_tokens: int
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5

    def __post_init__(self) -> None:
        # TGI's launcher refuses these too; max_input < max_total guarantees a default max_new_tokens >= 1.
        if self.max_input_tokens < 1:
            raise ValueError(f"max_input_tokens must be >= 1, got {self.max_input_tokens}")
        if self.max_total_tokens <= self.max_input_tokens:
            raise ValueError(
                f"max_input_tokens ({self.max_input_tokens}) must be < "
                f"max_total_tokens ({self.max_total_tokens})"
            )
        if self.max_best_of < 1:
            raise ValueError(f"max_best_of must be >= 1, got {self.max_best_of}")
        if self.max_stop_sequences < 0 or self.max_top_n_tokens < 0:
            raise ValueError("max_stop_sequences and max_top_n_tokens must be >= 0")


@dataclass
class ValidRequest:
    input_ids: list[int]  # after truncation
    input_length: int
    sampling: SamplingParams  # engine parameters (seed drawn when sampling and none given)
    best_of: int
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    watermark: bool
    stream: bool
    inputs: str  # the original text (what return_full_text prepends)
    truncate: Optional[int]  # as given


@dataclass
class _Checked:
    """What the checks before tokenization resolved."""

    inputs: str
    add_special_tokens: bool
    params: GenerateParameters
    best_of: int
    truncate: Optional[int]
    stream: bool


_Request = Union[GenerateRequest, CompatGenerateRequest]


def _tgi_samples(p: GenerateParameters) -> bool:
    """TGI's engine rule (NextTokenChooser / HeterogeneousNextTokenChooser): sample when do_sample or any
    warper is active, i.e. temperature != 1, top_k != 0, top_p < 1 or typical_p < 1 (values as resolved)."""
    return (
        p.do_sample
        or (p.temperature is not None and p.temperature != 1.0)
        or (p.top_k is not None and p.top_k != 0)
        or (p.top_p is not None and p.top_p < 1.0)
        or (p.typical_p is not None and p.typical_p < 1.0)
    )


class Validation:
    """TGI's validation: parameter rules, tokenization in a thread pool, the engine's SamplingParams."""

    def __init__(self, tokenizer: Any, limits: ValidLimits, workers: int = 2):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.tokenizer = tokenizer
        self.limits = limits
        self.workers = workers
        # `tokenizers` releases the GIL while encoding, so threads tokenize in parallel off the event loop.
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pytgi-validation")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- checks ------------------------------------------------------------------------------

    def _check_parameters(self, req: _Request, stream: bool) -> _Checked:
        lim = self.limits
        p = req.parameters

        # 0. what TGI's routes check before Validation::validate
        if stream:
            if p.best_of is not None and p.best_of != 1:
                raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
            if p.decoder_input_details:
                raise ValidationError(
                    "`decoder_input_details` == true is not supported when streaming tokens")
        elif p.best_of is not None and p.best_of != 1:
            # TGI only calls validate_best_of for best_of > 1 (0 slips through as a single sequence);
            # pytgi refuses 0 here too, as the message ("must be > 0") says.
            if lim.max_best_of == 1:
                raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
            if p.best_of == 0 or p.best_of > lim.max_best_of:
                raise ValidationError(f"`best_of` must be > 0 and <= {lim.max_best_of}. Given: {p.best_of}")
        best_of = 1 if p.best_of is None else p.best_of

        # 1. TGI's router counts a *given* warper as sampling here (even temperature=1.0)
        router_sampling = (
            p.do_sample
            or p.temperature is not None
            or p.top_k is not None
            or p.top_p is not None
            or p.typical_p is not None
        )
        if best_of > 1 and not router_sampling:
            raise ValidationError("you must use sampling when `best_of` is > 1")
        # 2..7
        if p.temperature is not None and p.temperature <= 0.0:
            raise ValidationError("`temperature` must be strictly positive")
        if p.repetition_penalty is not None and p.repetition_penalty <= 0.0:
            raise ValidationError("`repetition_penalty` must be strictly positive")
        if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
            raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
        if p.top_p is not None and not 0.0 < p.top_p < 1.0:
            raise ValidationError("`top_p` must be > 0.0 and < 1.0")
        if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
            raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
        if p.top_k is not None and p.top_k <= 0:
            raise ValidationError("`top_k` must be strictly positive")
        # 8
        if p.max_new_tokens == 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        # 9
        if len(p.stop) > lim.max_stop_sequences:
            raise ValidationError(
                f"`stop` supports up to {lim.max_stop_sequences} stop sequences. Given: {len(p.stop)}"
            )
        if any(s == "" for s in p.stop):
            # pytgi: an empty stop string would match at once (the engine refuses it too)
            raise ValidationError("`stop` must be a list of non-empty strings")
        # 10
        if p.seed is not None and best_of > 1:
            raise ValidationError("`seed` must not be set when `best_of` > 1")
        # 11
        if p.top_n_tokens is not None and p.top_n_tokens > lim.max_top_n_tokens:
            raise ValidationError(
                f"`top_n_tokens` must be >= 0 and <= {lim.max_top_n_tokens}. Given: {p.top_n_tokens}"
            )
        # 12
        if not req.inputs:
            raise ValidationError("`inputs` cannot be empty")
        # 13
        if p.truncate is not None and (p.truncate == 0 or p.truncate > lim.max_input_tokens):
            raise ValidationError(
                f"`truncate` must be strictly positive and less than {lim.max_input_tokens}. "
                f"Given: {p.truncate}"
            )
        return _Checked(
            inputs=req.inputs,
            add_special_tokens=getattr(req, "add_special_tokens", True),
            params=p,
            best_of=best_of,
            truncate=p.truncate,
            stream=stream,
        )

    def _encode(self, inputs: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer.encode(inputs, add_special_tokens=add_special_tokens))
        except Exception as e:  # noqa: BLE001 - any tokenizer failure is the client's input
            raise ValidationError(f"tokenizer error {e}") from e

    def _finish(self, c: _Checked, ids: list[int]) -> ValidRequest:
        lim = self.limits
        p = c.params
        # 14. lengths, after truncation
        input_length = min(len(ids), c.truncate) if c.truncate is not None else len(ids)
        if p.max_new_tokens is not None:
            max_new_tokens = p.max_new_tokens
        else:
            # TGI >= 3: an absent max_new_tokens means "up to max_total_tokens". TGI schedules such a
            # request in slices of min(that, 1024) tokens and re-queues it until the whole budget is used,
            # so the effective limit is max_total_tokens - input_length, which is what the engine gets.
            max_new_tokens = max(lim.max_total_tokens - input_length, 0)
        if input_length + max_new_tokens > lim.max_total_tokens:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {lim.max_total_tokens}. "
                f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
            )
        if input_length > lim.max_input_tokens:
            raise ValidationError(
                f"`inputs` must have less than {lim.max_input_tokens} tokens. Given: {input_length}"
            )
        input_ids = ids[len(ids) - input_length:]  # truncation keeps the last tokens

        # 15. grammar
        if p.grammar is not None:
            _check_grammar(p.grammar)
            raise ValidationError(GRAMMAR_UNSUPPORTED)

        # TGI's engine samples when do_sample or a warper is active; SamplingParams gets that answer as an
        # explicit do_sample, with temperature kept as given (it never turns a request greedy: > 0 here).
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if p.temperature is None else p.temperature,
            top_k=0 if p.top_k is None else p.top_k,
            top_p=1.0 if p.top_p is None else p.top_p,
            typical_p=1.0 if p.typical_p is None else p.typical_p,
            repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
            frequency_penalty=0.0 if p.frequency_penalty is None else p.frequency_penalty,
            do_sample=_tgi_samples(p),
            seed=p.seed,  # None + sampling -> SamplingParams draws one, echoed in details
            stop=list(p.stop),
            include_stop_str_in_output=True,  # TGI keeps the stop text in generated_text
            ignore_eos=p.ignore_eos_token,
            top_n_tokens=0 if p.top_n_tokens is None else p.top_n_tokens,
            prompt_logprobs=p.decoder_input_details,
            watermark=p.watermark,
        )
        return ValidRequest(
            input_ids=input_ids,
            input_length=input_length,
            sampling=sampling,
            best_of=c.best_of,
            details=p.details,
            decoder_input_details=p.decoder_input_details,
            return_full_text=bool(p.return_full_text),
            watermark=p.watermark,
            stream=c.stream,
            inputs=c.inputs,
            truncate=c.truncate,
        )

    # --- public ------------------------------------------------------------------------------

    async def validate(self, req: _Request, stream: bool) -> ValidRequest:
        """All of TGI's checks in TGI's order; tokenization runs in the worker pool."""
        checked = self._check_parameters(req, stream)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._pool, self._encode, checked.inputs, checked.add_special_tokens)
        return self._finish(checked, ids)

    def validate_sync(self, req: _Request, stream: bool = False) -> ValidRequest:
        """`validate` without an event loop (tokenizes in the calling thread)."""
        checked = self._check_parameters(req, stream)
        return self._finish(checked, self._encode(checked.inputs, checked.add_special_tokens))

    def _tokenize(self, inputs: str, add_special_tokens: bool) -> list[dict]:
        # Offsets need the `tokenizers.Tokenizer` that pytgi.tokenizer.Tokenizer keeps as `_hf`
        # (private, read only); a bare `tokenizers.Tokenizer` works as well.
        hf = getattr(self.tokenizer, "_hf", self.tokenizer)
        try:
            enc = hf.encode(inputs, add_special_tokens=add_special_tokens)
        except Exception as e:  # noqa: BLE001
            raise ValidationError(f"tokenizer error {e}") from e
        out = []
        for tid, (cs, ce) in zip(enc.ids, enc.offsets):
            # Python's `tokenizers` reports character offsets; TGI (Rust) reports byte offsets of the
            # UTF-8 input, so convert. `text` is the slice of the input the token covers.
            out.append({
                "id": tid,
                "text": inputs[cs:ce],
                "start": len(inputs[:cs].encode("utf-8")),
                "stop": len(inputs[:ce].encode("utf-8")),
            })
        return out

    async def validate_tokenize(self, inputs: str, add_special_tokens: bool = True) -> list[dict]:
        """/tokenize: `[{id, text, start, stop}]` (TGI does no parameter checks on this route)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._tokenize, inputs, add_special_tokens)

    def validate_tokenize_sync(self, inputs: str, add_special_tokens: bool = True) -> list[dict]:
        return self._tokenize(inputs, add_special_tokens)


def _check_grammar(grammar: GrammarType) -> None:
    """Raise "grammar is not valid: ..." for a malformed grammar (TGI's checks, without a JSON-schema
    meta-validator: the schema must be an object with `properties`; a regex must compile)."""

    def invalid(msg: str) -> ValidationError:
        return ValidationError(f"grammar is not valid: {msg}")

    value = grammar.value
    if grammar.type == "regex":
        if not isinstance(value, str):
            raise invalid("a regex grammar's `value` must be a string")
        try:
            re.compile(value)
        except re.error as e:
            raise invalid(f"cannot compile regex: {e}") from None
        return
    if grammar.type == "json_schema":  # TGI's JsonSchemaConfig: {name?, schema}
        if not isinstance(value, dict) or "schema" not in value:
            raise invalid("a json_schema grammar's `value` must be an object with a `schema` field")
        value = value["schema"]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise invalid(str(e)) from None
    if not isinstance(value, dict):
        raise invalid("the JSON schema must be an object")
    if "properties" not in value:
        raise invalid("Grammar must have a 'properties' field")
