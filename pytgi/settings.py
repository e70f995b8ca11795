"""Serving settings, each declared once: a field of the config that reads it (`EngineConfig` in the
engine process, `ServerConfig` in the API process), made with `setting(...)`, which records its
help, its flag and its environment variable. `table()` lists them all; from it come `pytgi serve`'s
flags (`add_arguments`), the configs built from parsed flags (`from_args`), the settings /info shows
(`Setting.info`) and the flag list in docs/flags.md (`markdown`; a test keeps that file current).

No torch here: the API process imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

READERS = ("engine", "server")


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    env: str | None = None,
    switch: bool = False,
    repeat: bool = False,
    info: bool = False,
) -> Any:
    """A config field that is a serving setting. `flag`: its command-line flag (default: the field's
    name with dashes); `env`: its environment variable (default: the flag in UPPER_SNAKE_CASE);
    `switch`: a bool flag without a value, which sets the field to `not default`; `repeat`: a tuple
    the flag may be given several times for (each value comma-separated too); `info`: /info shows
    the value the engine resolved it to. Defaults are immutable (a tuple, not a list)."""
    meta = {"help": help, "flag": flag, "env": env, "switch": switch, "repeat": repeat, "info": info}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class Setting:
    name: str  # the config field
    type: Callable[[str], Any]  # parses a flag's or an environment variable's text
    default: Any
    help: str
    flag: str
    env: str
    reader: str  # "engine" (EngineConfig) or "server" (ServerConfig)
    switch: bool = False
    repeat: bool = False
    info: bool = False

    def from_env(self) -> Any:
        """The environment's value (parsed), or the default."""
        text = os.environ.get(self.env)
        if text is None:
            return self.default
        if self.switch:
            return (text.lower() not in ("", "0", "false")) != self.default
        return self.type(text)


def _parser(annotation: Any) -> Callable[[str], Any]:
    """int | None → int, and so on: what parses one value of the field."""
    base = annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        base = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(base) is tuple:  # a comma-separated list
        return lambda text: tuple(p.strip() for p in text.split(",") if p.strip())
    return base


def _settings(cls: type, reader: str) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        yield Setting(
            name=f.name,
            type=_parser(hints[f.name]),
            default=f.default,
            help=meta["help"],
            flag=flag,
            env=meta["env"] or flag.lstrip("-").replace("-", "_").upper(),
            reader=reader,
            switch=meta["switch"],
            repeat=meta["repeat"],
            info=meta["info"],
        )


def table() -> list[Setting]:
    """Every serving setting, in the order `pytgi serve --help` lists them."""
    from pytgi.config import EngineConfig, ServerConfig

    return [*_settings(EngineConfig, "engine"), *_settings(ServerConfig, "server")]


def add_arguments(
    parser: argparse.ArgumentParser,
    only: tuple[str, ...] | None = None,
    env: Callable[[Setting], Any] | None = None,
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
        "Generated from `pytgi/settings.py`'s table (`python -m pytgi.settings > docs/flags.md`; a test",
        "checks this file is current). Each flag is also read from its environment variable.",
        "",
        "| flag | environment | default | read by | |",
        "|---|---|---|---|---|",
    ]
    for s in table():
        default = "" if s.default is None else f"`{s.default}`"
        flag = s.flag if s.switch else f"{s.flag} <{s.env}>"
        lines.append(f"| `{flag}` | `{s.env}` | {default} | {s.reader} | {s.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
