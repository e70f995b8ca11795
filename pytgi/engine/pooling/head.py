"""A causal LM's pooling on the paged engine (Qwen3-Embedding, gte-Qwen2, Qwen3-Reranker, a decoder's
`*ForSequenceClassification`): the answer made from the prompt's final hidden states.

The prompt is computed as a generator's is (chunked, in the running batch, on the KV cache); the step
that reaches its last token hands that token's state here instead of to the sampler, and the request
ends. An embedder that pools every token (mean or first-token pooling, or /embed_all's every state)
keeps each chunk's states as its steps compute them (`partial`) and pools them whole at the last
chunk: one reduction over the prompt's rows, whatever its chunks were. The head runs on each row
alone (a GEMM's rows change with the batch's size); the decoder's rows are batch invariant where the
generator's are (bf16 on pytgi's kernels: the same bits batched or alone; float32 within 1e-6).
docs/embeddings.md.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pytgi.core import protocol as P
from pytgi.core.pooling import PoolingInfo
from pytgi.engine.execution.batch import PagedModel, StepBatch
from pytgi.engine.models.causal_lm import CausalLM
from pytgi.engine.models.decoder import DecoderModel
from pytgi.engine.models.encoder import embedding, pool
from pytgi.engine.scheduling.step import ScheduledRequest, StepOutput


class PoolHead:
    """`task` "embed": the state itself (normalized, cut, as asked); "classify": a score head's logits
    (`model.score_weight`, a sequence classifier's) or two tokens' logits' difference (a causal LM as a
    reranker: `pooling.label_token_ids`)."""

    def __init__(self, model: CausalLM, pooling: PoolingInfo, task: str) -> None:
        self.model, self.pooling, self.task = model, pooling, task
        self.score: torch.Tensor | None = None
        self.partial: dict[str, list[torch.Tensor]] = {}  # an all-token request's states so far, by chunk
        if task == "classify" and not pooling.label_token_ids:
            assert isinstance(model, DecoderModel), "a sequence classifier runs on pytgi's decoder"
            self.score = model.score_weight
            assert self.score is not None, "a sequence classifier loaded without its score head"

    def __call__(self, states: torch.Tensor) -> list[torch.Tensor]:
        """Each row's answer, float32 [dims], from its state alone."""
        rows = states.split(1)
        if self.task == "embed":
            return [r[0].float() for r in rows]
        if self.score is not None:
            return [F.linear(r, self.score)[0].float() for r in rows]
        neg, pos = self.pooling.label_token_ids
        out = []
        for r in rows:
            logits = self.model.compute_logits(r)[0]
            out.append((logits[pos] - logits[neg]).reshape(1))
        return out

    def whole(self, s: ScheduledRequest) -> bool:
        """Whether the request's answer needs every token's state, not only its last one's."""
        p = s.request.pool
        return self.task == "embed" and (self.pooling.method != "last" or (p is not None and p.tokens))

    def drop(self, request_id: str) -> None:
        """A request gone before its last chunk (aborted): its states so far."""
        self.partial.pop(request_id, None)

    def step(self, paged: PagedModel, batch: list[ScheduledRequest], step: StepBatch) -> StepOutput:
        """Run the step and pool the requests whose prompt it finishes (the others' chunks only write
        their KV; an all-token request's chunk also leaves its states in `partial`)."""
        out = StepOutput()
        ends = np.cumsum(step.layout.query_lens)
        # the step's rows to read: a request's whole chunk where it needs every state, else its last
        # row where the step ends its prompt, else none; `spans`: each request's part of them
        firsts = np.array(
            [e - (s.num_new_tokens if self.whole(s) else int(s.samples)) for e, s in zip(ends, batch)],
            dtype=np.int64,
        )
        rows = np.concatenate([np.arange(a, e) for a, e in zip(firsts, ends)])
        counts = np.cumsum(ends - firsts)
        spans = list(zip([0, *counts[:-1].tolist()], counts.tolist()))
        states = paged.forward(step, rows.astype(np.int64), hidden=True)
        if states is None:  # no request needs a state this step
            return out
        for s, (a, b) in zip(batch, spans, strict=True):
            req = s.request
            if self.whole(s):
                if req.num_computed_tokens == 0:  # its first chunk (again, if it was preempted)
                    self.partial[req.request_id] = []
                self.partial[req.request_id].append(states[a:b].float())
            if not s.samples:
                continue
            p = req.pool
            assert p is not None, "a generation request on a pooling model"
            rows_out = 1
            if self.whole(s):
                hidden = torch.cat(self.partial.pop(req.request_id))
                if p.tokens:
                    v, rows_out = hidden, hidden.shape[0]
                else:
                    v = embedding(pool(hidden, [hidden.shape[0]], self.pooling)[0], self.pooling, p)
            else:
                v = self(states[a:b])[0]
                if self.task == "embed":
                    v = embedding(v, self.pooling, p)
            out.pooled[req.request_id] = P.PoolOut(
                req.request_id,
                v.contiguous().cpu().numpy().tobytes(),
                rows_out,
                req.num_prompt_tokens,
                max(req.scheduled - req.arrived, 0.0),  # waited before its first chunk
            )
        return out
