"""The offline API, as vLLM users know it: `LLM(...).generate(prompts, SamplingParams(...))`, and
on a pooling model `LLM(...).embed(texts)` and `LLM(...).score(text_1, text_2)`."""

from __future__ import annotations

import array
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

from pytgi.core import protocol as P
from pytgi.core.config import EngineConfig
from pytgi.core.errors import GenerationError, InvalidRequest
from pytgi.core.outputs import Delta, OutputProcessor, Token
from pytgi.core.protocol import PoolOut, PoolParams, TokenOut
from pytgi.core.sampling_params import SamplingParams
from pytgi.core.tokenizer import Tokenizer
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.pooling.encoder_engine import PoolingEngine
from pytgi.engine.process import start_engine


class ImagePrompt(TypedDict):
    """A vision model's prompt: its text (or ids) with one image token per image, and the images'
    encoded bytes (PNG, JPEG, ...) in order."""

    prompt: str | list[int]
    images: list[bytes]


Prompt = str | list[int] | ImagePrompt


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each generated token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when top_n_tokens > 0
    prompt_logprobs: list[float | None] | None = None  # when asked; the first is None
    finish_reason: str | None = None  # length | eos_token | stop_sequence
    num_cached_tokens: int = 0
    num_disk_tokens: int = 0  # of them, read back from --prefix-cache-dir's files
    seed: int | None = None

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM's shape: `out.outputs[0].text`."""
        return [self]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _logprob(token: Token) -> float:
    assert token.logprob is not None, "a generated token has its logprob"
    return token.logprob


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's shape: `out.outputs.embedding` (`embed`), `out.outputs.score` (`score`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput


class _Tracker:
    """One request's `OutputProcessor` and the `RequestOutput` it fills."""

    def __init__(self, out: RequestOutput, params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.out, self.params = out, params
        self.proc = OutputProcessor(tokenizer, out.prompt_token_ids, params)

    def apply(self, u: TokenOut) -> Delta | None:
        out, proc = self.out, self.proc
        try:
            delta = proc.process(u)
        except GenerationError as exc:
            raise GenerationError(f"request {out.request_id}: {exc}") from None
        out.prompt_logprobs = proc.prompt_logprobs
        if delta is None:
            return None
        out.num_cached_tokens, out.num_disk_tokens = proc.num_cached_tokens, proc.num_disk_tokens
        out.token_ids.append(delta.token.id)
        out.logprobs.append(_logprob(delta.token))
        if self.params.top_n_tokens:
            out.top_logprobs.append([(t.id, _logprob(t)) for t in delta.top_tokens])
        out.text, out.finish_reason = proc.text, proc.finish_reason
        return delta


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_args: Any) -> None:
        # a generator or a causal LM's pooling on LLMEngine, an encoder on PoolingEngine
        self.engine: LLMEngine | PoolingEngine = start_engine(
            EngineConfig(model=model, dtype=dtype, **engine_args)
        )
        self.tokenizer = Tokenizer.from_dir(Path(self.engine.info.model_path))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (also done at exit when they lose rank 0)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise InvalidRequest("a prompt is a string or a list of token ids (ints)")
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion, continuously batched; outputs in the prompts' order."""
        if isinstance(prompts, (str, dict)):
            batch: list[Prompt] = [prompts]
        elif prompts and isinstance(cast(Sequence[object], prompts)[0], int):
            batch = [cast(Prompt, prompts)]
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(plist) != len(batch):
            raise InvalidRequest("give one SamplingParams, or one per prompt")
        trackers: list[_Tracker] = []
        try:
            for prompt, sp in zip(batch, plist):
                trackers.append(self._submit(prompt, sp))
        except Exception:  # all or nothing: a bad prompt must not leave the others running
            for t in trackers:
                self.engine.abort_request(t.out.request_id)
            raise
        for _ in self._run({t.out.request_id: t for t in trackers}):
            pass
        return [t.out for t in trackers]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion's text as it is generated."""
        tracker = self._submit(prompt, sampling_params or SamplingParams())
        for _, text in self._run({tracker.out.request_id: tracker}):
            if text:
                yield text

    def chat(
        self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(self.tokenizer.encode(prompt, add_special_tokens=False), sampling_params)[0]

    # -- pooling models ---------------------------------------------------------------------------
    def embed(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        normalize: bool | None = None,
        dimensions: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """An embedding model's vectors, the prompts batched together; each text after the model's
        default prompt, as the server puts it (`normalize` None: the model's own default)."""
        batch = self._batch(prompts)
        pooling = self.engine.info.pooling
        default = pooling.prompts.get(pooling.default_prompt_name or "", "") if pooling else ""
        ids = [self.encode(default + p if isinstance(p, str) else p) for p in batch]
        outs = self._pool(ids, [PoolParams(False, normalize, dimensions)] * len(ids))
        return [
            PoolingRequestOutput(o.request_id, i, EmbeddingOutput(_floats(o.data))) for o, i in zip(outs, ids)
        ]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[PoolingRequestOutput]:
        """vLLM's `score`: one text against each of `text_2`, or as many as `text_2`, pairwise. A
        cross-encoder (or a causal LM's classifier) scores each pair by its one label (through the
        model's activation, a sigmoid by default); an embedding model by its vectors' cosine."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise InvalidRequest("give one text_1, or as many as text_2")
        info = self.engine.info
        if info.task == "embed":
            a, b = self.embed(firsts, normalize=True), self.embed(seconds, normalize=True)
            out = []
            for u, v in zip(a, b):
                x, y = cast(EmbeddingOutput, u.outputs), cast(EmbeddingOutput, v.outputs)
                cos = sum(p * q for p, q in zip(x.embedding, y.embedding))  # unit vectors
                out.append(
                    PoolingRequestOutput(
                        u.request_id, u.prompt_token_ids + v.prompt_token_ids, ScoringOutput(cos)
                    )
                )
            return out
        pooling = info.pooling
        if info.task != "classify" or pooling is None or len(pooling.labels) != 1:
            raise InvalidRequest(f"the model `{info.model_id}` scores no pairs: a reranker (one label) does")
        pairs = [self.tokenizer.encode_pair(a, b) for a, b in zip(firsts, seconds)]
        outs = self._pool([i for i, _ in pairs], [PoolParams(pair_at=at) for _, at in pairs])
        results = []
        for o, (ids, _) in zip(outs, pairs):
            logit = _floats(o.data)[0]
            score = logit if pooling.activation == "identity" else 1 / (1 + math.exp(-logit))
            results.append(PoolingRequestOutput(o.request_id, ids, ScoringOutput(score)))
        return results

    @staticmethod
    def _batch(prompts: str | list[int] | Sequence[str | list[int]]) -> list[str | list[int]]:
        if isinstance(prompts, str) or (prompts and isinstance(cast(Sequence[object], prompts)[0], int)):
            return [cast(str | list[int], prompts)]
        return list(cast(Sequence[str | list[int]], prompts))

    def _pool(self, ids: list[list[int]], params: list[PoolParams]) -> list[PoolOut]:
        """Submit every prompt, step until all are answered; answers in the prompts' order."""
        rids = [f"llm-{next(self._ids)}" for _ in ids]
        got: dict[str, PoolOut] = {}
        try:
            for rid, i, p in zip(rids, ids, params):
                self.engine.add_pool_request(rid, i, p)
            while len(got) < len(rids) and self.engine.has_unfinished():
                for u in self.engine.step():
                    if isinstance(u, PoolOut):
                        got[u.request_id] = u
                    elif u.error:
                        raise GenerationError(f"request {u.request_id}: {u.error}")
        finally:
            for rid in rids:
                if rid not in got:
                    self.engine.abort_request(rid)
        return [got[r] for r in rids]

    def _submit(self, prompt: Prompt, params: SamplingParams) -> _Tracker:
        images: list[bytes] = []
        text: str | list[int]
        if isinstance(prompt, dict):
            text, images = prompt["prompt"], list(prompt["images"])
        else:
            text = prompt
        ids = self.encode(text)
        rid = f"llm-{next(self._ids)}"
        out = RequestOutput(rid, text if isinstance(text, str) else None, ids, seed=params.seed)
        self.engine.submit(P.Submit(rid, ids, params, images))
        return _Tracker(out, params, self.tokenizer)

    def _run(self, trackers: dict[str, _Tracker]) -> Iterator[tuple[str, str]]:
        """Step the engine; yield (request id, text that can be shown now) per update of `trackers`."""
        pending = set(trackers)
        try:
            while pending and self.engine.has_unfinished():
                for u in self.engine.step():
                    tracker = trackers.get(u.request_id)
                    if tracker is None or tracker.proc.finished or not isinstance(u, TokenOut):
                        continue  # tokens of a step after a stop string
                    delta = tracker.apply(u)
                    if tracker.proc.stopped:  # a stop string: the engine only knows token ids
                        self.engine.abort_request(u.request_id)
                    if tracker.proc.finished:
                        pending.discard(u.request_id)
                    yield u.request_id, delta.text if delta else ""
        finally:
            for rid in pending:  # an exception or an abandoned stream must not leave work behind
                self.engine.abort_request(rid)


def _floats(data: bytes) -> list[float]:
    return array.array("f", data).tolist()
