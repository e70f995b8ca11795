"""Vectorised next-token selection for a batch of requests.

One row of ``logits`` per request that picks a token this step. The processing order follows Hugging
Face transformers' logits processors and warpers (and TGI's heterogeneous versions of them):

1. repetition penalty (HF ``RepetitionPenaltyLogitsProcessor``) over prompt and output tokens;
2. frequency / presence penalties (OpenAI semantics) over output tokens only, then OpenAI's
   ``logit_bias`` (added to the listed tokens' logits);
3. optional ``logits_mask`` (structured output's grammar): forbidden tokens get ``-inf``, so greedy and
   sampling rows alike choose among the allowed ones (a bool mask, or the additive 0 / -inf bias the
   engine builds from llguidance's bitmasks, which is cheaper to apply);
4. greedy rows: ``argmax`` of the result;
5. sampling rows: temperature, top-k, top-p, min-p, typical-p (HF ``TopKLogitsWarper``, ``TopPLogitsWarper``,
   ``MinPLogitsWarper``, ``TypicalLogitsWarper``, in that order, with ``min_tokens_to_keep=1``; min-p
   drops tokens less likely than ``min_p`` times the top token), then one draw from the softmax.

Draws use the exponential race: with ``q ~ Exp(1)`` i.i.d. per token, ``argmax(p / q)`` is distributed as
``p``. Each sampling row draws exactly ``V`` uniform values from its own generator per call
(``q = -log(1 - u)``: several times cheaper than ``exponential_``), so a request's sample depends only on
its own seed, step count and probabilities -- never on what it is batched with.

Top-k and top-p find their cut-offs with ``topk`` over a few dozen candidates (widened until the kept
mass is covered) instead of sorting the whole vocabulary per row; the kept set is the same as the sort's.

Reported logprobs (chosen token and top-n alternatives) are ``log_softmax`` of the *raw* float32 logits,
before penalties, mask, temperature and warpers (vLLM's default "raw" logprobs): they describe the
model, not the request's sampling settings, and are identical for greedy and sampling requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch

from pytgi.core.sampling_params import SamplingParams
from pytgi.engine import kernels
from pytgi.engine.models.cpu import triton_available

# Tiny positive floor for the exponential noise: a zero draw would turn p / q into inf or nan.
_NOISE_FLOOR = torch.finfo(torch.float32).tiny


def _pad_rows(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0)
    return [list(r) + [pad] * (width - len(r)) for r in rows]


def _ids_tensor(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, L] int64 padded with vocab_size; out-of-range ids map to the pad column, as HF clamps them."""
    ids = torch.tensor(_pad_rows(rows, vocab_size), dtype=torch.int64, device=device)
    if ids.dim() == 1:  # every row empty: torch.tensor([[], []]) is [B, 0] already, but be explicit
        ids = ids.reshape(len(rows), 0)
    return torch.where((ids < 0) | (ids > vocab_size), vocab_size, ids)


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 on greedy rows (treat as 1 for logprob purposes)
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    typical_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    # logit_bias as (rows, token ids, biases) to add; None when no row has one
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    repetition_penalty: torch.Tensor  # [B] float32, 1 = off
    frequency_penalty: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    prompt_ids: torch.Tensor | None  # [B, Lp] int64 padded with vocab_size; None when no row uses it
    output_ids: torch.Tensor | None  # [B, Lo] int64 padded with vocab_size; None when no penalty at all
    generators: list[torch.Generator | None]  # seeded generator on sampling rows, None on greedy rows
    max_top_n: int  # max top_n_tokens over rows (0 = none asked)
    all_greedy: bool
    no_penalties: bool  # fast path flags so a plain greedy batch costs one argmax
    no_warpers: bool  # no top_k/top_p/typical_p/min_p row

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Pack per-request parameters into batch tensors.

        A row samples only when its params say so *and* it has a generator; every other row is greedy
        and gets all warpers switched off, so the flags below reflect what really runs.
        """
        n = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(generators) == n):
            raise ValueError("params, prompt_ids, output_ids and generators must have one entry per row")
        sampling = [p.sampling and g is not None for p, g in zip(params, generators)]
        gens = [g if s else None for g, s in zip(generators, sampling)]

        temperature = [p.temperature if s else 0.0 for p, s in zip(params, sampling)]
        # top_k >= V keeps everything: treat it as off so the warper can be skipped.
        top_k = [p.top_k if s and p.top_k < vocab_size else 0 for p, s in zip(params, sampling)]
        top_p = [p.top_p if s else 1.0 for p, s in zip(params, sampling)]
        typical_p = [p.typical_p if s else 1.0 for p, s in zip(params, sampling)]
        min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampling)]
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        logit_bias = None
        if bias:
            at_row, at_token, value = zip(*bias)
            logit_bias = (
                torch.tensor(at_row, dtype=torch.int64, device=device),
                torch.tensor(at_token, dtype=torch.int64, device=device),
                torch.tensor(value, dtype=torch.float32, device=device),
            )
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]

        uses_rep = [r != 1.0 for r in rep]
        uses_any = [u or f != 0.0 or q != 0.0 for u, f, q in zip(uses_rep, freq, pres)]
        # Only rows that use a penalty contribute ids: the others stay all-padding (smaller tensors).
        prompt_t = None
        if any(uses_rep):
            rows = [ids if u else [] for ids, u in zip(prompt_ids, uses_rep)]
            prompt_t = _ids_tensor(rows, vocab_size, device)
        output_t = None
        if any(uses_any):
            rows = [ids if u else [] for ids, u in zip(output_ids, uses_any)]
            output_t = _ids_tensor(rows, vocab_size, device)

        # one copy to the device for all of them (top_k's values are exact in float32)
        packed = torch.tensor(
            [temperature, top_p, typical_p, min_p, rep, freq, pres, top_k], dtype=torch.float32
        ).reshape(8, n)
        f = packed.to(device, non_blocking=True)

        return cls(
            temperature=f[0],
            top_k=f[7].long(),
            top_p=f[1],
            typical_p=f[2],
            min_p=f[3],
            logit_bias=logit_bias,
            repetition_penalty=f[4],
            frequency_penalty=f[5],
            presence_penalty=f[6],
            prompt_ids=prompt_t,
            output_ids=output_t,
            generators=gens,
            max_top_n=min(max((p.top_n_tokens for p in params), default=0), vocab_size),
            all_greedy=not any(sampling),
            no_penalties=not any(uses_any) and logit_bias is None,
            no_warpers=not any(
                k > 0 or tp < 1.0 or ty < 1.0 or mp > 0.0
                for k, tp, ty, mp in zip(top_k, top_p, typical_p, min_p)
            ),
        )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: log_softmax of the raw logits at the chosen token
    top_ids: torch.Tensor | None  # [B, max_top_n] int64 (None when max_top_n == 0)
    top_logprobs: torch.Tensor | None  # [B, max_top_n] float32


# --- penalties (all rows) -----------------------------------------------------------------------------


def _token_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] bool: which tokens occur in each row of padded ids (the pad column V is dropped)."""
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, ids, True)
    return mask[:, :vocab_size]


def _token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32: how often each token occurs in each row of padded ids."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
    return counts[:, :vocab_size]


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    vocab_size = logits.shape[1]
    if meta.prompt_ids is not None:
        seen = _token_mask(meta.prompt_ids, vocab_size)
        if meta.output_ids is not None:
            seen |= _token_mask(meta.output_ids, vocab_size)
        penalty = meta.repetition_penalty[:, None]
        # HF: shrink positive logits, grow negative ones; a penalty of 1 is an exact identity.
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(seen, penalised, logits)
    if meta.output_ids is not None:
        counts = _token_counts(meta.output_ids, vocab_size)
        logits = (
            logits
            - meta.frequency_penalty[:, None] * counts
            - meta.presence_penalty[:, None] * (counts > 0).to(torch.float32)
        )
    if meta.logit_bias is not None:
        rows, cols, vals = meta.logit_bias
        logits = logits.index_put((rows, cols), vals, accumulate=True)  # a new tensor: raw stays raw
    return logits


# --- warpers (sampling rows only) ---------------------------------------------------------------------


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool, use_p: bool
) -> torch.Tensor:
    """Top-k then top-p; rows with k == 0 / p == 1 are left untouched."""
    vocab_size = logits.shape[1]
    if use_k:
        # HF keeps every token >= the k-th largest value, so ties at the threshold survive.
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
        widest = int(torch.where(k < vocab_size, k, 1).max())
        kth = logits.topk(widest, dim=-1).values.gather(1, (k.clamp(max=widest) - 1)[:, None])
        threshold = torch.where((k < vocab_size)[:, None], kth, logits.min(dim=-1, keepdim=True).values)
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if use_p:
        # float64: the row sums' order changes with the batch's shape, and must not move the cut
        logits = logits.masked_fill(_top_p_removed(logits.double().softmax(dim=-1), top_p), float("-inf"))
    return logits


def _top_p_removed(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: HF's top-p drops the low tail whose mass is <= 1 - p, i.e. every token whose more
    probable tokens already hold >= p (the most probable is always kept). Only the candidates before the
    cut are sorted: the widest top-`n` whose mass reaches p on every row (all V at worst)."""
    vocab_size = probs.shape[1]
    active = top_p < 1
    n = min(64, vocab_size)
    while True:
        values, ids = probs.topk(n, dim=-1)
        if n == vocab_size or bool(((values.sum(dim=-1) >= top_p) | ~active).all()):
            break
        n = min(4 * n, vocab_size)
    before = values.cumsum(dim=-1) - values  # mass of the more probable candidates
    keep = before < top_p[:, None]
    keep[:, 0] = True
    removed = torch.ones_like(probs, dtype=torch.bool).scatter_(1, ids, ~keep)
    return removed & active[:, None]  # float error must not touch rows that have top_p off


def _typical(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (HF TypicalLogitsWarper, min_tokens_to_keep=1) per row mass."""
    log_p = torch.log_softmax(logits.double(), dim=-1)  # float64: as in _top_k_top_p
    entropy = -(log_p * log_p.exp()).nansum(-1, keepdim=True)  # nansum: -inf * 0 on masked tokens
    shifted = (-log_p - entropy).abs()
    sorted_scores, sorted_idx = shifted.sort(dim=-1)
    cumulative = logits.double().gather(1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass[:, None]).sum(dim=1).clamp(max=logits.shape[1] - 1)
    remove = sorted_scores > sorted_scores.gather(1, last[:, None])
    remove[:, 0] = False
    remove &= (mass < 1)[:, None]
    return logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))


def _warp(logits: torch.Tensor, meta: SamplingMetadata, rows: torch.Tensor | None) -> torch.Tensor:
    """Temperature and the warpers for the sampling rows (``rows`` selects them; None = all)."""

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t[rows]

    temperature = pick(meta.temperature)
    # A sampling row with temperature 0 is resolved greedily later; divide by 1 to stay finite.
    logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if meta.no_warpers:
        return logits
    top_k, top_p, typical_p = pick(meta.top_k), pick(meta.top_p), pick(meta.typical_p)
    min_p = pick(meta.min_p)
    # One small host sync to skip the warpers no row of this batch uses (each costs a V-wide sort).
    used = torch.stack([(top_k > 0).any(), (top_p < 1).any(), (typical_p < 1).any(), (min_p > 0).any()])
    use_k, use_p, use_typ, use_min_p = used.tolist()
    if use_k or use_p:
        logits = _top_k_top_p(logits, top_k, top_p, use_k, use_p)
    if use_min_p:  # HF's order: top-k, top-p, min-p, typical-p
        logits = _min_p(logits, min_p)
    if use_typ:
        logits = _typical(logits, typical_p)
    return logits


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """HF MinPLogitsWarper: drop tokens whose probability is below min_p times the top token's; in
    logits, below the row's largest + log(min_p) (no softmax: each row's cut is exact whatever the
    batch). Rows with min_p 0 keep everything."""
    top = logits.max(dim=-1, keepdim=True).values
    cut = top + torch.log(min_p)[:, None]  # -inf where min_p == 0
    return logits.masked_fill(logits < cut, float("-inf"))


# --- drawing -------------------------------------------------------------------------------------------


def _exponential_noise(
    generators: list[torch.Generator], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[S, V] Exp(1) noise, one row per generator: exactly V draws each, so generators advance identically
    whatever the batch looks like. Drawn on the generator's own device, then moved."""
    rows = [torch.rand(vocab_size, device=g.device, generator=g) for g in generators]
    return torch.stack(rows).to(device).neg_().log1p_().neg_().clamp_(min=_NOISE_FLOOR)


def _draw(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(p / q) with q ~ Exp(1) picks token i with probability p_i; taken as
    argmax(logit - log q), which needs no softmax (whose row sum would round differently as the
    batch's shape changes: batch invariance)."""
    return (logits - noise.log()).argmax(dim=-1)


@overload
def row_stats(logits: torch.Tensor, lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def row_stats(logits: torch.Tensor, lse: Literal[False]) -> tuple[torch.Tensor, None]: ...
@overload
def row_stats(logits: torch.Tensor, lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]: ...
def row_stats(logits: torch.Tensor, lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's argmax (first index of its largest value) and, if `lse`, its logsumexp: one pass of
    the C kernel on the CPU (a few times faster than PyTorch's reductions, and each row's values the
    same whatever the batch); on CUDA the Triton kernel's one pass (`pytgi.engine.kernels.gpu.row_stats`);
    PyTorch without either, and for rows with NaN or inf."""
    out: torch.Tensor | None
    if logits.device.type == "cuda" and triton_available():
        from pytgi.engine.kernels import gpu

        arg, out, bad = gpu.row_stats(logits.float())
        if not lse:
            out = None
    elif logits.device.type != "cpu" or not kernels.available():
        return logits.argmax(dim=-1), (torch.stack([row.logsumexp(dim=0) for row in logits]) if lse else None)
    else:
        logits = logits.contiguous()
        arg, out, bad = kernels.logit_stats(logits, lse)
    if bad.any():
        for i in bad.nonzero()[:, 0].tolist():
            arg[i] = logits[i].argmax()
            if out is not None:
                out[i] = logits[i].logsumexp(dim=0)
    return arg, out


class Sampler:
    """Stateless; call once per step with the batch's logits and metadata."""

    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        logits_mask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits: [B, V] (upcast to float32). logits_mask: optional [B, V], bool (True = allowed) or
        float (added: 0 = allowed, -inf = forbidden); forbidden tokens get -inf before choosing."""
        raw = logits.float()
        processed = raw if meta.no_penalties else _apply_penalties(raw, meta)
        if logits_mask is not None and logits_mask.dtype == torch.bool:
            processed = processed.masked_fill(~logits_mask, float("-inf"))
        elif logits_mask is not None:
            processed = processed + logits_mask

        # greedy answer for every row (the whole job when all greedy); with the raw logits' logsumexp
        # when the same pass can give it
        token_ids, lse = row_stats(processed, processed is raw)
        sample_rows = [i for i, g in enumerate(meta.generators) if g is not None]
        if not meta.all_greedy and sample_rows:
            token_ids = self._sample_rows(processed, meta, token_ids, sample_rows)
        return self._logprobs(raw, token_ids, meta.max_top_n, lse)

    @staticmethod
    def _sample_rows(
        processed: torch.Tensor, meta: SamplingMetadata, token_ids: torch.Tensor, sample_rows: list[int]
    ) -> torch.Tensor:
        all_rows = len(sample_rows) == processed.shape[0]
        rows = None if all_rows else torch.tensor(sample_rows, device=processed.device)
        warped = _warp(processed if rows is None else processed[rows], meta, rows)
        generators = [g for i in sample_rows if (g := meta.generators[i]) is not None]
        assert len(generators) == len(sample_rows), "a sampled row without its generator"
        noise = _exponential_noise(generators, processed.shape[1], processed.device)
        sampled = _draw(warped, noise)
        temperature = meta.temperature if rows is None else meta.temperature[rows]
        greedy = token_ids if rows is None else token_ids[rows]
        sampled = torch.where(temperature > 0, sampled, greedy)
        if rows is None:
            return sampled
        return token_ids.index_copy(0, rows, sampled)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, token_ids: torch.Tensor, max_top_n: int, lse: torch.Tensor | None
    ) -> SamplerOutput:
        """Log-softmax of the raw logits at the chosen tokens (and the top n): each row's logsumexp
        from `row_stats`, whose value does not depend on the batch, subtracted element-wise."""
        if lse is None:
            lse = row_stats(raw, True)[1]
        if max_top_n == 0:  # only the chosen token's: no [B, V] log-softmax
            return SamplerOutput(token_ids, raw.gather(1, token_ids[:, None]).squeeze(1) - lse, None, None)
        log_probs = raw - lse[:, None]
        top_logprobs, top_ids = log_probs.topk(max_top_n, dim=-1)
        chosen = log_probs.gather(1, token_ids[:, None]).squeeze(1)
        return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)
