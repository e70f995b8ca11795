"""The tensor-parallel step message (pytgi.engine.distributed.step_message) over a recorded wire: what rank 0
sends is what the other ranks rebuild, field by field, with and without the optional parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pytgi.engine import distributed as dist
from pytgi.engine.distributed import commands
from pytgi.engine.distributed.step_message import StepMessage
from pytgi.engine.execution.batch import StepBatch
from pytgi.engine.models.attention import StepLayout
from pytgi.engine.models.decoder import StepImages


class Wire:
    """Rank 0's broadcasts recorded, then played back to a receiver."""

    def __init__(self, monkeypatch) -> None:
        self.sent: list = []
        self.monkeypatch = monkeypatch
        monkeypatch.setattr(dist, "broadcast_command", self.command)
        monkeypatch.setattr(dist, "broadcast_arrays", self.arrays)
        monkeypatch.setattr(dist, "broadcast_tensor", self.tensor)
        self.receiving = False

    def command(self, cmd, *args):
        self.sent.append(("command", (cmd, *args)))
        return (cmd, *args)

    def arrays(self, arrays, shapes):
        if self.receiving:
            kind, (got, got_shapes) = self.sent.pop(0)
            assert kind == "arrays" and got_shapes == shapes
            return [a.copy() for a in got]
        assert [a.shape for a in arrays] == [tuple(s) for s in shapes]
        self.sent.append(("arrays", (arrays, shapes)))
        return arrays

    def tensor(self, x, shape, dtype):
        if self.receiving:
            kind, got = self.sent.pop(0)
            assert kind == "tensor" and tuple(got.shape) == tuple(shape) and got.dtype == dtype
            return got.clone()
        self.sent.append(("tensor", x.to(dtype)))
        return x

    def header(self) -> tuple[int, ...]:
        self.receiving = True
        kind, (cmd, *args) = self.sent.pop(0)
        assert kind == "command" and cmd == commands.Step.code
        return tuple(args)


def step(spans: bool) -> StepBatch:
    q = np.array([3, 1], np.int64)
    layout = StepLayout(
        q,
        np.array([3, 9], np.int64),
        np.array([[0, 1], [2, 3]], np.int64),
        np.arange(4, dtype=np.int64),
        4,
        np.array([[0, 1, 3]], np.int64) if spans else None,
    )
    return StepBatch(np.array([5, 6, 7, 8], np.int64), np.array([0, 1, 2, 9], np.int64), layout)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("images", [None, "rows", "rope"])
def test_what_rank_0_sends_is_what_the_others_rebuild(monkeypatch, lora, images):
    wire = Wire(monkeypatch)
    rows = np.array([2, 3], np.int64)
    slots = np.array([0, 0, 0, -1], np.int64) if lora else None
    imgs = None
    if images is not None:
        rope = (torch.tensor([0, 1]), torch.arange(6).reshape(3, 2)) if images == "rope" else (None, None)
        imgs = StepImages(torch.tensor([1, 2]), torch.randn(2, 8, dtype=torch.bfloat16), *rope)
    StepMessage.of(step(spans=images is not None), rows, slots, imgs).send(torch.bfloat16)
    got, got_rows, got_slots, got_images = StepMessage.receive(wire.header(), torch.bfloat16).parts(4)
    want = step(spans=images is not None)
    for name in ["ids", "positions"]:
        assert np.array_equal(getattr(got, name), getattr(want, name))
    for name in ["query_lens", "context_lens", "block_tables", "slot_mapping", "spans"]:
        a, b = getattr(got.layout, name), getattr(want.layout, name)
        assert (a is None and b is None) or np.array_equal(a, b), name
    assert got.layout.block_size == 4 and np.array_equal(got_rows, rows)
    assert (got_slots is None) == (slots is None) and (slots is None or np.array_equal(got_slots, slots))
    assert (got_images is None) == (imgs is None)
    if imgs is not None:
        assert torch.equal(got_images.rows, imgs.rows) and torch.equal(got_images.values, imgs.values)
        if images == "rope":
            assert torch.equal(got_images.rope_rows, imgs.rope_rows)
            assert torch.equal(got_images.rope_positions, imgs.rope_positions)
        else:
            assert got_images.rope_rows is None
    assert wire.sent == []  # every broadcast read back, in order


def test_a_field_whose_shape_disagrees_with_the_others_is_refused():
    msg = StepMessage.of(step(False), np.array([1], np.int64), np.zeros(3, np.int64), None)
    with pytest.raises(ValueError, match="lora_slots"):
        msg.sizes()


@pytest.mark.parametrize(
    "command",
    [
        commands.Ping(),
        commands.Shutdown(),
        commands.Allocate(12, 16, 3),
        commands.Capacity(0.25, None),
        commands.Capacity(None, 1 << 33),
        commands.Adapters(40),
        commands.Step((3, 4, 5, 1)),
    ],
)
def test_each_command_arrives_as_sent(monkeypatch, command):
    """A command is its code and at most 9 integers on the wire; the receiver gets the same typed one."""
    wire: list[tuple[int, ...]] = []

    def broadcast(cmd: int, *args: int) -> tuple[int, ...]:
        if wire:  # receiving: rank 0's ten integers
            return wire.pop()
        assert len(args) <= 9
        wire.append((cmd, *args, *[0] * (9 - len(args))))
        return wire[-1]

    monkeypatch.setattr(dist, "broadcast_command", broadcast)
    commands.send(command)
    got = commands.receive()
    if isinstance(command, commands.Step):  # the header is as long as the wire: its reader knows its dims
        assert isinstance(got, commands.Step) and got.header[: len(command.header)] == command.header
    else:
        assert got == command
