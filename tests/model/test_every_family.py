"""Every causal-LM family transformers ships, as a new user would serve it (issue 63, point 5): equal to
transformers' greedy tokens, or refused by name at start; never a crash at start that is not a
refusal, never a failed request, never other tokens. `tests/every_family.py` says how each is tried.
What cannot be tried here (no tiny decoder-only config of it) is skipped with its reason, so a
transformers release that adds a family shows up under `pytest -rs`, tried or skipped, never silently.
"""

from __future__ import annotations

import pytest

from tests.every_family import EQUAL, REFUSED, SKIPPED, causal_lm_types, check

TYPES = causal_lm_types()


@pytest.mark.parametrize("model_type", list(TYPES))
def test_equal_or_refused_by_name(model_type, tmp_path):
    outcome = check(model_type, TYPES[model_type], tmp_path)
    if outcome.result == SKIPPED:
        pytest.skip(f"{model_type}: {outcome.detail}")
    assert outcome.result in (EQUAL, REFUSED), outcome.detail
    if outcome.result == REFUSED:  # one line that names the architecture and the reason
        assert "\n" not in outcome.detail and outcome.architecture in outcome.detail, outcome.detail
