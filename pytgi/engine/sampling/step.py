"""A step's sampling: which logit rows a step needs, and the tokens, logprobs and prompt logprobs
drawn from them.

A request that reaches the end of its tokens samples one row, plus one per draft token before it
(row j is its output token number len(output) + j, after the first j draft tokens); the draft's
prefix those samples confirm is kept (`accepted_prefix`). A request that asked for prompt logprobs
adds the rows of its chunk that predict prompt tokens. Around the sampler: the watermark, the
structured-output grammars (masks computed while the forward runs, tokens accepted after), and each
seeded row's generator, seeded by (seed, output position).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pytgi.core import protocol as P
from pytgi.core.errors import GrammarError
from pytgi.engine.sampling.grammars import GrammarMatchers, StepMasks
from pytgi.engine.sampling.sampler import Sampler, SamplingMetadata, row_stats
from pytgi.engine.sampling.watermark import apply_watermark
from pytgi.engine.scheduling.request import Request
from pytgi.engine.scheduling.step import ScheduledRequest, StepOutput
from pytgi.engine.speculation.ngram import accepted_prefix


@dataclass(slots=True)
class SamplePlan:
    """The logit rows a step computes (`rows`, flat batch rows) and what each is for."""

    sampled: list[tuple[ScheduledRequest, int]]  # (request, draft position j): the first rows
    spans: list[tuple[ScheduledRequest, int]]  # (request, rows): prompt-logprob rows, after them
    rows: np.ndarray  # [R] int64
    masks: StepMasks | None  # structured output's masks for the sampled rows, being computed


class SamplingStep:
    def __init__(self, vocab_size: int, device: torch.device, grammars: GrammarMatchers) -> None:
        self.vocab_size, self.device, self.grammars = vocab_size, device, grammars
        self.sampler = Sampler()

    def plan(self, batch: list[ScheduledRequest], last_rows: np.ndarray) -> SamplePlan:
        """The rows to compute logits for, given each request's last flat row; starts the grammars'
        masks (on their own thread, while the forward runs)."""
        sampled: list[tuple[ScheduledRequest, int]] = []
        sample_rows: list[int] = []
        spans: list[tuple[ScheduledRequest, int]] = []
        span_rows: list[np.ndarray] = []
        for s, end in zip(batch, last_rows.tolist()):
            if s.samples:
                k = len(s.draft)
                sampled.extend((s, j) for j in range(k + 1))
                sample_rows.extend(range(end - k, end + 1))
            req = s.request
            if req.wants_prompt_logprobs:
                first = req.num_computed_tokens
                n = max(min(first + s.num_new_tokens, req.num_prompt_tokens - 1) - first, 0)
                spans.append((s, n))
                span_rows.append(np.arange(end - s.num_new_tokens + 1, end - s.num_new_tokens + 1 + n))
        rows = np.concatenate([np.array(sample_rows, np.int64), *span_rows]).astype(np.int64)
        masks = self.grammars.start_masks([s.request.request_id for s, _ in sampled]) if sampled else None
        return SamplePlan(sampled, spans, rows, masks)

    def run(self, logits: torch.Tensor | None, plan: SamplePlan) -> StepOutput:
        out = StepOutput()
        n = len(plan.sampled)
        if n:
            assert logits is not None
            self._sample(logits[:n], plan.sampled, out, plan.masks)
        offset = n
        for s, rows in plan.spans:
            assert logits is not None
            out.prompt_logprobs[s.request.request_id] = self._prompt_logprobs(
                logits[offset : offset + rows], s
            )
            offset += rows
        return out

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[tuple[ScheduledRequest, int]],
        out: StepOutput,
        masks: StepMasks | None,
    ) -> None:
        reqs = [s.request for s, _ in rows]
        marked = [i for i, r in enumerate(reqs) if r.params.watermark]
        if marked:
            apply_watermark(logits, marked, [reqs[i].all_ids[-1] for i in marked])
        gens = [self._generator(r, len(r.output_ids) + j) for r, (_, j) in zip(reqs, rows)]
        meta = SamplingMetadata.build(
            [r.params for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids + s.draft[:j] if j else r.output_ids for r, (s, j) in zip(reqs, rows)],
            gens,
            self.vocab_size,
            self.device,
        )
        res = self.sampler(logits, meta, masks.result() if masks is not None else None)
        tokens, logprobs = res.token_ids.tolist(), res.logprobs.tolist()
        for i in masks.rows if masks is not None else ():
            rid = reqs[i].request_id
            try:
                if self.grammars.accept(rid, tokens[i]):
                    out.complete.add(rid)
            except GrammarError as e:
                out.errors[rid] = str(e)
        top_ids = res.top_ids.tolist() if res.top_ids is not None else None
        top_lps = res.top_logprobs.tolist() if res.top_logprobs is not None else None

        def token(i: int) -> P.TokenOut:
            r, top = reqs[i], []
            if top_ids is not None and top_lps is not None and r.params.top_n_tokens:
                n = r.params.top_n_tokens
                top = list(zip(top_ids[i][:n], top_lps[i][:n]))
            return P.TokenOut(r.request_id, tokens[i], logprobs[i], top)

        i = 0
        while i < len(rows):
            s = rows[i][0]
            keep = accepted_prefix(s.draft, tokens[i : i + len(s.draft) + 1]) if s.draft else 0
            out.samples[s.request.request_id] = token(i)
            if keep:
                out.more[s.request.request_id] = [token(i + j) for j in range(1, keep + 1)]
            i += len(s.draft) + 1

    def _generator(self, req: Request, position: int) -> torch.Generator | None:
        """A seeded request's draw for its output token number `position`: seeded by (seed, position),
        so the token does not depend on how many draws came before it (a step verifying a draft
        draws for several positions at once, and drops the draws past a rejected token)."""
        seed = req.params.seed  # drawn when the request was made, if it gave none
        if not req.params.sampling or seed is None:
            return None
        return torch.Generator(self.device).manual_seed(mix_seed(seed, position))

    def _prompt_logprobs(self, logits: torch.Tensor, s: ScheduledRequest) -> list[float | None]:
        """Logprob of each prompt token given the ones before it, for this chunk's positions."""
        req, first = s.request, s.request.num_computed_tokens
        lps: list[float | None] = [None] if first == 0 else []
        if len(logits):
            targets = torch.tensor(req.prompt_ids[first + 1 : first + 1 + len(logits)], device=self.device)
            # each row's logsumexp as the sampler's: a row's value must not change with the chunk's shape
            logits = logits.float()
            lps.extend((logits.gather(1, targets[:, None])[:, 0] - row_stats(logits, True)[1]).tolist())
        return lps


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): one well-spread 63-bit seed per output position."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) % (1 << 63)
