"""The server's JSON response: Starlette's, except that text no UTF-8 can carry (a lone surrogate a
client sent, echoed in an error such as "model `\\ud800` does not exist") is written as a JSON
escape instead of failing the response with a 500."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse as _StarletteJSON


class JSONResponse(_StarletteJSON):
    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode(
                "ascii"
            )
