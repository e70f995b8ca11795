"""Every causal-LM family transformers ships, tried as a new user would (issue 63, point 5): a tiny
random config of it saved as a model directory, greedy float32 generation in transformers and in
pytgi (`--model-impl auto`: its own code where a family has one, else transformers' fallback).

A family is one of:

- EQUAL: pytgi's tokens equal transformers' (a prompt longer than every window the config declares,
  a batch of two prompts of different lengths, so chunks, paged decodes and windows all count);
- REFUSED: pytgi refused it at start, by name (`UnsupportedModel`);
- SKIPPED: no tiny text-only config of it can be built here (an encoder-decoder, a config that
  needs another model's, a model transformers itself cannot run greedily): the reason is listed;
- anything else is a failure: a crash at start that is not a refusal, an error on a request, or
  other tokens.

`python -m tests.every_family [model_type ...]` prints the table (and `--json PATH` writes it);
tests/model/test_every_family.py asserts that nothing is a failure.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

EQUAL, REFUSED, SKIPPED, FAILED = "equal", "refused", "skipped", "FAILED"
WINDOW = 8  # the tiny configs' sliding window: the prompts pass it
PROMPTS = (
    [5, 9, 17, 33, 65, 3, 7, 11, 13, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61],
    [4, 8, 15, 16, 23, 42],
)
NEW_TOKENS = 6
VOCAB = 128
MAX_PARAMS = 12_000_000

# small values for every size a decoder config may declare (only the ones a config class has are set)
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rotary_dim=8,  # GPT-J, CodeGen: of the head's 16
    # GPT-2's names, and others'
    n_embd=64,
    n_layer=4,
    n_head=4,
    n_positions=256,
    n_inner=96,
    d_model=64,
    ffn_dim=96,
    num_layers=4,
    num_heads=4,
    sliding_window=WINDOW,
    attention_chunk_size=WINDOW,
    # mixtures of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    expert_intermediate_size=32,
    ffn_hidden_size=96,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    # latent attention
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    # linear attention, state spaces
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=8,
    mamba_n_groups=1,
    state_size=8,
    ssm_state_size=8,
    # per-layer inputs, global heads (Gemma 3n/4)
    hidden_size_per_layer_input=16,
    global_head_dim=32,
    vocab_size_per_layer_input=VOCAB,
    num_kv_shared_layers=0,
)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# per model_type, what its defaults leave out: a Mamba hybrid's default is every layer Mamba, which
# transformers' own generate cannot run (its cache has no attention layer to size a mask from), so one
# layer attends; LFM2's default puts attention in every layer (none of its short convolutions, the
# layer kind that makes the family), LFM2-MoE's names no layer types at all (transformers' model cannot
# be built from it), Kimi Linear's makes four layers all linear (transformers' masks then fail) and its
# linear heads stay 32 of 128
OWN = {
    "bamba": dict(attn_layer_indices=[1]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] + ["linear_attention"] * 2),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "conv"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "conv"], num_dense_layers=1),
    "kimi_linear": dict(
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_num_heads=4,
        linear_head_dim=16,
    ),
}


@dataclasses.dataclass(slots=True)
class Outcome:
    model_type: str
    architecture: str = ""
    result: str = SKIPPED
    detail: str = ""
    impl: str = ""  # pytgi's own code or transformers' fallback
    seconds: float = 0.0


def causal_lm_types() -> dict[str, str]:
    """model_type → its causal LM class name, as transformers maps them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def tiny_config(model_type: str):  # -> transformers.PreTrainedConfig
    """The config class's defaults with every size it declares made small; None when the config is not
    one decoder's (an encoder-decoder, a composite whose text part is another config)."""
    import transformers

    cls = transformers.CONFIG_MAPPING[model_type]
    base = cls()
    if getattr(base, "is_encoder_decoder", False):
        return None
    if base.get_text_config(decoder=True) is not base:
        return None  # a composite (vision, audio): its text model is tried under its own model_type
    given = {k: v for k, v in {**SMALL, **IDS}.items() if _has(base, k)}
    given.update(OWN.get(model_type, {}))
    if "head_dim" in given and _has(base, "qk_nope_head_dim"):  # latent attention: head_dim is rope's,
        given["head_dim"] = SMALL["qk_rope_head_dim"]  # and every query head has its keys
        given["num_key_value_heads"] = SMALL["num_attention_heads"]
    for _ in range(3):  # a size the class derives or checks against the others: left to its default
        try:
            return cls(**given)
        except Exception as e:  # noqa: BLE001
            error = e
            for key in given:
                try:
                    cls(**{k: v for k, v in given.items() if k != key})
                except Exception:  # noqa: BLE001, S112
                    continue
                given.pop(key)
                break
            else:
                raise error from None
    return cls(**given)


def _has(cfg, key: str) -> bool:
    try:
        return hasattr(cfg, key)
    except Exception:  # noqa: BLE001  # Gemma 4's per-layer attributes refuse a model-wide read
        return key in cfg.to_dict()


def _reference(cfg, arch: str, out: Path):
    """The tiny model saved to `out` with a tokenizer; its greedy tokens for each prompt (None: greedy
    generation fails in transformers itself, with the reason)."""
    import torch
    import transformers

    from pytgi.core.model_files import resolve_model

    cls = getattr(transformers, arch)
    cfg.architectures = [arch]
    with torch.device("meta"):  # a config whose other sizes stay large is not tried
        size = sum(p.numel() for p in cls(cfg).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"the tiny config still has {size / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # random selection biases (DeepSeek V3's) make routing depend on them
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.5)
    model.save_pretrained(out)
    tok = resolve_model(None, progress=False).path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, out / name)
    expected, uncached = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            plain = transformers.GenerationConfig(  # greedy, and nothing a checkpoint's defaults add
                max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=plain)
            expected.append(gen[0, len(prompt) :].tolist())
            seq = ids  # the same greedy tokens from whole forwards, no cache
            for _ in range(NEW_TOKENS):
                step = model(input_ids=seq, use_cache=False).logits[0, -1].argmax()
                seq = torch.cat([seq, step.view(1, 1)], 1)
            uncached.append(seq[0, len(prompt) :].tolist())
    return expected, uncached


def check(model_type: str, arch: str, root: Path) -> Outcome:
    out = Outcome(model_type, arch)
    start = time.perf_counter()
    try:
        cfg = tiny_config(model_type)
    except Exception as e:  # noqa: BLE001
        out.detail = f"no tiny config: {type(e).__name__}: {str(e)[:160]}"
        return out
    if cfg is None:
        out.detail = "not a decoder-only text config (encoder-decoder or composite)"
        return out
    path = root / model_type
    try:
        expected, uncached = _reference(cfg, arch, path)
    except Exception as e:  # noqa: BLE001
        out.detail = f"transformers cannot run it greedily: {type(e).__name__}: {str(e)[:160]}"
        return out
    out.result, out.detail = _pytgi(path, expected, uncached, out)
    out.seconds = time.perf_counter() - start
    return out


def _pytgi(path: Path, expected: list[list[int]], uncached: list[list[int]], out: Outcome) -> tuple[str, str]:
    """`expected`: transformers' `generate`; `uncached`: its whole forwards' greedy tokens (where the two
    differ, transformers' own cache disagrees with its forward: pytgi must equal the forward)."""
    from pytgi.core.errors import UnsupportedModel
    from pytgi.core.sampling_params import SamplingParams
    from pytgi.llm import LLM

    try:
        llm = LLM(str(path), dtype="float32", device="cpu", max_batch_size=4)
    except UnsupportedModel as e:
        return REFUSED, str(e)
    except Exception as e:  # noqa: BLE001
        return FAILED, f"crash at start: {type(e).__name__}: {str(e)[:200]}\n{traceback.format_exc()[-600:]}"
    try:
        out.impl = type(llm.engine.runner.model).__name__ if hasattr(llm.engine, "runner") else ""
        params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        try:
            got = [o.token_ids for o in llm.generate([list(p) for p in PROMPTS], params)]
        except Exception as e:  # noqa: BLE001
            return FAILED, f"a request failed: {type(e).__name__}: {str(e)[:300]}"
        if got == expected:
            return EQUAL, ""
        if got == uncached:
            return EQUAL, "equal to transformers' forward; its cached generate gives other tokens"
        return FAILED, f"other tokens: pytgi {got}, transformers {expected} (uncached: {uncached})"
    finally:
        llm.shutdown()


def survey(types: list[str] | None, root: Path) -> list[Outcome]:
    mapping = causal_lm_types()
    outcomes = []
    for model_type in types or list(mapping):
        o = check(model_type, mapping[model_type], root)
        print(f"{o.model_type:28} {o.result:8} {o.impl:18} {o.seconds:5.1f}s {o.detail[:150]!r}", flush=True)
        outcomes.append(o)
    return outcomes


if __name__ == "__main__":
    import tempfile

    args = sys.argv[1:]
    dest = None
    if "--json" in args:
        i = args.index("--json")
        dest, args = Path(args[i + 1]), args[:i] + args[i + 2 :]
    with tempfile.TemporaryDirectory() as tmp:
        results = survey(args or None, Path(tmp))
    counts = {r: sum(o.result == r for o in results) for r in (EQUAL, REFUSED, SKIPPED, FAILED)}
    print(counts)
    if dest:
        dest.write_text(json.dumps([dataclasses.asdict(o) for o in results], indent=1))
