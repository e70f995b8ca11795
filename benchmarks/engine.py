"""Offline engine throughput benchmark: pytgi's `LLM.generate` against transformers' continuous batching.

What it measures
    One fixed, seeded, synthetic workload (default: 64 requests, prompts of 64..512 random token ids,
    64..256 output tokens each, EOS ignored so every request generates exactly its requested count) is
    run to completion by each selected system, in this one process, on the same weights:

    * ``pytgi``        -- ``pytgi.LLM.generate`` (greedy, continuous batching, paged KV cache);
    * ``transformers`` -- transformers' continuous batching (the manager behind ``model.generate_batch``,
                          fed one request at a time so each keeps its own ``max_new_tokens``);
    * ``hf-padded``    -- plain ``model.generate`` on left-padded static batches (off by default).

    Each system gets a short warm-up, then the whole workload is timed (model loading and KV cache
    allocation excluded). Reported per system: wall time, output tok/s, total (prompt + output) tok/s,
    requests/s, how many requests did not produce exactly their requested token count, the process
    CPU seconds (far below wall x threads = starved by other processes: rerun on a quieter machine),
    and the fraction of requests whose greedy token ids equal transformers'. A markdown table goes to
    stdout and the full record to ``benchmarks/results/engine-<timestamp>.json``.

How to run
    .venv/bin/python benchmarks/engine.py                                   # full default workload
    .venv/bin/python benchmarks/engine.py --num-prompts 8 --input-max 128 --output-max 32   # quick
    .venv/bin/python benchmarks/engine.py --systems pytgi,transformers,hf-padded --hf-batch-size 8
    # a Llama-3-8B-shaped random-weight model, on a GPU machine:
    .venv/bin/python benchmarks/engine.py --make-random-model /tmp/llama3-8b-random --shape llama3-8b
    .venv/bin/python benchmarks/engine.py --model /tmp/llama3-8b-random --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import ContinuousBatchingManager

    from pytgi import LLM

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from anywhere, without installing pytgi
    sys.path.insert(0, str(REPO_ROOT))

SYSTEMS = ("pytgi", "transformers", "hf-padded")
MIN_TOKEN_ID = 100  # below this the default tokenizer keeps its special / control tokens
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

SHAPES: dict[str, dict[str, int]] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
SHAPE_DTYPES = {"llama3-8b": "bfloat16", "tiny": "float32"}

Outputs = list[list[int]]  # generated token ids, one list per request
Tensors = Iterator[tuple[str, torch.Tensor]]


# -- workload -----------------------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """Random token-id prompts and output lengths, uniform in the flagged ranges, from one seed."""
    rng = random.Random(args.seed)
    prompts, output_lens = [], []
    for _ in range(args.num_prompts):
        n_in = rng.randint(args.input_min, args.input_max)
        prompts.append([rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n_in)])
        output_lens.append(rng.randint(args.output_min, args.output_max))
    return Workload(prompts, output_lens)


def warmup_workload(vocab_size: int) -> Workload:
    """A couple of tiny requests, enough to touch every code path once before timing."""
    rng = random.Random(1234)
    prompts = [[rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)] for n in (8, 24)]
    return Workload(prompts, [4, 6])


# -- results ------------------------------------------------------------------------------------------


@dataclass
class SystemResult:
    system: str
    wall_s: float
    cpu_s: float  # process CPU time over the timed region (all threads)
    requests: int
    prompt_tokens: int
    output_tokens: int
    mismatched_requests: int
    notes: dict[str, object] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    @property
    def requests_s(self) -> float:
        return self.requests / self.wall_s

    def to_dict(self) -> dict[str, object]:
        rates = dict(output_tok_s=self.output_tok_s, total_tok_s=self.total_tok_s, requests_s=self.requests_s)
        return asdict(self) | rates


def summarize(system: str, workload: Workload, outputs: Outputs,
              seconds: tuple[float, float]) -> SystemResult:
    """Count what was actually generated and compare each request's length with the one asked for."""
    mismatches = sum(len(out) != want for out, want in zip(outputs, workload.output_lens))
    mismatches += abs(len(outputs) - len(workload.prompts))
    return SystemResult(system, seconds[0], seconds[1], len(outputs), workload.prompt_tokens,
                        sum(len(o) for o in outputs), mismatches)


def agreement(a: Outputs, b: Outputs) -> float:
    """Fraction of requests whose token ids are identical in both runs."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


@dataclass
class Clock:
    """Wall and process CPU seconds of a timed region. CPU seconds well under wall x threads mean the
    process was starved of cores (another process was using them): the run's figures are too low."""

    wall0: float = 0.0
    cpu0: float = 0.0

    def start(self) -> Clock:
        sync_device()
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def stop(self) -> tuple[float, float]:
        sync_device()
        return time.perf_counter() - self.wall0, time.process_time() - self.cpu0


def timed(run: Callable[[Workload], Outputs], workload: Workload) -> tuple[Outputs, tuple[float, float]]:
    """Run a system on the workload; return its outputs and (wall, cpu) seconds."""
    clock = Clock().start()
    outputs = run(workload)
    return outputs, clock.stop()


def sync_device() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def free_memory() -> None:
    """Drop a finished system's model and cache before the next one loads (matters on a GPU)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -- pytgi --------------------------------------------------------------------------------------------


def load_pytgi(args: argparse.Namespace) -> LLM:
    from pytgi import LLM

    extra = {} if args.device == "auto" else {"device": args.device}
    for name in ("max_batch_size", "max_batch_prefill_tokens", "quantize", "kv_cache_dtype"):
        if getattr(args, name, None) is not None:
            extra[name] = getattr(args, name)
    return LLM(model=args.model, dtype=args.dtype, **extra)


def run_pytgi(llm: LLM, workload: Workload) -> Outputs:
    from pytgi import SamplingParams

    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    return [out.token_ids for out in llm.generate(workload.prompts, params)]


class StepTimes:
    """Wall time of each model step (`ModelRunner.execute`: layout, forward, sampling, up to the sampled
    ids on the host), split into steps that decode only and steps with prompt tokens; the rest of the
    run's wall time is the engine's own work (scheduling, outputs, detokenizing)."""

    def __init__(self, runner) -> None:
        self.runner, self.execute = runner, runner.execute
        self.decode: list[float] = []
        self.prefill: list[float] = []

    def __enter__(self) -> StepTimes:
        def execute(batch):
            start = time.perf_counter()
            out = self.execute(batch)
            decode_only = all(s.num_new_tokens == 1 for s in batch)
            (self.decode if decode_only else self.prefill).append(time.perf_counter() - start)
            return out

        self.runner.execute = execute
        return self

    def __exit__(self, *exc: object) -> None:
        del self.runner.execute  # the bound method again

    def summary(self, wall: float) -> dict[str, float]:
        dec, pre = sum(self.decode), sum(self.prefill)
        return dict(decode_steps=len(self.decode), decode_step_ms=1e3 * dec / max(1, len(self.decode)),
                    decode_s=dec, prefill_steps=len(self.prefill), prefill_s=pre, outside_steps_s=wall - dec - pre)


def bench_pytgi(llm: LLM, workload: Workload) -> tuple[SystemResult, Outputs]:
    """Warm up, then time `LLM.generate` on the whole workload."""
    run_pytgi(llm, warmup_workload(llm.engine.runner.vocab_size))
    with StepTimes(llm.engine.runner) as steps:
        outputs, seconds = timed(lambda w: run_pytgi(llm, w), workload)
    result = summarize("pytgi", workload, outputs, seconds)
    engine = llm.engine
    result.notes = dict(steps=steps.summary(seconds[0]), engine_stats=engine.stats(),
                        max_batch_prefill_tokens=engine.info.max_batch_prefill_tokens,
                        max_batch_total_tokens=engine.info.max_batch_total_tokens,
                        max_batch_size=engine.info.max_batch_size, dtype=str(engine.runner.dtype),
                        device=str(engine.runner.device))
    return result, outputs


# -- transformers continuous batching ------------------------------------------------------------------


def hf_device(args: argparse.Namespace) -> str:
    if args.device != "auto":
        return args.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_hf(model_path: Path, args: argparse.Namespace, attn: str) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[args.dtype] if args.dtype != "auto" else "auto"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn)
    return model.to(hf_device(args)).eval()


def cb_config(workload: Workload, args: argparse.Namespace,
              max_batch_tokens: int) -> ContinuousBatchingConfig:
    """Size the paged cache to hold the whole workload at once (like pytgi's default cache) and give
    each step the same token budget as pytgi's `max_batch_prefill_tokens`."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = args.hf_page_size
    needed = sum(math.ceil((len(p) + n) / page) for p, n in zip(workload.prompts, workload.output_lens))
    num_blocks = args.hf_num_blocks or needed + len(workload.prompts)
    return ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                    auto_switch_to_flash=False)


def run_transformers_cb(model: PreTrainedModel, workload: Workload, args: argparse.Namespace,
                        max_batch_tokens: int) -> tuple[Outputs, tuple[float, float]]:
    """What `generate_batch` does, but with one `add_request` per prompt so that each request keeps
    its own `max_new_tokens` (`generate_batch` takes a single one for the whole batch). EOS is
    disabled (eos_token_id=None -> -1) so every request runs to its length. Returns the outputs and
    the seconds from the first request in to the last result out: the manager's set-up (cache
    allocation, CUDA graph capture on a GPU) is left out, as pytgi's is done when the LLM is built."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=max(workload.output_lens))
    hints = WorkloadHints(max(map(len, workload.prompts)), max(workload.output_lens), len(workload.prompts))
    cfg = cb_config(workload, args, max_batch_tokens)
    with torch.inference_mode(), model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cfg, block=True, timeout=30, workload_hints=hints
    ) as manager:
        clock = Clock().start()
        ids = [manager.add_request(p, request_id=f"bench-{i}", max_new_tokens=n)
               for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))]
        results = collect_cb_results(manager, {i for i in ids if i is not None})
        seconds = clock.stop()
    return [results[i].generated_tokens if i in results else [] for i in ids], seconds


def collect_cb_results(manager: ContinuousBatchingManager, pending: set[str]) -> dict:
    """Drain the manager's output queue until every request is finished (or the loop died)."""
    results = {}
    while pending:
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                print(f"transformers: generation loop gone, {len(pending)} requests left", file=sys.stderr)
                break
            continue
        if out.is_finished() and out.request_id in pending:
            if out.error is not None:
                print(f"transformers: {out.request_id} failed: {out.error}", file=sys.stderr)
            results[out.request_id] = out
            pending.discard(out.request_id)
    return results


def bench_transformers(model_path: Path, workload: Workload, args: argparse.Namespace,
                       max_batch_tokens: int) -> tuple[SystemResult, Outputs]:
    """Warm up, then time transformers' continuous batching on the whole workload."""
    model = load_hf(model_path, args, args.hf_attn)
    run_transformers_cb(model, warmup_workload(model.config.vocab_size), args, max_batch_tokens)
    outputs, seconds = run_transformers_cb(model, workload, args, max_batch_tokens)
    result = summarize("transformers", workload, outputs, seconds)
    result.notes = dict(attn_implementation=args.hf_attn, page_size=args.hf_page_size,
                        num_blocks=cb_config(workload, args, max_batch_tokens).num_blocks,
                        max_batch_tokens=max_batch_tokens, dtype=str(model.dtype), device=str(model.device))
    del model
    free_memory()
    return result, outputs


# -- plain HF generate, padded static batches ------------------------------------------------------------


def run_hf_padded(model: PreTrainedModel, workload: Workload, batch_size: int) -> Outputs:
    """Left-padded batches of `batch_size` in workload order; each batch runs to its longest output
    (min_new_tokens forces it), then every request keeps exactly its requested count."""
    outputs: Outputs = []
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start : start + batch_size]
        lens = workload.output_lens[start : start + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=None,
                                 max_new_tokens=max(lens), min_new_tokens=max(lens), pad_token_id=0)
        outputs += [row[width : width + n].tolist() for row, n in zip(gen, lens)]
    return outputs


def bench_hf_padded(model_path: Path, workload: Workload,
                    args: argparse.Namespace) -> tuple[SystemResult, Outputs]:
    model = load_hf(model_path, args, "sdpa")
    model.generation_config.eos_token_id = None
    run = lambda w: run_hf_padded(model, w, args.hf_batch_size)
    run(warmup_workload(model.config.vocab_size))
    outputs, seconds = timed(run, workload)
    result = summarize("hf-padded", workload, outputs, seconds)
    result.notes = dict(batch_size=args.hf_batch_size, attn_implementation="sdpa", dtype=str(model.dtype))
    del model
    free_memory()
    return result, outputs


# -- environment and report --------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> dict[str, object]:
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return dict(cpu=cpu_model(), cores=os.cpu_count(), torch=torch.__version__,
                torch_threads=torch.get_num_threads(), transformers=transformers.__version__,
                python=platform.python_version(), gpu=gpu,
                git_commit=git_commit(), load_average_1_5_15min=load_average())


def load_average() -> list[float] | None:
    """The machine's load: other processes competing for the cores make every figure slower."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def markdown_table(results: list[SystemResult]) -> str:
    """One row per system; the ratio is output tok/s against transformers' (when it ran)."""
    base = next((r for r in results if r.system == "transformers"), None)
    head = ("| system | requests | prompt tokens | output tokens | wall s | output tok/s | total tok/s "
            "| req/s | length mismatches | ratio vs transformers | cpu s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        ratio = f"{r.output_tok_s / base.output_tok_s:.2f}x" if base else "n/a"
        lines.append(f"| {r.system} | {r.requests} | {r.prompt_tokens} | {r.output_tokens} | {r.wall_s:.2f} "
                     f"| {r.output_tok_s:.1f} | {r.total_tok_s:.1f} | {r.requests_s:.2f} "
                     f"| {r.mismatched_requests} | {ratio} | {r.cpu_s:.1f} |")
    return "\n".join(lines)


def print_report(args: argparse.Namespace, machine: dict[str, object], model: str, workload: Workload,
                 results: list[SystemResult], agree: dict[str, float]) -> None:
    print(f"\n## pytgi engine benchmark ({model}, {args.dtype}, device {args.device})\n")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
          f"({machine['torch_threads']} threads), transformers {machine['transformers']}, "
          f"gpu {machine['gpu']}")
    print(f"commit: {machine['git_commit']}; load average before {machine['load_average_before']}, "
          f"after {machine['load_average_1_5_15min']} (1/5/15 min)")
    print(f"workload: {len(workload.prompts)} requests, seed {args.seed}, "
          f"input {args.input_min}-{args.input_max}, output {args.output_min}-{args.output_max} tokens, "
          "EOS ignored, greedy\n")
    print(markdown_table(results))
    for r in results:
        if (steps := (r.notes or {}).get("steps")) is not None:
            print(f"\n{r.system} steps: {steps['decode_steps']} decode-only, {steps['decode_s']:.2f} s "
                  f"({steps['decode_step_ms']:.2f} ms each); {steps['prefill_steps']} with prompt tokens, "
                  f"{steps['prefill_s']:.2f} s; outside the steps (scheduling, outputs) {steps['outside_steps_s']:.2f} s")
    for system, frac in agree.items():
        print(f"\ngreedy agreement {system} vs transformers: {frac:.3f} of requests have identical token ids")


def write_json(path: Path, payload: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nresults written to {path}")


# -- random-weight model helper --------------------------------------------------------------------------


def default_model_dir() -> Path:
    from pytgi.core.model_files import resolve_model

    return resolve_model(None).path


def random_model_config(shape: str, src: Path) -> dict[str, object]:
    """A plain HF LlamaForCausalLM config.json of the given shape, on the default model's tokenizer."""
    base = json.loads((src / "config.json").read_text())
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", **SHAPES[shape],
                head_dim=SHAPES[shape]["hidden_size"] // SHAPES[shape]["num_attention_heads"],
                vocab_size=base["vocab_size"], max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
                mlp_bias=False, torch_dtype=SHAPE_DTYPES[shape], bos_token_id=base.get("bos_token_id"),
                eos_token_id=base.get("eos_token_id"))


def random_state_dict(config: dict[str, object]) -> Tensors:
    """Parameter names and shapes from a meta-device transformers model; N(0, 0.02) weights, unit norms."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**config))
    # drawn on the GPU where there is one: an 8B model's 8e9 draws take a minute on a CPU
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype, gen = DTYPES[str(config["torch_dtype"])], torch.Generator(device).manual_seed(0)
    for name, p in meta.state_dict().items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(p.shape, dtype=dtype)
        else:
            yield name, (torch.randn(p.shape, generator=gen, device=device) * 0.02).to(dtype).cpu()


def group_shards(tensors: Tensors, shard_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group (name, tensor) pairs into dicts of at most `shard_bytes` (one tensor may exceed it)."""
    shard: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if shard and sum(x.nbytes for x in shard.values()) + t.nbytes > shard_bytes:
            yield shard
            shard = {}
        shard[name] = t
    if shard:
        yield shard


def write_shards(out: Path, tensors: Tensors, shard_bytes: int = 4 << 30) -> None:
    """Safetensors shards written as they fill (one shard in memory at a time), then named
    model-0000i-of-0000n, with the index transformers reads; a single shard is model.safetensors."""
    from safetensors.torch import save_file

    names: list[list[str]] = []
    total = 0
    for i, shard in enumerate(group_shards(tensors, shard_bytes), 1):
        save_file(shard, str(out / f"shard-{i:05d}.tmp"), metadata={"format": "pt"})
        names.append(list(shard))
        total += sum(t.nbytes for t in shard.values())
    if len(names) == 1:
        (out / "shard-00001.tmp").rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, keys in enumerate(names, 1):
        fname = f"model-{i:05d}-of-{len(names):05d}.safetensors"
        (out / f"shard-{i:05d}.tmp").rename(out / fname)
        weight_map |= dict.fromkeys(keys, fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_random_model(out: Path, shape: str, tokenizer_dir: Path | None = None) -> None:
    """Write a random-weight HF Llama directory: config, safetensors, and the default model's tokenizer
    (or `tokenizer_dir`'s: its config.json and tokenizer files)."""
    src = tokenizer_dir or default_model_dir()
    out.mkdir(parents=True, exist_ok=True)
    config = random_model_config(shape, src)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen_cfg = {k: config[k] for k in ("bos_token_id", "eos_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    write_shards(out, random_state_dict(config))
    print(f"wrote a random-weight {shape} LlamaForCausalLM to {out}")


# -- main ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-min", type=int, default=None, help="default 64, or --input-max if lower")
    p.add_argument("--input-max", type=int, default=512)
    p.add_argument("--output-min", type=int, default=None, help="default 64, or --output-max if lower")
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="pytgi,transformers", help=f"comma-separated, of {','.join(SYSTEMS)}")
    p.add_argument("--model", default=None, help="HF model directory (default: pytgi's default model)")
    p.add_argument("--dtype", default="float32", choices=["auto", *DTYPES])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for every system (default: pytgi's choice, one per core)")
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "paged|eager"],
                   help="attn_implementation for transformers' continuous batching (the CPU-capable ones)")
    p.add_argument("--hf-page-size", type=int, default=256, help="transformers' CB page size (its default)")
    p.add_argument("--hf-num-blocks", type=int, default=None, help="default: enough for the whole workload")
    p.add_argument("--hf-batch-size", type=int, default=8, help="batch size of the hf-padded system")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/engine-<time>.json")
    p.add_argument("--make-random-model", type=Path, default=None, metavar="DIR",
                   help="write a random-weight HF Llama directory to DIR and exit")
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="with --make-random-model: take config.json's vocabulary and the tokenizer from here")
    p.add_argument("--max-batch-size", type=int, default=None, help="pytgi's --max-batch-size (default 256)")
    p.add_argument("--quantize", default=None, help="pytgi's --quantize (default auto)")
    p.add_argument("--kv-cache-dtype", default=None, help="pytgi's --kv-cache-dtype (default auto)")
    p.add_argument("--max-batch-prefill-tokens", type=int, default=None,
                   help="pytgi's --max-batch-prefill-tokens (default 1024 on CPU, 4096 on CUDA)")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    args.input_min = min(64, args.input_max) if args.input_min is None else args.input_min
    args.output_min = min(64, args.output_max) if args.output_min is None else args.output_min
    if not 1 <= args.input_min <= args.input_max or not 1 <= args.output_min <= args.output_max:
        p.error("need 1 <= --input-min <= --input-max and 1 <= --output-min <= --output-max")
    return args


def set_threads(threads: int | None) -> None:
    """One thread count for all systems; OMP_NUM_THREADS keeps pytgi from resetting it."""
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def run_systems(args: argparse.Namespace) -> tuple[Path, Workload, list[SystemResult], dict[str, Outputs]]:
    """Load pytgi first (it resolves the model directory), then run each selected system in turn."""
    set_threads(args.threads)
    llm = load_pytgi(args)
    model_path, vocab = llm.engine.model_path, llm.engine.runner.vocab_size
    max_batch_tokens = llm.engine.info.max_batch_prefill_tokens
    workload = make_workload(args, vocab)
    results, outputs = [], {}
    if "pytgi" in args.systems:
        result, outputs["pytgi"] = bench_pytgi(llm, workload)
        results.append(result)
    del llm
    free_memory()
    if "transformers" in args.systems:
        result, outputs["transformers"] = bench_transformers(model_path, workload, args, max_batch_tokens)
        results.append(result)
    if "hf-padded" in args.systems:
        result, outputs["hf-padded"] = bench_hf_padded(model_path, workload, args)
        results.append(result)
    return model_path, workload, results, outputs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_random_model is not None:
        make_random_model(args.make_random_model, args.shape, args.tokenizer_dir)
        return 0
    load_before = load_average()
    model_path, workload, results, outputs = run_systems(args)
    machine = machine_info() | {"load_average_before": load_before}  # after pytgi set the torch thread count
    agree = {name: agreement(out, outputs["transformers"]) for name, out in outputs.items()
             if name != "transformers" and "transformers" in outputs}
    print_report(args, machine, args.model or "default model", workload, results, agree)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"engine-{stamp}.json"
    write_json(out, dict(timestamp=stamp, args=vars(args), machine=machine, model_path=str(model_path),
                         workload=dict(requests=len(workload.prompts), prompt_tokens=workload.prompt_tokens,
                                       output_tokens=workload.output_tokens),
                         results=[r.to_dict() for r in results], greedy_agreement_vs_transformers=agree))
    return 0 if all(r.mismatched_requests == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
