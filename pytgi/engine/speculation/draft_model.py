"""Speculative decoding with a draft model (`--draft-model-id`): a smaller model with the same
tokenizer guesses each decode's next tokens, and the model verifies them in its next step.

The draft model runs in the engine process (rank 0, whole even when the model is sharded:
`pytgi.engine.distributed.unsharded`) on its own paged KV cache, with the kernels the machine has. Each
step, for the decodes the scheduler lets draft, it computes in one batched forward the request's
tokens it has not seen yet (the whole prompt the first time), then decodes the draft one token per
forward, greedily. Its KV is kept for the tokens the model accepted;
the rest is recomputed when needed, so a draft that was never verified (the step ran out of blocks)
costs nothing but the work.

Drafts are the draft model's argmax, a point mass, whatever the request's sampling: the runner
samples every verified row as it would without speculation and keeps the draft's prefix those
samples confirm (`pytgi.engine.speculation.ngram.accepted_prefix`). For a point-mass draft that is the
rejection sampling of Leviathan et al. (the draft token is kept with probability p(token)), so the
output distribution is the model's, and a seeded request's tokens are even the ones it gets without
speculation. Drafting from the draft model's own distribution q would keep more tokens at high
temperatures, at the price of a residual distribution max(0, p - q) per rejection and seeded outputs
that change with speculation; pytgi does not do that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pytgi.core.errors import DraftModelError
from pytgi.core.model_files import resolve_model
from pytgi.engine import distributed as dist
from pytgi.engine.execution.batch import PagedModel, StepBatch
from pytgi.engine.kv.blocks import BlockManager
from pytgi.engine.loading.model import load_model, model_family, read_config, resolve_dtype
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.sampling.sampler import row_stats
from pytgi.engine.scheduling.request import Request
from pytgi.engine.speculation.ngram import next_length

# Prompt tokens the draft model computes per step for requests it is catching up on (a new prompt):
# the step's other streams wait for them.
CATCHUP_TOKENS = 512


@dataclass(slots=True, eq=False)
class _Seq:
    """The draft model's view of one request: the tokens its KV holds and their blocks (a
    `pytgi.engine.kv.blocks.BlockSeq`)."""

    ids: list[int] = field(default_factory=list)  # the tokens whose KV the draft cache holds, in order
    known: int = 0  # the request's tokens at the last proposal: ids[:known] are still its tokens
    block_table: list[int] = field(default_factory=list)
    length: float = 0.0  # the next draft's length, adapted by acceptance as the n-gram drafter's
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def num_computed_tokens(self) -> int:
        return len(self.ids)

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:  # BlockManager sets it on a first allocation
        del self.ids[value:]

    @property
    def num_tokens(self) -> int:  # what `BlockManager.trim` keeps blocks for
        return len(self.ids)


def _same_tokenizer(a: Path, b: Path) -> bool:
    from tokenizers import Tokenizer

    ta, tb = (Tokenizer.from_file(str(p / "tokenizer.json")) for p in (a, b))
    return ta.get_vocab(with_added_tokens=True) == tb.get_vocab(with_added_tokens=True)


class DraftModel:
    """Proposes drafts of at most `k` tokens with a second, smaller model (see the module's doc)."""

    def __init__(
        self,
        model: str,
        k: int,
        target_path: Path,
        target_vocab: int,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        eos_token_ids: frozenset[int],
        batch_invariant: bool = True,
        progress: bool = True,
    ) -> None:
        resolved = resolve_model(model, progress=progress)
        path, self.model_id = resolved.path, resolved.model_id
        if not _same_tokenizer(path, target_path):
            raise DraftModelError(
                f"the draft model {model!r} does not have the model's tokenizer: "
                "speculative decoding needs the same token ids"
            )
        self.k, self.device, self.vocab, self.eos = k, device, target_vocab, eos_token_ids
        dtype = resolve_dtype("auto", read_config(path), device)
        cpu = Kernels.for_device(device, dtype, batch_invariant=batch_invariant)
        with dist.unsharded():  # whole on rank 0, whatever the model's shards
            self.paged = PagedModel(
                load_model(path, dtype, device, cpu, "auto"),
                dtype,
                device,
                unsharded=True,
                family=model_family(path),
            )
        self.paged.allocate(num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[str, _Seq] = {}

    # -- the scheduler's proposer interface ------------------------------------------------------------
    def propose_batch(self, reqs: list[Request], spare: int) -> list[list[int]]:
        """A draft for each request (possibly empty), `spare` tokens in all at most. A request the draft
        model is far behind on (a new prompt) first catches up in pieces, CATCHUP_TOKENS a step for
        all requests together, and drafts once it is near: a long prompt does not stall the step."""
        wants: list[
            tuple[Request, _Seq, list[int], int]
        ] = []  # (request, its view, tokens to compute, draft length)
        catchup = CATCHUP_TOKENS
        for req in reqs:
            seq = self.seqs.get(req.request_id)
            if seq is None:
                seq = self.seqs[req.request_id] = _Seq(
                    length=float(self.k), num_prompt_tokens=req.num_prompt_tokens
                )
            room = req.params.max_new_tokens - len(req.output_ids) - 1  # the step samples one token anyway
            want = min(int(seq.length), spare, room)
            if want <= 0:
                continue
            self._sync(seq, req.all_ids)
            behind = req.num_tokens - len(seq.ids)
            if behind > catchup:
                if catchup <= 0:
                    continue
                feed, want = req.all_ids[len(seq.ids) : len(seq.ids) + catchup], 0  # a piece, no draft yet
            else:
                feed = req.all_ids[len(seq.ids) :]
            # blocks for the tokens to catch up on and the draft's first want - 1 tokens
            if not self.blocks.allocate(seq, len(feed) + max(want - 1, 0)):
                continue
            wants.append((req, seq, feed, want))
            seq.known = len(seq.ids) + len(feed)  # the request's tokens, once computed below
            catchup -= len(feed)
            spare -= want
        drafts: dict[str, list[int]] = {req.request_id: [] for req in reqs}
        if wants:
            self._draft(wants, drafts)
        return [drafts[req.request_id] for req in reqs]

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """The step kept `accepted` of the `drafted` tokens: adapt the next draft's length (as the
        n-gram drafter does). The KV of rejected tokens is dropped at the next proposal."""
        seq = self.seqs[req.request_id]
        seq.length = next_length(seq.length, self.k, drafted, accepted)

    def release(self, req: Request) -> None:
        seq = self.seqs.pop(req.request_id, None)
        if seq is not None:
            self.blocks.free(seq)

    # -- the draft model's forwards ----------------------------------------------------------------------
    def _sync(self, seq: _Seq, ids: list[int]) -> None:
        """Keep the KV of the longest common prefix of what the cache holds and the request's tokens,
        less the last token (its logits give the draft's first token)."""
        limit = min(len(seq.ids), len(ids) - 1)
        n = min(seq.known, limit)  # a request's tokens only grow: only what was drafted may differ
        while n < limit and seq.ids[n] == ids[n]:
            n += 1
        del seq.ids[n:]
        self.blocks.trim(seq)

    @torch.inference_mode()
    def _draft(self, wants: list[tuple[Request, _Seq, list[int], int]], drafts: dict[str, list[int]]) -> None:
        feed = [f for _, _, f, _ in wants]  # catch up, then one draft token each
        active = list(range(len(wants)))
        while active:
            nxt = self._forward([wants[i][1] for i in active], [feed[i] for i in active])
            still = []
            for i, token in zip(active, nxt):
                req, _, _, want = wants[i]
                draft = drafts[req.request_id]
                if (
                    want == 0 or token >= self.vocab
                ):  # catching up; or a token the model lacks (padded vocabulary)
                    continue
                draft.append(token)
                if len(draft) < want and token not in self.eos:
                    feed[i] = [token]
                    still.append(i)
            active = still

    def _forward(self, seqs: list[_Seq], tokens: list[list[int]]) -> list[int]:
        """Compute `tokens` after each sequence's cached ones (appending them to it); the argmax after
        each sequence's last token."""
        step = StepBatch.build(
            tokens, [len(s.ids) for s in seqs], [s.block_table for s in seqs], self.blocks.block_size
        )
        logits = self.paged.forward(step, step.last_rows)
        assert logits is not None
        for s, ts in zip(seqs, tokens):
            s.ids.extend(ts)
        return row_stats(logits, False)[0].tolist()
