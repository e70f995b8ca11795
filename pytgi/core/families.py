"""Every model family pytgi runs with its own code, declared once (no torch).

A `Family` says which Hugging Face architectures it is (as a generator, an embedder, a
cross-encoder), which names llama.cpp writes for it in a GGUF file, where its code is (a module of
`pytgi.engine.models` and the function there that reads its config.json, or its model class), and
what it can do: its attention kinds, a recurrent state, images, experts, LoRA, speculation, tensor
parallelism, CUDA graphs, KV-cache dtypes, and the chat formats its published templates use.

Every list of models in pytgi is read from `FAMILIES`: the loader's table of config readers
(`pytgi.engine.models.registry`), the pooling tasks (`pytgi.core.pooling`), the GGUF names
(`pytgi.core.gguf_convert`), the encoders, the fallback's list of what pytgi runs itself, and
docs/models.md's support table (`python -m pytgi.core.families docs/models.md`, kept current by
a test). A capability question ("can this model take LoRA adapters?") is a lookup here, never a
probe of a loaded module. Adding a family is one model file and one entry below (docs/models.md,
"Adding a model family").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# attention kinds (`Family.attention`)
FULL = "full"  # softmax over the whole context
SLIDING = "sliding"  # within a window, on some or all layers
SINKS = "sinks"  # a learned logit per head in every softmax (gpt-oss)
SOFTCAP = "softcap"  # cap · tanh(score / cap) (Gemma 2)
GATED = "gated"  # the output gated per head (Qwen3-Next)
ATTENTION_KINDS = (FULL, SLIDING, SINKS, SOFTCAP, GATED)
# what a family's code is (`Family.kind`)
DECODER, VISION, ENCODER = "decoder", "vision", "encoder"
KV_DTYPES = ("auto", "bf16", "int8", "fp8")  # --kv-cache-dtype
REGENERATE = "`python -m pytgi.core.families docs/models.md`"


@dataclass(frozen=True, slots=True)
class GgufName:
    """A `general.architecture` llama.cpp writes, and the Hugging Face architecture and model_type it
    reads as. `experts`: the name stands for this architecture only when the file has experts (or
    only when it has none: False); None: either way."""

    name: str
    architecture: str
    model_type: str
    experts: bool | None = None
    permuted_qk: bool = False  # llama.cpp's converter interleaved the q and k rows (its "llama" order)
    # metadata keys (after "<name>.") read into config.json's keys, beyond those every file has
    keys: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # as users say it: "Qwen3", "Gemma 2"
    module: str  # its code: a module of pytgi.engine.models
    generators: tuple[str, ...] = ()  # architectures served as generators
    embedders: tuple[str, ...] = ()  # ... as embedding models (a decoder saved without its head)
    classifiers: tuple[str, ...] = ()  # ... as cross-encoders (a score or classification head)
    # decoders: the function of `module` reading config.json into a DecoderConfig; vision: the one
    # reading the language model's config.json out of the whole model's
    config: str = ""
    model: str = ""  # vision and encoders: the model class in `module`
    kind: str = DECODER
    gguf: tuple[GgufName, ...] = ()
    attention: frozenset[str] = frozenset({FULL})
    recurrent: bool = False  # layers that keep a state between steps (a state pool)
    experts: bool = False  # a sparse mixture of experts
    images: str | None = None  # the image layout (pytgi.core.image_layouts) of a vision family
    lora: bool = True
    speculation: bool = True  # n-gram and draft-model speculation
    tensor_parallel: bool = True  # --num-shard
    cuda_graphs: bool = True
    kv_dtypes: tuple[str, ...] = KV_DTYPES
    # the formats its published chat templates use: tool calls (pytgi.api.chat.tools' styles) and the
    # reasoning parser that splits its thinking (--reasoning-parser); informational until a request asks
    tools: tuple[str, ...] = ()
    reasoning: str | None = None
    note: str = ""  # what the support table adds (one clause)

    @property
    def architectures(self) -> tuple[str, ...]:
        return (*self.generators, *self.embedders, *self.classifiers)


_PLAIN = frozenset({FULL})
_WINDOWED = frozenset({FULL, SLIDING})


def _llama_like(
    name: str,
    prefix: str,
    gguf: tuple[GgufName, ...],
    attention: frozenset[str] = _PLAIN,
    pooling: bool = True,
    **kw: object,
) -> Family:
    """A family on `llama.py`'s reader: `prefix`ForCausalLM, and its bare model and classifier."""
    return Family(
        name=name,
        module="llama",
        config="llama_config",
        generators=(f"{prefix}ForCausalLM",),
        embedders=(f"{prefix}Model",) if pooling else (),
        classifiers=(f"{prefix}ForSequenceClassification",) if pooling else (),
        gguf=gguf,
        attention=attention,
        **kw,  # type: ignore[arg-type]
    )


NO_FP8 = ("auto", "bf16", "int8")  # the FP8 cache is read by plain causal attention on Triton only
# what the entries of one kind share (each entry replaces the rest)
_HYBRID = Family(  # Qwen3-Next's layers: gated DeltaNet between gated attention layers
    name="",
    module="qwen3_next",
    attention=frozenset({FULL, GATED}),
    recurrent=True,
    experts=True,
    speculation=False,
    cuda_graphs=False,
    kv_dtypes=NO_FP8,
    tools=("hermes",),
    reasoning="qwen3",
)
_MAMBA = Family(  # Mamba-2 mixers between attention layers (`mamba_hybrid.py`)
    name="",
    module="mamba_hybrid",
    recurrent=True,
    speculation=False,
    cuda_graphs=False,
    kv_dtypes=NO_FP8,
)
_MAMBA1 = replace(_MAMBA, module="mamba1_models")  # Mamba-1 mixers (`mamba1_models.py`)
_VISION = Family(  # an image tower before pytgi's decoder; adapters wrap DecoderModel's linears only
    name="", module="", kind=VISION, config="text_config", lora=False, kv_dtypes=NO_FP8
)
_ENCODER = Family(  # whole prompts, no KV cache, one rank
    name="",
    module="encoder",
    kind=ENCODER,
    model="EncoderModel",
    lora=False,
    speculation=False,
    tensor_parallel=False,
    cuda_graphs=False,
    kv_dtypes=(),
)


FAMILIES: tuple[Family, ...] = (
    _llama_like(
        "Llama",
        "Llama",
        (GgufName("llama", "LlamaForCausalLM", "llama", experts=False, permuted_qk=True),),
        tools=("llama3_json", "pythonic"),
        note="Llama 2/3/3.x, SmolLM2, and most fine-tunes",
    ),
    _llama_like(
        "Mistral",
        "Mistral",
        (),  # llama.cpp writes Mistral as "llama"
        attention=_WINDOWED,
        tools=("mistral", "mistral_v11"),
        note="a window where the checkpoint sets one (then no CUDA graphs nor FP8 cache)",
    ),
    _llama_like("Qwen2", "Qwen2", (GgufName("qwen2", "Qwen2ForCausalLM", "qwen2"),), tools=("hermes",)),
    _llama_like(
        "Qwen3",
        "Qwen3",
        (GgufName("qwen3", "Qwen3ForCausalLM", "qwen3"),),
        tools=("hermes",),
        reasoning="qwen3",
    ),
    _llama_like(
        "Phi-3",
        "Phi3",
        (GgufName("phi3", "Phi3ForCausalLM", "phi3"),),
        attention=_WINDOWED,
        pooling=False,
        note="q, k, v and gate, up fused in the checkpoint; a window where the checkpoint sets one",
    ),
    _llama_like(
        "Mixtral",
        "Mixtral",
        (GgufName("llama", "MixtralForCausalLM", "mixtral", experts=True, permuted_qk=True),),
        attention=_WINDOWED,
        pooling=False,
        experts=True,
        cuda_graphs=False,
        tools=("mistral",),
        note="experts packed per expert; LoRA on the attention projections, not the experts",
    ),
    _llama_like(
        "Qwen2-MoE",
        "Qwen2Moe",
        (GgufName("qwen2moe", "Qwen2MoeForCausalLM", "qwen2_moe"),),
        pooling=False,
        experts=True,
        cuda_graphs=False,
        tools=("hermes",),
        note="a shared expert beside the routed ones",
    ),
    _llama_like(
        "Qwen3-MoE",
        "Qwen3Moe",
        (GgufName("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe"),),
        pooling=False,
        experts=True,
        cuda_graphs=False,
        tools=("hermes",),
        reasoning="qwen3",
    ),
    Family(
        name="Granite",
        module="granite",
        config="granite_config",
        generators=("GraniteForCausalLM",),
        gguf=(
            GgufName(
                "granite",
                "GraniteForCausalLM",
                "granite",
                permuted_qk=True,
                keys=(
                    ("attention.scale", "attention_multiplier"),
                    ("embedding_scale", "embedding_multiplier"),
                    ("residual_scale", "residual_multiplier"),
                    ("logit_scale", "logits_scaling"),
                ),
            ),
        ),
        note="IBM Granite 3.x: Llama with embedding, attention, residual and logit multipliers",
    ),
    Family(
        name="SmolLM3",
        module="smollm3",
        config="smollm3_config",
        generators=("SmolLM3ForCausalLM",),
        gguf=(GgufName("smollm3", "SmolLM3ForCausalLM", "smollm3", permuted_qk=True),),
        attention=_WINDOWED,
        tools=("hermes",),
        reasoning="qwen3",
        note="Llama's layers, every fourth without rotary embedding (NoPE, `no_rope_layers`)",
    ),
    Family(
        name="OLMo 2, OLMo 3",
        module="olmo",
        config="olmo_config",
        generators=("Olmo2ForCausalLM", "Olmo3ForCausalLM"),
        gguf=(GgufName("olmo2", "Olmo2ForCausalLM", "olmo2"),),
        attention=_WINDOWED,
        note=(
            "norms after attention and the MLP only, q/k normed over all heads; OLMo 3: three "
            "sliding layers of four (an `olmo2` GGUF file with windows reads as OLMo 3)"
        ),
    ),
    Family(
        name="Exaone 4",
        module="exaone4",
        config="exaone4_config",
        generators=("Exaone4ForCausalLM",),
        gguf=(GgufName("exaone4", "Exaone4ForCausalLM", "exaone4"),),
        attention=_WINDOWED,
        note=(
            "norms after attention and the MLP only, per-head q/k norms; with a window, three sliding "
            "layers of four and global layers without RoPE"
        ),
    ),
    Family(
        name="Seed-OSS",
        module="seed_oss",
        config="seed_oss_config",
        generators=("SeedOssForCausalLM",),
        gguf=(GgufName("seed_oss", "SeedOssForCausalLM", "seed_oss"),),
        note="Llama's layers with q/k/v biases (and an output bias where the config sets one)",
    ),
    Family(
        name="Cohere 2",
        module="cohere2",
        config="cohere2_config",
        generators=("Cohere2ForCausalLM",),
        # ggml's plain rotation pairs (2i, 2i + 1), as Cohere's: the loader reorders those rows as it
        # does a "llama" file's (`permuted_qk`)
        gguf=(
            GgufName(
                "cohere2",
                "Cohere2ForCausalLM",
                "cohere2",
                permuted_qk=True,
                keys=(("logit_scale", "logit_scale"),),
            ),
        ),
        attention=_WINDOWED,
        note=(
            "Command R7B / A: attention and MLP in parallel after one LayerNorm, three sliding layers "
            "of four with RoPE, global ones without (q/k rows, and LoRA adapters' B rows, reordered at load)"
        ),
    ),
    Family(
        name="Gemma 2",
        module="gemma",
        config="gemma_config",
        generators=("Gemma2ForCausalLM",),
        gguf=(GgufName("gemma2", "Gemma2ForCausalLM", "gemma2"),),
        attention=frozenset({FULL, SLIDING, SOFTCAP}),
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note="Gemma 3's layers without q/k norms, attention and logits soft-capped",
    ),
    Family(
        name="Gemma 3",
        module="gemma",
        config="gemma_config",
        generators=("Gemma3ForCausalLM",),
        gguf=(GgufName("gemma3", "Gemma3ForCausalLM", "gemma3_text"),),
        attention=_WINDOWED,
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note="five sliding layers of six, each kind with its own RoPE base",
    ),
    Family(
        name="Gemma 4",
        module="gemma4",
        config="gemma4_config",
        generators=("Gemma4ForCausalLM",),
        gguf=(
            GgufName(
                "gemma4",
                "Gemma4ForCausalLM",
                "gemma4_text",
                # the scalar keys; the per-layer ones (kv heads, MLP widths, the sliding pattern, the
                # two head sizes, the full layers' RoPE factors) are read by gguf_convert's `_gemma4`
                keys=(
                    ("attention.sliding_window", "sliding_window"),
                    ("attention.shared_kv_layers", "num_kv_shared_layers"),
                    ("embedding_length_per_layer_input", "hidden_size_per_layer_input"),
                    ("final_logit_softcapping", "final_logit_softcapping"),
                ),
            ),
        ),
        attention=_WINDOWED,
        experts=True,  # gemma-4-26B-A4B (`enable_moe_block`)
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note=(
            "full layers with their own head size, kv heads and proportional RoPE, k == v, per-layer "
            "inputs, the last layers reading earlier layers' KV cache; the MoE block (26B-A4B) beside the "
            "MLP, routed in PyTorch ops, its GELU experts in moe.c where packed"
        ),
    ),
    Family(
        name="Gemma 4 (multimodal checkpoints, as text)",
        module="gemma4",
        config="gemma4_vlm_config",
        generators=("Gemma4ForConditionalGeneration",),
        attention=_WINDOWED,
        experts=True,  # gemma-4-26B-A4B, published multimodal
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note="the language model only: the vision and audio towers are not read",
    ),
    Family(
        name="Gemma 3n",
        module="gemma3n",
        config="gemma3n_config",
        generators=("Gemma3nForCausalLM",),
        gguf=(
            GgufName(
                "gemma3n",
                "Gemma3nForCausalLM",
                "gemma3n_text",
                # the per-layer keys (MLP widths, the sliding pattern, the sparsity) are read by
                # gguf_convert's `_gemma3n`
                keys=(
                    ("attention.sliding_window", "sliding_window"),
                    ("attention.shared_kv_layers", "num_kv_shared_layers"),
                    ("embedding_length_per_layer_input", "hidden_size_per_layer_input"),
                    ("final_logit_softcapping", "final_logit_softcapping"),
                    ("altup.num_inputs", "altup_num_inputs"),
                    ("altup.active_idx", "altup_active_idx"),
                ),
            ),
        ),
        attention=_WINDOWED,
        lora=False,
        speculation=False,
        tensor_parallel=False,
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note=(
            "Gemma 4's attention and per-layer inputs; AltUp's four residual streams, LAuReL and the "
            "first MLPs' activation sparsity in PyTorch ops; the multimodal checkpoints as text"
        ),
    ),
    Family(
        name="Gemma 3n (multimodal checkpoints, as text)",
        module="gemma3n",
        config="gemma3n_vlm_config",
        generators=("Gemma3nForConditionalGeneration",),
        attention=_WINDOWED,
        lora=False,
        speculation=False,
        tensor_parallel=False,
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note="the language model only: the vision and audio towers are not read",
    ),
    Family(
        name="gpt-oss",
        module="gpt_oss",
        config="gpt_oss_config",
        generators=("GptOssForCausalLM",),
        gguf=(GgufName("gpt-oss", "GptOssForCausalLM", "gpt_oss"),),
        attention=frozenset({FULL, SLIDING, SINKS}),
        experts=True,
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        tools=("harmony",),
        reasoning="harmony",
        note=(
            "the published MXFP4 checkpoints' experts stay 4-bit on a CPU with the low-bit kernel; "
            "`--quantize` takes the attention linears; LoRA not tested"
        ),
    ),
    Family(
        name="DeepSeek V2 / V3, GLM-4.7-Flash, Mistral 4",
        module="deepseek",
        config="deepseek_config",
        generators=(
            "DeepseekV2ForCausalLM",
            "DeepseekV3ForCausalLM",
            "Glm4MoeLiteForCausalLM",
            "Mistral4ForCausalLM",
        ),
        # one name for both: a file whose router is V2's (softmax) reads as DeepseekV2ForCausalLM
        # (`pytgi.core.gguf_convert._deepseek2`); Mistral 4's under its own (`_mistral4`)
        gguf=(
            GgufName("deepseek2", "DeepseekV3ForCausalLM", "deepseek_v3"),
            GgufName("mistral4", "Mistral4ForCausalLM", "mistral4"),
        ),
        experts=True,
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note=(
            "multi-head latent attention, its KV cache the latent only (Kimi K2 too); the MTP layers "
            "are not read; GLM-4.7-Flash's GGUF files are `deepseek2` too; Mistral 4's `mistral4` files "
            "hold no Llama 4 query scaling beta: served below its original context, where the scale is 1"
        ),
    ),
    Family(
        name="GLM-4.5 MoE",
        module="glm4_moe",
        config="glm4_moe_config",
        generators=("Glm4MoeForCausalLM",),
        gguf=(
            GgufName(
                "glm4moe",
                "Glm4MoeForCausalLM",
                "glm4_moe",
                keys=(
                    ("expert_count", "n_routed_experts"),
                    ("expert_used_count", "num_experts_per_tok"),
                    ("expert_feed_forward_length", "moe_intermediate_size"),
                    ("expert_shared_count", "n_shared_experts"),
                    ("leading_dense_block_count", "first_k_dense_replace"),
                    ("expert_weights_scale", "routed_scaling_factor"),
                    ("expert_weights_norm", "norm_topk_prob"),
                    ("expert_group_count", "n_group"),
                    ("expert_group_used_count", "topk_group"),
                    ("expert_gating_func", "expert_gating_func"),
                    ("rope.dimension_count", "rotary_dim"),
                ),
            ),
        ),
        experts=True,
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note=(
            "GLM-4.5/4.6/4.7: partial rotary, a sigmoid router with correction bias, groups and scale, "
            "shared experts, dense first layers; the MTP layers are not read; LoRA on the attention "
            "projections"
        ),
    ),
    Family(
        name="MiniMax-M2",
        module="minimax_m2",
        config="minimax_m2_config",
        generators=("MiniMaxM2ForCausalLM",),
        gguf=(
            GgufName(
                "minimax-m2",
                "MiniMaxM2ForCausalLM",
                "minimax_m2",
                keys=(
                    ("expert_count", "num_local_experts"),
                    ("expert_used_count", "num_experts_per_tok"),
                    ("rope.dimension_count", "rotary_dim"),
                ),
            ),
        ),
        experts=True,
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note=(
            "q/k norms over the whole projection, partial rotary, a sigmoid router with correction bias; "
            "LoRA on the attention projections"
        ),
    ),
    replace(
        _HYBRID,
        name="Qwen3-Next / Qwen3.5",
        config="qwen3_next_config",
        generators=("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
        gguf=(
            GgufName("qwen3next", "Qwen3NextForCausalLM", "qwen3_next"),
            GgufName("qwen35", "Qwen3_5ForCausalLM", "qwen3_5_text"),
            GgufName("qwen35moe", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
        ),
        note=(
            "gated DeltaNet layers on a state pool; `--num-shard 1` for `qwen35`, `qwen35moe` GGUF files "
            "(llama.cpp reorders their value heads)"
        ),
    ),
    replace(
        _HYBRID,
        name="Qwen3.5 (vision checkpoints, as text)",
        config="qwen3_5_vlm_config",
        generators=("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
        note="the language model only: the vision tower and MTP layers are not read",
    ),
    Family(
        name="LFM2, LFM2-MoE",
        module="lfm2",
        config="lfm2_config",
        generators=("Lfm2ForCausalLM", "Lfm2MoeForCausalLM"),
        gguf=(
            GgufName("lfm2", "Lfm2ForCausalLM", "lfm2"),
            GgufName("lfm2moe", "Lfm2MoeForCausalLM", "lfm2_moe"),
        ),
        recurrent=True,
        experts=True,  # LFM2-MoE
        speculation=False,
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note=(
            "Liquid AI's hybrids: short-convolution layers on a state pool between attention layers "
            "with q/k norms; LFM2-MoE: dense first layers, a sigmoid router with an expert bias"
        ),
    ),
    Family(
        name="Kimi Linear",
        module="kimi_linear",
        config="kimi_linear_config",
        generators=("KimiLinearForCausalLM",),
        gguf=(GgufName("kimi-linear", "KimiLinearForCausalLM", "kimi_linear"),),
        recurrent=True,
        experts=True,
        speculation=False,
        cuda_graphs=False,
        kv_dtypes=NO_FP8,
        note=(
            "Kimi Delta Attention layers (a gated delta rule with a decay per channel) on a state pool, "
            "between latent-attention layers without RoPE; DeepSeek V3's experts"
        ),
    ),
    replace(
        _MAMBA,
        name="Nemotron-H",
        config="nemotron_h_config",
        generators=("NemotronHForCausalLM",),
        # llama.cpp's converter names a file with experts apart; each layer's kind is in its per-layer
        # head_count_kv and feed_forward_length
        gguf=(
            GgufName("nemotron_h", "NemotronHForCausalLM", "nemotron_h", permuted_qk=True),
            GgufName("nemotron_h_moe", "NemotronHForCausalLM", "nemotron_h", permuted_qk=True),
        ),
        experts=True,
        note=(
            "Mamba-2 layers on a state pool; one mixer a layer (Mamba-2, attention without RoPE, "
            "a relu² MLP or its experts); Nemotron 3 Nano"
        ),
    ),
    replace(
        _MAMBA,
        name="Granite-4.0-H",
        config="granite_hybrid_config",
        generators=("GraniteMoeHybridForCausalLM",),
        gguf=(
            GgufName(
                "granitehybrid",
                "GraniteMoeHybridForCausalLM",
                "granitemoehybrid",
                permuted_qk=True,
                keys=(
                    ("attention.scale", "attention_multiplier"),
                    ("embedding_scale", "embedding_multiplier"),
                    ("residual_scale", "residual_multiplier"),
                    ("logit_scale", "logits_scaling"),
                ),
            ),
        ),
        experts=True,
        note="Mamba-2 layers on a state pool, Granite's multipliers, experts beside a shared MLP",
    ),
    replace(
        _MAMBA,
        name="Bamba",
        config="bamba_config",
        generators=("BambaForCausalLM",),
        note=(
            "Mamba-2 layers on a state pool, RoPE on half of each head; its GGUF file is `granitehybrid` "
            "(read as Granite-4.0-H's with RoPE)"
        ),
    ),
    replace(
        _MAMBA,
        name="Falcon-H1",
        config="falcon_h1_config",
        generators=("FalconH1ForCausalLM",),
        # llama.cpp's converter folds the multipliers into the weights (embeddings and head too)
        gguf=(GgufName("falcon-h1", "FalconH1ForCausalLM", "falcon_h1"),),
        note="attention and a Mamba-2 mixer side by side in every layer, µP multipliers folded at load",
    ),
    replace(
        _MAMBA1,
        name="Jamba",
        config="jamba_config",
        generators=("JambaForCausalLM",),
        gguf=(GgufName("jamba", "JambaForCausalLM", "jamba"),),
        experts=True,
        note=(
            "Mamba-1 layers on a state pool, attention without RoPE every attn_layer_period, "
            "experts every expert_layer_period"
        ),
    ),
    replace(
        _MAMBA1,
        name="Mamba",
        config="mamba_config",
        generators=("MambaForCausalLM",),
        # llama.cpp's converter writes FalconMamba as "mamba" too, with `ssm.dt_b_c_rms` (`_mamba1`)
        gguf=(GgufName("mamba", "MambaForCausalLM", "mamba"),),
        note="Mamba-1 layers only, no attention: the state pool alone bounds the batch",
    ),
    replace(
        _MAMBA1,
        name="FalconMamba",
        config="mamba_config",
        generators=("FalconMambaForCausalLM",),
        note="Mamba-1 layers only, RMS norms on dt, B and C",
    ),
    replace(
        _VISION,
        name="LLaVA, LLaVA-NeXT",
        module="llava",
        model="LlavaModel",
        generators=("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"),
        images="Fixed, AnyRes",
        note="transformers' vision tower and projector before pytgi's decoder",
    ),
    replace(
        _VISION,
        name="Idefics3, SmolVLM",
        module="idefics3",
        model="Idefics3Model",
        generators=("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
        images="Tiles",
    ),
    replace(
        _VISION,
        name="Qwen2-VL, Qwen2.5-VL",
        module="qwen2_vl",
        model="Qwen2VLModel",
        generators=("Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration"),
        images="Merge",
        tools=("hermes",),
        note="M-RoPE positions for image rows",
    ),
    replace(
        _VISION,
        name="Gemma 3 (vision)",
        module="gemma3_vision",
        model="Gemma3VisionModel",
        generators=("Gemma3ForConditionalGeneration",),
        attention=_WINDOWED,
        images="Fixed",
        cuda_graphs=False,
    ),
    replace(
        _ENCODER,
        name="BERT",
        embedders=("BertModel",),
        classifiers=("BertForSequenceClassification",),
        note="bidirectional; sentence-transformers pooling",
    ),
    replace(
        _ENCODER,
        name="RoBERTa, XLM-RoBERTa",
        embedders=("RobertaModel", "XLMRobertaModel"),
        classifiers=("RobertaForSequenceClassification", "XLMRobertaForSequenceClassification"),
    ),
    replace(
        _ENCODER,
        name="ModernBERT",
        module="modernbert",
        model="ModernEncoder",
        embedders=("ModernBertModel",),
        classifiers=("ModernBertForSequenceClassification",),
        attention=_WINDOWED,
    ),
)

# every architecture → its family (an architecture belongs to one family: checked by a test)
BY_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}


def family_of(architecture: str | None) -> Family | None:
    """The family whose code runs `architecture` (None: pytgi has none; transformers' fallback may)."""
    return BY_ARCHITECTURE.get(architecture or "")


def own_architectures(kind: str | None = None) -> tuple[str, ...]:
    """Every architecture pytgi runs itself (of one kind of code: DECODER, VISION, ENCODER)."""
    return tuple(a for f in FAMILIES if kind in (None, f.kind) for a in f.architectures)


def gguf_names() -> tuple[str, ...]:
    """The `general.architecture` names pytgi reads, each once."""
    return tuple(dict.fromkeys(g.name for f in FAMILIES for g in f.gguf))


def gguf_architecture(name: str, experts: bool) -> GgufName | None:
    """What a GGUF file of `general.architecture` `name` is (with experts or not)."""
    for f in FAMILIES:
        for g in f.gguf:
            if g.name == name and g.experts in (None, experts):
                return g
    return None


def gguf_of_model_type(model_type: str) -> GgufName | None:
    """The GGUF name a converted file's model_type came from."""
    return next((g for f in FAMILIES for g in f.gguf if g.model_type == model_type), None)


def causal_lm(architecture: str | None) -> str | None:
    """A decoder's bare model or classifier (`Qwen3Model`, `Qwen3ForSequenceClassification`): the
    causal LM whose layers it has (`Qwen3ForCausalLM`); None for anything else."""
    f = family_of(architecture)
    if f is None or f.kind != DECODER or architecture in f.generators or not f.generators:
        return None
    return f.generators[0]


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


START, END = "<!-- families: generated -->", "<!-- families: end -->"


def markdown() -> str:
    """docs/models.md's support table, one row a family (between its START and END lines)."""
    head = (
        "| family | architectures | GGUF | code | attention | state, experts, images | pooling | LoRA | "
        "speculation | `--num-shard` | CUDA graphs | KV dtypes | tools, reasoning | notes |"
    )
    rows = [
        START,
        f"<!-- Generated from pytgi/core/families.py ({REGENERATE}); a unit test keeps it current. -->",
        "",
        head,
        "|" + "---|" * (head.count(" | ") + 1),
    ]
    for f in FAMILIES:
        extra = [
            *(["recurrent state"] if f.recurrent else []),
            *(["experts"] if f.experts else []),
            *([f"images ({f.images})"] if f.images else []),
        ]
        pooling = [*(["embed"] if f.embedders else []), *(["classify"] if f.classifiers else [])]
        formats = [*f.tools, *([f"reasoning: {f.reasoning}"] if f.reasoning else [])]
        cells = [
            f.name,
            ", ".join(f"`{a}`" for a in f.architectures),
            ", ".join(dict.fromkeys(f"`{g.name}`" for g in f.gguf)) or "—",
            f"`{f.module}.py`" + (f" (`{f.config or f.model}`)" if f.config or f.model else ""),
            ", ".join(k for k in ATTENTION_KINDS if k in f.attention),
            ", ".join(extra) or "—",
            ", ".join(pooling) or "—",
            _yes(f.lora),
            _yes(f.speculation),
            _yes(f.tensor_parallel),
            _yes(f.cuda_graphs),
            ", ".join(f.kv_dtypes) or "—",
            ", ".join(formats) or "—",
            f.note,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([*rows, END]) + "\n"


def with_table(doc: str) -> str:
    """`doc` (docs/models.md) with its generated section replaced by today's table."""
    start, end = doc.index(START), doc.index(END) + len(END) + 1
    return doc[:start] + markdown() + doc[end:]


if __name__ == "__main__":  # python -m pytgi.core.families docs/models.md: the table rewritten in place
    import sys
    from pathlib import Path

    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
        path.write_text(with_table(path.read_text()))
    else:
        print(markdown(), end="")
