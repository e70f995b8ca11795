"""Hugging Face float32 copies of GGUF models, for transformers to load as the tests' reference."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def hf_copy(model_dir: str | os.PathLike) -> Path:
    """`model_dir` itself for a Hugging Face directory; for a GGUF model's converted directory (whose
    weights stay in the GGUF file), its float32 export (`export_float`), made once into the cache."""
    from pytgi.core.gguf_convert import SOURCE_FILE
    from pytgi.core.paths import cache_dir
    from pytgi.engine.loading.gguf import export_float

    model_dir = Path(model_dir)
    if not (model_dir / SOURCE_FILE).is_file():
        return model_dir
    out = cache_dir() / "float-copies" / model_dir.name
    if not (out / "model.safetensors").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        export_float(model_dir, tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out
