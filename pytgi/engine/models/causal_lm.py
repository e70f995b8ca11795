"""What the engine uses of a loaded model, pytgi's own code or transformers'."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pytgi.engine.models.decoder import StepImages


class CausalLM(Protocol):
    """What the engine uses of a loaded model, pytgi's code or transformers' (`load_model`)."""

    config: Any  # its config: vocab_size, max_position_embeddings, ...
    attention: Any  # its attention backend: `prepare(layout, device)` builds a step's metadata
    layers: Any  # per layer, `self_attn.n_kv` and `self_attn.head_dim`: the KV cache's shape

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        meta: Any,
        image_rows: StepImages | None = None,
    ) -> torch.Tensor:
        """The last hidden states of the step's tokens (writing their keys and values); `image_rows`
        (a vision model's): flat rows whose embeddings are an image's rows."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the given hidden states."""
        ...
