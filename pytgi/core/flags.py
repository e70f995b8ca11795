"""The serving settings as flags: `table()` lists every setting the configs declare
(`pytgi.core.settings.setting`); from it come `pytgi serve`'s flags (`add_arguments`), the configs built
from parsed flags (`from_args`), the settings /info shows (`Setting.info`) and the flag list in
docs/flags.md (`markdown`; a test keeps that file current: `python -m pytgi.core.flags > docs/flags.md`).

No torch here: the API process imports this module.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from pytgi.core.config import EngineConfig, ServerConfig
from pytgi.core.settings import Setting, declared


def table() -> list[Setting]:
    """Every serving setting, in the order `pytgi serve --help` lists them."""
    return [*declared(EngineConfig, "engine"), *declared(ServerConfig, "server")]


def add_arguments(
    parser: argparse.ArgumentParser,
    only: tuple[str, ...] | None = None,
    env: Callable[[Setting], object] | None = None,
) -> None:
    """The settings' flags (`only`: these fields), each defaulting to its environment variable;
    `env(setting)` may read that variable differently (the launcher does for HOSTNAME)."""
    for s in table():
        if only is not None and s.name not in only:
            continue
        default = env(s) if env is not None else s.from_env()
        help_ = f"{s.help} [env {s.env}]"
        if s.switch:
            parser.add_argument(
                s.flag, dest=s.name, action="store_const", const=not s.default, default=default, help=help_
            )
        elif s.repeat:  # the flag's values are joined; not given: the environment's (from_args)
            parser.add_argument(
                s.flag, dest=s.name, type=s.type, action="append", default=None, metavar=s.env, help=help_
            )
        else:
            parser.add_argument(s.flag, dest=s.name, type=s.type, default=default, metavar=s.env, help=help_)


def from_args(args: argparse.Namespace, reader: str) -> dict[str, Any]:
    """The parsed values of one reader's settings, by field name."""
    out = {}
    for s in table():
        if s.reader != reader or not hasattr(args, s.name):
            continue
        value = getattr(args, s.name)
        if s.repeat:  # given: the flags' values, joined; not given: the environment's, or the default
            value = s.from_env() if value is None else tuple(v for vs in value for v in vs)
        out[s.name] = value
    return out


def markdown() -> str:
    """The flag list of docs/flags.md."""
    lines = [
        "# `pytgi serve` flags",
        "",
        "Generated from `pytgi/core/flags.py`'s table (`python -m pytgi.core.flags > docs/flags.md`;",
        "a test checks this file is current). Each flag is also read from its environment variable.",
        "",
        "| flag | environment | default | read by | |",
        "|---|---|---|---|---|",
    ]
    for s in table():
        default = "" if s.default is None else f"`{s.default}`"
        flag = s.flag if s.switch else f"{s.flag} <{s.env}>"
        lines.append(f"| `{flag}` | `{s.env}` | {default} | {s.reader} | {s.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


SHARD_SETTINGS = ("model", "revision", "dtype", "quantize", "master_addr", "master_port", "batch_invariant")


def add_shard_arguments(p: argparse.ArgumentParser) -> None:
    """The flags a rank > 0 shares with rank 0's `pytgi serve` (give the same values), and its place."""
    add_arguments(p, only=SHARD_SETTINGS, env=Setting.from_env)
    p.add_argument(
        "--rank", type=int, default=int(os.environ.get("RANK", "0")), help="this rank, >= 1 [env RANK]"
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="all ranks, rank 0 included [env WORLD_SIZE]",
    )


if __name__ == "__main__":
    print(markdown(), end="")
