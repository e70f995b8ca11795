"""Scores for pairs: TEI's `/rerank` and `/predict`, vLLM's (Cohere's and Jina's) `/v1/rerank` and
`/v1/score` (docs/embeddings.md).

A cross-encoder reads each (query, document) pair as one input, its second text in segment 1 where
the model has segments, and its one label's logit is the score (through a sigmoid unless the client
asks for raw scores); a classifier's labels come through a softmax (`/predict`). An embedding model
scores a pair by the cosine of its two normalized vectors, as vLLM's score route does for one.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import Field

from pytgi.api.embeddings import Embedder, _Body, floats, json_body, parsed, serves
from pytgi.api.json_response import JSONResponse
from pytgi.core import protocol as P
from pytgi.core.errors import InvalidRequest

router = APIRouter()
Str = Annotated[str, Field(strict=True)]
Int = Annotated[int, Field(strict=True)]


class TeiRerankRequest(_Body):
    query: Str
    texts: list[Str]
    truncate: bool | None = None
    truncation_direction: str = "right"
    raw_scores: bool = False
    return_text: bool = False


class RerankRequest(_Body):
    """vLLM's `/v1/rerank` (Cohere's and Jina's shape)."""

    query: Str
    documents: list[Str]
    model: str | None = None
    top_n: Int | None = None
    truncate_prompt_tokens: Int | None = None
    return_documents: bool = True


class ScoreRequest(_Body):
    """vLLM's `/v1/score`: `text_1` against each `text_2` (one to many), or pairwise."""

    text_1: Str | list[Str]
    text_2: Str | list[Str]
    model: str | None = None
    truncate_prompt_tokens: Int | None = None


class PredictRequest(_Body):
    """TEI's `/predict`: a text, a pair `[a, b]`, or a list of either."""

    inputs: Str | list[Str] | list[Str | list[Str]]
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: str = "right"


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    es = [math.exp(x - top) for x in xs]
    return [e / sum(es) for e in es]


class Scorer(Embedder):
    """A scoring request: pairs tokenized (a cross-encoder's) or texts embedded (a bi-encoder's)."""

    def __init__(self, request: Request, param: str, predict: bool = False) -> None:
        tasks = ("classify",) if predict else ("classify", "embed")
        super().__init__(request, param, tasks, "labels" if predict else "scores")
        labels = self.pooling.labels
        if not predict and self.info.task == "classify" and len(labels) != 1:
            raise InvalidRequest(
                f"{serves(self.info)}; with {len(labels)} labels it is a classifier, not a reranker: ask "
                "/predict",
                "model",
                "model_not_supported",
            )

    async def pairs(
        self, pairs: list[tuple[str, str]], truncate: int | None
    ) -> tuple[list[list[int]], list[P.PoolParams]]:
        """Each pair's token ids and where its second text starts; longer than the model takes refused
        unless `truncate` (the most tokens: the longer text is cut first)."""
        if not pairs:
            raise InvalidRequest("there is nothing to score", self.param)
        limit = self.st.config.max_client_batch_size
        if len(pairs) > limit:
            raise InvalidRequest(
                f"{len(pairs)} pairs, more than the {limit} one request may have", self.param
            )
        most = self.info.max_input_tokens if truncate is None else min(truncate, self.info.max_input_tokens)
        if most < 4:
            raise InvalidRequest(
                f"truncation to {most} tokens leaves no room for a pair", "truncate_prompt_tokens"
            )
        tok = self.st.tokenizer
        assert self.st.validation is not None
        cut = None if truncate is None else most
        encoded = await self.st.validation.in_pool(lambda: [tok.encode_pair(a, b, cut) for a, b in pairs])
        for ids, _ in encoded:
            if len(ids) > most:
                raise InvalidRequest(
                    f"a pair has {len(ids)} tokens, more than the {most} this model takes (truncate it: "
                    "`truncate` on TEI's routes, `truncate_prompt_tokens` on vLLM's)",
                    self.param,
                    "context_length_exceeded",
                )
        return [ids for ids, _ in encoded], [P.PoolParams(pair_at=at) for _, at in encoded]

    async def scores(
        self, pairs: list[tuple[str, str]], truncate: int | None, raw: bool = False
    ) -> tuple[list[float], int]:
        """Each pair's score, and the tokens computed."""
        if self.info.task == "embed":  # a bi-encoder: the cosine of the two vectors
            texts = sorted({t for pair in pairs for t in pair})
            ids = await self.tokenize(list(texts), truncate, "right")
            out = await self.pool(ids, P.PoolParams(normalize=True))
            vecs = {t: floats(o.data) for t, o in zip(texts, out, strict=True)}
            cos = [sum(x * y for x, y in zip(vecs[a], vecs[b], strict=True)) for a, b in pairs]
            return cos, sum(o.num_tokens for o in out)
        ids, params = await self.pairs(pairs, truncate)
        out = await self.pool(ids, params)
        logits = [floats(o.data)[0] for o in out]
        identity = raw or self.pooling.activation == "identity"
        return (logits if identity else [sigmoid(x) for x in logits]), sum(o.num_tokens for o in out)


def _tei_truncate(truncate: bool | None, side: str) -> int | None:
    if side.lower() not in ("right", "left"):
        raise InvalidRequest(
            f"truncation_direction must be right or left, got {side!r}", "truncation_direction"
        )
    return 1 << 30 if truncate else None  # the model's limit


async def tei_rerank(request: Request, body: TeiRerankRequest) -> JSONResponse:
    sc = Scorer(request, "texts")
    with sc.exchange.refused():
        truncate = _tei_truncate(body.truncate, body.truncation_direction)
        scores, tokens = await sc.scores([(body.query, t) for t in body.texts], truncate, body.raw_scores)
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
    return JSONResponse(
        [
            {"index": i, "score": scores[i], **({"text": body.texts[i]} if body.return_text else {})}
            for i in ranked
        ],
        headers={"x-total-tokens": str(tokens)},
    )


async def rerank(request: Request, body: RerankRequest) -> JSONResponse:
    sc = Scorer(request, "documents")
    with sc.exchange.refused():
        if body.top_n is not None and body.top_n < 1:
            raise InvalidRequest(f"top_n must be >= 1, got {body.top_n}", "top_n")
        scores, tokens = await sc.scores(
            [(body.query, d) for d in body.documents], body.truncate_prompt_tokens
        )
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": body.model or sc.info.model_id,
            "usage": {"total_tokens": tokens},
            "results": [
                {
                    "index": i,
                    "document": {"text": body.documents[i]} if body.return_documents else None,
                    "relevance_score": scores[i],
                }
                for i in ranked
            ],
        }
    )


@router.post("/rerank", tags=["Text Embeddings Inference"])
async def rerank_route(request: Request) -> JSONResponse:
    """TEI's body (`texts`) or vLLM's (`documents`): each answered in its own shape."""
    body = await json_body(request)
    if isinstance(body, dict) and "documents" in body:
        return await rerank(request, parsed(RerankRequest, body))
    return await tei_rerank(request, parsed(TeiRerankRequest, body))


@router.post("/v1/rerank", tags=["OpenAI"])
@router.post("/v2/rerank", tags=["OpenAI"])
async def rerank_v1(request: Request, body: RerankRequest) -> JSONResponse:
    return await rerank(request, body)


@router.post("/v1/score", tags=["OpenAI"])
@router.post("/score", tags=["OpenAI"])
async def score(request: Request, body: ScoreRequest) -> JSONResponse:
    sc = Scorer(request, "text_2")
    with sc.exchange.refused():
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise InvalidRequest(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as "
                "text_2",
                "text_1",
            )
        scores, tokens = await sc.scores(list(zip(first, second, strict=True)), body.truncate_prompt_tokens)
    return JSONResponse(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": body.model or sc.info.model_id,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def predict(request: Request, body: PredictRequest) -> JSONResponse:
    sc = Scorer(request, "inputs", predict=True)
    with sc.exchange.refused():
        truncate = _tei_truncate(body.truncate, body.truncation_direction)
        inputs: Any = body.inputs
        single = isinstance(inputs, str) or (
            len(inputs) == 2 and all(isinstance(x, str) for x in inputs)  # TEI's: [a, b] is one pair
        )
        items = [inputs] if single else list(inputs)
        if not items:
            raise InvalidRequest("the input cannot be empty", "inputs")
        for x in items:
            if isinstance(x, list) and len(x) != 2:
                raise InvalidRequest(f"a pair is two texts, got {len(x)}", "inputs")
        texts = [x for x in items if isinstance(x, str)]
        pairs = [(x[0], x[1]) for x in items if isinstance(x, list)]
        ids = await sc.tokenize(list(texts), truncate, body.truncation_direction) if texts else []
        pair_ids, pair_params = await sc.pairs(pairs, truncate) if pairs else ([], [])
    singles, doubles = iter(ids), iter(zip(pair_ids, pair_params, strict=True))
    order: list[tuple[list[int], P.PoolParams]] = [
        (next(singles), P.PoolParams()) if isinstance(x, str) else next(doubles) for x in items
    ]
    out = await sc.pool([i for i, _ in order], [p for _, p in order])
    labels = sc.pooling.labels

    def ranked(logits: list[float]) -> list[dict[str, Any]]:
        if body.raw_scores or (len(logits) == 1 and sc.pooling.activation == "identity"):
            probs = logits
        else:
            probs = [sigmoid(logits[0])] if len(logits) == 1 else softmax(logits)
        return sorted(
            ({"score": p, "label": label} for p, label in zip(probs, labels, strict=True)),
            key=lambda d: -d["score"],
        )

    answers = [ranked(floats(o.data)) for o in out]
    return JSONResponse(answers[0] if single else answers)


@router.post("/predict", tags=["Text Embeddings Inference"])
async def predict_route(request: Request, body: PredictRequest) -> JSONResponse:
    return await predict(request, body)


async def root(request: Request, body: Any) -> JSONResponse:
    """TEI's `POST /` on a cross-encoder: `/predict`."""
    return await predict(request, parsed(PredictRequest, body))
