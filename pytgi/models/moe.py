"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

Each token goes to its `top_k` experts by a softmax router (renormalized over the chosen ones when
the model says so) and gets their SwiGLU outputs, weighted. The experts' weights are stacked, gate and
up fused (`gate_up [E, 2I, H]`, `down [E, H, I]`), and a step runs one pair of matmuls per expert that
has tokens: tokens are grouped by expert once, not visited one by one. Qwen2-MoE adds a shared expert,
scaled by a sigmoid gate. With tensor parallelism each rank holds a slice of every expert's
intermediate features and the partial outputs are all-reduced.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pytgi.distributed import all_reduce, local_range
from pytgi.models.layers import ColumnParallelLinear, RowParallelLinear, merged_shards

# checkpoint names of one expert's weights: Mixtral's w1 / w3 / w2, or gate_proj / up_proj / down_proj
_EXPERT = re.compile(r"experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        shards = merged_shards([inter] * 2)
        self.gate_up_proj = ColumnParallelLinear(hidden, shards)
        self.down_proj = RowParallelLinear(shards[0], hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        norm_topk: bool,
        shared_inter: int | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = num_experts, top_k, norm_topk
        self.start, self.local = local_range(inter)
        self.inter = inter
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router, on every rank
        self.gate.weight.requires_grad_(False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, self.local), requires_grad=False)
        self.shared_expert = SharedExpert(hidden, shared_inter) if shared_inter else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_inter else None

    def load_experts(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Copy an expert checkpoint tensor (one expert's, or all stacked) into this rank's slice;
        returns the parameters it wrote to."""
        s, n = self.start, self.local
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.linear(x, self.gate.weight).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, picked = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        at = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            idx = tokens[at : at + count]
            gate, up = F.linear(x[idx], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e])
            out.index_add_(0, idx, (y * picked[at : at + count, None]).to(x.dtype))
            at += count
        out = all_reduce(out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
