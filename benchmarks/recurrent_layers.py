"""Where a recurrent layer's time goes on the CPU, for the kinds without a C kernel of their own at the
start of issue 64 (Mamba-1, LFM2's short convolution, Kimi Linear's KDA): a random-weight model of
`--layers` layers of the kind at hidden `--hidden` (built here with transformers, saved to a temporary
folder), served by pytgi's engine in-process. Prints a `--prompt`-token prefill's tok/s and the mean
decode step of one stream; per layer of the kind: the decoder layer, its mixer, and the mixer's
ops between its projections (the mixer less its linear layers), in ms. Where the kind has C kernels
(`fused`: Mamba-1's and KDA's, since) both paths are measured, alternating, best of `--reps` rounds
each. With `--clock thread` and one thread the figures are CPU time, which other work on a shared
machine barely changes.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/recurrent_layers.py --kind mamba
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/recurrent_layers.py --kind lfm2
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/recurrent_layers.py --kind kimi
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recurrent_layers.py --kind mamba --clock thread
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.llm_engine import LLMEngine
from pytgi.engine.models.decoder import DecoderLayer
from pytgi.engine.models.kda import KimiDeltaAttention
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear
from pytgi.engine.models.mamba1 import Mamba1Mixer
from pytgi.engine.models.quant import QuantizedLinear
from pytgi.engine.models.short_conv import ShortConv

MIXERS = (Mamba1Mixer, ShortConv, KimiDeltaAttention)
LINEARS = (ColumnParallelLinear, RowParallelLinear, QuantizedLinear)  # (on the CPU: packed at load)


def _model(kind: str, hidden: int, layers: int) -> transformers.PreTrainedModel:
    """All layers of the kind (Kimi Linear and LFM2 need no attention layer either)."""
    common = {"vocab_size": 1000, "hidden_size": hidden, "num_hidden_layers": layers, "eos_token_id": None}
    if kind == "mamba":
        cfg = transformers.MambaConfig(**common, state_size=16, expand=2)
        return transformers.MambaForCausalLM(cfg)
    if kind == "lfm2":
        cfg = transformers.Lfm2Config(
            **common, intermediate_size=3 * hidden, num_attention_heads=hidden // 64, num_key_value_heads=4,
            layer_types=["conv"] * layers,
        )  # fmt: skip
        return transformers.Lfm2ForCausalLM(cfg)
    cfg = transformers.KimiLinearConfig(
        **common, intermediate_size=3 * hidden, moe_intermediate_size=hidden, num_local_experts=0,
        layer_types=["linear_attention"] * layers, num_attention_heads=hidden // 128, num_key_value_heads=4,
        kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, linear_head_dim=128,
        linear_num_heads=hidden // 128, max_position_embeddings=4096, first_k_dense_replace=layers,
        pad_token_id=0, bos_token_id=1,
    )  # fmt: skip
    return transformers.KimiLinearForCausalLM(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["mamba", "lfm2", "kimi"], required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: the calling thread's CPU time (with OMP_NUM_THREADS=1: a shared machine's figures)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.manual_seed(0)
    tmp = tempfile.TemporaryDirectory()
    _model(args.kind, args.hidden, args.layers).save_pretrained(tmp.name)
    engine = LLMEngine(EngineConfig(model=tmp.name, dtype=args.dtype, max_batch_total_tokens=4096))
    times: dict[str, float] = collections.defaultdict(float)

    def timed(mod: torch.nn.Module, name: str) -> None:
        start: list[float] = []

        def done(m, a, o) -> None:
            times[name] += clock() - start.pop()

        mod.register_forward_pre_hook(lambda m, a: start.append(clock()))
        mod.register_forward_hook(done)

    n_mixers = 0
    for mod in engine.runner.model.modules():
        if isinstance(mod, DecoderLayer):
            timed(mod, "layer")
        elif isinstance(mod, MIXERS):
            n_mixers += 1
            timed(mod, "mixer")
            for child in mod.modules():
                if isinstance(child, LINEARS):
                    timed(child, "linears")
    params = SamplingParams(max_new_tokens=args.steps + 4, temperature=0, ignore_eos=True)
    prompt = [(7 * j) % 900 + 50 for j in range(args.prompt)]
    mixers = [m for m in engine.runner.model.modules() if isinstance(m, MIXERS)]
    # the paths to compare: the C kernels' where the kind has them (`fused`), and PyTorch's
    modes = ["pytorch", "c"] if any(getattr(m, "fused", False) for m in mixers) else ["pytorch"]
    best: dict[tuple[str, str], dict[str, float]] = {}

    def measure(mode: str, rid: str) -> None:
        """One prefill and `--steps` decode steps on `mode`'s path; keeps each figure's best."""
        for m in mixers:
            if hasattr(m, "fused"):
                m.fused = mode == "c"
        engine.add_request(rid, prompt, params)
        times.clear()
        t = clock()
        while any(r.num_uncomputed > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        got = {"prefill": (clock() - t)}
        for phase, steps in (("prefill", 1), ("decode", args.steps)):
            if phase == "decode":
                for _ in range(2):
                    engine.step()
                times.clear()
                t = clock()
                for _ in range(steps):
                    engine.step()
                got = {"decode": (clock() - t) / steps}
            got.update({k: v / steps / n_mixers for k, v in times.items()})
            got["ops"] = got["mixer"] - got.get("linears", 0.0)
            mine = best.setdefault((mode, phase), got)
            for k, v in got.items():
                mine[k] = min(mine[k], v)
        while engine.has_unfinished():
            engine.step()

    measure(modes[-1], "warm-up")
    for r in range(args.reps):
        for mode in modes:
            measure(mode, f"{mode}-{r}")
    print(
        f"{args.kind}, hidden {args.hidden}, {n_mixers} layers, {args.dtype}, {torch.get_num_threads()} "
        f"threads, {args.clock} clock, best of {args.reps} rounds (the paths alternate)"
    )
    for mode in modes:
        p, d = best[(mode, "prefill")], best[(mode, "decode")]
        print(
            f"{mode:8s} prefill {args.prompt} tokens: {args.prompt / p['prefill']:.0f} tok/s; a layer "
            f"{p['layer'] * 1e3:.1f} ms, mixer {p['mixer'] * 1e3:.1f}, its ops {p['ops'] * 1e3:.1f}"
        )
        print(
            f"{mode:8s} decode, 1 stream: {d['decode'] * 1e3:.2f} ms a step; a layer {d['layer'] * 1e3:.3f} "
            f"ms, mixer {d['mixer'] * 1e3:.3f}, its ops {d['ops'] * 1e3:.3f} "
            f"({100 * d['ops'] / d['layer']:.0f}% of the layer)"
        )
    engine.shutdown()
    tmp.cleanup()


if __name__ == "__main__":
    main()
