"""JSON values, and the server's JSON response: Starlette's, except that text no UTF-8 can carry (a
lone surrogate a client sent, echoed in an error such as "model `\\ud800` does not exist") is written as
a JSON escape instead of failing the response with a 500."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, TypeAlias

from starlette.responses import JSONResponse as _StarletteJSON

# A JSON value: a body's, a JSON schema, a tool's arguments, a chat template's variable. (Pydantic and
# msgspec, which read bodies and stored conversations, do not follow a recursive alias: to them it is
# any value, which is what a JSON document parses into.)
if TYPE_CHECKING:
    JSON: TypeAlias = str | int | float | bool | None | list["JSON"] | dict[str, "JSON"]
else:
    JSON = object
JSONObject: TypeAlias = dict[str, JSON]


class JSONResponse(_StarletteJSON):
    def render(self, content: object) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode(
                "ascii"
            )
