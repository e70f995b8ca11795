"""Engine configuration: what is asked (`EngineConfig`, named as TGI's launcher names its flags) and
what it resolves to once the model and the device are known (`EngineInfo`, frozen).

`EngineInfo` is the one resolved configuration: the scheduler obeys it, `Ready` carries it to the
API process, and /info shows it. No torch here: the API process imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

DRAFT_MODEL_TOKENS = 4  # a draft model's tokens per step when --speculate is not given


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = (
        None  # HF directory, .gguf file or Hub id (org/name[:TAG]); None = the embedded default
    )
    revision: str | None = None  # of a Hub id: a branch, tag or commit (default: main)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16; float32 is the exact path)
    quantize: str = "auto"  # auto | none | int8 | int4: weight-only, for small CPU steps (pytgi.models.quant)
    device: str = "auto"  # auto | cpu | cuda
    max_input_tokens: int | None = None  # default: max_total_tokens - 1
    max_total_tokens: int | None = None  # default: the model's positions
    max_batch_prefill_tokens: int | None = None  # default: 4096 on GPU, 1024 on CPU
    max_prefill_tokens_while_decoding: int | None = (
        None  # prompt tokens per step while others decode; None/0: no cap
    )
    max_batch_total_tokens: int | None = None  # KV slots; default: sized from free memory
    max_batch_size: int | None = None  # default: 256
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    batch_invariant: bool = True  # CPU: a row's numerics do not depend on the step (docs/batch-invariance.md)
    speculate: int = 0  # draft tokens per decode step, at most (0: off; pytgi.engine.speculate)
    draft_model: str | None = None  # a smaller model with the same tokenizer drafts (else n-gram drafts)
    kv_cache_memory_fraction: float = 0.9  # of free memory left after the weights (CUDA)
    kv_cache_cpu_bytes: int = 4 << 30  # on CPU: the most the KV cache takes by default
    attention_backend: str = "torch"
    model_impl: str = "auto"  # auto | pytgi | transformers: whose model code (auto: pytgi's where it has it)
    num_shard: int = 1
    master_addr: str = "localhost"  # torch.distributed rendezvous (MASTER_ADDR)
    master_port: int | None = None  # None: a free local port (all shards on this machine)
    progress: bool = True  # show progress bars on first conversion

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 <= self.waiting_served_ratio:
            raise ValueError("waiting_served_ratio must be >= 0")
        for name in (
            "max_input_tokens",
            "max_total_tokens",
            "max_batch_prefill_tokens",
            "max_batch_total_tokens",
            "max_batch_size",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be strictly positive, got {value}")
        if self.num_shard < 1:
            raise ValueError(f"num_shard must be >= 1, got {self.num_shard}")
        if self.speculate < 0:
            raise ValueError(f"speculate must be >= 0, got {self.speculate}")

    @property
    def draft_tokens(self) -> int:
        """Draft tokens per decode step, at most: --speculate, or 4 with a draft model and no --speculate."""
        return self.speculate or (DRAFT_MODEL_TOKENS if self.draft_model else 0)

    def resolve(
        self,
        *,
        model_id: str,
        model_path: str,
        dtype: str,
        device_type: str,
        vocab_size: int,
        max_positions: int,
        kv_capacity: Callable[[], int],
        quantization: dict[str, int] | None = None,
    ) -> EngineInfo:
        """Fill the defaults from the loaded model and check the limits against each other;
        `kv_capacity()` (KV slots that fit in memory) is asked only when no size was given."""
        total = self.max_total_tokens or max_positions
        if total > max_positions:
            raise ValueError(f"max_total_tokens ({total}) exceeds the model's {max_positions} positions")
        max_input = self.max_input_tokens or total - 1
        if max_input >= total:
            raise ValueError(f"max_input_tokens ({max_input}) must be < max_total_tokens ({total})")
        prefill = self.max_batch_prefill_tokens or (4096 if device_type == "cuda" else 1024)
        # Off by default: capping prompt tokens while others decode bounds the worst stall a long prompt
        # causes, but throttles prefill under load (docs/benchmarks.md measures both sides).
        cap = self.max_prefill_tokens_while_decoding or 0
        if cap < 0:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 0, got {cap}")
        if not self.enable_chunked_prefill and max_input > prefill:
            raise ValueError("without chunked prefill, max_input_tokens must be <= max_batch_prefill_tokens")
        num_blocks = (self.max_batch_total_tokens or kv_capacity()) // self.block_size
        if num_blocks * self.block_size < total:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens, fewer than max_total_tokens "
                f"({total}): raise max_batch_total_tokens or lower max_total_tokens"
            )
        return EngineInfo(
            model_id=model_id,
            model_path=model_path,
            model_dtype=dtype,
            model_device_type=device_type,
            vocab_size=vocab_size,
            num_shard=self.num_shard,
            max_input_tokens=max_input,
            max_total_tokens=total,
            max_batch_prefill_tokens=prefill,
            max_prefill_tokens_while_decoding=min(cap, prefill) or None,
            max_batch_total_tokens=num_blocks * self.block_size,
            max_batch_size=self.max_batch_size or 256,
            waiting_served_ratio=self.waiting_served_ratio,
            max_waiting_tokens=self.max_waiting_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            block_size=self.block_size,
            num_blocks=num_blocks,
            quantization=quantization,
            speculate=self.draft_tokens,
            draft_model=self.draft_model,
        )


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's configuration, resolved once (`EngineConfig.resolve`)."""

    model_id: str
    model_path: str
    model_dtype: str
    model_device_type: str
    vocab_size: int
    num_shard: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int  # tokens computed in one step (decodes count one each)
    # Prompt tokens (new prefills and chunks) in a step that also decodes: keeps a step with a long
    # prompt's chunk from stalling the streams (None: only max_batch_prefill_tokens applies).
    max_prefill_tokens_while_decoding: int | None
    max_batch_total_tokens: int  # KV slots: num_blocks * block_size
    max_batch_size: int
    waiting_served_ratio: float
    max_waiting_tokens: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    block_size: int
    num_blocks: int
    # A GGUF model's tensor types as the file has them, with their counts (e.g. {"Q4_K": 27, "F32": 109})
    quantization: dict[str, int] | None = None
    speculate: int = 0  # draft tokens per decode step, at most
    draft_model: str | None = None  # the draft model (--draft-model-id), if any
