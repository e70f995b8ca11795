"""Speculative decoding with n-gram (prompt-lookup) drafts: TGI's `--speculate N` without a draft model.

A decode step on the CPU reads every weight once whatever the number of rows, so a step that
verifies a few guessed tokens costs little more than a step of one. The guesses come from the
request's own tokens: the longest suffix (up to `MAX_NGRAM` tokens) that occurred before is
looked up, and the tokens that followed its latest occurrence are the draft. That pays off where
the output repeats its input (editing code, quoting, summaries with names) and costs a few rows
where it does not.

The scheduler asks `Drafter.propose` for each decode; the runner computes the request's last
token and its draft in one step (a row per position), samples every row, and keeps the draft's
longest prefix the samples agree with, plus the sample after it (`accepted_prefix`). Every row is
sampled as the request's next token at that position would be without speculation: greedy rows
by argmax, seeded rows with the draw of that position (`pytgi.engine.execution.runner`), so a request's
output is the one it would have had without speculation, token for token. For a draft of one
token per position (a point mass) this is the rejection sampling of Leviathan et al.: the draft is
accepted with probability p(draft), and on rejection the token comes from p without it.

The scheduler takes any `Proposer`: this n-gram one, or a draft model's
(`pytgi.engine.speculation.draft_model`, `--draft-model-id`). Medusa/EAGLE heads would be a third. A
proposer keeps its own state per request id, from its first proposal for the request until `release` (the
request ended or was preempted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pytgi.engine.scheduling.request import Request

MAX_NGRAM = 8  # longest suffix matched: a longer match picks the right one of a token's occurrences
CANDIDATES = 64  # a token's latest occurrences tried
WEAK_DRAFT = 2  # tokens drafted on a one-token match (weak evidence: often the wrong occurrence)
# The draft rows a step may add: verification is nearly free while the step stays small (the low-bit
# kernels are bound by reading the weights), not once a big batch has made the step compute bound.
MAX_STEP_ROWS = 16


class Proposer(Protocol):
    def propose_batch(self, reqs: list[Request], spare: int) -> list[list[int]]:
        """A draft for each request (possibly empty), `spare` tokens in all at most."""
        ...

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """A step verified `drafted` tokens of `req`'s draft and kept `accepted`: adapt."""
        ...

    def release(self, req: Request) -> None:
        """The request ended or was preempted: drop its state."""
        ...


@dataclass(slots=True)
class DraftState:
    """One request's token index and draft length."""

    where: dict[int, list[int]] = field(default_factory=dict)  # token → the positions it occurs at, in order
    indexed: int = 0  # positions before this one are in `where`
    length: float = 0.0  # the next draft's length (adapted by acceptance); 0 until the first proposal
    drafted: int = 0
    accepted: int = 0


class Drafter:
    """Proposes n-gram drafts of at most `k` tokens and adapts each request's length to its
    acceptance: a fully accepted draft doubles the next one, a partly accepted one sets it to the
    accepted count plus one, a rejected one halves it (never below one token)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.states: dict[str, DraftState] = {}  # request id → its index and draft length

    def propose(self, req: Request, budget: int) -> list[int]:
        """Up to min(the request's draft length, `budget`) tokens that may follow `req.all_ids`."""
        if self.k <= 0 or budget <= 0:
            return []
        state = self.states.get(req.request_id)
        if state is None:
            state = self.states[req.request_id] = DraftState(length=float(self.k))
        ids = req.all_ids
        L = len(ids)
        where = state.where
        for pos in range(state.indexed, L - 1):  # the last token must not match itself
            where.setdefault(ids[pos], []).append(pos)
        state.indexed = max(state.indexed, L - 1)
        room = req.params.max_new_tokens - len(req.output_ids) - 1  # the step samples one token anyway
        want = min(int(state.length), budget, room)
        if want <= 0 or L < 2:
            return []
        # the occurrence of the last token whose preceding tokens match the suffix longest (latest on a tie)
        best, best_n = -1, 0
        for pos in reversed(where.get(ids[-1], ())[-CANDIDATES:]):
            n = 1
            while n < MAX_NGRAM and n <= pos and ids[pos - n] == ids[L - 1 - n]:
                n += 1
            if n > best_n:
                best, best_n = pos, n
                if n == MAX_NGRAM:
                    break
        if best < 0:
            return []
        if best_n == 1:
            want = min(want, WEAK_DRAFT)
        end = best + 1
        draft = ids[end : end + want]
        while len(draft) < want:  # the match runs into the suffix: a period, continued
            draft.append(draft[len(draft) - (L - end)])
        return draft

    def propose_batch(self, reqs: list[Request], spare: int) -> list[list[int]]:
        """A draft for each request in turn (possibly empty), `spare` tokens in all at most."""
        drafts = []
        for req in reqs:
            drafts.append(self.propose(req, spare) if spare > 0 else [])
            spare -= len(drafts[-1])
        return drafts

    def release(self, req: Request) -> None:
        self.states.pop(req.request_id, None)

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        state = self.states[req.request_id]
        state.drafted += drafted
        state.accepted += accepted
        state.length = next_length(state.length, self.k, drafted, accepted)


def next_length(length: float, k: int, drafted: int, accepted: int) -> float:
    """The next draft's length after a step kept `accepted` of `drafted` tokens: doubled after a full
    acceptance (a run of copied text: back to long drafts quickly, at most k), the accepted count
    plus one after a partial one, halved after a rejection (never below one)."""
    if accepted == drafted:
        return min(length * 2, float(k))
    return max(1.0, length / 2 if accepted == 0 else float(accepted + 1))


def accepted_prefix(draft: list[int], sampled: list[int]) -> int:
    """How many draft tokens the rows' samples confirm: sampled[i] is the token chosen at draft
    position i (sampled has one more row, the token after the last draft token)."""
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return a
