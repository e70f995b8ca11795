"""GGUF files of the families beyond Llama/Qwen/Gemma (Mixtral, Qwen2-MoE, Qwen3-MoE, Phi-3, Granite,
gpt-oss, GLM-4.5 MoE, MiniMax-M2): a tiny random transformers model is written out as llama.cpp's
converter writes it (tensor names, q/k row interleaving, experts stacked per kind, Phi-3's fused
tensors, the metadata keys, GLM-4.5's MTP block after its layers), pytgi converts and serves the
file, and its logits equal transformers' on the original model (fp32).

The layout below was checked against files that llama.cpp's own `convert_hf_to_gguf.py` made from
such models (docs/models.md says how)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pytgi.core.config import EngineConfig
from pytgi.core.model_files import resolve_model
from pytgi.engine.execution.runner import ModelRunner
from tests.model.test_tiny_models import CONFIGS as TINY

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
FAMILIES = {
    "mixtral": (
        "llama",
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(BASE, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2moe": (
        "qwen2moe",
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            BASE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        ),
    ),
    "qwen3moe": (
        "qwen3moe",
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            BASE,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
        ),
    ),
    "phi3": ("phi3", transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(BASE, pad_token_id=0)),
    "granite": (
        "granite",
        transformers.GraniteConfig,
        transformers.GraniteForCausalLM,
        {**dict(TINY["granite"][1]), "tie_word_embeddings": False},
    ),
    # sinks, alternating 8-token windows (the 23-token prompt reaches past them), YaRN, the oai experts
    "gpt-oss": (
        "gpt-oss",
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        # test_tiny_models' gpt-oss, with the clamp's limit llama.cpp's fixed 7.0 (GGUF stores none)
        {k: v for k, v in dict(TINY["gpt-oss"][1]).items() if k != "swiglu_limit"},
    ),
    # DeepSeek V3's MLA and experts (test_tiny_models' V3, YaRN's mscale equal to mscale_all_dim: a
    # file keeps 0.1 · mscale_all_dim alone) and V2-Lite's (its q_proj, a greedy softmax router)
    "deepseek2-v3": (
        "deepseek2",
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        {
            **dict(TINY["deepseek-v3-moe"][1]),
            "rope_parameters": {**TINY["deepseek-v3-moe"][1]["rope_parameters"], "mscale": 0.7},
        },
    ),
    "deepseek2-v2-lite": (
        "deepseek2",
        transformers.DeepseekV2Config,
        transformers.DeepseekV2ForCausalLM,
        dict(TINY["deepseek-v2-lite-moe"][1]),
    ),
    # GLM-4.7-Flash: V3's layers, its dense layer first, an MTP block after them (not read)
    "deepseek2-glm4-moe-lite": (
        "deepseek2",
        transformers.Glm4MoeLiteConfig,
        transformers.Glm4MoeLiteForCausalLM,
        {**dict(TINY["glm4-moe-lite"][1]), "mlp_layer_types": ["dense", "sparse", "sparse"]},
    ),
    # GLM-4.5: as test_tiny_models' (groups, scale, shared expert, partial rotary, q/k norms, a dense layer)
    "glm4moe": (
        "glm4moe",
        transformers.Glm4MoeConfig,
        transformers.Glm4MoeForCausalLM,
        {**dict(TINY["glm4-moe"][1]), "tie_word_embeddings": False},
    ),
    "minimax-m2": (
        "minimax-m2",
        transformers.MiniMaxM2Config,
        transformers.MiniMaxM2ForCausalLM,
        {**dict(TINY["minimax-m2"][1]), "tie_word_embeddings": False},
    ),
}
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    # DeepSeek's (llama.cpp's `deepseek2`)
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",  # GLM-4.5's (ungated)
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# a sigmoid router's correction bias, as llama.cpp names it (GLM-4.5 keeps it in the router, MiniMax-M2
# beside it)
ROUTER_BIAS = ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias")


def deepseek2_metadata(w, cfg, mtp_blocks: int = 0) -> None:
    """The keys llama.cpp's DeepseekV2Model writes (MLA as one kv head of the latent row; the MTP
    layers skipped, but for GLM-4.7-Flash's: `mtp_blocks` after the model's; no gating function where
    the config names none: the correction bias says V3)."""
    rope = cfg.rope_parameters
    w.add_block_count(cfg.num_hidden_layers + mtp_blocks)
    if mtp_blocks:
        w.add_nextn_predict_layers(mtp_blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "yarn":
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.n_group is not None:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    kinds = getattr(cfg, "mlp_layer_types", None)  # GLM-4.7-Flash's: its dense layers come first
    dense = kinds.index("sparse") if kinds else cfg.first_k_dense_replace
    w.add_leading_dense_block_count(dense)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)


def deepseek2_tensors(cfg, rest: str, a: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """A layer tensor's GGUF name(s) and values where llama.cpp's converter changes them: kv_b_proj split
    per head into W_UK transposed (attn_k_b) and W_UV (attn_v_b); the router's correction bias."""
    if rest == "self_attn.kv_b_proj.weight":
        kv_b = a.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        k_b, v_b = kv_b[:, : cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim :]
        return [("attn_k_b.weight", k_b.swapaxes(1, 2)), ("attn_v_b.weight", v_b)]
    if rest == "mlp.gate.e_score_correction_bias":
        return [("exp_probs_b.bias", a)]
    return None


# gpt-oss's tensors as llama.cpp's converter writes them: gate and up apart (de-interleaved), each
# expert's weights transposed to [E, out, in]; sinks and the post-attention norm under their own names
GPT_OSS = {
    "self_attn.sinks": lambda a: [("attn_sinks.weight", a)],
    "post_attention_layernorm.weight": lambda a: [("post_attention_norm.weight", a)],
    "mlp.router.weight": lambda a: [("ffn_gate_inp.weight", a)],
    "mlp.router.bias": lambda a: [("ffn_gate_inp.bias", a)],
    "mlp.experts.gate_up_proj": lambda a: [
        ("ffn_gate_exps.weight", a.swapaxes(1, 2)[:, 0::2]),
        ("ffn_up_exps.weight", a.swapaxes(1, 2)[:, 1::2]),
    ],
    "mlp.experts.gate_up_proj_bias": lambda a: [
        ("ffn_gate_exps.bias", a[:, 0::2]),
        ("ffn_up_exps.bias", a[:, 1::2]),
    ],
    "mlp.experts.down_proj": lambda a: [("ffn_down_exps.weight", a.swapaxes(1, 2))],
    "mlp.experts.down_proj_bias": lambda a: [("ffn_down_exps.bias", a)],
}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of the q/k rows of a "llama" file."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def common_metadata(w, cfg, mtp_blocks: int = 0) -> None:
    """The keys every family's file has, from a transformers config, as llama.cpp's converter writes them
    (`mtp_blocks`: multi-token-prediction blocks written after the model's, llama.cpp's nextn layers)."""
    w.add_block_count(cfg.num_hidden_layers + mtp_blocks)
    if mtp_blocks:
        w.add_nextn_predict_layers(mtp_blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None):  # (none where every layer has experts: Qwen3.5-MoE)
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def byte_vocabulary(w, size: int) -> None:
    """A byte-level vocabulary of single characters, no merges."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(0x21 + i) for i in range(size)])
    w.add_token_merges([])
    w.add_token_types([1] * size)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)


def write_gguf(hf, arch: str, path: Path, quant=None) -> Path:
    """`quant(gguf_name, array)`: the GGUF type to store a tensor as (None, or no `quant`: as it is)."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)

    def add(name: str, a: np.ndarray) -> None:
        qtype = quant(name, a) if quant else None
        if qtype is None:
            w.add_tensor(name, a)
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a, np.float32), t), raw_dtype=t)

    # with an MTP block after the layers, as a published GLM-4.5's and GLM-4.7-Flash's file has
    mtp = arch == "glm4moe" or cfg.model_type == "glm4_moe_lite"
    if arch == "deepseek2":
        deepseek2_metadata(w, cfg, mtp_blocks=int(mtp))
    else:
        common_metadata(w, cfg, mtp_blocks=int(mtp))
    if arch == "glm4moe":  # as llama.cpp's Glm4MoeModel writes it
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    if arch == "minimax-m2":  # as llama.cpp's MiniMaxM2Model writes it
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_rope_dimension_count(cfg.rotary_dim)
    if arch == "gpt-oss":  # as llama.cpp's GptOssModel writes it
        rope = cfg.rope_parameters
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "granite":  # as llama.cpp's GraniteModel writes it
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    byte_vocabulary(w, cfg.vocab_size)
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", a)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                add("output.weight", a)
        elif name == "model.norm.weight":
            add("output_norm.weight", a)
        else:
            _, _, i, rest = name.split(".", 3)
            stem, _, kind = rest.rpartition(".")
            if arch == "deepseek2" and (parts := deepseek2_tensors(cfg, rest, a)) is not None:
                for gguf_name, part in parts:
                    add(f"blk.{i}.{gguf_name}", np.ascontiguousarray(part))
                continue
            if arch == "gpt-oss" and rest in GPT_OSS:
                for gguf_name, part in GPT_OSS[rest](a):
                    add(f"blk.{i}.{gguf_name}", np.ascontiguousarray(part))
                continue
            if rest in (
                "mlp.experts.gate_up_proj",
                "mlp.experts.down_proj",
            ):  # stacked [E, 2I, H] / [E, H, I]
                if rest.endswith("down_proj"):
                    add(f"blk.{i}.ffn_down_exps.weight", a)
                else:
                    gate, up = np.split(a, 2, axis=1)
                    add(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                    add(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(up))
                continue
            if rest in ROUTER_BIAS:
                add(f"blk.{i}.exp_probs_b.bias", a)
                continue
            if arch == "glm4moe" and stem == "post_attention_layernorm":
                add(f"blk.{i}.post_attention_norm.{kind}", a)
                continue
            if arch in ("llama", "granite") and stem in ("self_attn.q_proj", "self_attn.k_proj"):
                a = _permute(
                    a, cfg.num_attention_heads if stem.endswith("q_proj") else cfg.num_key_value_heads
                )
            add(f"blk.{i}.{LAYER[stem]}.{kind}", np.ascontiguousarray(a))
    if mtp:  # the MTP block's own tensors, and a layer's (not read)
        L, H = cfg.num_hidden_layers, cfg.hidden_size
        add(f"blk.{L}.nextn.eh_proj.weight", np.ones((H, 2 * H), np.float32))
        add(f"blk.{L}.nextn.enorm.weight", np.ones(H, np.float32))
        add(f"blk.{L}.exp_probs_b.bias", np.ones(cfg.n_routed_experts, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(spec: tuple) -> tuple[str, dict, torch.nn.Module]:
    """A family's (GGUF arch, config kwargs, random float32 transformers model), seeded."""
    arch, cfg_cls, model_cls, kw = spec
    torch.manual_seed(0)
    return arch, kw, model_cls(cfg_cls(**kw)).float().eval()


def prompt_logits(runner: ModelRunner, seq: list[int]) -> torch.Tensor:
    """The logits of a prompt's tokens, computed by `runner` in one step over a fresh KV cache."""
    from tests.model.test_tiny_models import BLOCK, NUM_BLOCKS, Paged, step

    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK)
    pager = Paged()
    req = pager.request("r", seq)
    return step(runner, pager, [(req, req.num_tokens)])[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_of_the_family_serves_transformers_logits(tmp_path, monkeypatch, family):
    monkeypatch.setenv("PYTGI_CACHE", str(tmp_path / "cache"))
    arch, _, hf = tiny_model(FAMILIES[family])
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in hf.named_buffers():  # as test_tiny_models sets them
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.04)
    path = write_gguf(hf, arch, tmp_path / f"{family}.gguf")
    model_dir = resolve_model(str(path), progress=False).path  # converted once, as `pytgi serve` does
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    assert type(runner.model).__name__ == "DecoderModel"  # pytgi's own code, not the fallback
    from tests.model.test_tiny_models import reference

    seq = np.random.default_rng(1).integers(0, 97, 23).tolist()
    torch.testing.assert_close(prompt_logits(runner, seq), reference(hf, seq), atol=2e-5, rtol=1e-4)


def test_the_gpt_4o_pre_tokenizer_splits_as_o200k():
    """gpt-oss's GGUF names its pre-tokenizer "gpt-4o" (o200k): case runs, contractions, digits in
    threes, punctuation with the slashes and newlines after it."""
    from tokenizers import Regex, pre_tokenizers

    from pytgi.core.gguf_convert import _GPT4O_REGEX

    split = pre_tokenizers.Split(Regex(_GPT4O_REGEX), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("HelloWorld's 12345 foo/bar\n\n  x")]
    assert pieces == ["Hello", "World's", " ", "123", "45", " foo", "/bar", "\n\n", " ", " x"]
