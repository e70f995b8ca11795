"""LoRA adapters against transformers + peft (float32, greedy): adapters made by peft in the test with
random nonzero A and B, on tiny random Llama and Qwen2 models; alone, batched with each other and with
base-model requests; refusals; the prefix cache keeps each adapter's blocks apart."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

peft = pytest.importorskip("peft")

from pytgi.core.adapters import AdapterError
from pytgi.core.config import EngineConfig
from pytgi.core.errors import InvalidRequest
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine import kernels
from pytgi.engine.llm_engine import LLMEngine
from tests.kernel_paths import decoder_loop
from tests.reference import hf_copy

BASE = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=None,
    tie_word_embeddings=False,
)
# name → (peft config, whether to scale its weights up so that the adapter changes greedy outputs)
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp": dict(r=16, lora_alpha=4, target_modules=["gate_proj", "down_proj"]),
}
PROMPTS = [[5, 17, 3, 99, 42, 8, 1, 64], [7] * 20, list(range(30, 60)), [11, 12, 13]]
NEW = 10


def make_adapter(base_dir, out, cfg: dict, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **cfg))
    with torch.no_grad():  # big enough to change what greedy picks
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    lora.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"tiny-lora-{request.param}")
    if request.param == "llama":
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).save_pretrained(path)
    else:  # q, k, v biases
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**BASE)).save_pretrained(path)
    adapters = {
        name: make_adapter(path, tmp_path_factory.mktemp(name), cfg, seed)
        for seed, (name, cfg) in enumerate(ADAPTERS.items(), start=1)
    }
    return path, adapters


def reference(base_dir, adapter_dir, prompts, merged: bool = False):
    """transformers (+ peft) greedy continuations, one prompt at a time. `merged`: the adapter merged
    into the weights (W + scaling·BA), for a model whose code reads a targeted weight itself (Jamba's
    dt_proj) and so would skip peft's unmerged product."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_copy(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                min_new_tokens=NEW,
                pad_token_id=0,
            )
        out.append(gen[0, len(p) :].tolist())
    return out


def run(engine, jobs):
    """jobs: (prompt, adapter) all submitted at once; each one's greedy tokens."""
    got: dict[str, list[int]] = {}
    for i, (prompt, adapter) in enumerate(jobs):
        engine.add_request(str(i), prompt, SamplingParams(max_new_tokens=NEW, temperature=0, adapter=adapter))
        got[str(i)] = []
    while engine.has_unfinished():
        for u in engine.step():
            if u.token_id >= 0:
                got[u.request_id].append(u.token_id)
    return [got[str(i)] for i in range(len(jobs))]


def engine_for(path, adapters, **kw):
    specs = tuple(f"{name}={d}" for name, d in adapters.items())
    return LLMEngine(
        EngineConfig(
            **{
                "model": str(path),
                "dtype": "float32",
                "max_batch_total_tokens": 2048,
                "lora_adapters": specs,
                **kw,
            }
        )
    )


def test_each_adapter_equals_peft_alone_and_mixed_in_one_batch(tiny):
    path, adapters = tiny
    want = {None: reference(path, None, PROMPTS)}
    want |= {name: reference(path, d, PROMPTS) for name, d in adapters.items()}
    assert all(want[name] != want[None] for name in adapters), "an adapter that changes nothing tests nothing"
    engine = engine_for(path, adapters)
    try:
        for name in [None, *adapters]:  # alone: one adapter's requests at a time
            assert run(engine, [(p, name) for p in PROMPTS]) == want[name], name
        # mixed: every prompt with every adapter and the base model, all in one batch
        jobs = [
            (p, name)
            for i, p in enumerate(PROMPTS)
            for name in [None, *adapters][i % 4 :] + [None, *adapters][: i % 4]
        ]
        got = run(engine, jobs)
        assert got == [want[name][PROMPTS.index(p)] for p, name in jobs]
    finally:
        engine.shutdown()


def test_unknown_adapters_and_unservable_ones_are_refused(tiny, tmp_path):
    path, adapters = tiny
    engine = engine_for(path, {"qv": adapters["qv"]})
    try:
        with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'nope'"):
            engine.add_request("x", [1, 2, 3], SamplingParams(max_new_tokens=2, adapter="nope"))
        assert engine.adapters.snapshot().served == {"qv": str(adapters["qv"])}
    finally:
        engine.shutdown()
    big = make_adapter(path, tmp_path / "big", dict(r=8, target_modules=["q_proj"]), 9)
    with pytest.raises(AdapterError, match="rank 8 is above --max-lora-rank 4"):
        engine_for(path, {"big": big}, max_lora_rank=4)
    head = make_adapter(path, tmp_path / "head", dict(r=2, target_modules=["q_proj", "lm_head"]), 9)
    with pytest.raises(AdapterError, match="lm_head"):
        engine_for(path, {"head": head})
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_model.safetensors").write_bytes((big / "adapter_model.safetensors").read_bytes())
    config = json.loads((big / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA is not supported"):
        engine_for(path, {"dora": dora})


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(tiny):
    path, adapters = tiny
    engine = engine_for(path, adapters, block_size=4)
    prompt = list(range(40, 70))
    try:
        first = run(engine, [(prompt, "qv")])
        cached = {}
        for name in ["qv", None, "all", "qv"]:
            engine.add_request(
                name or "base", prompt, SamplingParams(max_new_tokens=1, temperature=0, adapter=name)
            )
            while engine.has_unfinished():
                for u in engine.step():
                    cached[u.request_id] = u.num_cached_tokens
        assert cached["qv"] > 0 and cached["base"] == 0 and cached["all"] == 0
        assert run(engine, [(prompt, "qv")]) == first  # from its own cached blocks, the same
        # a name unloaded and loaded again with other weights does not find the old weights' blocks
        engine.adapters.unload("qv")
        assert engine.adapters.settle() == ["qv"]
        engine.adapters.load("qv", str(adapters["all"]))
        engine.add_request("again", prompt, SamplingParams(max_new_tokens=1, temperature=0, adapter="qv"))
        while engine.has_unfinished():
            for u in engine.step():
                cached[u.request_id] = u.num_cached_tokens
        assert cached["again"] == 0
        assert run(engine, [(prompt, "qv")]) == run(engine, [(prompt, "all")]) != first
    finally:
        engine.shutdown()


def test_preemption_speculation_and_shards_keep_each_adapters_output(tiny):
    """A KV cache too small for the batch (requests preempted and recomputed), n-gram speculation,
    and two tensor-parallel shards all give what one unhurried engine gives, adapter by adapter."""
    path, adapters = tiny
    jobs = [(p, name) for p in PROMPTS for name in [None, *adapters]]
    engine = engine_for(path, adapters)
    try:
        want = run(engine, jobs)
    finally:
        engine.shutdown()
    for kw in [
        dict(max_batch_total_tokens=96, max_total_tokens=48, block_size=4),
        dict(speculate=3),
        dict(num_shard=2),
    ]:
        engine = engine_for(path, adapters, **kw)
        try:
            assert run(engine, jobs) == want, kw
            if "block_size" in kw:
                assert engine.scheduler.num_preemptions > 0
        finally:
            engine.shutdown()


@pytest.mark.slow
def test_the_default_models_hf_copy_with_an_adapter_equals_peft(tmp_path):
    from pytgi.core.model_files import resolve_model
    from pytgi.core.tokenizer import Tokenizer

    base = resolve_model(None).path
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_copy(base), dtype=torch.float32)
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=8, lora_alpha=16, init_lora_weights=False, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
    )
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)
    lora.save_pretrained(tmp_path / "a")
    tok = Tokenizer.from_dir(base)
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in ["What is the capital of France?", "Write a haiku about rain."]
    ]
    want = reference(base, tmp_path / "a", prompts)
    assert want != reference(base, None, prompts)
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            max_batch_total_tokens=4096,
            max_total_tokens=1024,
            lora_adapters=(f"a={tmp_path / 'a'}",),
        )
    )
    try:
        assert run(engine, [(p, "a") for p in prompts]) == want
    finally:
        engine.shutdown()


@decoder_loop
def test_the_c_decoder_loop_adds_the_adapters_as_the_python_path_does(tmp_path):
    """The fast path's one-call decoder loop (decoder.c) adds each row's LoRA products (lora.c) where
    the Python layer path adds them: the same tokens and prompt logprobs, bit for bit, for a batch of
    requests with two adapters and none; and each request alone gives the bits it gives in the batch
    (batch invariance with adapters)."""
    from pytgi.core.model_files import resolve_model
    from pytgi.core.tokenizer import Tokenizer

    base = resolve_model(None).path
    adapters = {}
    for i, targets in enumerate([["q_proj", "v_proj"], ["o_proj", "gate_proj", "up_proj", "down_proj"]]):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_copy(base), dtype=torch.float32)
        peft.get_peft_model(
            model, peft.LoraConfig(r=8, init_lora_weights=False, target_modules=targets)
        ).save_pretrained(tmp_path / str(i))
        adapters[f"a{i}"] = tmp_path / str(i)
    tok = Tokenizer.from_dir(base)
    prompts = [tok.encode(f"Question {i}: what is {i} plus {i}?") for i in range(6)]
    engine = engine_for(base, adapters, dtype="auto", max_total_tokens=1024, max_batch_total_tokens=8192)
    model = engine.runner.model
    loop, used = model.decoder_loop, []
    assert loop is not None and loop.takes_lora

    def counting(*args, **kwargs):
        h = loop(*args, **kwargs)
        used.append(h is not None and args[-1] is not None)
        return h

    counting.takes_lora = True  # type: ignore[attr-defined]

    def outputs(which=range(len(prompts))):
        for i in which:
            engine.add_request(
                str(i),
                prompts[i],
                SamplingParams(
                    max_new_tokens=8,
                    temperature=0,
                    prompt_logprobs=True,
                    ignore_eos=True,
                    adapter=[None, "a0", "a1"][i % 3],
                ),
            )
        got: dict[str, list] = {str(i): [] for i in which}
        while engine.has_unfinished():
            for u in engine.step():
                got[u.request_id].append((u.token_id, u.logprob, u.prompt_logprobs))
        return got

    try:
        model.decoder_loop = counting
        with_loop = outputs()
        assert sum(used) >= 7, used  # the decode steps ran in the loop, with their adapters
        for i in range(len(prompts)):
            assert outputs([i]) == {str(i): with_loop[str(i)]}, i
        model.decoder_loop = None
        assert outputs() == with_loop
    finally:
        engine.shutdown()


def test_adapters_loaded_at_run_time_on_two_shards_with_one_in_memory(tiny):
    """Loading, evicting (--max-cpu-loras 1), loading back and unloading at run time: rank 0 decides,
    the other rank mirrors it slot for slot, and every adapter still gives what it gives alone."""
    path, adapters = tiny
    engine = engine_for(path, {})
    try:
        for name, d in adapters.items():
            engine.adapters.load(name, str(d))
        jobs = [(p, name) for p in PROMPTS[:2] for name in [None, *adapters]]
        want = [run(engine, [job])[0] for job in jobs]
    finally:
        engine.shutdown()
    engine = engine_for(path, {}, num_shard=2, max_cpu_loras=1)
    try:
        for name, d in adapters.items():
            engine.adapters.load(name, str(d))
        assert list(engine.runner.adapters().slots) == ["mlp"]  # the last one loaded stays in memory
        # adding a request loads nothing: the step that runs it does
        engine.add_request("q", [1, 2, 3], SamplingParams(max_new_tokens=1, adapter="qv"))
        assert list(engine.runner.adapters().slots) == ["mlp"]
        engine.step()
        assert list(engine.runner.adapters().slots) == ["qv"]
        while engine.has_unfinished():
            engine.step()
        assert [run(engine, [job])[0] for job in jobs] == want  # each one loaded back in turn
        engine.adapters.unload("qv")
        assert engine.adapters.settle() == ["qv"]
        assert "qv" not in engine.adapters.served
        with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'qv'"):
            engine.add_request("x", [1, 2], SamplingParams(max_new_tokens=1, adapter="qv"))
        assert run(engine, [(PROMPTS[0], "all")]) == [want[jobs.index((PROMPTS[0], "all"))]]
    finally:
        engine.shutdown()


SIGMOID_MOE = {  # the attention of each (partial rotary; GLM's biases and per-head norms, MiniMax's whole ones)
    "glm4-moe": lambda: transformers.Glm4MoeForCausalLM(
        transformers.Glm4MoeConfig(
            **{**BASE, "num_hidden_layers": 3, "head_dim": 16},
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        )
    ),
    "minimax-m2": lambda: transformers.MiniMaxM2ForCausalLM(
        transformers.MiniMaxM2Config(
            **{**BASE, "intermediate_size": 32},
            head_dim=16,
            rotary_dim=8,  # type: ignore[call-arg]  # (released checkpoints' legacy key)
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    ),
}


@pytest.mark.parametrize("family", list(SIGMOID_MOE))
def test_an_attention_adapter_on_a_sigmoid_routed_moe_equals_peft(family, tmp_path):
    """GLM-4.5 MoE and MiniMax-M2 take adapters on their attention projections (docs/models.md)."""
    torch.manual_seed(0)
    SIGMOID_MOE[family]().save_pretrained(tmp_path / "base")
    cfg = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    adapter = make_adapter(tmp_path / "base", tmp_path / "attn", cfg, seed=1)
    want = reference(tmp_path / "base", adapter, PROMPTS)
    assert want != reference(tmp_path / "base", None, PROMPTS)
    engine = engine_for(tmp_path / "base", {"attn": adapter})
    try:
        assert run(engine, [(p, "attn") for p in PROMPTS]) == want
    finally:
        engine.shutdown()


def test_a_cohere2_adapter_on_reordered_rotary_rows_equals_peft(tmp_path):
    """Cohere 2's q/k rows are reordered at load (its rotary pairs interleaved, `rope_interleaved`):
    an adapter's B rows for q and k take the same order (sliding layers with RoPE, a global one
    without, biases, the parallel block)."""
    torch.manual_seed(0)
    config = transformers.Cohere2Config(
        **{**BASE, "num_hidden_layers": 3, "pad_token_id": 0, "bos_token_id": 1},
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        logit_scale=0.3,
        attention_bias=True,
    )
    transformers.Cohere2ForCausalLM(config).save_pretrained(tmp_path / "base")
    adapter = make_adapter(tmp_path / "base", tmp_path / "all", ADAPTERS["all"], seed=2)
    want = reference(tmp_path / "base", adapter, PROMPTS)
    assert want != reference(tmp_path / "base", None, PROMPTS)
    engine = engine_for(tmp_path / "base", {"all": adapter})
    try:
        assert run(engine, [(p, "all") for p in PROMPTS]) == want
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["gemma4", "gemma4-moe"])
def test_a_gemma4_adapter_equals_peft_on_one_and_two_shards(name, tmp_path):
    """Gemma 4 takes adapters on its attention and MLP: the full layers' own head size, their keys that
    are their values (an adapter on k_proj changes both), the shared layers that have no k or v, the
    MLP beside the experts; on 2 shards, each layer split by its own kv heads."""
    from tests.model.test_tiny_models import CONFIGS, randomize_gemma4_router

    cls, kw = CONFIGS[name]
    kw = dict(kw, vocab_size=101, eos_token_id=None, pad_token_id=0, num_global_key_value_heads=2)
    if kw.get("hidden_size_per_layer_input"):
        kw["vocab_size_per_layer_input"] = 101
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cls(**kw)).float().eval()
    randomize_gemma4_router(model)
    model.save_pretrained(tmp_path / "base")
    adapter = make_adapter(tmp_path / "base", tmp_path / "all", ADAPTERS["all"], seed=2)
    want = reference(tmp_path / "base", adapter, PROMPTS)
    assert want != reference(tmp_path / "base", None, PROMPTS)
    for shards in (1, 2):
        engine = engine_for(tmp_path / "base", {"all": adapter}, num_shard=shards)
        try:
            assert run(engine, [(p, "all") for p in PROMPTS]) == want, shards
        finally:
            engine.shutdown()


MLA_TARGETS = {  # DeepSeek V3's projections (q through its low-rank pair), V2-Lite's (one q_proj)
    "deepseek-v3-mla-yarn": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "deepseek-v2-lite-mla": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}


def _mla_base(name: str, path, **change) -> None:
    from tests.model.test_tiny_models import CONFIGS

    cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    config = cls(**{**kw, "vocab_size": 101, "eos_token_id": None, "pad_token_id": 0, **change})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


@pytest.mark.parametrize("name", list(MLA_TARGETS))
def test_a_latent_attention_adapter_equals_peft_on_one_and_two_shards(name, tmp_path):
    """Latent attention takes adapters on each of its projections: q (or q_a and q_b), kv_a, o as
    linears, and kv_b_proj, which pytgi absorbs into the query's and the output's latent products, as
    low-rank terms there (`LoraKVB`); a base-model request in the same batch keeps its own tokens."""
    _mla_base(name, tmp_path / "base")
    cfg = dict(r=8, lora_alpha=16, target_modules=MLA_TARGETS[name])
    adapter = make_adapter(tmp_path / "base", tmp_path / "mla", cfg, seed=1)
    want = reference(tmp_path / "base", adapter, PROMPTS)
    base = reference(tmp_path / "base", None, PROMPTS)
    assert want != base
    for shards in (1, 2):
        engine = engine_for(tmp_path / "base", {"mla": adapter}, num_shard=shards)
        try:
            got = run(engine, [(p, "mla") for p in PROMPTS] + [(p, None) for p in PROMPTS[:2]])
            assert got == want + base[:2], shards
        finally:
            engine.shutdown()


def test_a_kv_b_adapter_in_bf16_steps_mla_c_aside(tmp_path):
    """In bf16 on the CPU, where mla.c takes a step of decodes whole, a step with a kv_b_proj adapter's
    rows runs the PyTorch path with the adapter's terms: its first tokens are float32 peft's (mla.c
    without them parts at the second, the first decode), and every request's tokens, with or without
    the adapter, are those it gets alone (batch invariance)."""
    _mla_base("deepseek-v3-mla-yarn", tmp_path / "base", v_head_dim=32)  # bf16gemm.c's shapes: packed
    cfg = dict(r=8, lora_alpha=16, target_modules=["kv_b_proj"])
    adapter = make_adapter(tmp_path / "base", tmp_path / "kvb", cfg, seed=3)
    want = reference(tmp_path / "base", adapter, PROMPTS)
    engine = engine_for(tmp_path / "base", {"kvb": adapter}, dtype="bfloat16")
    try:
        if kernels.supports(torch.bfloat16):  # packed for mla.c where bf16gemm.c runs
            assert engine.runner.paged.model.layers[0].self_attn.kv_b_proj.packed is not None
        got = run(engine, [(p, "kvb") for p in PROMPTS])
        assert [g[:3] for g in got] == [w[:3] for w in want]
        jobs = [(p, "kvb") for p in PROMPTS[:2]] + [(p, None) for p in PROMPTS[:2]]
        alone = [run(engine, [job])[0] for job in jobs]
        assert alone[:2] != alone[2:]
        assert run(engine, jobs) == alone
    finally:
        engine.shutdown()
