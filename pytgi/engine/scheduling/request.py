"""The engine's state for one request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pytgi.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pytgi.core.protocol import PoolParams
    from pytgi.engine.execution.images import PromptImage


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"  # a stop token id here; stop strings are matched on text by the caller
    ERROR = "error"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    # all_ids = prompt + output; KV exists for all_ids[:num_computed_tokens].
    all_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the first schedule
    block_table: list[int] = field(default_factory=list)
    state_slot: int = -1  # a model with linear attention: its recurrent state's slot while it runs
    # ... and whether every chunk that made that state started on the kernel's chunk grid, as a cold
    # prefill's do: only such a state is bit-exact, so only it is checkpointed (BlockManager.checkpoint)
    state_on_grid: bool = True
    shared_prefix: int = 0  # ... and the tokens of its prompt whose KV was cached when it was admitted
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks so far
    status: Status = Status.WAITING
    num_preemptions: int = 0
    prompt_logprobs: list[float | None] | None = None  # set once the prompt is computed, if asked
    partial_prompt_logprobs: list[float | None] = field(default_factory=list)  # until then, chunk by chunk
    speculative: bool = True  # may decode with drafts (not with a grammar or a watermark)
    num_accepted: int = 0  # draft tokens accepted (TGI's skipped tokens)
    # where the prefix cache's hash chain starts: None for the base model, the adapter's name and
    # load number for an adapter (blocks of an adapter unloaded and loaded again are not its own)
    cache_root: object = None
    # a `PromptImage` per image in the prompt (pytgi.engine.execution.images)
    images: list[PromptImage] = field(default_factory=list)
    # the prefix cache's disk tier (pytgi.engine.kv.disk_tier): "" not looked up yet, "reading" its blocks,
    # "done"; the prompt tokens it restored
    disk: str = ""
    num_disk_tokens: int = 0
    num_pinned: int = 0  # of params.cache_pins, those applied (once their tokens were computed)
    arrived: float = field(default_factory=time.monotonic)
    scheduled: float = 0.0  # when it was first admitted to the running batch
    pool: PoolParams | None = None  # a pooling model's request: its prompt's state is its answer

    def __post_init__(self) -> None:
        self.all_ids = list(self.prompt_ids) + list(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.all_ids) - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs and self.prompt_logprobs is None

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.all_ids.append(token_id)

    def check_stop(self) -> FinishReason | None:
        """Stopping on ids (EOS, stop token ids, length); stop strings are the detokenizer's job."""
        last = self.output_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return FinishReason.EOS
        if last in self.params.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_ids) >= self.params.max_new_tokens:
            return FinishReason.LENGTH
        return None
