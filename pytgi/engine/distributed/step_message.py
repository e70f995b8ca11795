"""One step as rank 0 sends it to the other tensor-parallel ranks: a declared message, by field.

Rank 0 lays the step out, picks its logit rows, its rows' LoRA slots and a vision model's image rows;
the other ranks need exactly those to run the same forward on their shards. `StepMessage` names each
part once, with its shape in terms of the step's sizes (`DIMS`); sending it broadcasts a command with
the sizes and which optional fields are present, then the integer arrays in one broadcast, then the
image rows' values (the model's dtype). Adding a field is one line in `FIELDS` (and the dataclass).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pytgi.engine import distributed as dist
from pytgi.engine.distributed import commands
from pytgi.engine.execution.batch import StepBatch
from pytgi.engine.models.attention import StepLayout
from pytgi.engine.models.decoder import StepImages

# The sizes a step's arrays are made of (at most 8: they travel in one command with the field mask).
DIMS = ("tokens", "requests", "blocks", "rows", "image_rows", "image_width", "rope_rows", "spans")

# Each int64 field and its shape (a size's name or a number); optional ones may be None.
FIELDS: dict[str, tuple[str | int, ...]] = {
    "ids": ("tokens",),
    "positions": ("tokens",),
    "query_lens": ("requests",),
    "context_lens": ("requests",),
    "block_tables": ("requests", "blocks"),
    "slot_mapping": ("tokens",),
    "rows": ("rows",),  # the logit rows the step samples from
    "lora_slots": ("tokens",),  # each row's adapter slot (-1: the base model); None: no adapter
    "image_rows": ("image_rows",),  # the flat rows at image positions
    "rope_rows": ("rope_rows",),  # M-RoPE's rows ...
    "rope_positions": (3, "rope_rows"),  # ... and their 3-D positions
    "spans": ("spans", 3),  # positions attending both ways (StepLayout.spans)
    "state_slots": ("requests",),  # each request's recurrent state (a model with linear attention)
}
OPTIONAL = ("lora_slots", "image_rows", "rope_rows", "rope_positions", "spans", "state_slots")


@dataclass
class StepMessage:
    ids: np.ndarray
    positions: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    rows: np.ndarray
    lora_slots: np.ndarray | None = None
    image_rows: np.ndarray | None = None
    rope_rows: np.ndarray | None = None
    rope_positions: np.ndarray | None = None
    spans: np.ndarray | None = None
    state_slots: np.ndarray | None = None
    image_values: torch.Tensor | None = None  # (image_rows, image_width), the model's dtype

    @classmethod
    def of(
        cls, step: StepBatch, rows: np.ndarray, slots: np.ndarray | None, images: StepImages | None
    ) -> StepMessage:
        layout = step.layout
        msg = cls(
            step.ids,
            step.positions,
            layout.query_lens,
            layout.context_lens,
            layout.block_tables,
            layout.slot_mapping,
            rows,
            lora_slots=slots,
            spans=layout.spans,
            state_slots=layout.state_slots,
        )
        if images is not None:
            msg.image_rows = images.rows.numpy()
            msg.image_values = images.values if len(images.rows) else None
            if images.rope_rows is not None:
                assert images.rope_positions is not None
                msg.rope_rows, msg.rope_positions = images.rope_rows.numpy(), images.rope_positions.numpy()
        return msg

    def parts(self, block_size: int) -> tuple[StepBatch, np.ndarray, np.ndarray | None, StepImages | None]:
        """What rank 0 made it of: the step, its logit rows, its rows' LoRA slots, its image rows."""
        layout = StepLayout(
            self.query_lens,
            self.context_lens,
            self.block_tables,
            self.slot_mapping,
            block_size,
            self.spans,
            self.state_slots,
        )
        images = None
        if self.image_rows is not None or self.rope_rows is not None:
            rope: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
            if self.rope_rows is not None and self.rope_positions is not None:
                rope = (torch.from_numpy(self.rope_rows.copy()), torch.from_numpy(self.rope_positions.copy()))
            flat = self.image_rows if self.image_rows is not None else np.zeros(0, np.int64)
            values = self.image_values if self.image_values is not None else torch.zeros(0, 0)
            images = StepImages(torch.from_numpy(flat.copy()), values, *rope)
        return StepBatch(self.ids, self.positions, layout), self.rows, self.lora_slots, images

    # -- the wire ---------------------------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        """Each of DIMS, read off the fields' shapes."""
        sizes, seen = dict.fromkeys(DIMS, 0), set()
        for name, shape in FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            for dim, n in zip(shape, value.shape, strict=True):
                if isinstance(dim, str) and dim not in seen:
                    sizes[dim] = n
                    seen.add(dim)
                elif n != (sizes[dim] if isinstance(dim, str) else dim):
                    raise ValueError(f"StepMessage.{name}: shape {value.shape}, declared {shape} ({sizes})")
        if self.image_values is not None:
            sizes["image_width"] = self.image_values.shape[1]
        return sizes

    def send(self, dtype: torch.dtype) -> None:
        """Rank 0: broadcast the message (the others call `receive` after the command)."""
        sizes = self.sizes()
        mask = sum(1 << i for i, name in enumerate(OPTIONAL) if getattr(self, name) is not None)
        commands.send(commands.Step((*(sizes[d] for d in DIMS), mask)))
        present = [name for name in FIELDS if getattr(self, name) is not None]
        arrays = [getattr(self, name) for name in present]
        dist.broadcast_arrays(arrays, [_shape(FIELDS[name], sizes) for name in present])
        if self.image_values is not None:
            dist.broadcast_tensor(self.image_values, tuple(self.image_values.shape), dtype)

    @classmethod
    def receive(cls, header: tuple[int, ...], dtype: torch.dtype) -> StepMessage:
        """Ranks > 0: the message whose command arguments are `header` (the sizes, then the mask)."""
        sizes = dict(zip(DIMS, header[: len(DIMS)], strict=True))
        mask = header[len(DIMS)]
        present = [n for n in FIELDS if n not in OPTIONAL or mask >> OPTIONAL.index(n) & 1]
        arrays = dist.broadcast_arrays(None, [_shape(FIELDS[name], sizes) for name in present])
        msg = cls(**dict(zip(present, arrays, strict=True)))  # type: ignore[arg-type]  # int64 fields only
        if sizes["image_rows"] and sizes["image_width"]:
            shape = (sizes["image_rows"], sizes["image_width"])
            msg.image_values = dist.broadcast_tensor(None, shape, dtype)
        return msg


def _shape(declared: tuple[str | int, ...], sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[d] if isinstance(d, str) else d for d in declared)


assert len(DIMS) + 1 <= 9, "a command carries 9 ints"
assert set(OPTIONAL) <= set(FIELDS) and all(
    f.name in FIELDS for f in dataclasses.fields(StepMessage) if f.name != "image_values"
)
