"""What every family's image layout has: the image token and the positions of an unsplit image."""

from __future__ import annotations

from typing import ClassVar

import msgspec


class LayoutBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """How many prompt positions an image takes once the engine expands its image token: what the API
    process counts before the engine runs the image processor. Each family's arithmetic is a subclass
    in its own module (registered in `pytgi.core.image_layouts`), sent between the processes by its
    tag (`kind`).

    `wrap` (Gemma 3: a blank line, "\\n\\n"): text the model's processor puts on both sides of each
    image token before the prompt is tokenized (`pytgi.core.image_geometry.wrap_images`); it may merge
    with the text around it, so it is tokenized with the prompt, not counted in `positions`."""

    sized: ClassVar[bool] = True  # whether an image's size decides its positions (then it is read)

    token: int  # the image token: a prompt holds one per image, where the chat template puts it
    positions: int  # an image that is not split
    wrap: str = ""

    def image_positions(self, width: int, height: int) -> int:
        """The prompt positions an image of `width` × `height` pixels takes."""
        raise NotImplementedError


class Fixed(LayoutBase, frozen=True, kw_only=True, tag="fixed"):
    """LLaVA-1.5, Gemma 3: `positions`, whatever the image."""

    sized: ClassVar[bool] = False

    def image_positions(self, width: int, height: int) -> int:
        return self.positions
