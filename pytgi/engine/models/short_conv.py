"""LFM2's short convolution, a recurrent layer kind (layer type `conv`) over the pool of states.

A layer projects its input x [T, hidden] to three gates B, C and h (`in_proj`, [B | C | h] rows),
convolves B · h over time, causally and per channel, with a short kernel of `kernel` taps
(`conv_L_cache`), multiplies by C and projects back (`out_proj`):

    y_t = C_t · Σ_j w[:, j] · (B · h)_{t − kernel + 1 + j};   out = out_proj(y)

There is no activation and no recurrence beyond the window: a request's state is the convolution's
last `kernel − 1` inputs (B · h) per channel, in the model's dtype, `hidden · (kernel − 1)` values a
layer. A request's state starts from zero at its first token; a prompt chunk reads the state the
previous chunk left, so chunks give what the whole prompt gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pytgi.engine.distributed import local_range
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear, _set_loader
from pytgi.engine.models.linear_attention import StateSpec

if TYPE_CHECKING:
    from pytgi.engine.models.attention import Rope
    from pytgi.engine.models.linear_attention import StateMetadata


@dataclass(frozen=True, slots=True)
class ShortConvConfig:
    kernel: int  # the convolution's taps (LFM2's conv_L_cache)
    bias: bool = False  # biases on in_proj, the convolution and out_proj (conv_bias)

    def build(self, hidden: int, eps: float, fused: bool) -> ShortConv:
        """The layer of this kind (a `RecurrentMixer`); it runs in PyTorch ops whatever `fused` says
        (its work is two linears and a few multiply-adds a channel)."""
        return ShortConv(self, hidden)


class ShortConv(nn.Module):
    """One short-convolution layer; this rank holds channels [start, start + n) of every gate, of the
    convolution and of out_proj's input."""

    # no recurrence: the state is the window's last inputs, and each output sums its taps alone, so a
    # prefill split anywhere gives the bits of one unsplit (measured)
    state_grid = 1

    def __init__(self, cfg: ShortConvConfig, hidden: int) -> None:
        super().__init__()
        if cfg.kernel < 2:
            raise ValueError(
                f"a short convolution of {cfg.kernel} taps keeps no state: pytgi has no code for it"
            )
        self.cfg = cfg
        start, n = local_range(hidden)
        self.channels = [(start, n), (hidden + start, n), (2 * hidden + start, n)]  # B, C, h
        self.in_proj = ColumnParallelLinear(hidden, self.channels, cfg.bias)
        _set_loader(self.in_proj.weight, self._load_gates)
        if self.in_proj.bias is not None:
            _set_loader(self.in_proj.bias, self._load_gates)
        self.conv = nn.Parameter(torch.zeros(n, cfg.kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(n), requires_grad=False) if cfg.bias else None
        for p in (self.conv, self.conv_bias):
            if p is not None:
                _set_loader(p, self._load_channels)
        self.out_proj = RowParallelLinear((start, n), hidden, cfg.bias)

    def _load_channels(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """This rank's channels of the convolution's weight ([C, 1, kernel], or [C, kernel] as
        llama.cpp's converter squeezes it) or bias."""
        start, n = self.channels[0]
        param.data.copy_(loaded.reshape(loaded.shape[0], -1)[start : start + n].view_as(param))

    def _load_gates(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """This rank's channels of each gate of a [B | C | h] tensor (in_proj's weight or bias)."""
        param.data.copy_(torch.cat([loaded[s : s + n] for s, n in self.channels]))

    def state_specs(self) -> tuple[StateSpec, ...]:
        """Per request: the convolution's last kernel − 1 inputs [channels, kernel − 1]."""
        return (StateSpec((self.conv.shape[0], self.cfg.kernel - 1)),)

    def forward(
        self, x: torch.Tensor, rope: Rope, state: tuple[torch.Tensor, ...], meta: StateMetadata
    ) -> torch.Tensor:
        (states,) = state
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        bx = b * h  # the convolution's input, in the model's dtype (what the state keeps)
        # the taps' sums in float32: a decode's sum and a chunk's conv1d then round alike, so a prompt
        # cut into chunks and its decodes give what it gives whole in bf16 too
        w = self.conv.float()
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
        if meta.reset is not None:
            states[meta.reset] = 0
        if len(meta.decodes):
            rows, slots = meta.decode_rows, meta.slots[meta.decodes]
            window = torch.cat([states[slots], bx[rows].unsqueeze(-1)], dim=-1)  # [B, channels, kernel]
            states[slots] = window[..., 1:]
            y[rows] = (window.float() * w).sum(-1)
        start = 0
        for i, (n, fresh) in enumerate(zip(meta.query_lens, meta.fresh)):
            if n > 1:
                slot = meta.slots[i]
                prev = torch.zeros_like(states[slot]) if fresh else states[slot]
                window = torch.cat([prev, bx[start : start + n].T], dim=-1)  # [channels, kernel − 1 + n]
                states[slot] = window[:, -prev.shape[-1] :]
                out = F.conv1d(window.unsqueeze(0).float(), w.unsqueeze(1), groups=w.shape[0])
                y[start : start + n] = out[0].T
            start += n
        if self.conv_bias is not None:
            y = y + self.conv_bias.float()
        return self.out_proj(c * y.to(x.dtype))
