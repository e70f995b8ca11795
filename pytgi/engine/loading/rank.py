"""Loading this rank's model for the runner: the device and dtype resolved, the weights checked to fit
before a byte is read, the model built with its kernels, and wrapped with its (not yet allocated)
paged KV cache. The runner computes steps; this is the one place a served model is loaded (the draft
model takes its own path, `pytgi.engine.speculation.draft_model`)."""

from __future__ import annotations

from pathlib import Path

import torch

from pytgi.core.config import EngineConfig
from pytgi.core.errors import ConfigError, UnsupportedModel
from pytgi.engine import distributed as dist
from pytgi.engine.execution.batch import PagedModel, kv_dtype_refusal
from pytgi.engine.kv.sizing import check_fits, local_engines
from pytgi.engine.loading.model import load_model, model_family, read_config, resolve_dtype
from pytgi.engine.loading.sizes import weight_bytes
from pytgi.engine.models.cpu import Kernels


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pooling_head(config: EngineConfig) -> str:
    """The head `load_model` builds for the engine's task (the task resolved by the engine first)."""
    if config.task in ("auto", "generate") or config.classifier_tokens:
        return "lm"
    return "score" if config.task == "classify" else "none"


def load_paged_model(config: EngineConfig, device: torch.device) -> PagedModel:
    """This rank's shard of `config.model` (a resolved directory; the process group is up)."""
    assert config.model is not None, "a resolved model directory"
    model_path = Path(config.model)
    dtype = resolve_dtype(config.dtype, read_config(model_path), device)
    # On CPU this builds the C kernels now (about a second, once), not on the first request.
    cpu = Kernels.for_device(device, dtype, batch_invariant=config.batch_invariant)
    family = model_family(model_path, config.model_impl)
    if family is not None and not family.tensor_parallel and dist.tp_size() > 1:
        raise UnsupportedModel(
            f"--num-shard {dist.tp_size()}: {family.name} runs on one rank in pytgi (docs/models.md)"
        )
    share = local_engines(dist.tp_size()) / dist.tp_size()  # of the whole model, on this machine
    need = weight_bytes(model_path, dtype, device, config.quantize)
    check_fits(int(need * share), device, f"the model ({model_path.name})")
    model = load_model(
        model_path,
        dtype,
        device,
        cpu,
        config.quantize,
        config.attention_backend,
        config.model_impl,
        pooling_head(config),
    )
    if why := kv_dtype_refusal(model, device, dtype, config.kv_cache_dtype, family):
        raise ConfigError(why)
    return PagedModel(model, dtype, device, kv_dtype=config.kv_cache_dtype, family=family)
