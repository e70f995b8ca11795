"""The commands rank 0 broadcasts to the other ranks, declared one class each (as `StepMessage`
declares a step's fields): each knows its code and its integer arguments, so that a rank receives a
typed command, never a position in a tuple. A command is one broadcast of at most 9 integers on the
command group; what follows it (a step's arrays, the adapters' state) is the command's to describe."""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import ClassVar

from pytgi.engine import distributed as dist


@dataclass(frozen=True, slots=True)
class Step:
    """A forward step follows (`StepMessage`): its sizes per dimension, then the mask of its optional
    fields."""

    code: ClassVar[int] = 0
    header: tuple[int, ...]

    def args(self) -> tuple[int, ...]:
        return self.header

    @classmethod
    def read(cls, args: tuple[int, ...]) -> Step:
        return cls(args)


@dataclass(frozen=True, slots=True)
class Ping:
    """Nothing to do: a barrier follows, so a dead or stuck rank shows while the engine is idle."""

    code: ClassVar[int] = 1

    def args(self) -> tuple[int, ...]:
        return ()

    @classmethod
    def read(cls, args: tuple[int, ...]) -> Ping:
        return cls()


@dataclass(frozen=True, slots=True)
class Allocate:
    """Allocate the KV cache (and a hybrid model's recurrent states)."""

    code: ClassVar[int] = 2
    num_blocks: int
    block_size: int
    state_slots: int

    def args(self) -> tuple[int, ...]:
        return astuple(self)

    @classmethod
    def read(cls, args: tuple[int, ...]) -> Allocate:
        return cls(*args[:3])


@dataclass(frozen=True, slots=True)
class Capacity:
    """Measure how many KV slots fit (`ModelRunner.auto_num_tokens`): a fraction of the free memory
    (None: the device's default) and a cap in bytes (None: none)."""

    code: ClassVar[int] = 3
    fraction: float | None
    cap_bytes: int | None

    def args(self) -> tuple[int, ...]:
        f = -1 if self.fraction is None else int(self.fraction * 1_000_000)
        return (f, -1 if self.cap_bytes is None else self.cap_bytes)

    @classmethod
    def read(cls, args: tuple[int, ...]) -> Capacity:
        f, cap = args[:2]
        return cls(None if f < 0 else f / 1_000_000, None if cap < 0 else cap)


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop: the rank leaves its loop."""

    code: ClassVar[int] = 4

    def args(self) -> tuple[int, ...]:
        return ()

    @classmethod
    def read(cls, args: tuple[int, ...]) -> Shutdown:
        return cls()


@dataclass(frozen=True, slots=True)
class Adapters:
    """The LoRA adapters' state follows, `length` int64 values (JSON bytes): mirror it."""

    code: ClassVar[int] = 5
    length: int

    def args(self) -> tuple[int, ...]:
        return (self.length,)

    @classmethod
    def read(cls, args: tuple[int, ...]) -> Adapters:
        return cls(args[0])


@dataclass(frozen=True, slots=True)
class CopyStates:
    """`count` recurrent-state row copies follow, (source, destination) pairs as 2 × count int64
    values: make them, in order, before the next step (the prefix cache's checkpoints)."""

    code: ClassVar[int] = 6
    count: int

    def args(self) -> tuple[int, ...]:
        return (self.count,)

    @classmethod
    def read(cls, args: tuple[int, ...]) -> CopyStates:
        return cls(args[0])


Command = Step | Ping | Allocate | Capacity | Shutdown | Adapters | CopyStates
BY_CODE: dict[int, type[Command]] = {
    c.code: c for c in (Step, Ping, Allocate, Capacity, Shutdown, Adapters, CopyStates)
}


def send(command: Command) -> None:
    """Rank 0: broadcast `command` to the other ranks."""
    dist.broadcast_command(command.code, *command.args())


def receive() -> Command:
    """Ranks > 0: the next command rank 0 broadcasts."""
    code, *args = dist.broadcast_command(Ping.code)
    return BY_CODE[code].read(tuple(args))
