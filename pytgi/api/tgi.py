"""TGI's routes: /generate, /generate_stream, /, /invocations, /health, /info, /metrics, /tokenize."""

from __future__ import annotations

import re
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from pytgi.api import embeddings, scores
from pytgi.api.error_handlers import error_body, error_response, infer_error_response, validation_response
from pytgi.api.exchange import Exchange, sse_event
from pytgi.api.frontend.bodies import DetokenizeRequest, GenerateInput
from pytgi.api.frontend.infer import Generation, RequestStream, Timings
from pytgi.api.frontend.media import ImageRef
from pytgi.api.frontend.validation import CompatGenerateRequest, GenerateRequest, ValidRequest
from pytgi.api.json_response import JSONResponse
from pytgi.api.state import State, state_of
from pytgi.core import flags
from pytgi.core.outputs import Delta, OutputProcessor, Token
from pytgi.core.pooling import PoolingInfo
from pytgi.core.sampling_params import check_token_ids
from pytgi.core.version import __version__

router = APIRouter()


# -- JSON shapes ---------------------------------------------------------------------------------
def token_json(t: Token) -> dict[str, Any]:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def _seed(req: ValidRequest) -> int | None:
    return req.sampling.seed if req.sampling.sampling else None


def generated_text(out: OutputProcessor, req: ValidRequest) -> str:
    return req.inputs + out.text if req.return_full_text else out.text


def sequence_details(g: Generation, req: ValidRequest) -> dict[str, Any]:
    out = g.output
    d: dict[str, Any] = {
        "finish_reason": out.finish_reason,
        "generated_tokens": len(out.tokens),
        "cached_tokens": out.num_cached_tokens,  # pytgi's: prompt tokens the prefix cache served
        "seed": _seed(g.request),
        "prefill": [token_json(t) for t in out.prefill] if req.decoder_input_details else [],
        "tokens": [token_json(t) for t in out.tokens],
    }
    if req.sampling.top_n_tokens:
        d["top_tokens"] = [[token_json(t) for t in top] for top in out.top_tokens]
    return d


def generate_json(g: Generation, req: ValidRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"generated_text": generated_text(g.output, req)}
    if req.details:
        details = sequence_details(g, req)
        if req.best_of > 1:
            details["best_of_sequences"] = [
                {"generated_text": generated_text(o.output, req), **sequence_details(o, req)}
                for o in g.best_of_sequences
            ]
        out["details"] = details
    return out


def stream_json(delta: Delta, stream: RequestStream) -> dict[str, Any]:
    req, last = stream.req, delta.finish_reason is not None
    details = None
    if last and req.details:
        details = {
            "finish_reason": delta.finish_reason,
            "generated_tokens": delta.index,
            "cached_tokens": stream.output.num_cached_tokens,  # pytgi's, as in `details` above
            "seed": _seed(req),
            "input_length": req.input_length,
        }
    out: dict[str, Any] = {
        "index": delta.index,
        "token": token_json(delta.token),
        "generated_text": generated_text(stream.output, req) if last else None,
        "details": details,
    }
    if req.sampling.top_n_tokens:
        out["top_tokens"] = [token_json(t) for t in delta.top_tokens]
    return out


def timing_headers(
    st: State, t: Timings, arrived: float, prompt_tokens: int, generated: int
) -> dict[str, str]:
    total = time.monotonic() - arrived
    inference = max(t.end - t.start, 0.0) if t.end else 0.0
    info = st.client.info
    return {
        "x-compute-type": f"{info.num_shard}-{info.model_device_type}" if info else "unknown",
        "x-compute-time": f"{total:.6f}",
        "x-total-time": str(int(total * 1000)),
        "x-validation-time": str(int(t.validation * 1000)),
        "x-queue-time": str(int(max(t.start - t.queued, 0.0) * 1000)),
        "x-inference-time": str(int(inference * 1000)),
        "x-time-per-token": str(int(inference * 1000 / max(generated, 1))),
        "x-prompt-tokens": str(prompt_tokens),
        "x-generated-tokens": str(generated),
    }


# -- the request path (pytgi.api.exchange) -----------------------------------------------------
MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def markdown_images(inputs: str, image_token: str) -> tuple[str, list[ImageRef]]:
    """TGI's images in `inputs` (a vision model's): each `![alt](url)` becomes the model's image token,
    its URL (a data: or http(s) URL) one of the request's images."""
    refs: list[ImageRef] = []

    def one(m: re.Match[str]) -> str:
        refs.append(ImageRef(m.group(1), f"inputs: image {len(refs)}"))
        return image_token

    return MARKDOWN_IMAGE.sub(one, inputs), refs


async def admit(ex: Exchange, body: GenerateRequest, stream: bool) -> ValidRequest:
    """A slot (429 at once if none), then validation (422), then best_of's other slots."""
    st = ex.st
    assert st.validation is not None
    validation = st.validation

    async def prepare() -> list[ValidRequest]:
        if not st.takes_images or "![" not in body.inputs:
            return [await validation.validate(body, stream)]
        gi = GenerateInput.from_body(body, stream)
        gi.inputs, refs = markdown_images(body.inputs, st.image_token_text())
        gi.images = await st.load_images(refs)
        return [await validation.validate(gi)]

    [req] = await ex.admit(1, prepare)
    if req.best_of > 1:
        ex.take(req.best_of - 1)
    return req


async def generate_response(request: Request, body: GenerateRequest) -> tuple[dict[str, Any], dict[str, str]]:
    ex = Exchange(request)
    req = await admit(ex, body, stream=False)
    [g] = await ex.generate([req])
    headers = timing_headers(ex.st, g.timings, ex.arrived, req.input_length, len(g.output.tokens))
    return generate_json(g, req), headers


async def stream_response(request: Request, body: GenerateRequest) -> Response:
    """`data:{json}` per token, `:` keep-alive comments, errors as a last event."""
    ex = Exchange(request)
    req = await admit(ex, body, stream=True)
    [stream] = ex.streams([req])
    return ex.sse(
        [stream],
        lambda _, delta: [sse_event(stream_json(delta, stream), space=False)],
        lambda exc: sse_event(error_body(exc.message, exc.error_type), space=False),
    )


# -- routes ----------------------------------------------------------------------------------------
@router.post("/generate", tags=["Text Generation Inference"])
async def generate(request: Request, body: GenerateRequest) -> JSONResponse:
    out, headers = await generate_response(request, body)
    return JSONResponse(out, headers=headers)


@router.post("/generate_stream", tags=["Text Generation Inference"])
async def generate_stream(request: Request, body: GenerateRequest) -> Response:
    return await stream_response(request, body)


@router.post("/", tags=["Text Generation Inference"])
async def root(request: Request) -> Response:
    """TGI's compat route (`/generate` or `/generate_stream` by `stream`); on an embedding model,
    TEI's (pytgi.api.embeddings.root)."""
    body = await embeddings.json_body(request)
    info = state_of(request).client.info
    if info is not None and info.task == "embed":
        return await embeddings.root(request, body)
    if info is not None and info.task == "classify":
        return await scores.root(request, body)
    return await compat_generate(request, embeddings.parsed(CompatGenerateRequest, body))


async def compat_generate(request: Request, body: CompatGenerateRequest) -> Response:
    if body.stream:
        return await stream_response(request, body.to_generate_request())
    out, headers = await generate_response(request, body.to_generate_request())
    return JSONResponse([out], headers=headers)


@router.post("/invocations", tags=["Text Generation Inference"])
async def invocations(request: Request, body: CompatGenerateRequest) -> Response:
    return await compat_generate(request, body)


@router.get("/", tags=["Text Generation Inference"])
@router.get("/health", tags=["Text Generation Inference"])
async def health(request: Request) -> Response:
    if state_of(request).client.healthy:
        return Response(status_code=200)
    return error_response(503, "unhealthy", "healthcheck")


INFO_SETTINGS = [s for s in flags.table() if s.info]
PIPELINE_TAGS = {
    "generate": "text-generation",
    "embed": "feature-extraction",
    "classify": "text-classification",
}


def model_type(pooling: PoolingInfo) -> dict[str, Any]:
    """TEI's `model_type`: an embedding model's pooling, a cross-encoder's labels (one: a reranker)."""
    if not pooling.labels:
        return {"embedding": {"pooling": pooling.method}}
    id2label = dict(enumerate(pooling.labels))
    labels = {
        "id2label": {str(i): n for i, n in id2label.items()},
        "label2id": {n: i for i, n in id2label.items()},
    }
    return {"reranker" if len(pooling.labels) == 1 else "classifier": labels}


@router.get("/info", tags=["Text Generation Inference"])
async def info(request: Request) -> JSONResponse:
    st = state_of(request)
    cfg, eng = st.config, st.client.info
    assert eng is not None
    # The settings marked for /info (pytgi.core.settings), as the engine resolved them; the LoRA
    # adapters as served now (the engine's last snapshot).
    live = {"lora_adapters": st.adapters}
    resolved = {
        s.name: live[s.name] if s.name in live else getattr(eng if s.reader == "engine" else cfg, s.name)
        for s in INFO_SETTINGS
    }
    return JSONResponse(
        {
            "model_id": cfg.model_id,
            "model_sha": cfg.model_sha,
            "model_dtype": eng.model_dtype,
            "model_device_type": eng.model_device_type,
            "model_quantization": eng.quantization,  # pytgi's: a GGUF file's tensor types and counts
            "model_pipeline_tag": PIPELINE_TAGS[eng.task],
            **({"model_type": model_type(eng.pooling)} if eng.pooling else {}),  # TEI's field
            **resolved,
            "max_input_length": eng.max_input_tokens,  # TGI's older name
            "max_client_batch_size": 4 if eng.task == "generate" else cfg.max_client_batch_size,
            "max_batch_tokens": eng.max_batch_prefill_tokens,  # TEI's name
            "router": "pytgi",
            "version": __version__,
            "sha": None,
            "docker_label": None,
        }
    )


@router.get("/metrics", tags=["Text Generation Inference"])
async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/tokenize", tags=["Text Generation Inference"])
async def tokenize(request: Request) -> JSONResponse:
    """TGI's `/tokenize` (`GenerateRequest`'s body: one input's tokens); on a pooling model, TEI's
    (pytgi.api.embeddings.tei_tokenize: a list of inputs, a list of tokens each)."""
    st = state_of(request)
    raw = await embeddings.json_body(request)
    if st.client.info is not None and st.client.info.task != "generate":
        return await embeddings.tei_tokenize(request, embeddings.parsed(embeddings.TokenizeRequest, raw))
    body = embeddings.parsed(GenerateRequest, raw)
    assert st.validation is not None
    if not body.inputs:
        return validation_response("`inputs` cannot be empty")
    return JSONResponse(await st.validation.validate_tokenize(body.inputs, body.add_special_tokens))


@router.post("/decode", tags=["Text Embeddings Inference"])
async def decode(request: Request, body: embeddings.DecodeRequest) -> JSONResponse:
    """TEI's: token ids (a list, or a list of lists) → one text each."""
    return await embeddings.tei_decode(request, body)


@router.post("/detokenize", tags=["Text Generation Inference"])
async def detokenize(request: Request, body: DetokenizeRequest) -> JSONResponse:
    """vLLM's route (TGI has none): `{"tokens": [ids]}` → `{"prompt": text}`, special tokens kept."""
    st = state_of(request)
    assert st.validation is not None
    check_token_ids(body.tokens, st.validation.vocab_size)
    return JSONResponse({"prompt": st.tokenizer.decode(body.tokens, skip_special_tokens=False)})


__all__ = ["infer_error_response", "router"]
