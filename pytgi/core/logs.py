"""Logging set-up shared by pytgi's processes: plain lines, or JSON lines with --json-output."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

JSON_ENV = "PYTGI_JSON_LOGS"  # set by the launcher so the engine and worker processes log alike


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        entry.update(
            getattr(record, "fields", {})
        )  # logging's extra={"fields": {...}}: machine-readable values
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(json_output: bool | None = None, prefix: str = "") -> None:
    if json_output is None:
        json_output = os.environ.get(JSON_ENV) == "1"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if json_output
        else logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s")
    )
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(), handlers=[handler], force=True)
    for name in ("httpx", "httpx2"):  # huggingface_hub's HTTP clients log every request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
