"""The router's request types: TGI's request bodies (which are also the parameters every API's request
is converted into), the router's `GenerateInput`, the server's limits and a validated `ValidRequest`.

Plain data, no torch: pydantic v2 and `pytgi.core.sampling_params` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pytgi.core.sampling_params import SamplingParams

F32_MAX, F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38  # largest, smallest normal


def as_f32(v: float) -> float:
    """A value a 32-bit float holds (TGI parses these fields as serde's f32): past its range is an
    error, and below its smallest normal is 0.0, as the engine sees it (sampling runs in float32, and
    the engine process's compiled kernels set FTZ/DAZ, so 1e-320 reads as 0.0 there): the rules are
    checked on the value the engine will use."""
    if abs(v) > F32_MAX:
        raise ValueError("number out of range for a 32-bit float")
    return 0.0 if abs(v) < F32_TINY else v


# --- JSON types as TGI's serde structs declare them -------------------------------------------
# Strict: serde_json rejects "10" or 10.5 for an integer and "true" or 1 for a bool, so these do too
# (pydantic's lax mode would coerce them). A float field accepts a JSON integer, like serde's f32.
U32 = Annotated[int, Field(strict=True, ge=0, le=2**32 - 1)]
U64 = Annotated[int, Field(strict=True, ge=0, le=2**64 - 1)]
USIZE = U64
I32 = Annotated[int, Field(strict=True, ge=-(2**31), le=2**31 - 1)]
I64 = Annotated[int, Field(strict=True, ge=-(2**63), le=2**64 - 1)]  # OpenAI's seed: any 64-bit integer
F32 = Annotated[float, Field(strict=True, allow_inf_nan=False), AfterValidator(as_f32)]
Bool = Annotated[bool, Field(strict=True)]
Str = Annotated[str, Field(strict=True)]


class _Body(BaseModel):
    # Unknown fields are IGNORED, not rejected: TGI's request structs are plain serde derives without
    # `#[serde(deny_unknown_fields)]`, so TGI drops fields it does not know. Clients rely on it (e.g. a
    # `stream` key posted to /generate, fields of newer TGI versions). Wrong types still fail.
    model_config = ConfigDict(extra="ignore")


class GrammarType(_Body):
    """`{type, value}`: json (a JSON schema, or a string holding one; `json_object` is TGI's alias),
    json_schema (`{name?, schema}`), regex (a pattern); pytgi's own: choice (a list of strings) and
    grammar (Lark, or GBNF/EBNF)."""

    type: Literal["json", "json_object", "json_schema", "regex", "choice", "grammar"]
    value: Any = None


class GenerateParameters(_Body):
    """TGI's `GenerateParameters`, with TGI's defaults (None = not given)."""

    best_of: USIZE | None = None
    temperature: F32 | None = None
    repetition_penalty: F32 | None = None
    frequency_penalty: F32 | None = None
    top_k: I32 | None = None
    top_p: F32 | None = None
    typical_p: F32 | None = None
    do_sample: Bool = False
    # TGI >= 3: absent (or null) fills up to max_total_tokens; see Validation.
    max_new_tokens: U32 | None = None
    return_full_text: Bool | None = None
    stop: list[Str] = Field(default_factory=list)
    truncate: USIZE | None = None
    watermark: Bool = False
    details: Bool = False
    decoder_input_details: Bool = False
    seed: U64 | None = None
    top_n_tokens: U32 | None = None
    grammar: GrammarType | None = None
    adapter_id: Str | None = None  # a LoRA adapter of --lora-adapters (None: the base model)
    ignore_eos_token: Bool = False  # pytgi: keep generating past EOS (benchmarks)
    presence_penalty: F32 | None = None  # pytgi (OpenAI's): penalize tokens already generated


class GenerateRequest(_Body):
    """Body of /generate, /generate_stream and /tokenize."""

    inputs: Str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    add_special_tokens: Bool = True  # TGI's field (default true)


class DetokenizeRequest(_Body):
    """vLLM's `POST /detokenize` body: token ids to text (`model` is accepted and ignored)."""

    tokens: list[int]
    model: str | None = None


class CompatGenerateRequest(_Body):
    """Body of `POST /` and /invocations: a GenerateRequest plus `stream`."""

    inputs: Str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: Bool = False

    def to_generate_request(self) -> GenerateRequest:
        return GenerateRequest(inputs=self.inputs, parameters=self.parameters)


@dataclass(slots=True)
class GenerateInput:
    """The router's request, whichever API it came through: TGI's body converts field for field,
    OpenAI's routes convert theirs (as TGI's `try_into_generate` does). `Validation` checks it."""

    inputs: str | list[int]  # text, or token ids (OpenAI's token prompts)
    parameters: GenerateParameters
    stream: bool = False
    add_special_tokens: bool = True
    # Where the two APIs' contracts differ:
    include_stop_str_in_output: bool = True  # TGI keeps the stop text in generated_text; OpenAI cuts it
    max_top_n_tokens: int | None = (
        None  # None: the server's --max-top-n-tokens (OpenAI's own bounds otherwise)
    )
    # OpenAI's (and vLLM's) sampling knobs TGI's parameters do not have
    min_p: float | None = None
    logit_bias: dict[int, float] | None = None
    cache_key: str | None = None  # OpenAI's prompt_cache_key: the replica router's affinity
    reasoning: str | None = None  # chat answers with --reasoning-parser: constraints apply after <think>
    skip_special_tokens: bool = True  # False: special tokens stay in the text (Mistral's [TOOL_CALLS])
    images: list[bytes] = field(default_factory=list)  # for the prompt's image tokens, fetched and checked

    @classmethod
    def from_body(cls, body: GenerateRequest | CompatGenerateRequest, stream: bool) -> GenerateInput:
        return cls(body.inputs, body.parameters, stream, getattr(body, "add_special_tokens", True))


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
    truncate: int | None  # as given
    images: list[bytes] = field(default_factory=list)  # for the prompt's image tokens, in order
    cache_key: str | None = None  # routes requests that share it to one replica (pytgi.api.replicas)
