"""Token masks for structured output: one llguidance matcher per constrained request, on rank 0.

The request's grammar string comes from `pytgi.core.grammar` (checked before it was queued). Matchers
are built in a small thread pool as soon as a request is added, and a built matcher is kept per
grammar so the next request with the same schema starts from a copy. Each step, the masks of the
constrained rows are computed in a thread while the model's forward runs (llguidance releases the
GIL and parallelises over rows), then turned into the sampler's `logits_mask`. After sampling, each
matcher consumes its token: a grammar that is complete ends its request, and a token the matcher
refuses (it cannot happen through the mask, but a bug must not poison the batch) fails only its own
request.

A matcher lives until its request ends, so preemption (which recomputes KV but keeps the sampled
tokens) leaves its state as it was; `n` > 1 and best_of are separate requests with their own
matchers; prefix caching and chunked prefill do not touch it (a request samples only once its
prompt is computed).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pytgi.core.errors import GrammarError

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher

log = logging.getLogger(__name__)

_CACHED_GRAMMARS = 64


# Each bitmask byte's 8 tokens as additive logits (0 allowed, -inf forbidden), bit i = token 8 * byte + i:
# expanding a byte table with `embedding` costs a quarter of unpacking bits and a masked_fill.
_BYTE_BIAS = torch.tensor(
    [[0.0 if byte >> bit & 1 else float("-inf") for bit in range(8)] for byte in range(256)]
)


class StepMasks:
    """The masks of one step's sampling rows, being computed in the background."""

    def __init__(self, future: Future[np.ndarray], rows: list[int], vocab_size: int) -> None:
        self._future, self.rows, self._vocab_size = future, rows, vocab_size

    def result(self) -> torch.Tensor:
        """[B, V] float32 to add to the logits: 0 where allowed, -inf where not (unconstrained rows: 0)."""
        packed = torch.from_numpy(self._future.result()).view(torch.uint8).int()
        return torch.nn.functional.embedding(packed, _BYTE_BIAS).flatten(1)[:, : self._vocab_size]


class GrammarMatchers:
    """`tokenizer_json`: the model's tokenizer.json; `vocab_size`: the width of the logits (a mask bit
    per column); `eos_token_ids`: the tokens that end a request, allowed where the grammar accepts."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: Future | None = None
        self._pristine: OrderedDict[str, LLMatcher] = OrderedDict()  # grammar → its matcher before any token
        self._lock = threading.Lock()
        self._matchers: dict[str, Future] = {}  # request id → its matcher
        self._ignore_eos: set[str] = set()
        self._executor: LLExecutor | None = None  # made on first use

    # -- requests -----------------------------------------------------------------------------------
    def add(self, request_id: str, grammar: str, ignore_eos: bool = False) -> None:
        """Start building the request's matcher (off the engine's thread). With `ignore_eos` the
        request may end only where the grammar admits nothing else (EOS is masked while it can go on)."""
        self._matchers[request_id] = self._ensure_pool().submit(self._copy_of, grammar)
        if ignore_eos:
            self._ignore_eos.add(request_id)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._ignore_eos.discard(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    # -- one step -----------------------------------------------------------------------------------
    def start_masks(self, request_ids: list[str]) -> StepMasks | None:
        """Compute the masks of a step's sampling rows in the background, or None when no row is
        constrained."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return None
        matchers = [self._matchers[request_ids[i]] for i in rows]
        no_eos = [i for i in rows if request_ids[i] in self._ignore_eos]
        future = self._ensure_pool().submit(self._fill, matchers, rows, len(request_ids), no_eos)
        return StepMasks(future, rows, self.vocab_size)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its sampled token; True when the grammar is complete (the
        request ends). Raises GrammarError when the matcher refuses the token."""
        try:
            matcher = self._matchers[request_id].result()
        except Exception as e:  # noqa: BLE001 - its build failed: this request ends, the batch goes on
            raise GrammarError(str(e) if isinstance(e, GrammarError) else f"structured output: {e}") from None
        if not matcher.consume_token(token_id) or matcher.is_error():
            raise GrammarError(f"structured output: {matcher.get_error() or f'token {token_id} not allowed'}")
        return bool(matcher.is_stopped())

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- inside the pool ----------------------------------------------------------------------------
    def _ensure_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # Two threads: a matcher can be built while a step's masks are computed.
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="pytgi-grammar")
            self._tokenizer = self._pool.submit(self._load_tokenizer)
        return self._pool

    def _load_tokenizer(self):
        import llguidance

        if not self._tokenizer_json.is_file():
            raise GrammarError(f"structured output needs the model's tokenizer.json ({self._tokenizer_json})")
        text = self._tokenizer_json.read_text(encoding="utf-8")
        return llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos or None)

    def _copy_of(self, grammar: str):
        """A fresh matcher for the grammar: a copy of the cached one, built first if need be. (A task
        never waits on a task queued after it, so the pool cannot deadlock.)"""
        import llguidance

        with self._lock:
            pristine = self._pristine.get(grammar)
            if pristine is not None:
                self._pristine.move_to_end(grammar)
        if pristine is None:
            assert self._tokenizer is not None
            pristine = llguidance.LLMatcher(self._tokenizer.result(), grammar)
            if pristine.is_error():
                raise GrammarError(f"structured output: {pristine.get_error()}")
            with self._lock:
                self._pristine[grammar] = pristine
                if len(self._pristine) > _CACHED_GRAMMARS:
                    self._pristine.popitem(last=False)
        with self._lock:
            return pristine.deep_copy()

    def _fill(self, matchers: list[Future], rows: list[int], batch: int, no_eos: list[int]) -> np.ndarray:
        import llguidance
        import llguidance.numpy as llg_np

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        packed = llg_np.allocate_token_bitmask(batch, self.vocab_size)  # all allowed
        # A matcher whose build failed leaves its row open; `accept` then fails that request alone.
        built = [(m.result(), i) for m, i in zip(matchers, rows) if m.exception() is None]
        llg_np.fill_next_token_bitmask_par(self._executor, built, packed)
        for i in no_eos:  # EOS off, unless it is all the grammar admits
            row = packed[i].view(np.uint32)
            eos = row.copy()
            for t in self._eos:
                row[t // 32] &= ~np.uint32(1 << (t % 32))
            if not row.any():
                row[:] = eos
        return packed
