#!/usr/bin/env python
"""An agent session on a hybrid (linear-attention) model, in pytgi's engine, with and without the
prefix cache's state checkpoints: each turn's TTFT, warm against cold, and what a checkpoint's copy
costs.

    .venv/bin/python benchmarks/hybrid_prefix.py                       # a random Qwen3.5-shaped model
    .venv/bin/python benchmarks/hybrid_prefix.py --model /tmp/llama/qwen35-8l-hf --system-tokens 8000

The session: a system prompt of --system-tokens random token ids, then --turns turns, each adding a
tool result of --tool-tokens and the answer of the turn before (--answer-tokens, generated greedily
with EOS ignored), the whole conversation sent each turn (as an agent does). Run once on an engine with
the prefix cache (a hybrid's checkpoints) and on one with --disable-prefix-caching, both in this
process, each turn on one then the other (so that a shared machine's load falls on both alike); each
turn's TTFT (add to first token; wall and this process's CPU seconds, which a shared machine's other
load moves less) and cached prompt tokens are recorded. The answers are compared: with
checkpoints they are the cold ones, tokens and logprobs to the bit.

Without --model, a random Qwen3.5 text model is written to a temporary directory: --layers layers (one
in four softmax attention), hidden --hidden, the linear layers at Qwen3.5-35B-A3B's state shape (16
key heads, 32 value heads of 128: a 2 MiB float32 state and a 48 KiB convolution state per layer), so
a checkpoint's copy is per layer what it is at full scale (63 MB over its 30 linear layers). The copy
is timed on its own too: one request's state into a checkpoint row, and a 63 MB row copy.
The record goes to benchmarks/results/hybrid_prefix-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine

REPO = Path(__file__).resolve().parent.parent


def random_model(args: argparse.Namespace, directory: Path) -> Path:
    import transformers

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=65536,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    return directory


def engine_for(model: str, args: argparse.Namespace, cache: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            max_batch_total_tokens=args.kv_tokens,
            max_batch_size=4,
            enable_prefix_caching=cache,
            prefix_cache_state_bytes=args.checkpoint_bytes,
        )
    )


def ask(engine: LLMEngine, rid: str, prompt: list[int], new: int) -> dict:
    """One request alone: its TTFT (add to first token), answer, logprobs and cached prompt tokens."""
    params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    engine.add_request(rid, list(prompt), params)
    ttft, cpu, answer, logprobs, cached = None, None, [], [], 0
    while engine.has_unfinished():
        for u in engine.step():
            if u.token_id >= 0:
                if ttft is None:  # (CPU seconds too: on a shared machine the wall clock is others' as well)
                    ttft, cpu = time.perf_counter() - t0, time.process_time() - c0
                answer.append(u.token_id)
                logprobs.append(u.logprob)
                cached = u.num_cached_tokens
    return {"prompt_tokens": len(prompt), "cached_tokens": cached, "ttft_s": ttft, "ttft_cpu_s": cpu, "answer": answer,
            "logprobs": logprobs}


def session(model: str, args: argparse.Namespace) -> dict:
    """The session on both engines, turn by turn, the warm one first then the cold one (interleaved,
    so that the load of a shared machine falls on both alike); the warm answers drive it."""
    warm, cold = engine_for(model, args, True), engine_for(model, args, False)
    g = torch.Generator().manual_seed(0)
    conversation = torch.randint(100, 30000, (args.system_tokens,), generator=g).tolist()
    rec: dict = {"state_bytes": warm.runner.state_bytes, "checkpoints": len(warm.block_manager.free_checkpoints),
                 "warm": [], "cold": []}
    try:
        for engine in (warm, cold):  # first-call costs (thread pools, kernels) out of turn 0
            ask(engine, "warm-up", [5] * 16, 2)
        for k in range(args.turns + 1):
            conversation += torch.randint(100, 30000, (args.tool_tokens,), generator=g).tolist()
            w = ask(warm, f"turn{k}", conversation, args.answer_tokens)
            c = ask(cold, f"turn{k}", conversation, args.answer_tokens)
            rec["warm"].append(w)
            rec["cold"].append(c)
            print(f"  turn {k}: {len(conversation)} tokens, {w['cached_tokens']} cached, TTFT warm "
                  f"{w['ttft_s']:.3f} s, cold {c['ttft_s']:.3f} s", flush=True)
            conversation += w["answer"]
        paged = warm.runner.paged
        row = warm.info.max_batch_size  # the first checkpoint row
        t = time.perf_counter()
        for _ in range(20):
            paged.copy_states([(0, row)])
        rec["copy_s"] = (time.perf_counter() - t) / 20
    finally:
        warm.shutdown()
        cold.shutdown()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a Hugging Face directory (default: a random one)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tool-tokens", type=int, default=200)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--checkpoint-bytes", type=int, default=256 * 2**20, help="--prefix-cache-state-bytes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(random_model(args, Path(tmp)))
        rec = session(model, args)
    big = torch.empty(63_000_000 // 4, dtype=torch.float32)
    dst = torch.empty_like(big)
    t = time.perf_counter()
    for _ in range(20):
        dst.copy_(big)
    rec["copy_63mb_s"] = (time.perf_counter() - t) / 20
    same = [(w["answer"], w["logprobs"]) for w in rec["warm"]] == [(c["answer"], c["logprobs"]) for c in rec["cold"]]
    print(f"\nstate {rec['state_bytes'] / 2**20:.1f} MiB a request, {rec['checkpoints']} checkpoint rows; "
          f"answers and logprobs equal: {same}")
    print("turn  prompt  cached   cold TTFT  warm TTFT  cold/warm   (CPU s: cold  warm  cold/warm)")
    for k, (w, c) in enumerate(zip(rec["warm"], rec["cold"])):
        print(f"{k:4d}  {w['prompt_tokens']:6d}  {w['cached_tokens']:6d}   {c['ttft_s']:8.3f}   {w['ttft_s']:8.3f}"
              f"   {c['ttft_s'] / w['ttft_s']:6.2f}x   {c['ttft_cpu_s']:8.2f} {w['ttft_cpu_s']:6.2f}"
              f"  {c['ttft_cpu_s'] / w['ttft_cpu_s']:6.2f}x")
    print(f"a checkpoint's copy: {rec['copy_s'] * 1e3:.2f} ms ({rec['state_bytes'] / 2**20:.1f} MiB); "
          f"a 63 MB row copy on this CPU: {rec['copy_63mb_s'] * 1e3:.2f} ms")
    rec.update(args=vars(args), answers_equal=same, threads=torch.get_num_threads())
    out = REPO / "benchmarks" / "results" / f"hybrid_prefix-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(rec, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
