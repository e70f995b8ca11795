"""Where pytgi keeps what it builds once: converted models and compiled kernels; files' stamps."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("PYTGI_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pytgi"
    )
    return Path(root)


def files_stamp(path: Path) -> list[tuple[str, int, int]]:
    """A file's or a directory's files (not recursive) by name, size and modification time: what
    changes when they are rewritten (the prefix cache keys blocks by their model's and adapter's)."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [(p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files]
