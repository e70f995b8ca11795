"""What an answer must match. Each API has its own field for it (OpenAI's `response_format`, the
Responses API's `text.format`, Anthropic's `output_config.format`), and every one of them also takes
vLLM's fields (`structured_outputs`, `guided_*`: `StructuredFields`). A request gives one constraint at
most (`one`); it becomes the chat request's `constraint`. No torch here."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from pytgi.api.frontend.bodies import GrammarType
from pytgi.api.json_response import JSONObject
from pytgi.core.errors import InvalidRequest


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one of them)."""

    model_config = ConfigDict(extra="ignore")
    json_: JSONObject | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StructuredFields(BaseModel):
    """vLLM's structured-output fields, as a body's (its older `guided_*` names too)."""

    model_config = ConfigDict(extra="ignore")
    structured_outputs: StructuredOutputs | None = None
    guided_json: JSONObject | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_constraints(self) -> list[tuple[GrammarType, str]]:
        """The constraints these fields give, each with the field that gave it."""
        so = self.structured_outputs
        given: list[tuple[GrammarType, str]] = []
        for kind, value, name in [
            ("json", so and so.json_, "structured_outputs"),
            ("regex", so and so.regex, "structured_outputs"),
            ("choice", so and so.choice, "structured_outputs"),
            ("grammar", so and so.grammar, "structured_outputs"),
            ("json", self.guided_json, "guided_json"),
            ("regex", self.guided_regex, "guided_regex"),
            ("choice", self.guided_choice, "guided_choice"),
            ("grammar", self.guided_grammar, "guided_grammar"),
        ]:
            if value is not None:
                given.append((GrammarType(type=kind, value=value), name))  # type: ignore[arg-type]
        return given


def one(given: Sequence[tuple[GrammarType, str]], default: str) -> tuple[GrammarType | None, str]:
    """The one constraint given and the field that gave it (`default` when none was); refused when
    there are several, naming the second."""
    if len(given) > 1:
        raise InvalidRequest(
            "give one structured-output constraint, not several: " + ", ".join(name for _, name in given),
            given[1][1],
        )
    return given[0] if given else (None, default)
