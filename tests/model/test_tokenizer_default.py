"""pytgi.core.tokenizer on the default model's own tokenizer (SmolLM2's 49152 tokens, converted from the
embedded GGUF file): the checks of tests/unit/test_tokenizer.py that do not depend on the tokenizer
they run on, again here, and those that hard-code SmolLM2's ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytgi.core.tokenizer import Tokenizer

# Collected here again, with this module's `tokenizer_dir` and `tok` (and `hf`, which reads `tokenizer_dir`).
from tests.unit.test_tokenizer import (  # noqa: F401
    hf,
    test_attributes_match_transformers,
    test_chat_template_default_adds_generation_prompt,
    test_chat_template_matches_transformers,
    test_decode_matches_transformers,
    test_decode_roundtrip,
    test_detokenizer_decodes_a_small_window_only,
    test_detokenizer_flush_returns_dangling_partial_char,
    test_detokenizer_holds_back_split_emoji,
    test_detokenizer_on_chat_prompt,
    test_detokenizer_on_multibyte_text,
    test_detokenizer_on_random_ids,
    test_detokenizer_with_prompt_context,
    test_encode_matches_transformers,
    test_special_token_text_encodes_to_one_id,
    test_truncation_and_padding_in_tokenizer_json_are_ignored,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    """The default model's converted directory (tokenizer and config; converted once if missing)."""
    from pytgi.core.model_files import resolve_model

    path = resolve_model(None).path
    return Path(path)


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


def test_id_to_piece(tok: Tokenizer, hf) -> None:  # noqa: F811 (the fixture imported above)
    for i in [0, 1, 2, 3, 17, 28, 200, 1000, 30000, tok.vocab_size - 1]:
        assert tok.id_to_piece(i) == hf.decode([i], skip_special_tokens=False)
    assert tok.id_to_piece(1) == "<|im_start|>"  # special tokens are reported, not skipped


def test_default_tokenizer_is_smollm2(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152 and tok.encode("<repo_name>", add_special_tokens=False) == [3]
