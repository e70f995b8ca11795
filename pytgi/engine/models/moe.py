"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek, GLM-4.5, MiniMax-M2, Gemma 4).

Each token goes to its `top_k` experts by a softmax router (renormalized over the chosen ones when
the model says so) and gets their SwiGLU outputs, weighted. Other routers are data (`Routing`,
`route`): sigmoid scores, a per-expert correction bias that steers the choice but not the weights,
grouped selection (DeepSeek-V3's `n_group` / `topk_group`), a scale on the weights; they decide the
(expert, weight) pairs only, and the experts run as for any other router.

The experts' weights are stacked, gate and up fused (`gate_up [E, 2I, H]`, `down [E, H, I]`), and a
step runs one pair of matmuls per expert that has tokens: tokens are grouped by expert once, not
visited one by one. A GGUF model's experts stay packed as the file holds them (`pack_experts`), and a
bf16 step runs all its experts in one C call (`pytgi/engine/kernels/moe.c`: the same low-bit matmuls,
no Python between them; routed there too for the plain softmax router, else by `route` first).
Qwen2-MoE adds a shared expert, scaled by a sigmoid gate; DeepSeek's shared experts (one MLP) are
added ungated. gpt-oss (`oai`) has biases on the router and the experts, softmaxes the chosen experts'
logits, and clamps its SwiGLU; its checkpoint stacks each expert's weights transposed, [E, H, 2I] with
gate and up interleaved, or in MXFP4 (two e2m1 codes a byte, a power of two per 32): on a CPU with
pytgi's low-bit kernels those stay 4-bit (format "mxfp4"), packed from the codes as they are read
(`Mxfp4.pack`). Gemma 4's experts compute GELU(gate)·up (`activation`; in moe.c, routed by `route`)
and its router reads its own input (`forward`'s `router_input`: the residual stream, not the experts'
normed input), RMS-normed and scaled, and scales each chosen expert's weight (`Routing.input_norm`,
`Routing.expert_scale`). With tensor parallelism each rank holds a slice of every expert's intermediate
features and the partial outputs are all-reduced.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pytgi.engine import kernels
from pytgi.engine.distributed import all_reduce, local_range
from pytgi.engine.models.cpu import Kernels
from pytgi.engine.models.layers import ColumnParallelLinear, RowParallelLinear, merged_shards
from pytgi.engine.models.quant import GROUP

if TYPE_CHECKING:
    from pytgi.engine.loading.checkpoints import Mxfp4, Mxfp4Experts
    from pytgi.engine.loading.gguf import GGUFWeights, Grid
    from pytgi.engine.models.quant import QuantizedWeight

# checkpoint names of one expert's weights: Mixtral's w1 / w3 / w2, or gate_proj / up_proj / down_proj
_EXPERT = re.compile(r"experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True, slots=True)
class Routing:
    """How a router's logits become each token's (expert, weight) pairs, beyond the softmax top-k
    (`route`): the score function, DeepSeek-V3's correction bias (`e_score_correction_bias`, a checkpoint
    tensor added to the scores to choose the experts, never to weigh them), grouped selection (the
    experts split in `n_group` equal groups; only the `topk_group` best groups' experts may be chosen,
    a group scored by the sum of its two best corrected scores, or by its best score with
    `group_score` "max": DeepSeek-V2's group_limited_greedy) and `scale` (routed_scaling_factor) on the
    weights after any renormalization. Gemma 4's router (`input_norm`) reads its input RMS-normed
    (no weight), times a learned `router_scale` [H] and 1/√H, and (`expert_scale`) multiplies each
    chosen expert's weight by that expert's learned `per_expert_scale` after the renormalization.
    Mixtral's, Qwen's: the default."""

    scoring: str = "softmax"  # "softmax" | "sigmoid"
    correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2"  # "top2" | "max"
    scale: float = 1.0
    input_norm: bool = False
    expert_scale: bool = False
    # added to the chosen weights' sum where they are renormalized (LFM2-MoE's router adds 1e-6)
    norm_eps: float = 1e-20

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid") or self.group_score not in ("top2", "max"):
            raise ValueError(f"unknown routing {self}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"routing: topk_group {self.topk_group} of n_group {self.n_group}")

    @property
    def plain(self) -> bool:
        """The softmax top-k alone (that moe.c's router computes)."""
        return self == Routing()


def route(
    logits: torch.Tensor,
    routing: Routing,
    top_k: int,
    norm_topk: bool,
    bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → each token's (float32 weights, experts), both [T, top_k]: the scores
    (softmax or sigmoid, float32), plus `bias` [E] to choose; within the best groups where the experts
    are grouped; the chosen experts' uncorrected scores, renormalized to sum 1 with `norm_topk`, times
    `routing.scale`, times each chosen expert's `expert_scale` [E] where given (Gemma 4)."""
    scores = logits.float().softmax(dim=-1) if routing.scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if routing.n_group > 1:
        T, E, G = len(choice), choice.shape[-1], routing.n_group
        groups = choice.view(T, G, E // G)
        best = groups.topk(2, dim=-1).values.sum(-1) if routing.group_score == "top2" else groups.amax(-1)
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, best.topk(routing.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + routing.norm_eps)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    if expert_scale is not None:
        weights = weights * expert_scale.float()[experts]
    return weights, experts


class Router(nn.Linear):
    """The router's linear [E, H], with the correction bias [E] where its routing has one (the
    checkpoint's `gate.e_score_correction_bias`): kept in float32 whatever the model's dtype, as
    transformers keeps it (its values differ in the third or fourth digit: bf16 would change the
    choices)."""

    def __init__(self, hidden: int, num_experts: int, bias: bool, correction_bias: bool) -> None:
        super().__init__(hidden, num_experts, bias=bias)
        self.e_score_correction_bias: nn.Parameter | None = None
        if correction_bias:
            zeros = torch.zeros(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(zeros, requires_grad=False)
        self.requires_grad_(False)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` / `.to(device)`: the correction bias moves but stays float32."""
        held = None if self.e_score_correction_bias is None else self.e_score_correction_bias.data
        super()._apply(fn, recurse)
        if held is not None and self.e_score_correction_bias is not None:
            device = self.e_score_correction_bias.device
            self.e_score_correction_bias.data = held.to(device=device, dtype=torch.float32)
        return self


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        shards = merged_shards([inter] * 2)
        self.gate_up_proj = ColumnParallelLinear(hidden, shards)
        self.down_proj = RowParallelLinear(shards[0], hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class PlainSharedExpert(nn.Module):
    """A shared expert without a gate: down(relu(up(x))²) (Nemotron-H's)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        shard = local_range(inter)
        self.up_proj = ColumnParallelLinear(hidden, [shard])
        self.down_proj = RowParallelLinear(shard, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        norm_topk: bool,
        shared_inter: int | None = None,
        oai: tuple[float, float] | None = None,
        routing: Routing | None = None,
        shared_gate: bool = True,
        activation: str = "silu",
        router_eps: float = 1e-6,
    ) -> None:
        """oai: gpt-oss's experts, (alpha, limit) of its clamped SwiGLU; routing: the router's rule
        beyond softmax top-k (`Routing`); shared_gate: the shared expert's output is scaled by a
        sigmoid gate (Qwen2-MoE's `shared_expert_gate`), else added as it is (DeepSeek's
        `shared_experts`, one MLP of n_shared_experts × the experts' size); activation: the experts'
        act(gate) · up, "silu" (SwiGLU) or "gelu_tanh" (Gemma 4's: in moe.c where packed, routed
        here), or "relu2": experts without a gate, relu(up)² (Nemotron-H's: in moe.c where packed,
        routed here; its shared expert as plain); router_eps: the epsilon of the router's input norm
        (`Routing.input_norm`)."""
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = num_experts, top_k, norm_topk
        self.routing = routing or Routing()
        if activation not in ("silu", "gelu_tanh", "relu2"):
            raise ValueError(f"unknown experts' activation {activation!r}")
        if oai is not None and (not self.routing.plain or activation != "silu"):
            raise ValueError("gpt-oss's experts route by their softmaxed top-k logits only")
        self.activation, self.router_eps = activation, router_eps
        if num_experts % self.routing.n_group:
            raise ValueError(f"{num_experts} experts do not split in {self.routing.n_group} groups")
        self.start, self.local = local_range(inter)
        self.inter, self.oai = inter, oai
        # the router, on every rank
        self.gate = Router(hidden, num_experts, oai is not None, self.routing.correction_bias)
        # Gemma 4's router: the scale [H] on its normed input, each expert's scale [E] on its weight
        self.router_scale: nn.Parameter | None = None
        self.per_expert_scale: nn.Parameter | None = None
        if self.routing.input_norm:
            self.router_scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        if self.routing.expert_scale:
            self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.gated = activation != "relu2"  # else `gate_up` holds each expert's up rows alone
        parts = 2 if self.gated else 1
        self.gate_up = nn.Parameter(torch.empty(num_experts, parts * self.local, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, self.local), requires_grad=False)
        self.gate_up_bias: nn.Parameter | None = None  # [E, 2 * local]: this rank's gate | up
        self.down_bias: nn.Parameter | None = None  # [E, H]: added once, after the all-reduce
        if oai is not None:
            self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * self.local), requires_grad=False)
            self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False)
        # per expert, gate|up and down packed (`pack_experts`)
        self.packed: list[tuple[QuantizedWeight, QuantizedWeight]] = []
        self.fused: kernels.PackedExperts | None = None  # the same, for moe.c
        self._mxfp4: dict[str, Mxfp4] = {}  # the first of a pair of MXFP4 tensors while the other is read
        self.shared_expert: SharedExpert | PlainSharedExpert | None = None
        if shared_inter:
            self.shared_expert = (SharedExpert if self.gated else PlainSharedExpert)(hidden, shared_inter)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_inter and shared_gate else None

    def load_experts(self, name: str, tensor: torch.Tensor | Mxfp4) -> list[str]:
        """Copy an expert checkpoint tensor (one expert's, or all stacked) into this rank's slice;
        returns the parameters it wrote to."""
        s, n = self.start, self.local
        if self.oai is not None:
            return self._load_oai(name, tensor)
        assert isinstance(tensor, torch.Tensor), f"{name}: MXFP4 experts are gpt-oss's only"
        if not self.gated:  # up alone: one expert's [I, H], or stacked [E, I, H]
            if name == "experts.up_proj":
                self.gate_up.data.copy_(tensor[:, s : s + n])
                return ["gate_up"]
            m = _EXPERT.match(name)
            if m is not None and m.group(2) == "up_proj":
                self.gate_up.data[int(m.group(1))].copy_(tensor[s : s + n])
                return ["gate_up"]
        if name == "experts.gate_up_proj":  # stacked [E, 2I, H]
            self.gate_up.data[:, :n].copy_(tensor[:, s : s + n])
            self.gate_up.data[:, n:].copy_(tensor[:, self.inter + s : self.inter + s + n])
            return ["gate_up"]
        if name == "experts.down_proj":  # stacked [E, H, I]
            self.down.data.copy_(tensor[:, :, s : s + n])
            return ["down"]
        if name in ("experts.gate_proj", "experts.up_proj"):  # stacked [E, I, H] apart (from GGUF files)
            half = 0 if name == "experts.gate_proj" else n
            self.gate_up.data[:, half : half + n].copy_(tensor[:, s : s + n])
            return ["gate_up"]
        m = _EXPERT.match(name)
        if m is None:
            raise ValueError(f"unexpected expert weight {name!r}")
        e, kind = int(m.group(1)), m.group(2)
        if kind in ("w2", "down_proj"):
            self.down.data[e].copy_(tensor[:, s : s + n])
            return ["down"]
        half = 0 if kind in ("w1", "gate_proj") else n
        self.gate_up.data[e, half : half + n].copy_(tensor[s : s + n])
        return ["gate_up"]

    def _load_oai(self, name: str, tensor: torch.Tensor | Mxfp4) -> list[str]:
        """gpt-oss's stacked tensors: gate_up [E, H, 2I] and its bias [E, 2I] (gate and up interleaved),
        down [E, I, H] and its bias [E, H]; or, from a GGUF file, `experts.{gate,up}_proj.weight`
        [E, I, H] and `.bias` [E, I] apart, `experts.down_proj.weight` [E, H, I] and `.bias` [E, H].
        MXFP4 weights (`checkpoints.Mxfp4`) are packed as they are where the source says so (`pack`) and
        this rank's slice falls on whole groups, else dequantized."""
        from pytgi.engine.loading.checkpoints import Mxfp4, Mxfp4Experts, dequantize_mxfp4

        s, n = self.start, self.local
        assert self.gate_up_bias is not None and self.down_bias is not None
        if isinstance(tensor, Mxfp4):
            hidden = self.down.shape[1]
            if tensor.pack is None or s % GROUP or n % GROUP or hidden % 16:
                tensor = dequantize_mxfp4(tensor.blocks, tensor.scales, self.gate_up.dtype)
            else:
                self._mxfp4[name] = tensor
                if len(self._mxfp4) == 2:  # both read: packed, a slice of rows at a time
                    held, self._mxfp4 = self._mxfp4, {}
                    experts = Mxfp4Experts(held["experts.gate_up_proj"], held["experts.down_proj"])
                    act_dtype, cpu = tensor.pack
                    self.pack_experts(experts, ["gate", "up", "down"], ("mxfp4", "mxfp4"), act_dtype, cpu)
                return ["gate_up" if name == "experts.gate_up_proj" else "down"]
        if name.startswith(("experts.gate_proj.", "experts.up_proj.")):
            half = 0 if name.startswith("experts.gate_proj.") else n
            dst = self.gate_up if name.endswith(".weight") else self.gate_up_bias
            dst.data[:, half : half + n].copy_(tensor[:, s : s + n])
            return ["gate_up" if name.endswith(".weight") else "gate_up_bias"]
        if name == "experts.down_proj.weight":
            self.down.data.copy_(tensor[:, :, s : s + n])
            return ["down"]
        if name == "experts.down_proj.bias":
            name = "experts.down_proj_bias"
        if name in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
            t = tensor.transpose(1, 2) if name == "experts.gate_up_proj" else tensor  # [E, 2I(, H)]
            gate, up = t[:, 0::2][:, s : s + n], t[:, 1::2][:, s : s + n]
            dst = self.gate_up if name == "experts.gate_up_proj" else self.gate_up_bias
            dst.data[:, :n].copy_(gate)
            dst.data[:, n:].copy_(up)
            return ["gate_up" if name == "experts.gate_up_proj" else "gate_up_bias"]
        if name == "experts.down_proj":
            self.down.data.copy_(tensor.transpose(1, 2)[:, :, s : s + n])
            return ["down"]
        if name == "experts.down_proj_bias":
            self.down_bias.data.copy_(tensor)
            return ["down_bias"]
        raise ValueError(f"unexpected expert weight {name!r}")

    def pack_experts(
        self,
        weights: GGUFWeights | Mxfp4Experts,
        names: list[str],
        kinds: tuple[str, str],
        act_dtype: torch.dtype,
        cpu: Kernels,
    ) -> None:
        """Keep the experts packed for the low-bit kernels, as a GGUF file's blocks hold them
        (`pytgi.engine.models.quant.grid_layout`): per expert, this rank's slice of gate|up in `kinds[0]`'s
        layout and of down in `kinds[1]`'s, read from `weights` (`GGUFWeights`; `names`: the stacked
        gate, up and down tensors; gate and up one name where they are stacked together, [E, 2I, H] as
        Gemma 4's and Mistral 4's `ffn_gate_up_exps`; experts without a gate, up alone). Every step then
        multiplies by the packed weights."""
        from pytgi.engine.models.quant import (
            Layout,
            LayoutRows,
            QuantizedWeight,
            five_bit,
            grid_layout,
            six_bit,
        )

        gate, up, down = names
        s, n, inter = self.start, self.local, self.inter
        hidden = weights.shape(down)[1]

        def grid(name: str, start: int, stop: int) -> Grid:
            rows = weights.grid(name, start, stop)
            assert rows is not None, f"{name}: not on a grid the low-bit kernels take"
            return rows

        def gate_up(e: int) -> Iterator[Layout]:  # this rank's rows of expert e's gate, then up
            if not self.gated:  # up alone (relu² experts)
                yield grid_layout(grid(up, e * inter + s, e * inter + s + n), kinds[0])
                return
            if gate == up:  # one tensor: expert e's gate rows, then its up rows
                starts = [e * 2 * inter + s, e * 2 * inter + inter + s]
            else:
                starts = [e * inter + s] * 2
            for name, start in zip((gate, up), starts):
                yield grid_layout(grid(name, start, start + n), kinds[0])

        def down_rows(e: int) -> Iterator[Layout]:  # expert e's rows, this rank's columns
            yield grid_layout(grid(down, e * hidden, (e + 1) * hidden).cols(s, n), kinds[1])

        types = getattr(weights, "type_name", None)  # a GGUF file's (a checkpoint's MXFP4 pairs have none)
        six = [types is not None and six_bit(map(types, ts)) for ts in ((gate, up), (down,))]
        five = [types is not None and five_bit(map(types, ts)) for ts in ((gate, up), (down,))]
        self.packed = []
        for e in range(self.num_experts):
            pair = (
                QuantizedWeight(
                    kinds[0],
                    LayoutRows(((2 if self.gated else 1) * n, hidden), partial(gate_up, e), six[0], five[0]),
                    act_dtype,
                    cpu,
                ),
                QuantizedWeight(
                    kinds[1], LayoutRows((hidden, n), partial(down_rows, e), six[1], five[1]), act_dtype, cpu
                ),
            )
            for w in pair:
                w.dequantized = torch.empty(0)  # the packed weight serves every step here
            self.packed.append(pair)
        self.gate_up = nn.Parameter(torch.empty(0, dtype=act_dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(0, dtype=act_dtype), requires_grad=False)
        self.fuse()

    def pack_bf16(self, cpu: Kernels) -> None:
        """A bf16 model's float experts on bf16gemm.c, one expert's gate|up and down at a time (as
        the model's linears run: the same rows whatever the step, `pytgi.engine.models.quant`)."""
        from pytgi.engine.models.quant import QuantizedWeight

        dtype = self.gate_up.dtype
        self.packed = []
        for e in range(self.num_experts):
            pair = (
                QuantizedWeight("bf16", self.gate_up.data[e], dtype, cpu),
                QuantizedWeight("bf16", self.down.data[e], dtype, cpu),
            )
            for w in pair:
                w.dequantized = torch.empty(0)  # the packed weight serves every step
            self.packed.append(pair)
        self.gate_up = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def fuse(self) -> None:
        """Where every expert is packed for pytgi's low-bit kernel, hand them to one C call (moe.c;
        Gemma 4's GELU experts and Nemotron-H's relu² ones there too, routed here: `moe_experts`)."""
        if self.packed and all(w.vnni for pair in self.packed for w in pair):
            gu, dn = zip(*self.packed)

            self.fused = kernels.PackedExperts(
                gate_up=np.array([w.packed.data_ptr() for w in gu], dtype=np.int64),
                down=np.array([w.packed.data_ptr() for w in dn], dtype=np.int64),
                bits_gu=np.array([w.bits for w in gu], dtype=np.int64),
                bits_down=np.array([w.bits for w in dn], dtype=np.int64),
                inter=gu[0].shape[0] // (2 if self.gated else 1),
                amx_above=min(w.vnni_max_m for pair in self.packed for w in pair),
                oai=self.oai,
                activation=self.activation if self.gated else "relu2",
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (float32 weights, experts), [T, top_k]: the router's logits in float32 where
        the routing is more than softmax top-k (its choice by sigmoid scores and biases is sensitive),
        in the model's dtype otherwise (as moe.c's are). Gemma 4's router input (`input_norm`): x
        RMS-normed in float32, times `router_scale` and 1/√H."""
        if self.oai is not None:  # the chosen logits softmaxed (= the renormalized softmax)
            logits, experts = self.gate(x).float().topk(self.top_k, dim=-1)
            return logits.softmax(dim=-1), experts
        if self.routing.plain:
            logits = F.linear(x, self.gate.weight)
        else:
            h = x.float()
            if self.router_scale is not None:
                h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.router_eps)
                h = h * self.router_scale.float() * h.shape[-1] ** -0.5
            logits = F.linear(h, self.gate.weight.float())
        bias, scale = self.gate.e_score_correction_bias, self.per_expert_scale
        return route(logits, self.routing, self.top_k, self.norm_topk, bias, scale)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """x: the experts' input; router_input: the router's, where it differs (Gemma 4's router reads
        the residual stream, its experts their own norm of it)."""
        if router_input is not None:
            return self._routed(x, *self.route(router_input))
        if (
            self.fused is not None
            and x.dtype == self.gate.weight.dtype == torch.bfloat16
            and not self.routing.plain
        ):  # routed here, the experts in moe.c
            weights, experts = self.route(x)
            routed = kernels.moe_experts(x.contiguous(), self.fused, experts, weights)
            return self._shared(x, all_reduce(routed))
        bf16 = x.dtype == self.gate.weight.dtype == torch.bfloat16
        if self.fused is not None and bf16 and self.fused.activation == "silu":  # all in moe.c (SwiGLU)
            biases = None
            if self.oai is not None:  # gpt-oss's (the down bias in the first rank's part of the sum alone)
                assert self.gate_up_bias is not None and self.down_bias is not None
                biases = (self.gate.bias, self.gate_up_bias, self.down_bias if self.start == 0 else None)
            routed = kernels.moe(
                x.contiguous(), self.fused, self.gate.weight, self.top_k, self.norm_topk, biases
            )
            return self._shared(x, all_reduce(routed))
        return self._routed(x, *self.route(x))

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts' weighted outputs for the tokens `x` routed to `experts` with `weights` ([T, k])."""
        if (
            self.fused is not None
            and x.dtype == self.gate.weight.dtype == torch.bfloat16
            and self.oai is None
        ):
            routed = kernels.moe_experts(x.contiguous(), self.fused, experts, weights)
            return self._shared(x, all_reduce(routed))
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        xs = x[order // self.top_k]  # each (token, expert) pair's input, grouped by expert
        ys = []
        at = 0
        for e, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            xe = xs[at : at + count]
            h = self.packed[e][0].matmul(xe) if self.packed else F.linear(xe, self.gate_up[e])
            if self.gate_up_bias is not None:
                h = h + self.gate_up_bias[e]
            h = self._act(h)
            ys.append(self.packed[e][1].matmul(h) if self.packed else F.linear(h, self.down[e]))
            at += count
        # back in (token, choice) order, then each token's k outputs weighted and summed in float32
        y = torch.cat(ys)[order.argsort()].view(len(x), self.top_k, -1).float()
        out = all_reduce((y * weights[..., None]).sum(dim=1).to(x.dtype))
        if self.down_bias is not None:  # each chosen expert's bias, weighted, once (not per rank)
            out = out + (self.down_bias[experts].float() * weights[..., None]).sum(dim=1).to(x.dtype)
        return self._shared(x, out)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """gate | up → the experts' activation: SwiGLU, GELU(tanh)·up (Gemma 4), or gpt-oss's clamped one;
        up → relu(up)² for experts without a gate."""
        if not self.gated:
            return F.relu(h).square()
        gate, up = h.chunk(2, dim=-1)
        if self.oai is None:
            return (F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")) * up
        alpha, limit = self.oai
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def _shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' output plus the shared expert's, where the model has one."""
        if self.shared_expert is None:
            return out
        if self.shared_expert_gate is None:
            return out + self.shared_expert(x)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
