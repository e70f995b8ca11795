"""Configuration: what the engine is asked for (`EngineConfig`, named as TGI's launcher names its
flags), what that resolves to once the model and the device are known (`EngineInfo`, frozen), and
the API process's (`ServerConfig`). Each serving setting is one field, declared with `setting`
(`pytgi.core.flags` derives the flags, /info and docs/flags.md from them).

`EngineInfo` is the one resolved configuration: the scheduler obeys it, `Ready` carries it to the
API process, and /info shows it. No torch here: the API process imports this module.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pytgi.core.errors import ConfigError
from pytgi.core.image_layouts import ImageLayout
from pytgi.core.pooling import TASKS, PoolingInfo
from pytgi.core.settings import setting

DRAFT_MODEL_TOKENS = 4  # a draft model's tokens per step when --speculate is not given
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is e4m3


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine is asked for: the serving settings the engine process reads (`setting`), and
    knobs the offline `LLM` and the tests set."""

    model: str | None = setting(
        None,
        "Hub id (org/name, org/name-GGUF:Q4_K_M, org/name/file.gguf), HF directory or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct, never downloaded)",
        flag="--model-id",
    )
    revision: str | None = setting(None, "of a Hub id: a branch, tag or commit (default: main)")
    num_shard: int = setting(1, "tensor-parallel ranks", info=True)
    dtype: str = setting("auto", "auto (bfloat16) | float32 (exact) | bfloat16 | float16")
    quantize: str = setting(
        "auto",
        "weights: auto (as the GGUF file, on CPU and CUDA; on CPU a bf16 model as it is, on pytgi's bf16 "
        "kernel) | none (PyTorch's matmuls) | int8 | int4 (weight-only) | bf16 (CPU) | fp8 (CUDA: e4m3 per "
        "output channel)",
    )
    model_impl: str = setting(
        "auto", "whose model code: auto (pytgi's where it has it, else transformers') | pytgi | transformers"
    )
    task: str = setting(
        "auto",
        "what the model serves: auto (its architecture and sentence-transformers files say) | generate | "
        "embed (a causal LM: its last token's state) | classify (a causal LM: --classifier-tokens' logits)",
    )
    classifier_tokens: tuple[str, ...] = setting(
        (),
        "--task classify on a causal LM: the negative and the positive token, whose logits' difference at "
        "the last position scores a pair (Qwen3-Reranker: no,yes)",
        repeat=True,
    )
    max_input_tokens: int | None = setting(None, "longest prompt (default: max_total_tokens - 1)", info=True)
    max_total_tokens: int | None = setting(
        None,
        "prompt + generated tokens (default: the model's positions, as many as the KV cache holds)",
        info=True,
    )
    waiting_served_ratio: float = setting(0.3, "admission rule for a running batch", info=True)
    speculate: int = setting(
        0,
        "draft tokens verified per decode step, at most (0: off): n-gram (prompt-lookup) drafts, "
        "or --draft-model-id's",
    )
    draft_model: str | None = setting(
        None,
        "a smaller model with the same tokenizer drafts for --speculate (default 4 tokens): Hub id, "
        "HF directory or .gguf file",
        flag="--draft-model-id",
    )
    lora_adapters: tuple[str, ...] = setting(
        (),
        "LoRA adapters (PEFT) to serve beside the base model: name=PATH_OR_HUB_ID, or a bare one named "
        "by itself; comma-separated or the flag repeated",
        repeat=True,
        info=True,
    )
    max_lora_rank: int = setting(64, "the highest rank a LoRA adapter may have")
    max_cpu_loras: int | None = setting(
        None, "LoRA adapters kept in memory, the least recently used out (default: all of them)"
    )
    mm_cache_size: int = setting(
        32, "images whose rows a vision model keeps across requests, by content (0: none)"
    )
    max_batch_prefill_tokens: int | None = setting(
        None, "tokens computed per step (default 4096 GPU, 1024 CPU)", info=True
    )
    max_prefill_tokens_while_decoding: int | None = setting(
        None,
        "prompt tokens per step while others decode: bounds a long prompt's stall of running streams "
        "(default: no cap)",
    )
    max_batch_total_tokens: int | None = setting(
        None, "KV-cache slots (default: sized from memory, --kv-cache-memory-fraction)", info=True
    )
    kv_cache_memory_fraction: float | None = setting(
        None,
        "the share of the memory left once the weights are loaded (MemAvailable on CPU, free GPU memory "
        "on CUDA) that the KV cache takes, split evenly over the ranks on this machine and over "
        "--replicas (default 0.25 CPU, 0.9 GPU)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "the KV cache's values: auto, bf16 (the model's dtype) | int8 (CPU: a bf16 scale per token and "
        "head, about half the bytes: twice the tokens) | fp8 (CUDA: e4m3, a float32 scale per token "
        "and head)",
    )
    max_waiting_tokens: int = setting(20, "steps before waiting requests join regardless", info=True)
    max_batch_size: int | None = setting(None, "most running requests (default: 256)", info=True)
    enable_prefix_caching: bool = setting(
        True, "turn the prefix cache off", flag="--disable-prefix-caching", switch=True
    )
    prefix_cache_dir: str | None = setting(
        None,
        "a directory for the prefix cache's disk tier: full KV blocks (and a hybrid model's checkpoints "
        "of its recurrent states) written behind, read back after eviction or a restart "
        "(docs/prefix-cache.md)",
    )
    prefix_cache_disk_bytes: int = setting(
        16 * 2**30,
        "the most the disk tier keeps in --prefix-cache-dir (blocks and states), the least recently used out",
    )
    prefix_cache_state_bytes: int | None = setting(
        None,
        "a model with recurrent layers (Qwen3.5, the Mamba families, LFM2, Kimi Linear): the memory for "
        "the prefix cache's state checkpoints, taken from the KV cache's (default: an eighth of it, at "
        "least one a running request; without attention layers, one a running request; 0: no prefix "
        "cache for it)",
    )
    prefix_cache_verify_rate: float = setting(
        0.0,
        "the share of disk reads checked: the last block recomputed and compared bit for bit, a "
        "mismatching file dropped",
    )
    prefix_cache_max_pin_seconds: float = setting(
        3600.0,
        "the longest a client's pin (Anthropic's cache_control ttl) keeps its prefix's blocks in the "
        "KV pool; 0: pins are ignored",
        info=True,
    )
    # CPU: a row's numerics do not depend on the step (docs/batch-invariance.md)
    batch_invariant: bool = setting(
        True,
        "let a step's size pick faster kernels for long prompts on CPU: a greedy output may then "
        "depend on what else runs (docs/batch-invariance.md)",
        flag="--disable-batch-invariance",
        switch=True,
    )
    cuda_graphs: str | None = setting(
        None,
        "CUDA: decode batch sizes captured as CUDA graphs, comma-separated (default: 1, 2, 4, 8, 16, 24, "
        "32 ... 512, up to --max-batch-size; 0: none)",
    )
    threads: int | None = setting(
        None,
        "CPU threads of each engine process (llama.cpp's -t; default: OMP_NUM_THREADS if set, else the "
        "CPUs this process may use, its affinity mask and cgroup CPU quota, shared by the shards and "
        "replicas on this machine; docs/deploy.md)",
    )
    master_addr: str = setting(
        "localhost", "torch.distributed rendezvous address (shards on several machines)"
    )
    master_port: int | None = setting(
        None, "torch.distributed rendezvous port (default: a free local port; 29500 when ranks start apart)"
    )
    # Not flags: the offline API's and the tests' knobs.
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    enable_chunked_prefill: bool = True
    kv_cache_cpu_bytes: int | None = None  # the most the KV cache takes (tests; default: no cap)
    local_replicas: int = 1  # engines of this server sharing the machine (--replicas on a local cluster)
    attention_backend: str = "auto"  # auto | torch | triton
    progress: bool = True  # show progress bars on first conversion

    def pooling_refusals(self) -> list[str]:
        """The flags asked for that no pooling model takes (one rank, no drafts, no adapters, no disk
        tier): each engine of one refuses them at start."""
        return [
            flag
            for flag, on in (
                ("--num-shard", self.num_shard > 1),
                ("--speculate / --draft-model-id", self.draft_tokens > 0),
                ("--lora-adapters", bool(self.lora_adapters)),
                ("--prefix-cache-dir", bool(self.prefix_cache_dir)),
            )
            if on
        ]

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 <= self.waiting_served_ratio:
            raise ConfigError("waiting_served_ratio must be >= 0")
        for name in (
            "max_input_tokens",
            "max_total_tokens",
            "max_batch_prefill_tokens",
            "max_batch_total_tokens",
            "max_batch_size",
            "threads",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be strictly positive, got {value}")
        if self.num_shard < 1:
            raise ConfigError(f"num_shard must be >= 1, got {self.num_shard}")
        if self.speculate < 0:
            raise ConfigError(f"speculate must be >= 0, got {self.speculate}")
        if self.mm_cache_size < 0:
            raise ConfigError(f"mm_cache_size must be >= 0, got {self.mm_cache_size}")
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.classifier_tokens and (len(self.classifier_tokens) != 2 or self.task != "classify"):
            raise ConfigError(
                "--classifier-tokens takes two tokens, the negative then the positive, with --task classify"
            )
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ConfigError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.prefix_cache_dir is not None:
            if not self.enable_prefix_caching:
                raise ConfigError("--prefix-cache-dir needs the prefix cache (no --disable-prefix-caching)")
            if self.num_shard > 1:
                raise ConfigError(
                    "--prefix-cache-dir serves one rank's KV cache: it does not run with --num-shard > 1 yet"
                )
        if self.prefix_cache_disk_bytes < 0:
            raise ConfigError(f"prefix_cache_disk_bytes must be >= 0, got {self.prefix_cache_disk_bytes}")
        if self.prefix_cache_state_bytes is not None and self.prefix_cache_state_bytes < 0:
            raise ConfigError(f"prefix_cache_state_bytes must be >= 0, got {self.prefix_cache_state_bytes}")
        if self.prefix_cache_max_pin_seconds < 0:
            raise ConfigError(
                f"prefix_cache_max_pin_seconds must be >= 0, got {self.prefix_cache_max_pin_seconds}"
            )
        if not 0.0 <= self.prefix_cache_verify_rate <= 1.0:
            raise ConfigError(
                f"prefix_cache_verify_rate must be in [0, 1], got {self.prefix_cache_verify_rate}"
            )
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ConfigError(f"max_cpu_loras must be >= 1, got {self.max_cpu_loras}")

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
        memory = self.max_batch_total_tokens or kv_capacity()  # the KV slots asked for, or that fit
        # by default a request may take the model's positions, as far as the KV cache holds them
        total = self.max_total_tokens or min(max_positions, memory // self.block_size * self.block_size)
        if total < 2:
            raise ConfigError(
                f"the KV cache holds {memory} tokens: too little memory is left for it (lower the other "
                "engines' --kv-cache-memory-fraction, or set --max-batch-total-tokens)"
            )
        if total > max_positions:
            raise ConfigError(f"max_total_tokens ({total}) exceeds the model's {max_positions} positions")
        max_input = self.max_input_tokens or total - 1
        if max_input >= total:
            raise ConfigError(f"max_input_tokens ({max_input}) must be < max_total_tokens ({total})")
        prefill = self.max_batch_prefill_tokens or (4096 if device_type == "cuda" else 1024)
        # Off by default: capping prompt tokens while others decode bounds the worst stall a long prompt
        # causes, but throttles prefill under load (docs/history/2026-11-30-default-model.md measures
        # both sides).
        cap = self.max_prefill_tokens_while_decoding or 0
        if cap < 0:
            raise ConfigError(f"max_prefill_tokens_while_decoding must be >= 0, got {cap}")
        if not self.enable_chunked_prefill and max_input > prefill:
            raise ConfigError("without chunked prefill, max_input_tokens must be <= max_batch_prefill_tokens")
        # sized from memory, up to what max_batch_size requests of max_total_tokens can use
        slots = self.max_batch_total_tokens or min(memory, (self.max_batch_size or 256) * total)
        num_blocks = slots // self.block_size
        if num_blocks * self.block_size < total:
            raise ConfigError(
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
            prefix_cache_max_pin_seconds=self.prefix_cache_max_pin_seconds
            if self.enable_prefix_caching
            else 0.0,
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
    image_layout: ImageLayout | None = None  # a vision model's: how its images take prompt positions
    prefix_cache_max_pin_seconds: float = 0.0  # 0: clients' pins are ignored (or no prefix cache)
    task: str = "generate"  # or "embed": a pooling model (pytgi.core.pooling), served by its own routes
    pooling: PoolingInfo | None = None  # an embedding model's pooling


# Names the API side defines and the settings below take (each module checks its own against these):
API_KEY_EXEMPTIONS = ("health", "metrics", "info", "docs", "openapi", "models")  # pytgi.api.middleware
REASONING_PARSERS = ("deepseek_r1", "qwen3", "harmony")  # pytgi.api.chat.reasoning
REPLICA_ROUTING = ("prefix", "round-robin")  # pytgi.api.replicas.affinity
OTLP_MODULE = "opentelemetry.exporter.otlp.proto.http"


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file's text, or the template itself (it has Jinja's `{{` or `{%`)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"{value!r} is neither a file nor a Jinja template")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


@dataclass(slots=True)
class ServerConfig:
    """The API process's configuration: its serving settings (`setting`), and what the launcher
    resolved (the model, the engine's config)."""

    engine: EngineConfig
    model_path: Path
    model_id: str
    hostname: str = setting("0.0.0.0", "address to listen on")
    port: int = setting(3000, "port to listen on")
    max_concurrent_requests: int = setting(128, "in-flight requests before answering 429", info=True)
    max_best_of: int = setting(2, "largest best_of", info=True)
    max_stop_sequences: int = setting(4, "most stop sequences per request", info=True)
    max_top_n_tokens: int = setting(5, "largest top_n_tokens")
    max_client_batch_size: int = setting(
        2048, "most inputs in one embedding request (OpenAI's limit; TEI's default is 32)"
    )
    validation_workers: int = setting(2, "tokenizer threads", info=True)
    api_key: str | None = setting(
        None,
        "require `Authorization: Bearer <key>` on every route but --api-key-exempt's (prefer the "
        "API_KEY environment variable: a flag shows in `ps` and /proc/*/cmdline)",
    )
    # route names (API_KEY_EXEMPTIONS; "none": none of them)
    api_key_exempt: tuple[str, ...] = setting(
        ("health",),
        "routes open without the key, comma-separated: health, metrics, info, docs, openapi, models "
        "(or none)",
    )
    ssl_keyfile: str | None = setting(None, "serve HTTPS with this private key (PEM)")
    ssl_certfile: str | None = setting(None, "... and this certificate chain (PEM)")
    keep_alive_timeout: int = setting(5, "seconds an idle keep-alive connection stays open")
    request_header_timeout: float = setting(
        10.0, "seconds a request's headers may take to arrive (else 408, closed)"
    )
    request_body_timeout: float = setting(30.0, "seconds a request body may pause between chunks (else 408)")
    payload_limit: int = setting(2_000_000, "largest request body in bytes")
    graceful_termination_timeout: int = setting(90, "seconds to finish in-flight requests on SIGTERM")
    cors_allow_origin: tuple[str, ...] = setting(
        (), "allowed CORS origins, comma-separated (or the flag repeated)", repeat=True
    )
    json_output: bool = setting(False, "log as JSON lines", switch=True)
    reasoning_parser: str | None = setting(
        None,
        "split a chat answer's reasoning (<think>…</think>) from its content: qwen3 (the model opens "
        "the block) | deepseek_r1 (the template opens it) | harmony (gpt-oss: the analysis channel)",
    )
    chat_template: str | None = setting(
        None,
        "a Jinja chat template (or a file holding one) instead of the model's, e.g. a pythonic "
        "tool-calling template",
    )
    max_images_per_request: int = setting(8, "most images in one request (a vision model's)")
    allowed_media_domains: tuple[str, ...] = setting(
        (),
        "hosts whose image URLs are fetched even at loopback or private addresses, comma-separated "
        "(others must resolve to public addresses)",
        repeat=True,
    )
    media_fetch_timeout: float = setting(
        10.0, "seconds to fetch one image URL, its redirects included (one deadline for the whole fetch)"
    )
    max_concurrent_media_fetches: int = setting(
        16, "image URLs fetched at once, across requests (more wait their turn, within their deadline)"
    )
    enable_lora_runtime_updates: bool = setting(
        False,
        "turn on POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off, they are 404); "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True turns them on too",
        switch=True,
        env="PYTGI_ALLOW_RUNTIME_LORA_UPDATING",
    )
    lora_dirs: tuple[str, ...] = setting(
        (),
        "directories a runtime adapter load may read (its lora_path inside one, after symlinks and `..`; "
        "a relative path is looked up in each), comma-separated",
        repeat=True,
    )
    allow_hub_adapters: bool = setting(
        False, "let a runtime adapter load fetch the Hub id a client names", switch=True
    )
    responses_store_bytes: int = setting(
        256 << 20, "bytes of Responses-API responses and conversations kept (the oldest dropped first)"
    )
    responses_store_size: int = setting(
        1000, "Responses-API responses kept, at most (the oldest dropped first)"
    )
    replicas: int = setting(
        0,
        "serve with this many engine replicas on Ray Serve behind this endpoint, each request routed "
        "to the replica holding its prompt's longest cached prefix (0: one engine, no Ray)",
    )
    min_replicas: int | None = setting(None, "with --replicas: the autoscaler's lower bound")
    max_replicas: int | None = setting(None, "with --replicas: the autoscaler's upper bound (on queue depth)")
    ray_address: str | None = setting(
        None, "with --replicas: the Ray cluster to join (default: start one on this machine)"
    )
    replica_routing: str = setting("prefix", "with --replicas: prefix (cache affinity) | round-robin")
    otlp_endpoint: str | None = setting(
        None, "export one OpenTelemetry trace per request over OTLP/HTTP to this collector URL"
    )
    otlp_service_name: str = setting("pytgi", "the service.name of the exported traces")
    model_sha: str | None = None  # the Hub commit served (or --revision for a local model)
    engine_module: str = "pytgi.engine.process"  # the engine process's entry point

    @property
    def tls(self) -> bool:
        return bool(self.ssl_certfile)

    def validate(self) -> None:
        """`ConfigError` naming the flag, for settings that cannot work together or on this machine
        (checked before the model is fetched or loaded)."""
        if unknown := [e for e in self.api_key_exempt if e not in (*API_KEY_EXEMPTIONS, "none")]:
            raise ConfigError(
                f"--api-key-exempt: unknown route name(s) {', '.join(unknown)}; choose among "
                f"{', '.join(API_KEY_EXEMPTIONS)}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(
                f"--reasoning-parser: unknown {self.reasoning_parser!r}; "
                f"choose among {', '.join(REASONING_PARSERS)}"
            )
        if self.chat_template is not None:
            try:
                read_chat_template(self.chat_template)
            except ConfigError as exc:
                raise ConfigError(f"--chat-template: {exc}") from None
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        if self.otlp_endpoint and not _installed(OTLP_MODULE):
            raise ConfigError(
                "--otlp-endpoint needs the OpenTelemetry SDK and OTLP/HTTP exporter: "
                "pip install 'pytgi[otel]'"
            )
        self._validate_replicas()

    def _validate_replicas(self) -> None:
        lo, hi = self.min_replicas, self.max_replicas
        if self.replicas < 0 or any(b is not None and b < 1 for b in (lo, hi)):
            raise ConfigError("--replicas must be >= 0, and --min-replicas / --max-replicas >= 1")
        if self.replicas == 0:
            if lo is not None or hi is not None or self.ray_address:
                raise ConfigError(
                    "--min-replicas, --max-replicas and --ray-address need --replicas N (N >= 1)"
                )
            return
        if self.replica_routing not in REPLICA_ROUTING:
            raise ConfigError(
                f"--replica-routing: unknown {self.replica_routing!r}; "
                f"choose among {', '.join(REPLICA_ROUTING)}"
            )
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(f"--min-replicas {lo} is above --max-replicas {hi}")
        if (lo is not None and self.replicas < lo) or (hi is not None and self.replicas > hi):
            raise ConfigError(
                f"--replicas {self.replicas} (the replicas to start with) is outside the autoscaling bounds"
            )
        if not _installed("ray"):  # (not ray.serve: that would import ray before its settings are made)
            raise ConfigError("--replicas needs Ray Serve: pip install 'pytgi[ray]'")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                "--replicas cannot run under torchrun's ranks (WORLD_SIZE > 1); "
                "use --num-shard for each replica"
            )
