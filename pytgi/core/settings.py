"""Serving settings, each declared once: a field of the config that reads it (`EngineConfig` in the
engine process, `ServerConfig` in the API process), made with `setting(...)`, which records its
help, its flag and its environment variable. `pytgi.core.flags` lists them all (`table()`) and makes
`pytgi serve`'s flags, the configs built from parsed flags, and docs/flags.md from them.

No torch here: the API process imports this module.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeAlias, TypeVar, cast

READERS = ("engine", "server")
T = TypeVar("T")
# A setting's value: the configs' fields are these (and Optional ones)
SettingValue: TypeAlias = "str | int | float | bool | tuple[str, ...] | None"


def setting(
    default: T,
    help: str,
    *,
    flag: str | None = None,
    env: str | None = None,
    switch: bool = False,
    repeat: bool = False,
    info: bool = False,
) -> T:
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
    type: Callable[[str], SettingValue]  # parses a flag's or an environment variable's text
    default: SettingValue
    help: str
    flag: str
    env: str
    reader: str  # "engine" (EngineConfig) or "server" (ServerConfig)
    switch: bool = False
    repeat: bool = False
    info: bool = False

    def from_env(self) -> SettingValue:
        """The environment's value (parsed), or the default."""
        text = os.environ.get(self.env)
        if text is None:
            return self.default
        if self.switch:
            return (text.lower() not in ("", "0", "false")) != self.default
        return self.type(text)


def _parser(annotation: object) -> Callable[[str], SettingValue]:
    """int | None → int, and so on: what parses one value of the field (its annotation's class)."""
    base = annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        base = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(base) is tuple:  # a comma-separated list
        return lambda text: tuple(p.strip() for p in text.split(",") if p.strip())
    return cast("Callable[[str], SettingValue]", base)


def declared(cls: type, reader: str) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        assert f.default is not dataclasses.MISSING, f"{f.name}: `setting` gives every field a default"
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
