"""Request validation for both APIs: TGI's rules and messages, in TGI's order, and tokenization.

Runs in the API process, which never imports torch: stdlib, pydantic v2, `pytgi.core.tokenizer` and
`pytgi.core.sampling_params` only. The request types are in `pytgi.api.frontend.bodies`; OpenAI's routes
convert their bodies into a `GenerateInput`, so its requests meet the same rules.

The rules, their messages and their order follow TGI's router (`api/frontend/src/validation.rs`,
`Validation::validate` and `validate_input`, plus the checks `api/frontend/src/server.rs` and
`api/frontend/src/infer` make before it):

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
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pytgi.api.frontend.bodies import (
    CompatGenerateRequest,
    GenerateInput,
    GenerateParameters,
    GenerateRequest,
    GrammarType,
    ValidLimits,
    ValidRequest,
)
from pytgi.core import grammar as structured
from pytgi.core.errors import InvalidRequest
from pytgi.core.image_geometry import added_positions, image_places, wrap_images
from pytgi.core.image_layouts import ImageLayout
from pytgi.core.sampling_params import SamplingParams, check, check_logit_bias, check_prompt, check_token_ids

T = TypeVar("T")

__all__ = [
    "CompatGenerateRequest",
    "GenerateInput",
    "GenerateParameters",
    "GenerateRequest",
    "GrammarType",
    "ValidLimits",
    "ValidRequest",
    "Validation",
]


@dataclass(slots=True)
class _Checked:
    """What the checks before tokenization resolved."""

    input: GenerateInput
    best_of: int
    truncate: int | None


_Request = GenerateRequest | CompatGenerateRequest | GenerateInput


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


def _is_unicode(text: str) -> bool:
    """False for a lone surrogate (JSON's "\\ud800" decodes to one): no tokenizer or wire format takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Validation:
    """TGI's validation: parameter rules, tokenization in a thread pool, the engine's SamplingParams.
    Every API's request reaches it as a `GenerateInput`, so each rule exists once."""

    def __init__(
        self,
        tokenizer: Any,
        limits: ValidLimits,
        workers: int = 2,
        vocab_size: int | None = None,
        adapters: Callable[[], Collection[str]] = tuple,
        image_layout: ImageLayout | None = None,
        refusal: str | None = None,
    ):
        """adapters: the LoRA adapters' names that `adapter_id` may take now (asked at each request: the
        engine's last snapshot); image_layout: a vision
        model's image token, and how many positions the engine expands each one to; refusal: why every
        generation is refused (a model that does not generate: an embedding model)."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.tokenizer = tokenizer
        self.limits = limits
        self.adapters = adapters
        self.image_layout = image_layout
        self.refusal = refusal
        self.workers = workers
        self.vocab_size = vocab_size or getattr(tokenizer, "vocab_size", None)  # bounds token-id prompts
        # `tokenizers` releases the GIL while encoding, so threads tokenize in parallel off the event loop.
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pytgi-validation")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- checks ------------------------------------------------------------------------------

    def _check_parameters(self, gi: GenerateInput) -> _Checked:
        lim = self.limits
        p = gi.parameters

        # 0. what TGI's routes check before Validation::validate
        if gi.stream:
            if p.best_of is not None and p.best_of != 1:
                raise InvalidRequest("`best_of` != 1 is not supported when streaming tokens", "best_of")
            if p.decoder_input_details:
                raise InvalidRequest(
                    "`decoder_input_details` == true is not supported when streaming tokens",
                    "decoder_input_details",
                )
        elif p.best_of is not None and p.best_of != 1:
            # TGI only calls validate_best_of for best_of > 1 (0 slips through as a single sequence);
            # pytgi refuses 0 here too, as the message ("must be > 0") says.
            if lim.max_best_of == 1:
                raise InvalidRequest("`best_of` != 1 is not allowed for this endpoint", "best_of")
            if p.best_of == 0 or p.best_of > lim.max_best_of:
                raise InvalidRequest(
                    f"`best_of` must be > 0 and <= {lim.max_best_of}. Given: {p.best_of}", "best_of"
                )
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
            raise InvalidRequest("you must use sampling when `best_of` is > 1", "best_of")
        # 2..7
        if p.temperature is not None and p.temperature <= 0.0:
            raise InvalidRequest("`temperature` must be strictly positive", "temperature")
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            check(name, getattr(p, name))
        if p.top_p is not None and not 0.0 < p.top_p < 1.0:
            raise InvalidRequest("`top_p` must be > 0.0 and < 1.0", "top_p")
        if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
            raise InvalidRequest("`typical_p` must be > 0.0 and < 1.0", "typical_p")
        if p.top_k is not None and p.top_k <= 0:
            raise InvalidRequest("`top_k` must be strictly positive", "top_k")
        # 8
        check("max_new_tokens", p.max_new_tokens)
        # 9
        if len(p.stop) > lim.max_stop_sequences:
            raise InvalidRequest(
                f"`stop` supports up to {lim.max_stop_sequences} stop sequences. Given: {len(p.stop)}", "stop"
            )
        check("stop", p.stop)  # pytgi: an empty stop string would match at once
        if not all(_is_unicode(s) for s in p.stop):
            raise InvalidRequest("`stop` sequences must be valid Unicode (no lone surrogates)", "stop")
        # 10
        if p.seed is not None and best_of > 1:
            raise InvalidRequest("`seed` must not be set when `best_of` > 1", "seed")
        # 11
        max_top_n = lim.max_top_n_tokens if gi.max_top_n_tokens is None else gi.max_top_n_tokens
        if p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= max_top_n:
            raise InvalidRequest(
                f"`top_n_tokens` must be >= 0 and <= {max_top_n}. Given: {p.top_n_tokens}", "top_n_tokens"
            )
        check_logit_bias(gi.logit_bias, self.vocab_size)  # OpenAI's knobs (their ranges: SamplingParams)
        # 12
        check("inputs", gi.inputs)
        if isinstance(gi.inputs, str) and not _is_unicode(gi.inputs):
            raise InvalidRequest("`inputs` must be valid Unicode (no lone surrogates)", "inputs")
        if isinstance(gi.inputs, list):
            check_token_ids(gi.inputs, self.vocab_size)
        # 13
        if p.truncate is not None and (p.truncate == 0 or p.truncate > lim.max_input_tokens):
            raise InvalidRequest(
                f"`truncate` must be strictly positive and less than {lim.max_input_tokens}. "
                f"Given: {p.truncate}",
                "truncate",
            )
        if p.adapter_id is not None and p.adapter_id not in (adapters := self.adapters()):
            served = ", ".join(f"`{a}`" for a in sorted(adapters)) or "none"
            raise InvalidRequest(
                f"`adapter_id` `{p.adapter_id}` is not a LoRA adapter of this server (adapters: {served})",
                "adapter_id",
            )
        return _Checked(input=gi, best_of=best_of, truncate=p.truncate)

    def _encode(self, inputs: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(inputs, list):
            return list(inputs)
        layout = self.image_layout
        if layout is not None and layout.wrap:  # as the model's processor tokenizes it
            inputs = wrap_images(inputs, layout, self.tokenizer.id_to_piece(layout.token))
        try:
            return list(self.tokenizer.encode(inputs, add_special_tokens=add_special_tokens))
        except Exception as e:
            raise InvalidRequest(f"tokenizer error {e}", "inputs") from e

    def _image_positions(self, ids: list[int], images: list[bytes]) -> int:
        """The positions the engine adds to the prompt when it expands its image tokens (each image's
        token must be in the prompt, truncation included)."""
        layout = self.image_layout
        image_places(ids, None if layout is None else layout.token, len(images), "inputs")
        return added_positions(layout, images) if layout is not None and images else 0

    def _finish(self, c: _Checked, ids: list[int]) -> ValidRequest:
        lim, gi = self.limits, c.input
        p = gi.parameters
        # 14. lengths, after truncation
        input_length = min(len(ids), c.truncate) if c.truncate is not None else len(ids)
        if p.max_new_tokens is not None:
            max_new_tokens = p.max_new_tokens
        else:
            # TGI >= 3: an absent max_new_tokens means "up to max_total_tokens". TGI schedules such a
            # request in slices of min(that, 1024) tokens and re-queues it until the whole budget is used,
            # so the effective limit is max_total_tokens - input_length, which is what the engine gets.
            max_new_tokens = max(lim.max_total_tokens - input_length, 0)
        input_ids = ids[len(ids) - input_length :]  # truncation keeps the last tokens
        extra = self._image_positions(input_ids, gi.images)
        if p.max_new_tokens is None:
            max_new_tokens = max(max_new_tokens - extra, 0)
        # token ids: checked above (a tokenizer's are in range)
        check_prompt(input_ids, max_new_tokens, lim.max_input_tokens, lim.max_total_tokens, None, extra)

        constraint = {} if p.grammar is None else _constraint(p.grammar)  # 15. grammar

        # TGI's engine samples when do_sample or a warper is active; SamplingParams gets that answer as an
        # explicit do_sample, with temperature kept as given (it never turns a request greedy: > 0 here).
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if p.temperature is None else p.temperature,
            top_k=0 if p.top_k is None else p.top_k,
            top_p=1.0 if p.top_p is None else p.top_p,
            typical_p=1.0 if p.typical_p is None else p.typical_p,
            min_p=0.0 if gi.min_p is None else gi.min_p,
            reasoning=gi.reasoning,
            skip_special_tokens=gi.skip_special_tokens,
            adapter=p.adapter_id,
            logit_bias=gi.logit_bias,
            repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
            frequency_penalty=0.0 if p.frequency_penalty is None else p.frequency_penalty,
            presence_penalty=0.0 if p.presence_penalty is None else p.presence_penalty,
            do_sample=_tgi_samples(p),
            seed=p.seed,  # None + sampling -> SamplingParams draws one, echoed in details
            stop=list(p.stop),
            include_stop_str_in_output=gi.include_stop_str_in_output,
            ignore_eos=p.ignore_eos_token,
            top_n_tokens=0 if p.top_n_tokens is None else p.top_n_tokens,
            prompt_logprobs=p.decoder_input_details,
            watermark=p.watermark,
            **constraint,
        )
        if constraint:
            _checked_grammar(sampling)
        text = gi.inputs if isinstance(gi.inputs, str) else self.tokenizer.decode(gi.inputs, False)
        return ValidRequest(
            input_ids=input_ids,
            input_length=input_length + extra,  # the prompt's positions, images expanded
            sampling=sampling,
            best_of=c.best_of,
            details=p.details,
            decoder_input_details=p.decoder_input_details,
            return_full_text=bool(p.return_full_text),
            watermark=p.watermark,
            stream=gi.stream,
            inputs=text,
            truncate=c.truncate,
            images=gi.images,
            cache_key=gi.cache_key,
        )

    # --- public ------------------------------------------------------------------------------

    async def validate(self, req: _Request, stream: bool = False) -> ValidRequest:
        """All of TGI's checks in TGI's order; tokenization runs in the worker pool. `stream` applies
        to a TGI body (a `GenerateInput` says it itself)."""
        if self.refusal is not None:
            raise InvalidRequest(self.refusal, "model", "model_not_supported")
        checked = self._check_parameters(_as_input(req, stream))
        gi = checked.input
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._pool, self._encode, gi.inputs, gi.add_special_tokens)
        return await loop.run_in_executor(
            self._pool, self._finish, checked, ids
        )  # a grammar check may take ms

    def _tokenize(self, inputs: str, add_special_tokens: bool) -> list[dict]:
        try:
            ids, offsets = self.tokenizer.encode_with_offsets(inputs, add_special_tokens=add_special_tokens)
        except Exception as e:
            raise InvalidRequest(f"tokenizer error {e}") from e
        out = []
        for tid, (cs, ce) in zip(ids, offsets):
            # Python's `tokenizers` reports character offsets; TGI (Rust) reports byte offsets of the
            # UTF-8 input, so convert. `text` is the slice of the input the token covers.
            out.append(
                {
                    "id": tid,
                    "text": inputs[cs:ce],
                    "start": len(inputs[:cs].encode("utf-8")),
                    "stop": len(inputs[:ce].encode("utf-8")),
                }
            )
        return out

    async def in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer threads (an embedding request's inputs)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def validate_tokenize(self, inputs: str, add_special_tokens: bool = True) -> list[dict]:
        """/tokenize: `[{id, text, start, stop}]` (TGI does no parameter checks on this route)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._tokenize, inputs, add_special_tokens)


def _as_input(req: _Request, stream: bool) -> GenerateInput:
    return req if isinstance(req, GenerateInput) else GenerateInput.from_body(req, stream)


def _constraint(grammar: GrammarType) -> dict[str, Any]:
    """The `SamplingParams` fields of a TGI grammar (plus pytgi's `choice` and `grammar` types), or
    "grammar is not valid: ..." for a malformed one. llguidance judges the rest (`pytgi.core.grammar`)."""

    def invalid(msg: str) -> InvalidRequest:
        return InvalidRequest(f"grammar is not valid: {msg}", "grammar")

    value = grammar.value
    if grammar.type in ("regex", "grammar"):
        if not isinstance(value, str):
            raise invalid(f"a {grammar.type} grammar's `value` must be a string")
        return {grammar.type: value}
    if grammar.type == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid("a choice grammar's `value` must be a non-empty list of non-empty strings")
        return {"choice": value}
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
    return {"json_schema": value}


def _checked_grammar(sampling: SamplingParams) -> None:
    try:
        structured.check(sampling)
    except InvalidRequest as e:
        raise InvalidRequest(f"grammar is not valid: {e}", "grammar") from None
