"""Encoders for embeddings: BERT, RoBERTa and XLM-RoBERTa (post-norm layers, learned absolute
positions, bidirectional attention), over a step's prompts laid out flat, and their pooling.

No KV cache: an encoder's prompt is computed in one step and only its pooled vector (or its tokens'
states) leaves the step. Batch invariance (docs/batch-invariance.md) holds bit for bit: the
element-wise and per-row steps (embeddings, LayerNorm, GELU) see each row alone, attention runs per
prompt, and each linear runs per prompt too in float32 (a GEMM's rows change with its M in oneDNN
and MKL), so a prompt's vector does not depend on the other prompts of its step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytgi.core.errors import UnsupportedModel
from pytgi.core.families import family_of
from pytgi.core.pooling import PoolingInfo
from pytgi.core.protocol import PoolParams
from pytgi.engine import kernels

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def per_prompt(lin: nn.Linear, x: torch.Tensor, lens: list[int], bias: bool = True) -> torch.Tensor:
    """A linear on each prompt's rows alone (so its rows' bits are its own, whatever the step: a GEMM's
    rows change with its M), written in place into one output. `bias=False`: its bias left to the next
    step (a fused kernel adds it)."""
    out = x.new_empty(x.shape[0], lin.out_features)
    w, at = lin.weight.t(), 0
    for n in lens:
        rows = x[at : at + n]
        if lin.bias is None or not bias:
            torch.mm(rows, w, out=out[at : at + n])
        else:
            torch.addmm(lin.bias, rows, w, out=out[at : at + n])
        at += n
    return out


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int, eps: float, act: str) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, inter)
        self.down = nn.Linear(inter, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps)
        self.act: Callable[[torch.Tensor], torch.Tensor] = ACTIVATIONS[act]
        self.gelu = act == "gelu"

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        ctx = self.attention(per_prompt(self.qkv, x, lens), lens)
        if x.dtype == torch.bfloat16 and kernels.available():
            return self._fused(x, ctx, lens)
        x = self.attn_norm(per_prompt(self.o, ctx, lens) + x)
        h = self.act(per_prompt(self.up, x, lens))
        return self.ffn_norm(per_prompt(self.down, h, lens) + x)

    def _fused(self, x: torch.Tensor, ctx: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """bf16: the biases, GELU, residuals and LayerNorms in pytgi's kernels, one pass each (PyTorch
        takes five: the bias copied into each linear's output, GELU, add, LayerNorm)."""
        x = kernels.bias_residual_norm(
            per_prompt(self.o, ctx, lens, bias=False), self.o.bias, x, self.attn_norm
        )
        if self.gelu:
            h = kernels.bias_gelu_(per_prompt(self.up, x, lens, bias=False), self.up.bias)
        else:
            h = self.act(per_prompt(self.up, x, lens))
        return kernels.bias_residual_norm(
            per_prompt(self.down, h, lens, bias=False), self.down.bias, x, self.ffn_norm
        )

    def attention(self, qkv: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Each prompt's bidirectional attention over its own rows: [T, 3·hidden] → [T, hidden]. pytgi's
        kernel where this build has one for the dtype and head size (2.4× PyTorch's flash kernel in
        bf16 on AVX-512 BF16, all-MiniLM-L6-v2's shapes), else SDPA."""
        if kernels.encoder_attention_supported(qkv.dtype, self.head_dim):
            scale = 1.0 / math.sqrt(self.head_dim)
            return torch.cat([kernels.encoder_attention(part, self.heads, scale) for part in qkv.split(lens)])
        return torch.cat([self._attend(part) for part in qkv.split(lens)])

    def _attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """One prompt's attention by PyTorch's SDPA: [L, 3·hidden] → [L, hidden]."""
        L = qkv.shape[0]
        q, k, v = qkv.view(1, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 4-D: the flash kernel
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim))
        return out[0].transpose(0, 1).reshape(L, -1)


class ClassifierHead(nn.Module):
    """A cross-encoder's head on the first token's state: dense + tanh, then the labels' logits (BERT's
    pooler + classifier and RoBERTa's classification head are this one shape)."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        """[hidden] → [num_labels], one prompt's row alone (an M of 1, whatever the step)."""
        return self.out(torch.tanh(self.dense(first[None])))[0]


class EncoderModel(nn.Module):
    """BERT's layout (RoBERTa's too: its positions start after the padding id), and a cross-encoder's
    head where the architecture has one."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        arch = (cfg.get("architectures") or ["?"])[0]
        family = family_of(arch)
        if family is None or family.module != "encoder":  # (ModernBERT's is modernbert.py)
            raise UnsupportedModel(f"architecture {arch!r} is not one of BERT's or RoBERTa's encoders")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModel(
                f"position_embedding_type {cfg['position_embedding_type']!r}: only absolute"
            )
        act = cfg.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedModel(f"hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        hidden, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        self.hidden_size = hidden
        # RoBERTa numbers positions from padding_idx + 1 (its position table has those rows more)
        self.position_offset = cfg.get("pad_token_id", 1) + 1 if "Roberta" in arch else 0
        self.max_positions = cfg["max_position_embeddings"] - self.position_offset
        self.word = nn.Embedding(cfg["vocab_size"], hidden)
        self.position = nn.Embedding(cfg["max_position_embeddings"], hidden)
        self.segments = max(cfg.get("type_vocab_size", 1), 1)  # token types: a pair's two texts where 2
        self.token_type = nn.Embedding(self.segments, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            EncoderLayer(hidden, cfg["num_attention_heads"], cfg["intermediate_size"], eps, act)
            for _ in range(cfg["num_hidden_layers"])
        )
        labels = cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2
        self.head = ClassifierHead(hidden, labels) if arch in family.classifiers else None

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, lens: list[int], types: torch.Tensor | None = None) -> torch.Tensor:
        """The prompts' tokens flat ([T] ids, `lens` per prompt; `types`: each token's segment, a
        pair's second text 1) → their last hidden states [T, hidden]."""
        positions = torch.cat([torch.arange(n) for n in lens]) + self.position_offset
        segment = self.token_type.weight[0] if types is None else self.token_type(types)
        x = self.word(ids) + segment + self.position(positions)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, lens)
        return x

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
        """A cross-encoder's logits per prompt, from its first token's state (float32)."""
        assert self.head is not None
        starts = [0, *itertools.accumulate(lens)][:-1]
        return [self.head(hidden[s]).float() for s in starts]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A transformers checkpoint's names (`bert.` / `roberta.` prefixes and old gamma/beta included);
        the pooler is read only for a cross-encoder's head (BERT's is its first half)."""
        copy_weights(self, _fused(_renamed(tensors)))


def copy_weights(model: nn.Module, named: Iterable[tuple[str | None, torch.Tensor]]) -> None:
    """Each (name, tensor) into the model's parameter of that name (None: not the model's); every
    parameter must be given, at its shape."""
    own = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, t in named:
        if name is None or name not in own:
            continue
        if own[name].shape != t.shape:
            raise UnsupportedModel(
                f"weight {name}: shape {tuple(t.shape)}, expected {tuple(own[name].shape)}"
            )
        with torch.no_grad():
            own[name].copy_(t)
        loaded.add(name)
    missing = sorted(set(own) - loaded)
    if missing:
        raise UnsupportedModel(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


def _fused(named: Iterable[tuple[str | None, torch.Tensor]]) -> Iterator[tuple[str | None, torch.Tensor]]:
    """q, k and v (tagged `#q` ...) concatenated into one tensor once all three came."""
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        if name is None or not name.endswith(("#q", "#k", "#v")):
            yield name, t
            continue
        key, part = name[:-2], name[-1]
        qkv.setdefault(key, {})[part] = t
        if len(qkv[key]) == 3:
            parts = qkv.pop(key)
            yield key, torch.cat([parts["q"], parts["k"], parts["v"]])


_LAYER_NAMES = {
    "attention.output.dense": "o",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "ffn_norm",
}
# BERT's pooler + classifier, RoBERTa's classification head
_HEAD_NAMES = {
    "pooler.dense": "dense",
    "classifier": "out",
    "classifier.dense": "dense",
    "classifier.out_proj": "out",
}
_EMBED_NAMES = {
    "word_embeddings": "word",
    "position_embeddings": "position",
    "token_type_embeddings": "token_type",
    "LayerNorm": "embed_norm",
}


def _renamed(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str | None, torch.Tensor]]:
    """A checkpoint's names → this module's (q, k and v tagged `#q` ... to be fused); None: not ours."""
    for name, t in tensors:
        for prefix in ("bert.", "roberta."):
            name = name.removeprefix(prefix)
        name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
        module, _, leaf = name.rpartition(".")
        if module in _HEAD_NAMES:
            yield f"head.{_HEAD_NAMES[module]}.{leaf}", t
            continue
        if module.startswith("embeddings."):
            new = _EMBED_NAMES.get(module.removeprefix("embeddings."))
            yield (None if new is None else f"{new}.{leaf}"), t
            continue
        if not module.startswith("encoder.layer."):
            yield None, t
            continue
        index, _, rest = module.removeprefix("encoder.layer.").partition(".")
        if rest.startswith("attention.self."):
            part = {"query": "q", "key": "k", "value": "v"}.get(rest.removeprefix("attention.self."))
            yield (None if part is None else f"layers.{index}.qkv.{leaf}#{part}"), t
            continue
        new = _LAYER_NAMES.get(rest)
        yield (None if new is None else f"layers.{index}.{new}.{leaf}"), t


def pool(hidden: torch.Tensor, lens: list[int], pooling: PoolingInfo) -> list[torch.Tensor]:
    """Each prompt's vector [hidden], float32, from its rows alone."""
    out = []
    for h in hidden.split(lens):
        if pooling.method == "cls":
            v = h[0]
        elif pooling.method == "last":
            v = h[-1]
        else:
            v = h.float().sum(0) / h.shape[0]
        out.append(v.float())
    return out


def embedding(v: torch.Tensor, pooling: PoolingInfo, params: PoolParams) -> torch.Tensor:
    """A pooled vector as a request (`PoolParams`) asks for it: cut to its `dimensions`, normalized
    unless it says otherwise (None: the model's own Normalize module decides)."""
    normalize = pooling.normalize if params.normalize is None else params.normalize
    return finish(v, normalize, params.dimensions)


def finish(v: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka's cut (the first `dimensions` values), then the L2 normalization: a shortened
    vector is a unit vector again, as OpenAI's `dimensions` and TEI's are."""
    if dimensions is not None:
        v = v[..., :dimensions]
    if normalize:
        v = F.normalize(v, p=2.0, dim=-1)
    return v
