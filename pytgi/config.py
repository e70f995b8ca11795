"""Engine configuration: one dataclass, named as TGI's launcher names its flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None = the embedded default
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16; float32 is the exact path)
    quantize: str = "auto"  # auto | none | int8 | int4: weight-only, for small CPU steps (pytgi.models.quant)
    device: str = "auto"  # auto | cpu | cuda
    max_input_tokens: int | None = None  # default: the model's positions - 1
    max_total_tokens: int | None = None  # default: the model's positions
    max_batch_prefill_tokens: int | None = None  # default: max(4096, max_input_tokens)... see resolve()
    max_prefill_tokens_while_decoding: int | None = None  # prompt tokens per step while others decode; None/0: no cap
    max_batch_total_tokens: int | None = None  # KV slots; default: sized from free memory
    max_batch_size: int | None = None  # default: 256
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_fraction: float = 0.9  # of free memory left after the weights (CUDA)
    kv_cache_cpu_bytes: int = 4 << 30  # on CPU: the most the KV cache takes by default
    attention_backend: str = "torch"
    num_shard: int = 1
    master_addr: str = "localhost"  # torch.distributed rendezvous (MASTER_ADDR)
    master_port: int | None = None  # None: a free local port (all shards on this machine)
    progress: bool = True  # show progress bars on first conversion

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 <= self.waiting_served_ratio:
            raise ValueError("waiting_served_ratio must be >= 0")
        for name in ("max_input_tokens", "max_total_tokens", "max_batch_prefill_tokens",
                     "max_batch_total_tokens", "max_batch_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be strictly positive, got {value}")
        if self.num_shard < 1:
            raise ValueError(f"num_shard must be >= 1, got {self.num_shard}")
