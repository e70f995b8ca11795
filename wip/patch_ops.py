def sub(p, old, new, count=1):
    s=open(p).read()
    assert old in s, (p, old)
    s=s.replace(old,new,count); open(p,'w').write(s)
p='pytgi/models/cpu.py'
s=open(p).read()
a=s.index('class TorchOps:')
b=s.index('def _rotate(attn')
s=s[:a]+'''class TorchOps:
    """The element-wise steps of a decoder layer in PyTorch ops."""

    def rope_tables(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        return rotary(positions, dtype)  # cos, signed sin: [T, 1, D] in the model's dtype

    def add_norm(
        self, y: torch.Tensor | None, residual: torch.Tensor, norm, out_norm=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual + y, `norm` of it): y None: no add; `out_norm`: y is normed before the add
        (Gemma's sandwich); `norm` None: no norm after."""
        if y is not None:
            residual = residual + (y if out_norm is None else out_norm(y))
        return residual, None if norm is None else norm(residual)

    def act_mul(self, activation: str, gate_up: torch.Tensor) -> torch.Tensor:
        """activation(gate) * up, for gate_up = [gate | up]: "silu" or "gelu_tanh"."""
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up

    def qkv_rotary(self, attn, qkv: torch.Tensor, rope, kv_cache, meta):
        """q [T, H, D] and k, v [T, KVH, D] with the rotary embedding applied; k, v are None when
        they are already in their cache slots."""
        return _rotate(attn, qkv, *rope)


class KernelOps(TorchOps):
    """The same steps with the fused C kernels: each residual add shares a pass with the norms around
    it, and rope writes k and v straight into the cache."""

    def rope_tables(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        return rotary.cos[positions].float(), rotary.sin[positions].float()  # float32 [T, D]

    def add_norm(
        self, y: torch.Tensor | None, residual: torch.Tensor, norm, out_norm=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual = residual.contiguous()  # updated in place from here on
        if out_norm is not None or (norm is not None and norm.offset):  # Gemma's float32 1 + w scales
            eps = (norm if norm is not None else out_norm).eps
            scales = (n.scale() if n is not None else None for n in (out_norm, norm))
            return residual, kernels.norm_add_norm(y, residual, *scales, eps)
        return residual, kernels.add_rms_norm(y, residual, norm.weight, norm.eps)

    def act_mul(self, activation: str, gate_up: torch.Tensor) -> torch.Tensor:
        if activation == "silu":
            return kernels.silu_mul(gate_up)
        return kernels.gelu_tanh_mul(gate_up.contiguous())

    def qkv_rotary(self, attn, qkv: torch.Tensor, rope, kv_cache, meta):
        if attn.q_norm is not None and not attn.q_norm.offset:  # Qwen3's q/k norms: PyTorch's rotation
            cos, sin = (t.unsqueeze(1).to(qkv.dtype) for t in rope)
            return _rotate(attn, qkv, cos, sin)
        qkv = qkv.contiguous()
        H, KVH, D = attn.n_heads, attn.n_kv, attn.head_dim
        if attn.q_norm is not None:  # Gemma 3's, in place
            kernels.qk_norm_(qkv, attn.q_norm.scale(), attn.k_norm.scale(), H, KVH, D, attn.q_norm.eps)
        cos, sin = rope
        q = kernels.rope_write_kv(qkv, cos, sin, meta.slot_mapping, kv_cache[0], kv_cache[1], H, KVH, D)
        return q, None, None


'''+s[b:]
open(p,'w').write(s)
p='pytgi/models/layers.py'
sub(p,'''class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the dtype, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
''','''class RMSNorm(nn.Module):
    """x / rms(x), computed in float32 whatever the dtype, times `weight` in the model's dtype; with
    `offset` (Gemma, whose weights are offsets from 1) times `1 + weight`, in float32, then cast."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def scale(self) -> torch.Tensor:
        """`1 + weight` in float32, what the fused kernels multiply an offset norm by (made once per
        weight)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_scale_key", None) != key:
            self._scale, self._scale_key = (1.0 + self.weight.detach().float()).contiguous(), key
        return self._scale
''')
p='pytgi/models/loader.py'
sub(p,'''from pytgi.models.gemma import Gemma3Config, Gemma3ForCausalLM
from pytgi.models.llama import SUPPORTED_ARCHITECTURES as LLAMA_ARCHITECTURES
from pytgi.models.llama import LlamaConfig, LlamaForCausalLM
''','''from pytgi.models.decoder import DecoderConfig, DecoderModel
from pytgi.models.gemma import gemma_config
from pytgi.models.llama import SUPPORTED_ARCHITECTURES as LLAMA_ARCHITECTURES
from pytgi.models.llama import llama_config
''')
s=open(p).read()
a=s.index('# architecture → (its config, its model)')
b=s.index('SUPPORTED_ARCHITECTURES = tuple(MODELS)')
s=s[:a]+'''# architecture → its config.json read as a `DecoderConfig` (every family runs on `DecoderModel`)
MODELS: dict[str, Callable[[dict[str, Any]], DecoderConfig]] = {
    **{arch: llama_config for arch in LLAMA_ARCHITECTURES},
    "Gemma3ForCausalLM": gemma_config,
    "Gemma2ForCausalLM": gemma_config,  # Gemma 3's layers, without q/k norms, soft-capped
}
'''+s[b:]
s=s.replace('''    config_cls, model_cls = MODELS[hf["architectures"][0]]
    cfg = config_cls.from_hf(hf)''','''    cfg = MODELS[hf["architectures"][0]](hf)''')
s=s.replace('''        model = model_cls(cfg, cpu, attention)''','''        model = DecoderModel(cfg, cpu, attention)''')
s=s.replace('from collections.abc import Iterator\n','from collections.abc import Callable, Iterator\n')
open(p,'w').write(s)
