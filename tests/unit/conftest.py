from pathlib import Path

import pytest

from pytgi.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model's converted directory (tokenizer and config; converted once if missing)."""
    from pytgi.models.registry import resolve_model

    path, _ = resolve_model(None)
    return Path(path)


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)
