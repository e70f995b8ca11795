"""Build a model from a Hugging Face directory: config, architecture check, safetensors weights."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from pytgi.core.errors import ConfigError, UnsupportedModel
from pytgi.core.families import VISION, Family, causal_lm, family_of, own_architectures
from pytgi.engine import kernels
from pytgi.engine.models.checkpoint_quant import (
    QuantizedCheckpoint,
    UnsupportedQuantization,
    mxfp4_tensors,
    read_quantization,
)
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.decoder import DecoderModel, StepImages
from pytgi.engine.models.gguf_weights import GGUFWeights, open_gguf
from pytgi.engine.models.moe import SparseMoE
from pytgi.engine.models.quant import resolve_plan
from pytgi.engine.models.registry import config_reader, decoder_config, model_class
from pytgi.engine.models.safetensors_files import iter_safetensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CausalLM(Protocol):
    """What the engine uses of a loaded model, pytgi's code or transformers' (`load_model`)."""

    config: Any  # its config: vocab_size, max_position_embeddings, ...
    attention: Any  # its attention backend: `prepare(layout, device)` builds a step's metadata
    layers: Any  # per layer, `self_attn.n_kv` and `self_attn.head_dim`: the KV cache's shape

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        meta: Any,
        image_rows: StepImages | None = None,
    ) -> torch.Tensor:
        """The last hidden states of the step's tokens (writing their keys and values); `image_rows`
        (a vision model's): flat rows whose embeddings are an image's rows."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the given hidden states."""
        ...


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


MODEL_IMPLS = ("auto", "pytgi", "transformers")


def model_impl(cfg: dict[str, Any], path: Path, impl: str = "auto") -> str:
    """Whose model code runs this model: pytgi's where it has it (auto), or transformers'."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"unknown model implementation {impl!r} ({' | '.join(MODEL_IMPLS)})")
    arch = (cfg.get("architectures") or [None])[0]
    arch = causal_lm(arch) or arch  # a decoder's classifier or bare model: its causal LM's code
    own = family_of(arch) is not None
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
    if model_impl(hf, path, impl) == "transformers":
        return None
    arch = (hf.get("architectures") or [None])[0]
    return family_of(causal_lm(arch) or arch)


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


# bytes per weight of each packed layout, its fp16 scales and offsets included (`pytgi.engine.models.quant`);
# int8x16's tensors of Q6_K and Q3_K take 0.875 on CPU (6 bits): the estimate stays on the safe side
PACKED_BYTES = {"int4": 0.625, "mxfp4": 0.53125, "int8": 1.125, "int8x16": 1.25, "fp8": 1.0}


def keeps_mxfp4(dtype: torch.dtype, device: torch.device, cpu: Kernels | None = None) -> bool:
    """Whether a Hugging Face MXFP4 checkpoint's experts stay 4-bit (bf16 on a CPU with pytgi's low-bit
    kernel), rather than being dequantized to `dtype`."""
    vnni = cpu.vnni if cpu is not None else kernels.vnni_supported()
    gpu = cpu is not None and cpu.triton
    return device.type == "cpu" and dtype == torch.bfloat16 and vnni and not gpu


def _shapes(
    path: Path, gguf: GGUFWeights | None, mxfp4: set[str] | None = None
) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's shape, from the GGUF file or the safetensors headers (no data read);
    the names of MXFP4 tensors go to `mxfp4`."""
    if gguf is not None:
        return {name: gguf.shape(name) for name in gguf.names()}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, info in header.items():
            shape = tuple(info["shape"])
            if name.endswith("_blocks"):  # MXFP4 (gpt-oss's experts): two values a byte, loaded as floats
                shapes[name.removesuffix("_blocks")] = (*shape[:-2], shape[-2] * shape[-1] * 2)
                if mxfp4 is not None:
                    mxfp4.add(name.removesuffix("_blocks"))
            elif not name.endswith("_scales"):
                shapes[name] = shape
    return shapes


def weight_bytes(path: Path, dtype: torch.dtype, device: torch.device, quantize: str = "auto") -> int:
    """About how many bytes the whole model's weights take at their largest while loading: a GGUF
    model's packed tensors at their layouts' size and the rest in `dtype`; a Hugging Face model in
    `dtype`, or in float32 when it is quantized on the fly (`--quantize int8|int4`)."""
    plan = resolve_plan(quantize, path, dtype, device)
    weights = open_gguf(path)
    mxfp4: set[str] = set()
    shapes, gguf = _shapes(path, weights, mxfp4), weights is not None
    if not keeps_mxfp4(dtype, device):
        mxfp4.clear()
    elt = (
        4
        if isinstance(plan, str) and plan not in ("bf16", "fp8")
        else torch.empty((), dtype=dtype).element_size()
    )
    total = 0.0
    for name, shape in shapes.items():
        kind = plan.get(name) if gguf and isinstance(plan, dict) else "mxfp4" if name in mxfp4 else None
        total += math.prod(shape) * PACKED_BYTES.get(kind or "", elt)
    return int(total)


def loaded_bytes(model: Any) -> int:
    """The bytes a loaded model holds: its parameters and buffers, its linears' and experts' packed
    weights."""
    from pytgi.engine.models.quant import QuantizedLinear

    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for mod in model.modules():
        quants = [mod.quant] if isinstance(mod, QuantizedLinear) else []
        quants += [w for pair in mod.packed for w in pair] if isinstance(mod, SparseMoE) else []
        tensors += [t for q in quants for t in (q.packed, getattr(q, "scales", None))]
    for t in tensors:
        if t is not None and t.device.type != "meta" and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


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
    classifier's score head, left in `model.score_weight`) | none (an embedder's: no head at all, the
    checkpoint need not have one)."""
    hf = read_config(path)
    if head != "lm" and model_impl(hf, path, impl) == "transformers":
        raise UnsupportedModel(
            f"{path.name}: a pooling model needs pytgi's own model code (--model-impl pytgi)"
        )
    if model_impl(hf, path, impl) == "transformers":
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

        return TransformersModel(path, dtype, device, cpu, attention, own_architectures())
    family = family_of(hf["architectures"][0])
    vision = family if family is not None and family.kind == VISION else None
    text = config_reader(vision)(hf) if vision else hf
    cfg = decoder_config(text, path)
    aside: dict[str, torch.Tensor] = {}
    if head != "lm":  # the LM head is not used: tied to the embedding (no memory), not read
        if vision:
            raise UnsupportedModel(f"{path.name}: a vision model is not served as a pooling model")
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
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
        ckpt = QuantizedCheckpoint(path, checkpoint)
        with _default_dtype(dtype), torch.device(device):
            decoder = DecoderModel(cfg, cpu, attention)
        # float32 (or --quantize none, or a GPU without Triton) takes the checkpoint's values dequantized;
        # otherwise the levels are packed (FP8 on CPU: dequantized to bf16, on pytgi's bf16 kernel)
        if quantize == "auto" and dtype != torch.float32 and (cpu.triton or device.type == "cpu"):
            decoder.load_quantized_checkpoint(ckpt, dtype)
        else:
            decoder.load_weights(ckpt.dense_tensors())
        return decoder.eval()
    plan = resolve_plan(quantize, path, dtype, device, gpu=cpu.triton)
    if gguf is not None and not vision and isinstance(plan, dict):
        # A GGUF file's tensors are read one at a time, the quantized linears packed from their blocks
        # as they are and the rest dequantized to `dtype`: never a float copy of the model.
        with _default_dtype(dtype), torch.device(device):
            decoder = DecoderModel(cfg, cpu, attention)
        if plan:
            decoder.load_gguf(gguf, plan, dtype)
        else:
            decoder.load_weights(gguf.dense_tensors(dtype))
        return decoder.eval()
    # A Hugging Face model to quantize is loaded in float32 first, so the low-bit grids see the
    # checkpoint's values (bf16 weights are only re-laid out: loaded as they are).
    model: Any
    # (FP8 scales come from the checkpoint's own dtype: loaded as it is.)
    with (
        _default_dtype(torch.float32 if plan and plan not in ("bf16", "fp8") else dtype),
        torch.device(device),
    ):
        model = DecoderModel(cfg, cpu, attention)
        if vision:
            model = model_class(vision)(hf, model)
    if gguf is not None:
        tensors = gguf.dense_tensors()
    elif (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        keep = keeps_mxfp4(dtype, device, cpu)
        if keep:  # the experts' codes packed as they are read: never a float copy of them
            for mod in model.modules():
                if isinstance(mod, SparseMoE):
                    mod.keep_mxfp4 = (dtype, cpu)
        tensors = mxfp4_tensors(iter_safetensors(path), dtype, keep)  # exact in bf16 too
    else:
        tensors = (
            _set_aside(iter_safetensors(path), "score.weight", aside)
            if head == "score"
            else iter_safetensors(path)
        )
    model.load_weights(tensors)
    if head == "score":
        if "score.weight" not in aside:
            raise ValueError(f"{path.name}: a sequence classifier's checkpoint without score.weight")
        model.score_weight = aside["score.weight"].to(device, dtype)
    if plan:
        model.quantize(plan, dtype)
    return model.eval()


def _set_aside(
    tensors: Iterator[tuple[str, torch.Tensor]], name: str, kept: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors but `name` (with or without "model."), which is copied into `kept`."""
    for n, t in tensors:
        if n.removeprefix("model.") == name:
            kept[name] = t.clone()
        else:
            yield n, t
