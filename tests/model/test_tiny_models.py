"""pytgi's models (the Llama family, Gemma 2 and 3, mixtures of experts) against transformers' on tiny random-weight configs (fp32).

Logits are compared at every position for mixed batches of prefills, prefill chunks and paged
decodes, with block tables that are deliberately not contiguous.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.sampling_params import SamplingParams
from pytgi.engine.execution.runner import ModelRunner
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.scheduling.request import Request
from pytgi.engine.scheduling.step import ScheduledRequest

BLOCK = 4
NUM_BLOCKS = 64

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# DeepSeek's MLA dims (latent 32 + rotary 16: a cache row of 48), every layer dense
MLA = dict(
    BASE,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    first_k_dense_replace=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
)
MLA_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.9,
    "mscale_all_dim": 0.7,
    "beta_fast": 32,
    "beta_slow": 1,
}
# ... with a dense layer, then two of experts: 8 routed (2 a token), a shared one
MLA_MOE = dict(
    MLA,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
)

SMALL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # families whose defaults are past 97

CONFIGS: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, dict(BASE, rope_theta=10000.0)),
    "llama-mha-tied": (transformers.LlamaConfig, dict(BASE, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        dict(
            BASE,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-yarn": (
        transformers.LlamaConfig,
        dict(BASE, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    ),
    "qwen3-yarn-mscale": (  # DeepSeek's attention factor (mscale / mscale_all_dim), other ramp bounds
        transformers.Qwen3Config,
        dict(
            BASE,
            head_dim=32,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            },
        ),
    ),
    "phi3-longrope": (  # a 30-token prompt is past the original 16: the long factors; 9 + 4 tokens stay short
        transformers.Phi3Config,
        dict(
            BASE,
            pad_token_id=0,
            original_max_position_embeddings=16,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [1.0 + 0.9 * i for i in range(8)],
            },
        ),
    ),
    "llama-biases": (transformers.LlamaConfig, dict(BASE, attention_bias=True, mlp_bias=True)),
    "mistral": (transformers.MistralConfig, dict(BASE, sliding_window=None)),
    "mistral-sliding": (transformers.MistralConfig, dict(BASE, sliding_window=8)),  # sequences reach past it
    "qwen2-bias": (transformers.Qwen2Config, dict(BASE, tie_word_embeddings=True)),
    "qwen3-qknorm": (transformers.Qwen3Config, dict(BASE, head_dim=32)),
    "phi3-fused-checkpoint": (transformers.Phi3Config, dict(BASE, pad_token_id=0)),
    "mixtral-moe": (transformers.MixtralConfig, dict(BASE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe-shared": (
        transformers.Qwen2MoeConfig,
        dict(
            BASE,
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        dict(
            BASE,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
        ),
    ),
    # sliding layers see 8 positions: the test sequences (up to 30 tokens) reach past it
    "gemma3-sliding": (
        transformers.Gemma3TextConfig,
        dict(
            BASE,
            num_hidden_layers=3,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    # Gemma 2: every other layer sliding, one RoPE base, scores and logits soft-capped (caps small
    # enough to bite on random weights)
    "gemma2-softcap": (
        transformers.Gemma2Config,
        dict(
            BASE,
            num_hidden_layers=3,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=0.3,
        ),
    ),
    # gpt-oss: sinks, alternating 8-token windows, YaRN, a biased top-2 router over 4 experts with
    # biases and the clamped SwiGLU (a limit small enough to clamp random activations)
    "gpt-oss": (
        transformers.GptOssConfig,
        dict(
            BASE,
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=0.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # Granite (added as docs/models.md's "Adding a model family" says): multipliers far from 1
    "granite": (
        transformers.GraniteConfig,
        dict(
            BASE,
            embedding_multiplier=3.0,
            attention_multiplier=0.3,
            residual_multiplier=0.6,
            logits_scaling=4.0,
        ),
    ),
    # SmolLM3: the middle layer of three without rotary embedding (NoPE); then with an 8-token window,
    # which SmolLM3's config puts on the NoPE layers
    "smollm3-nope": (
        transformers.SmolLM3Config,
        dict(BASE, **SMALL_IDS, num_hidden_layers=3, no_rope_layer_interval=2, tie_word_embeddings=False),
    ),
    "smollm3-sliding-tied": (
        transformers.SmolLM3Config,
        dict(
            BASE,
            **SMALL_IDS,
            num_hidden_layers=3,
            no_rope_layers=[1, 0, 0],
            use_sliding_window=True,
            sliding_window=8,
        ),
    ),
    # OLMo 2: norms after the sublayers only, q/k normed over all heads; OLMo 3: 8-token windows on
    # two layers of three, YaRN on the full layer and a RoPE base of its own on the sliding ones
    "olmo2": (transformers.Olmo2Config, dict(BASE, **SMALL_IDS)),
    "olmo3-sliding-yarn": (
        transformers.Olmo3Config,
        dict(
            BASE,
            **SMALL_IDS,
            num_hidden_layers=3,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # Exaone 4: OLMo's norm placement with per-head q/k norms; 8-token windows on two sliding layers
    # of three, which rotate (llama3-scaled), the global one without RoPE; then no window: all rotate
    "exaone4-sliding-nope": (
        transformers.Exaone4Config,
        dict(
            BASE,
            **SMALL_IDS,
            num_hidden_layers=3,
            head_dim=32,
            sliding_window=8,
            sliding_window_pattern=3,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "exaone4-global": (
        transformers.Exaone4Config,
        dict(BASE, **SMALL_IDS, sliding_window=None, layer_types=["full_attention"] * 2),
    ),
    # Seed-OSS: q/k/v biases, and the output projection's too
    "seed-oss-biases": (
        transformers.SeedOssConfig,
        dict(BASE, **SMALL_IDS, head_dim=32, attention_out_bias=True),
    ),
    # Cohere 2: parallel blocks after one LayerNorm, 8-token windows on two layers of three (rotated,
    # pairs interleaved), the global one without RoPE, logits scaled, tied; q/k/v/o biases
    "cohere2-sliding-nope": (
        transformers.Cohere2Config,
        dict(
            BASE,
            **SMALL_IDS,
            num_hidden_layers=3,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            logit_scale=0.3,
            attention_bias=True,
        ),
    ),
    # Gemma 4, every per-layer feature: sliding layers (window 8) of head size 16 and 2 kv heads, full
    # layers of head size 32 with 1 kv head whose keys are their values (no v_proj) and proportional
    # RoPE (a quarter of the angles turn), per-layer inputs, the last two layers reading layers 2's
    # and 3's KV cache with a double-wide MLP, random layer scalars (the fixture), soft-capped logits
    "gemma4": (
        transformers.Gemma4TextConfig,
        dict(
            BASE,
            num_hidden_layers=6,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=97,
            sliding_window=8,
            final_logit_softcapping=0.5,
            layer_types=["sliding_attention", "full_attention"] * 3,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1_000_000.0,
                },
            },
        ),
    ),
    # Gemma 4's mixture of experts (gemma-4-26B-A4B's shape): in every layer 8 GELU experts of 32
    # features, 2 a token, beside the dense MLP; full layers whose keys are their values, no per-layer
    # inputs; random router scales and per-expert scales (the fixture)
    "gemma4-moe": (
        transformers.Gemma4TextConfig,
        dict(
            BASE,
            num_hidden_layers=4,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            sliding_window=8,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
    ),
    # Gemma 4's multimodal checkpoint served as text (its vision and audio towers not read): full layers
    # with their own head size but v_proj and the sliding layers' kv heads
    "gemma4-multimodal-as-text": (
        transformers.Gemma4Config,
        dict(
            text_config=dict(
                BASE,
                head_dim=16,
                global_head_dim=32,
                hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=97,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
            ),
            vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16
            ),
            audio_config=dict(
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                subsampling_conv_channels=[8, 4],
                output_proj_dims=32,
            ),
            # ids outside the test's 97: transformers would embed its placeholders as padding
            image_token_id=200,
            audio_token_id=201,
            video_token_id=202,
            boi_token_id=203,
            eoi_token_id=204,
            boa_token_id=205,
            eoa_token_index=206,
        ),
    ),
    # DeepSeek's multi-head latent attention: V2-Lite's plain q_proj, V2's and V3's q_a → q_b; the
    # cache holds the latent row (kv_lora_rank + qk_rope_head_dim), attention runs in the latent space
    "deepseek-v2-lite-mla": (transformers.DeepseekV2Config, dict(MLA, q_lora_rank=None)),
    "deepseek-v3-mla-yarn": (transformers.DeepseekV3Config, dict(MLA, rope_parameters=MLA_YARN)),
    # ... and their experts after a dense layer: V2-Lite's greedy softmax router; V2's within the
    # best groups (by each group's best), scaled; V3's sigmoid router whose correction bias (random,
    # set after init) chooses within the best groups (by each group's best two), renormalized and
    # scaled, beside two shared experts, under YaRN with DeepSeek's mscale
    "deepseek-v2-lite-moe": (
        transformers.DeepseekV2Config,
        dict(MLA_MOE, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0),
    ),
    "deepseek-v2-moe-groups": (
        transformers.DeepseekV2Config,
        dict(MLA_MOE, topk_method="group_limited_greedy", n_group=2, topk_group=1),
    ),
    "deepseek-v3-moe": (
        transformers.DeepseekV3Config,
        dict(
            MLA_MOE,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            n_shared_experts=2,
            rope_parameters=MLA_YARN,
        ),
    ),
    # the same layers under other names: GLM-4.7-Flash (V3's router, a kind per layer) and Mistral 4
    # (softmax scores grouped by each group's best two; queries scaled by Llama 4's rule past 8 positions)
    "glm4-moe-lite": (
        transformers.Glm4MoeLiteConfig,
        dict(
            {k: v for k, v in MLA_MOE.items() if k != "first_k_dense_replace"},
            mlp_layer_types=["sparse", "dense", "sparse"],
            n_group=2,
            topk_group=1,
        ),
    ),
    "mistral4": (
        transformers.Mistral4Config,
        dict(
            MLA_MOE,
            n_group=2,
            topk_group=1,
            rope_parameters={
                **MLA_YARN,
                "factor": 32.0,
                "original_max_position_embeddings": 8,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
                "max_position_embeddings": 256,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # GLM-4.5: partial rotary (half of each head), q/k/v biases and per-head q/k norms, a dense first
    # layer, then 8 experts in 4 groups (the best 2 groups' experts eligible) under a sigmoid router
    # with a correction bias (random, `models`), renormalized and scaled, beside an ungated shared expert
    "glm4-moe": (
        transformers.Glm4MoeConfig,
        dict(
            BASE,
            num_hidden_layers=3,
            head_dim=32,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    # MiniMax-M2: q/k norms over the whole projection, a quarter of each head rotated, a sigmoid
    # router with a correction bias over 4 Mixtral-named experts (w1/w2/w3), no shared expert
    "minimax-m2": (
        transformers.MiniMaxM2Config,
        dict(BASE, head_dim=32, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2),
    ),
    # architectures pytgi does not implement: transformers' model code inside pytgi's engine
    "gpt-neox-via-transformers": (
        transformers.GPTNeoXConfig,
        dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            rotary_pct=0.5,
        ),
    ),
    # Gemma 3n: AltUp's four streams, LAuReL of rank 4, the first two MLPs sparse, MLPs of their own
    # widths, sliding layers (window 8) and full ones with their own RoPE base, per-layer inputs, the
    # last two layers reading layers 3's and 2's KV cache; AltUp's and LAuReL's weights random (the fixture)
    "gemma3n": (
        transformers.Gemma3nTextConfig,
        dict(
            BASE,
            num_hidden_layers=6,
            head_dim=16,
            intermediate_size=[96, 80, 96, 64, 96, 80],
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=97,
            laurel_rank=4,
            sliding_window=8,
            num_kv_shared_layers=2,
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=30.0,
        ),
    ),
    "llama-via-transformers": (transformers.LlamaConfig, dict(BASE, rope_theta=10000.0)),
    "gemma3-sliding-via-transformers": (
        transformers.Gemma3TextConfig,
        dict(
            BASE,
            num_hidden_layers=3,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}
IMPL = {
    "llama-via-transformers": "transformers",
    "gemma3-sliding-via-transformers": "transformers",
}  # others: auto
ARCH = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.MistralConfig: transformers.MistralForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
    transformers.Gemma3TextConfig: transformers.Gemma3ForCausalLM,
    transformers.Gemma2Config: transformers.Gemma2ForCausalLM,
    transformers.Phi3Config: transformers.Phi3ForCausalLM,
    transformers.MixtralConfig: transformers.MixtralForCausalLM,
    transformers.Qwen2MoeConfig: transformers.Qwen2MoeForCausalLM,
    transformers.Qwen3MoeConfig: transformers.Qwen3MoeForCausalLM,
    transformers.Olmo2Config: transformers.Olmo2ForCausalLM,
    transformers.Olmo3Config: transformers.Olmo3ForCausalLM,
    transformers.GptOssConfig: transformers.GptOssForCausalLM,
    transformers.GraniteConfig: transformers.GraniteForCausalLM,
    transformers.Gemma4TextConfig: transformers.Gemma4ForCausalLM,
    transformers.Gemma4Config: transformers.Gemma4ForConditionalGeneration,
    transformers.Gemma3nTextConfig: transformers.Gemma3nForCausalLM,
    transformers.GPTNeoXConfig: transformers.GPTNeoXForCausalLM,
    transformers.SmolLM3Config: transformers.SmolLM3ForCausalLM,
    transformers.Cohere2Config: transformers.Cohere2ForCausalLM,
    transformers.SeedOssConfig: transformers.SeedOssForCausalLM,
    transformers.Exaone4Config: transformers.Exaone4ForCausalLM,
    transformers.DeepseekV2Config: transformers.DeepseekV2ForCausalLM,
    transformers.DeepseekV3Config: transformers.DeepseekV3ForCausalLM,
    transformers.Glm4MoeLiteConfig: transformers.Glm4MoeLiteForCausalLM,
    transformers.Mistral4Config: transformers.Mistral4ForCausalLM,
    transformers.Glm4MoeConfig: transformers.Glm4MoeForCausalLM,
    transformers.MiniMaxM2Config: transformers.MiniMaxM2ForCausalLM,
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request, tmp_path_factory):
    cfg_cls, kw = CONFIGS[request.param]
    torch.manual_seed(0)
    hf = ARCH[cfg_cls](cfg_cls(**kw)).float().eval()
    if cfg_cls is transformers.Gemma2Config:
        hf.set_attn_implementation("eager")  # SDPA would drop the soft cap
    with torch.no_grad():  # random norms, so a wrong norm weight cannot hide behind ones
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if ".altup." in name or ".laurel." in name:  # Gemma 3n's (zeros at init, some of them)
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in hf.named_buffers():  # Gemma 4's per-layer output scales (ones at init)
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
        randomize_gemma4_router(hf)
        # a sigmoid router's correction bias: on the scale of the scores' spread (~0.04 here), so it
        # changes about half the choices and the scores still decide the rest
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.04)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    runner = ModelRunner(
        EngineConfig(
            model=str(path), dtype="float32", device="cpu", model_impl=IMPL.get(request.param, "auto")
        )
    )
    assert ("via-transformers" in request.param) == (type(runner.model).__name__ == "TransformersModel")
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK)
    return hf, runner


def randomize_gemma4_router(hf) -> None:
    """Gemma 4's router scales (ones at init): random, so a scale read wrong cannot hide."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):
                p.uniform_(0.5, 1.5)


class Paged:
    """Hands out shuffled blocks so block tables are never contiguous."""

    def __init__(self, seed: int = 0) -> None:
        self.free = list(np.random.default_rng(seed).permutation(NUM_BLOCKS))

    def request(self, rid: str, ids: list[int]) -> Request:
        return Request(rid, ids, SamplingParams(temperature=0))

    def grow(self, req: Request, n: int) -> None:
        while len(req.block_table) * BLOCK < req.num_computed_tokens + n:
            req.block_table.append(int(self.free.pop()))


def step(runner: ModelRunner, pager: Paged, work: list[tuple[Request, int]]) -> list[torch.Tensor]:
    """Run one flat batch; return each request's logits for the tokens it computed."""
    batch = []
    for req, n in work:
        pager.grow(req, n)
        batch.append(ScheduledRequest(req, n))
    step = runner.layout(batch)
    logits = runner.paged.forward(step, np.arange(len(step.ids)))
    out, start = [], 0
    for req, n in work:
        out.append(logits[start : start + n])
        req.num_computed_tokens += n
        start += n
    return out


def reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_prefill_batch_matches(models):
    hf, runner = models
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 97, n).tolist() for n in (1, 7, 23, 4)]
    pager = Paged()
    reqs = [pager.request(str(i), s) for i, s in enumerate(seqs)]
    outs = step(runner, pager, [(r, r.num_tokens) for r in reqs])
    for seq, got in zip(seqs, outs):
        assert_close(got, reference(hf, seq))


def test_chunks_and_paged_decodes_in_mixed_steps_match(models):
    hf, runner = models
    rng = np.random.default_rng(2)
    a_ids = rng.integers(0, 97, 30).tolist()
    b_ids = rng.integers(0, 97, 9).tolist()
    pager = Paged(seed=3)
    a, b = pager.request("a", a_ids), pager.request("b", b_ids[:5])
    got_a: list[torch.Tensor] = []
    got_b: list[torch.Tensor] = []
    # step 1: b's whole prompt + a's first chunk; step 2: b decodes + a's second chunk; ...
    gb, ga = step(runner, pager, [(b, 5), (a, 11)])
    got_a.append(ga), got_b.append(gb)
    for i in range(5, 9):  # b decodes one token per step (teacher-forced) while a's prompt streams in
        b.all_ids.append(b_ids[i])
        chunk = min(6, a.num_uncomputed)
        work = [(b, 1)] + ([(a, chunk)] if chunk else [])
        outs = step(runner, pager, work)
        got_b.append(outs[0])
        if chunk:
            got_a.append(outs[1])
    while a.num_uncomputed:
        got_a.append(step(runner, pager, [(a, a.num_uncomputed)])[0])
    assert_close(torch.cat(got_a), reference(hf, a_ids))
    assert_close(torch.cat(got_b), reference(hf, b_ids))


def test_prefill_on_top_of_cached_prefix_blocks_matches(models):
    """A request whose first blocks were computed by another request (a prefix-cache hit)."""
    hf, runner = models
    rng = np.random.default_rng(4)
    shared, tail = rng.integers(0, 97, 8).tolist(), rng.integers(0, 97, 5).tolist()
    pager = Paged(seed=5)
    a = pager.request("a", shared)
    step(runner, pager, [(a, 8)])
    b = pager.request("b", shared + tail)
    b.block_table = list(a.block_table[:2])
    b.num_computed_tokens = 8
    got = step(runner, pager, [(b, 5)])[0]
    assert_close(got, reference(hf, shared + tail)[8:])


def test_pure_torch_path_matches(models, monkeypatch):
    """Without the C kernels (no compiler, or CUDA): PyTorch ops for attention and the fused steps."""
    runner = models[1]
    if type(runner.model).__name__ == "TransformersModel":
        pytest.skip("transformers' model code has no kernel choice")
    model = type(runner.model)(runner.config, Kernels.none())  # the same weights on PyTorch's ops
    model.load_state_dict(runner.model.state_dict())
    monkeypatch.setattr(runner, "model", model.eval())
    test_chunks_and_paged_decodes_in_mixed_steps_match(models)


def test_triton_path_matches(models, monkeypatch):
    """The CUDA path's Triton kernels (paged attention, fused norms, rope and cache writes; in
    Triton's interpreter on a machine without a GPU) give transformers' logits too."""
    pytest.importorskip("triton")
    runner = models[1]
    if type(runner.model).__name__ == "TransformersModel":
        pytest.skip("transformers' model code has no kernel choice")
    model = type(runner.model)(runner.config, Kernels(triton=True))
    # (MLA's latent rows of 48 values too: the kernel pads a row to 2^n values and masks the rest)
    assert type(model.attention).__name__ in ("TritonAttention", "SlidingWindowBackend")
    model.load_state_dict(runner.model.state_dict())
    monkeypatch.setattr(runner, "model", model.eval())
    test_chunks_and_paged_decodes_in_mixed_steps_match(models)


def test_gemma4_reads_the_published_config_keys():
    """Google's config.json files give the full layers' heads as `global_head_dim` and (where k == v)
    `num_global_key_value_heads`; transformers saves them as `per_layer_config`: the same layers."""
    from pytgi.engine.models.gemma4 import gemma4_config

    cfg_cls, kw = CONFIGS["gemma4"]
    saved = cfg_cls(**kw).to_dict()
    published = {k: v for k, v in saved.items() if k != "per_layer_config"}
    published.update(global_head_dim=32, num_global_key_value_heads=1)
    got, want = gemma4_config(published), gemma4_config(saved)
    assert got == want
    heads = [(a.num_key_value_heads, a.head_dim, a.kv_source, a.k_eq_v) for a in want.layer_attention or []]
    assert heads == [(2, 16, None, False), (1, 32, None, True)] * 2 + [(2, 16, 2, False), (1, 32, 3, True)]
    assert [a.intermediate_size for a in want.layer_attention or []] == [None] * 4 + [192, 192]
    # without k == v the global kv-head count is not applied (as transformers reads it)
    plain = gemma4_config({**published, "attention_k_eq_v": False})
    assert [a.num_key_value_heads for a in plain.layer_attention or []] == [2] * 6


@pytest.mark.parametrize(
    "change, feature",
    [
        (dict(use_bidirectional_attention="all"), "bidirectional attention"),
    ],
)
def test_gemma4_refuses_what_it_does_not_run_at_load(tmp_path, change, feature):
    """One `UnsupportedModel` line at load naming the feature (before: an error that did not say)."""
    from pytgi.core.errors import UnsupportedModel

    cfg_cls, kw = CONFIGS["gemma4"]
    torch.manual_seed(0)
    transformers.Gemma4ForCausalLM(cfg_cls(**{**kw, **change})).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match=feature) as err:
        ModelRunner(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu"))
    assert "\n" not in str(err.value) and str(err.value).startswith("Gemma 4: ")


def save_tiny_gemma4(path):
    """The "gemma4" config above with a vocabulary of 128, no EOS (the engine tests' prompts) and no
    soft cap (whose 0.5 leaves near ties everywhere), saved with random weights (a sharper head):
    the engine tests' Gemma 4."""
    cfg_cls, kw = CONFIGS["gemma4"]
    torch.manual_seed(0)
    vocab = {"vocab_size": 128, "vocab_size_per_layer_input": 128}
    cfg = cfg_cls(**{**kw, **vocab, "eos_token_id": None, "final_logit_softcapping": None})
    hf = transformers.Gemma4ForCausalLM(cfg)
    with torch.no_grad():  # a tied head of std 0.16, not 0.02: logits far from a flat distribution
        hf.model.embed_tokens.weight.mul_(8)
    hf.save_pretrained(path)
    return path
