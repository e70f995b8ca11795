"""Green-list watermarking (Kirchenbauer et al., "A Watermark for Large Language Models", 2023),
with TGI's constants: the previous token seeds a permutation of the vocabulary; the first
gamma·V tokens of it are "green" and get +delta on their logits. A detector that knows the
scheme counts green tokens: a watermarked text has far more than the expected gamma fraction.
"""

from __future__ import annotations

import itertools
import math
import os

import torch

GAMMA = float(os.environ.get("WATERMARK_GAMMA", "0.5"))
DELTA = float(os.environ.get("WATERMARK_DELTA", "2.0"))
HASH_KEY = 15485863  # a large prime, as in the paper's reference code


def green_list(prev_token: int, vocab_size: int, gamma: float = GAMMA) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(HASH_KEY * prev_token)
    return torch.randperm(vocab_size, generator=gen)[: int(gamma * vocab_size)]


def apply_watermark(
    logits: torch.Tensor, rows: list[int], prev_tokens: list[int], delta: float = DELTA
) -> None:
    """In place: +delta on the green list of each watermarked row (one permutation per row)."""
    vocab = logits.shape[1]
    for row, prev in zip(rows, prev_tokens):
        logits[row, green_list(prev, vocab).to(logits.device)] += delta


def z_score(token_ids: list[int], vocab_size: int, gamma: float = GAMMA) -> float:
    """Detection statistic over a token sequence (the first token has no predecessor)."""
    hits = sum(
        int(t in set(green_list(p, vocab_size, gamma).tolist())) for p, t in itertools.pairwise(token_ids)
    )
    n = len(token_ids) - 1
    return (hits - gamma * n) / math.sqrt(n * gamma * (1 - gamma)) if n > 0 else 0.0
