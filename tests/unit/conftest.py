from pathlib import Path

import pytest

from pytgi.core.tokenizer import Tokenizer
from tests.unit import tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny SmolLM2-shaped tokenizer directory (tokenizer and config files, no weights), built in
    milliseconds: the unit tier never needs the default model."""
    return tiny_tokenizer.build(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)
