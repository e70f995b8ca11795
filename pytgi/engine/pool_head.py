"""A causal LM's pooling on the paged engine (Qwen3-Embedding, gte-Qwen2, Qwen3-Reranker, a decoder's
`*ForSequenceClassification`): the answer made from the last prompt token's final hidden state.

The prompt is computed as a generator's is (chunked, in the running batch, on the KV cache); the step
that reaches its last token hands that token's state here instead of to the sampler, and the request
ends. The head runs on each row alone (a GEMM's rows change with the batch's size); the decoder's
rows are batch invariant where the generator's are (bf16 on pytgi's kernels: the same bits batched or
alone; float32 within 1e-6). docs/embeddings.md.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pytgi.core import protocol as P
from pytgi.core.pooling import PoolingInfo
from pytgi.engine.batch import PagedModel, StepBatch
from pytgi.engine.models.encoder import embedding
from pytgi.engine.models.loader import CausalLM
from pytgi.engine.step import ScheduledRequest, StepOutput


class PoolHead:
    """`task` "embed": the state itself (normalized, cut, as asked); "classify": a score head's logits
    (`model.score_weight`, a sequence classifier's) or two tokens' logits' difference (a causal LM as a
    reranker: `pooling.label_token_ids`)."""

    def __init__(self, model: CausalLM, pooling: PoolingInfo, task: str) -> None:
        self.model, self.pooling, self.task = model, pooling, task
        self.score: torch.Tensor | None = None
        if task == "classify" and not pooling.label_token_ids:
            self.score = getattr(model, "score_weight", None)
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

    def step(self, paged: PagedModel, batch: list[ScheduledRequest], step: StepBatch) -> StepOutput:
        """Run the step and pool the requests whose prompt it finishes (the others' chunks only write
        their KV)."""
        out = StepOutput()
        done = [i for i, s in enumerate(batch) if s.samples]
        states = paged.forward(step, step.last_rows[np.array(done, dtype=np.int64)], hidden=True)
        if states is None:
            return out
        for i, v in zip(done, self(states), strict=True):
            req = batch[i].request
            p = req.pool
            assert p is not None, "a generation request on a pooling model"
            if self.task == "embed":
                v = embedding(v, self.pooling, p)
            out.pooled[req.request_id] = P.PoolOut(
                req.request_id,
                v.contiguous().cpu().numpy().tobytes(),
                1,
                req.num_prompt_tokens,
                max(req.scheduled - req.arrived, 0.0),  # waited before its first chunk
            )
        return out
