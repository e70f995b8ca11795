"""What the engine uses of a loaded model, pytgi's own code or transformers'."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol, TypeAlias

import torch
from torch import nn

from pytgi.engine.models.attention import LayerCache, StepLayout
from pytgi.engine.models.decoder import DecoderConfig, DecoderMetadata, StepImages

if TYPE_CHECKING:
    from pytgi.engine.models.transformers_impl import StepContext, TransformersConfig

# A step's metadata, as the model's attention backend prepares it: pytgi's decoder's, or the
# context transformers' code reads its layers' metadata from
StepMetadata: TypeAlias = "DecoderMetadata | StepContext"


class StepAttention(Protocol):
    """A model's attention backend, as the runner sees it."""

    @property
    def captures_decode(self) -> bool:
        """CUDA graphs can replay its decode steps (declared, never probed)."""
        ...

    @property
    def fp8_cache(self) -> bool:
        """It reads and writes an FP8 cache."""
        ...

    def prepare(self, layout: StepLayout, device: torch.device) -> StepMetadata:
        """The step's metadata, built once for all the layers."""
        ...


class CausalLM(Protocol):
    """What the engine uses of a loaded model, pytgi's code or transformers' (`load_model`)."""

    @property
    def config(self) -> DecoderConfig | TransformersConfig:
        """Its config: vocab_size, max_position_embeddings, ..."""
        ...

    @property
    def attention(self) -> StepAttention:
        """Its attention backend: `prepare(layout, device)` builds a step's metadata."""
        ...

    @property
    def layers(self) -> Iterable[object]:
        """Its layers: an attention layer's `self_attn.n_kv` and `self_attn.head_dim` give the KV
        cache's shape; a recurrent layer's `linear_attn.state_specs()` its states'."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerCache],
        meta: StepMetadata,
        image_rows: StepImages | None = None,
    ) -> torch.Tensor:
        """The last hidden states of the step's tokens (writing their keys and values); `image_rows`
        (a vision model's): flat rows whose embeddings are an image's rows."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the given hidden states."""
        ...

    # nn.Module's, for the bytes it holds (`pytgi.engine.loading.sizes.loaded_bytes`)
    def parameters(self) -> Iterator[nn.Parameter]: ...
    def buffers(self) -> Iterator[torch.Tensor]: ...
    def modules(self) -> Iterator[nn.Module]: ...
