"""An embedding model's routes: OpenAI's `POST /v1/embeddings`, text-embeddings-inference's `/embed`,
`/embed_all`, `/similarity` and its `POST /` (docs/embeddings.md).

Each input is one engine request (`Infer.pool`), submitted together so the engine batches them.
The engine sends float32 vectors as bytes; OpenAI's base64 is those bytes as they are. A generation
route on an embedding model, or one of these on a generator, is refused in words naming what the
model serves.
"""

from __future__ import annotations

import array
import asyncio
import base64
import time
from typing import Annotated, Any, Literal, TypeVar, cast

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pytgi.api.exchange import Exchange, unless_gone
from pytgi.api.json_response import JSONResponse
from pytgi.api.state import State, state_of
from pytgi.core import protocol as P
from pytgi.core.config import EngineInfo
from pytgi.core.errors import InferError, InvalidRequest
from pytgi.core.pooling import PoolingInfo
from pytgi.core.sampling_params import check_token_ids

router = APIRouter()

Str = Annotated[str, Field(strict=True)]
Ids = list[Annotated[int, Field(strict=True)]]
Inputs = Str | list[Str] | Ids | list[Ids]
EMBEDDING_ROUTES = (
    "POST /v1/embeddings, /embed, /embed_all, /similarity, /rerank, /v1/rerank, /v1/score and /"
)
SCORING_ROUTES = "POST /rerank, /v1/rerank, /v1/score, /predict and /"
SERVES = {"embed": "an embedding model", "classify": "a cross-encoder"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


M = TypeVar("M", bound=BaseModel)


async def json_body(request: Request) -> Any:
    """A route's body read by hand (a route whose body's model depends on the served model or the body)."""
    try:
        return await request.json()
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        raise RequestValidationError([{"loc": ("body",), "msg": "the body is not JSON"}]) from None


def parsed(model: type[M], body: Any) -> M:
    """`body` as `model`, or the 422 FastAPI gives a body it parses itself."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


class EmbeddingRequest(_Body):
    """OpenAI's body (vLLM's extras: `truncate_prompt_tokens`, `normalize`, `add_special_tokens`)."""

    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(strict=True)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(strict=True)] | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True


class EmbedRequest(_Body):
    """TEI's `/embed` and `/embed_all` body."""

    inputs: Inputs
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: str = "right"
    prompt_name: str | None = None
    dimensions: Annotated[int, Field(strict=True)] | None = None


class SimilarityInputs(_Body):
    source_sentence: Str
    sentences: list[Str]


class SimilarityRequest(_Body):
    """TEI's `/similarity` (huggingface_hub's `sentence_similarity`)."""

    inputs: SimilarityInputs
    truncate: bool | None = None
    truncation_direction: str = "right"
    prompt_name: str | None = None


def serves(info: EngineInfo) -> str:
    """What a pooling model is and the routes it serves, in words."""
    routes = EMBEDDING_ROUTES if info.task == "embed" else SCORING_ROUTES
    return f"the model `{info.model_id}` is {SERVES[info.task]}: it serves {routes}"


def refusal(info: EngineInfo) -> str:
    """Why a generation route refuses a pooling model's requests."""
    return f"{serves(info)}, and generates no text"


def _as_list(inputs: Any) -> list[str | list[int]]:
    """One input or many: a string, a list of strings, token ids, or lists of token ids."""
    if isinstance(inputs, str):
        return [inputs]
    if inputs and all(isinstance(x, int) for x in inputs):
        return [inputs]
    return list(inputs)


class Embedder:
    """One embedding request: its inputs checked and tokenized, then pooled by the engine."""

    def __init__(
        self, request: Request, param: str, tasks: tuple[str, ...] = ("embed",), what: str = "embeddings"
    ) -> None:
        """`tasks`: the models the route serves; `what`: what it computes, for the refusal's words."""
        self.st: State = state_of(request)
        self.request, self.param = request, param
        info = self.st.client.info
        assert info is not None
        if info.task not in tasks or info.pooling is None:
            model = f"the model `{info.model_id}` generates text" if info.task == "generate" else serves(info)
            raise InvalidRequest(
                f"{model}; it computes no {what} (docs/embeddings.md)", "model", "model_not_supported"
            )
        self.info, self.pooling = info, info.pooling
        self.exchange = Exchange(request)

    def check_dimensions(self, dims: int | None) -> None:
        if dims is not None and not 0 < dims <= self.pooling.dimensions:
            raise InvalidRequest(
                f"dimensions must be in 1..{self.pooling.dimensions}, got {dims}", "dimensions"
            )

    async def tokenize(
        self,
        inputs: list[str | list[int]],
        truncate: int | None,
        side: str = "right",
        add_special_tokens: bool = True,
        prompt_name: str | None = None,
    ) -> list[list[int]]:
        """Token ids per input, each text after its prompt (`prompt_name`'s, or the model's default
        one); longer than `truncate` (or the model's limit when truncating) cut on `side`; too long
        otherwise refused, naming the limit."""
        prompt = prompt_text(self.pooling, prompt_name)
        if not inputs:
            raise InvalidRequest("the input cannot be empty", self.param)
        limit = self.st.config.max_client_batch_size
        if len(inputs) > limit:
            raise InvalidRequest(
                f"{len(inputs)} inputs, more than the {limit} one request may have (--max-client-batch-size)",
                self.param,
            )
        if side.lower() not in ("right", "left"):  # TEI's Right / Left too
            raise InvalidRequest(
                f"truncation_direction must be right or left, got {side!r}", "truncation_direction"
            )
        vocab = self.info.vocab_size
        for x in inputs:
            if isinstance(x, list):
                if not x:
                    raise InvalidRequest("an input's token ids cannot be empty", self.param)
                check_token_ids(x, vocab)
        most = self.info.max_input_tokens
        side = side.lower()
        if truncate is not None:
            if truncate < 1:
                raise InvalidRequest(
                    f"truncate_prompt_tokens must be >= 1, got {truncate}", "truncate_prompt_tokens"
                )
            most = min(truncate, most)
        texts = [prompt + x for x in inputs if isinstance(x, str)]
        assert self.st.validation is not None
        tok = self.st.tokenizer

        def encode() -> list[list[int]]:
            if truncate is None:
                return [tok.encode(t, add_special_tokens) for t in texts]
            return [tok.encode_truncated(t, most, side, add_special_tokens) for t in texts]

        encoded = iter(await self.st.validation.in_pool(encode) if texts else [])
        ids = [x if isinstance(x, list) else next(encoded) for x in inputs]
        if truncate is not None:  # token ids are cut as they are
            return [x[-most:] if side == "left" else x[:most] for x in ids]
        for x in ids:
            if len(x) > most:
                raise InvalidRequest(
                    f"an input has {len(x)} tokens, more than the {most} this model takes (truncate it: "
                    "`truncate` on /embed, `truncate_prompt_tokens` on /v1/embeddings)",
                    self.param,
                    "context_length_exceeded",
                )
        return ids

    async def pool(self, ids: list[list[int]], params: P.PoolParams | list[P.PoolParams]) -> list[P.PoolOut]:
        """The engine's vectors, under one concurrency slot (429 at once when none is free)."""
        ex = self.exchange
        ex.take(1)
        assert self.st.infer is not None and ex.admission is not None
        try:
            out = await unless_gone(
                self.request, asyncio.ensure_future(self.st.infer.pool(ids, params, ex.admission))
            )
        except InferError as exc:
            ex.failed(exc)
            raise
        m = self.st.metrics
        m.request_success.inc()
        m.request_duration.observe(time.monotonic() - ex.arrived)
        tokens = sum(o.num_tokens for o in out)
        m.request_input_length.observe(tokens)
        m.prompt_tokens.inc(tokens)
        return out


def floats(data: bytes) -> list[float]:
    return array.array("f", data).tolist()


def rows(out: P.PoolOut) -> list[list[float]]:
    values = floats(out.data)
    n = len(values) // out.rows
    return [values[i * n : (i + 1) * n] for i in range(out.rows)]


def _truncate(body: EmbedRequest | SimilarityRequest, info: EngineInfo) -> int | None:
    return info.max_input_tokens if body.truncate else None


def prompt_text(pooling: PoolingInfo, name: str | None) -> str:
    """The text a prompt name puts before each input (the model's default prompt when none is named),
    as sentence-transformers' `encode(prompt_name=...)` does."""
    name = name if name is not None else pooling.default_prompt_name
    if name is None:
        return ""
    if name not in pooling.prompts:
        known = ", ".join(pooling.prompts) or "none"
        raise InvalidRequest(f"prompt_name {name!r}: this model's prompts are {known}", "prompt_name")
    return pooling.prompts[name]


# -- OpenAI -----------------------------------------------------------------------------------------
@router.post("/v1/embeddings", tags=["OpenAI"])
async def openai_embeddings(request: Request, body: EmbeddingRequest) -> JSONResponse:
    em = Embedder(request, "input")
    with em.exchange.refused():
        em.check_dimensions(body.dimensions)
        ids = await em.tokenize(
            _as_list(body.input), body.truncate_prompt_tokens, "left", body.add_special_tokens
        )
    out = await em.pool(ids, P.PoolParams(normalize=body.normalize, dimensions=body.dimensions))
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(o.data).decode()
            if body.encoding_format == "base64"
            else floats(o.data),
        }
        for i, o in enumerate(out)
    ]
    tokens = sum(o.num_tokens for o in out)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": body.model or em.info.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


# -- text-embeddings-inference -------------------------------------------------------------------------
async def embed(request: Request, body: EmbedRequest, tokens: bool = False) -> JSONResponse:
    em = Embedder(request, "inputs")
    with em.exchange.refused():
        if not tokens:
            em.check_dimensions(body.dimensions)
        inputs = _as_list(body.inputs)
        ids = await em.tokenize(
            inputs, _truncate(body, em.info), body.truncation_direction, True, body.prompt_name
        )
    params = P.PoolParams(tokens=True) if tokens else P.PoolParams(False, body.normalize, body.dimensions)
    out = await em.pool(ids, params)
    headers = {"x-total-tokens": str(sum(o.num_tokens for o in out))}
    if tokens:
        return JSONResponse([rows(o) for o in out], headers=headers)
    return JSONResponse([floats(o.data) for o in out], headers=headers)


@router.post("/embed", tags=["Text Embeddings Inference"])
async def embed_route(request: Request, body: EmbedRequest) -> JSONResponse:
    return await embed(request, body)


@router.post("/embed_all", tags=["Text Embeddings Inference"])
async def embed_all(request: Request, body: EmbedRequest) -> JSONResponse:
    return await embed(request, body, tokens=True)


@router.post("/similarity", tags=["Text Embeddings Inference"])
async def similarity(request: Request, body: SimilarityRequest) -> JSONResponse:
    """The cosine similarity of `source_sentence` to each of `sentences`."""
    em = Embedder(request, "inputs")
    with em.exchange.refused():
        texts: list[str | list[int]] = [body.inputs.source_sentence, *body.inputs.sentences]
        truncate = _truncate(body, em.info)
        ids = await em.tokenize(texts, truncate, body.truncation_direction, True, body.prompt_name)
    source, *others = [floats(o.data) for o in await em.pool(ids, P.PoolParams(normalize=True))]
    return JSONResponse([sum(a * b for a, b in zip(source, v, strict=True)) for v in others])


# -- TEI's /tokenize and /decode on a pooling model ------------------------------------------------------
class TokenizeRequest(_Body):
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(_Body):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def _simple_tokens(st: State, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
    """TEI's SimpleToken per token: a special token's text is its own, with no span; another's is the
    slice of the text it covers, its span in UTF-8 bytes."""
    tok = st.tokenizer
    ids, offsets = tok.encode_with_offsets(text, add_special_tokens)
    out = []
    for tid, (cs, ce) in zip(ids, offsets, strict=True):
        if tid in tok.special_ids:
            out.append({"id": tid, "text": tok.token(tid), "special": True, "start": None, "stop": None})
        else:
            start, stop = len(text[:cs].encode()), len(text[:ce].encode())
            out.append({"id": tid, "text": text[cs:ce], "special": False, "start": start, "stop": stop})
    return out


async def tei_tokenize(request: Request, body: TokenizeRequest) -> JSONResponse:
    """TEI's `/tokenize`: every input's tokens (a list per input, one input too), after its prompt."""
    st = state_of(request)
    info = st.client.info
    assert info is not None and info.pooling is not None and st.validation is not None
    prompt = prompt_text(info.pooling, body.prompt_name)
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise InvalidRequest("`inputs` cannot be empty", "inputs")

    def run() -> list[list[dict[str, Any]]]:
        return [_simple_tokens(st, prompt + t, body.add_special_tokens) for t in texts]

    return JSONResponse(await st.validation.in_pool(run))


async def tei_decode(request: Request, body: DecodeRequest) -> JSONResponse:
    """TEI's `/decode`: one text per list of ids."""
    st = state_of(request)
    assert st.validation is not None
    one = not body.ids or isinstance(body.ids[0], int)  # one list of ids, or lists of them
    lists = cast(list[list[int]], [body.ids] if one else body.ids)
    for ids in lists:
        check_token_ids(ids, st.validation.vocab_size)
    texts = [st.tokenizer.decode(ids, body.skip_special_tokens) for ids in lists]
    return JSONResponse(texts)


async def root(request: Request, body: Any) -> JSONResponse:
    """TEI's `POST /` on an embedding model: `/similarity`'s body, or `/embed`'s."""
    if isinstance(body, dict) and isinstance(body.get("inputs"), dict):
        return await similarity(request, parsed(SimilarityRequest, body))
    return await embed(request, parsed(EmbedRequest, body))
