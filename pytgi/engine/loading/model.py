"""A model built from its directory: whose code runs it (its family's, or transformers'), its config
read by its family, then its weights from one source through one quantization method."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pytgi.core.errors import ConfigError, UnsupportedModel
from pytgi.core.families import ENCODER, FAMILIES, VISION, Family, causal_lm, family_of, own_architectures
from pytgi.core.pooling import read_labels
from pytgi.engine.loading.checkpoints import (
    QuantizedCheckpoint,
    UnsupportedQuantization,
    mxfp4_tensors,
    read_quantization,
)
from pytgi.engine.loading.gguf import GGUFWeights, open_gguf
from pytgi.engine.loading.methods import load_gguf, load_quantized_checkpoint
from pytgi.engine.loading.safetensors_dir import iter_safetensors
from pytgi.engine.loading.sizes import keeps_mxfp4
from pytgi.engine.models.causal_lm import CausalLM
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.decoder import DecoderConfig, DecoderModel, Weights
from pytgi.engine.models.quant import resolve_plan
from pytgi.engine.models.registry import config_reader, decoder_config, model_class
from pytgi.engine.models.vision import VisionLanguageModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


MODEL_IMPLS = ("auto", "pytgi", "transformers")


def _own_family(cfg: dict[str, Any]) -> Family | None:
    """The family whose code runs config.json's architecture (a decoder's classifier or bare model:
    its causal LM's); None where pytgi has none."""
    arch = (cfg.get("architectures") or [None])[0]
    family = family_of(causal_lm(arch) or arch)
    return family if family is not None and not _renamed(cfg, arch) else None


def _renamed(cfg: dict[str, Any], arch: str | None) -> bool:
    """Whether config.json's model_type is another family's that transformers maps onto `arch` by
    renaming its checkpoint's weights on load (Exaone 3's, saved as `LlamaForCausalLM`): pytgi's code for
    `arch` would not find its weights, transformers' does."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return False
    config_class = CONFIG_MAPPING_NAMES.get(cfg.get("model_type") or "") or ""
    prefix = re.split(r"For[A-Z]|Model$", arch or "")[0]
    return bool(config_class and prefix) and not config_class.lower().startswith(prefix.lower())


def model_impl(cfg: dict[str, Any], path: Path, impl: str = "auto") -> str:
    """Whose model code runs this model: pytgi's where it has it (auto), or transformers'."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"unknown model implementation {impl!r} ({' | '.join(MODEL_IMPLS)})")
    arch = (cfg.get("architectures") or [None])[0]
    own = _own_family(cfg) is not None
    if impl == "transformers" or (impl == "auto" and not own and arch is not None):
        return "transformers"
    if not own:
        raise UnsupportedModel(
            f"architecture {arch!r} of {path} is not supported; pytgi runs "
            f"{', '.join(own_architectures())} "
            "(--model-impl auto runs others through transformers' model code)"
        )
    return "pytgi"


def model_family(path: Path, impl: str = "auto") -> Family | None:
    """The family whose code runs the model (None: transformers' code runs it)."""
    hf = read_config(path)
    return None if model_impl(hf, path, impl) == "transformers" else _own_family(hf)


def eos_token_ids(path: Path) -> frozenset[int]:
    """The ids that end a generation, from config.json and generation_config.json."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def resolve_dtype(name: str, cfg: dict[str, Any], device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r} (auto, {', '.join(DTYPES)})")
        return DTYPES[name]
    if device.type == "cpu":
        # bfloat16 activations: bf16 matmuls win for prefill and big batches, and the low-bit
        # decode kernels take bf16 inputs (`pytgi.engine.models.quant`). --dtype float32 is the exact path.
        return torch.bfloat16
    declared = str(cfg.get("torch_dtype") or cfg.get("dtype"))
    return DTYPES.get(declared, torch.bfloat16) if declared != "float32" else torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    cpu: Kernels,
    quantize: str = "none",
    attention: str = "auto",
    impl: str = "auto",
    head: str = "lm",
) -> CausalLM:
    """`cpu`: the kernels to run on; `quantize`: none | auto | int8 | int4 (see `pytgi.engine.models.quant`);
    `attention`: the attention backend's name; `impl`: auto | pytgi | transformers (whose model code);
    `head`: lm (the LM head: a generator's, or a reranker's by its tokens' logits) | score (a sequence
    classifier's score head, `DecoderModel.score_weight`) | none (an embedder's: no head at all, the
    checkpoint need not have one).

    The weights come from one source (a GGUF file, a pre-quantized checkpoint, a safetensors
    directory, whose MXFP4 experts may stay as codes) through one quantization method
    (`pytgi.engine.loading.methods`): the checkpoint's levels, the GGUF file's grids, float weights
    re-quantized by `--quantize`, or the floats as they are."""
    hf = read_config(path)
    if model_impl(hf, path, impl) == "transformers":
        return _transformers_model(hf, path, dtype, device, cpu, quantize, attention, head)
    family = family_of(hf["architectures"][0])
    vision = family if family is not None and family.kind == VISION else None
    cfg = decoder_config(config_reader(vision)(hf) if vision else hf, path)
    if head != "lm":  # the LM head is not used: tied to the embedding (no memory), not read
        if vision:
            raise UnsupportedModel(f"{path.name}: a vision model is not served as a pooling model")
        labels = read_labels(path).dimensions if head == "score" else 0
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True, score_labels=labels)
    gguf = open_gguf(path)
    checkpoint = read_quantization(path) if gguf is None else None
    if head == "score" and (checkpoint is not None or gguf is not None):
        raise UnsupportedModel(f"{path.name}: a sequence classifier is served from float safetensors only")
    if checkpoint is not None:  # GPTQ, AWQ, compressed-tensors, FP8: served as published
        if vision:
            raise UnsupportedQuantization(f"a quantized vision model ({checkpoint.method}) is not served yet")
        if quantize not in ("auto", "none"):
            raise ConfigError(
                f"--quantize {quantize}: this checkpoint is quantized already ({checkpoint.method})"
            )
        return _from_checkpoint(
            QuantizedCheckpoint(path, checkpoint), cfg, dtype, device, cpu, quantize, attention
        )
    plan = resolve_plan(quantize, path, dtype, device, gpu=cpu.triton)
    if gguf is not None and not vision and isinstance(plan, dict):
        return _from_gguf(gguf, plan, cfg, dtype, device, cpu, attention)
    # A Hugging Face model to quantize is loaded in float32 first, so the low-bit grids see the
    # checkpoint's values (bf16 weights are only re-laid out, and FP8 scales come from the
    # checkpoint's own dtype: loaded as they are).
    requantized = bool(plan) and plan not in ("bf16", "fp8")
    model: DecoderModel | VisionLanguageModel
    with _default_dtype(torch.float32 if requantized else dtype), torch.device(device):
        model = DecoderModel(cfg, cpu, attention)
        if vision:
            model = model_class(vision)(hf, model)
    if gguf is not None:
        tensors: Weights = gguf.dense_tensors()
    elif (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        # with the low-bit kernel the experts' codes are packed as they are read: never a float copy
        keep = (dtype, cpu) if keeps_mxfp4(dtype, device, cpu) else None
        tensors = mxfp4_tensors(iter_safetensors(path), dtype, keep)  # exact in bf16 too
    else:
        tensors = iter_safetensors(path)
    model.load_weights(tensors)
    if plan:
        model.quantize(plan, dtype)
    return model.eval()


def _from_checkpoint(
    ckpt: QuantizedCheckpoint,
    cfg: DecoderConfig,
    dtype: torch.dtype,
    device: torch.device,
    cpu: Kernels,
    quantize: str,
    attention: str,
) -> DecoderModel:
    """A pre-quantized checkpoint: float32 (or --quantize none, or a GPU without Triton) takes its values
    dequantized; otherwise its levels are packed (FP8 on CPU: dequantized to bf16, on the bf16 kernel)."""
    with _default_dtype(dtype), torch.device(device):
        decoder = DecoderModel(cfg, cpu, attention)
    if quantize == "auto" and dtype != torch.float32 and (cpu.triton or device.type == "cpu"):
        load_quantized_checkpoint(decoder, ckpt, dtype)
    else:
        decoder.load_weights(ckpt.dense_tensors())
    return decoder.eval()


def _from_gguf(
    gguf: GGUFWeights,
    plan: dict[str, str],
    cfg: DecoderConfig,
    dtype: torch.dtype,
    device: torch.device,
    cpu: Kernels,
    attention: str,
) -> DecoderModel:
    """A GGUF file's tensors, read one at a time: the quantized linears packed from their blocks as they
    are and the rest dequantized to `dtype` (an empty plan: every tensor dequantized), never a float copy
    of the model."""
    with _default_dtype(dtype), torch.device(device):
        decoder = DecoderModel(cfg, cpu, attention)
    if plan:
        load_gguf(decoder, gguf, plan, dtype)
    else:
        decoder.load_weights(gguf.dense_tensors(dtype))
    return decoder.eval()


def _transformers_model(
    hf: dict[str, Any],
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    cpu: Kernels,
    quantize: str,
    attention: str,
    head: str,
) -> CausalLM:
    """transformers' model code for an architecture pytgi has no family of (a generator, as it is)."""
    if head != "lm":
        raise UnsupportedModel(
            f"{path.name}: a pooling model needs pytgi's own model code (--model-impl pytgi)"
        )
    if quantize not in ("auto", "none"):
        raise ConfigError(f"--quantize {quantize} needs pytgi's own model code (--model-impl pytgi)")
    if "quantization_config" in hf:  # transformers' loaders for these need packages pytgi does not have
        method = hf["quantization_config"].get("quant_method")
        arch = (hf.get("architectures") or ["?"])[0]
        raise UnsupportedQuantization(
            f"{path.name}: a {method} checkpoint of {arch} needs pytgi's own model code, which this "
            "architecture does not have"
        )
    from pytgi.engine.models.transformers_impl import TransformersModel

    own = tuple(f.name for f in FAMILIES if f.kind != ENCODER)
    return TransformersModel(path, dtype, device, cpu, attention, own)
