"""GPTQ, AWQ, compressed-tensors (every format, with that library's own packer and compressors) and FP8
(block-scaled, HF's `fp8`) checkpoints of a transformers model, written here by each format's published
layout (AutoGPTQ's v1 GPTQ format or GPTQModel's v2, AutoAWQ's GEMM packing;
`pytgi.engine.loading.checkpoints` describes both), with round-to-nearest levels per group, and the float
model that holds exactly their dequantized values (the reference: transformers on the same weights)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] → (levels int32 [N, K], zeros int32 [N, G], scales fp16 [N, G])."""
    N, K = w.shape
    g = w.float().view(N, K // group, group)
    top = (1 << bits) - 1
    if sym:
        scale = (g.abs().amax(-1) / (top // 2)).clamp(min=1e-6).half()
        zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / top).clamp(min=1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(0, top).to(torch.int32)
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(0, top).to(torch.int32)
    return q.view(N, K), zero, scale


def pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] levels → [R / (32 / bits), C]: value r in bits (r mod per)·bits of row r / per."""
    per = 32 // bits
    v = v.to(torch.int64).view(v.shape[0] // per, per, v.shape[1])
    return _int32(sum(v[:, i] << (bits * i) for i in range(per)))


def pack_cols(v: torch.Tensor, bits: int, awq: bool = False) -> torch.Tensor:
    """int32 [R, C] → [R, C / (32 / bits)] packed along the columns (AWQ: in its nibble order)."""
    per = 32 // bits
    v = v.to(torch.int64).view(v.shape[0], v.shape[1] // per, per)
    if awq:  # nibble i holds output ORDER[i]
        v = v[:, :, [0, 2, 4, 6, 1, 3, 5, 7]]
    out = sum(v[:, :, i] << (bits * i) for i in range(per))
    return _int32(out)


def _int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] → (e4m3 [N, K], float32 scales [ceil(N / block), ceil(K / block)], the values they hold):
    each block's largest magnitude maps to 448 (as HF's fp8 checkpoints store them)."""
    N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    padded = torch.zeros(nb * block, kb * block)
    padded[:N, :K] = w.float()
    blocks = padded.view(nb, block, kb, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * block, kb * block)[:N, :K]
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:N, :K]
    return q.contiguous(), scale, q.float() * full


def ct_scheme(fmt: str, bits: int, group: int, sym: bool):
    """compressed-tensors' own scheme for a format: int weights per group (`group` > 0), channel (-1) or
    tensor (0); float (e4m3) weights per channel (-1), tensor (0) or `group` x `group` block. int- and
    float-quantized are W8A8 (dynamic per-token activations), naive- and pack-quantized weight-only."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    float8 = fmt == "float-quantized"
    strategy = "channel" if group == -1 else "tensor" if group == 0 else "block" if float8 else "group"
    kind = "float" if float8 else "int"
    weights = QuantizationArgs(num_bits=bits, type=kind, symmetric=sym, strategy=strategy,
                               group_size=group if strategy == "group" else None,
                               block_structure=[group, group] if strategy == "block" else None)  # fmt: skip
    acts = None
    if fmt in ("int-quantized", "float-quantized"):
        acts = QuantizationArgs(num_bits=8, type=kind, symmetric=True, strategy="token", dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def ct_plain(w: torch.Tensor, fmt: str, bits: int, group: int, sym: bool):
    """One linear as compressed-tensors' own compressor stores it in `fmt` (int- / naive- / float-
    quantized), from scales made here by round to nearest; and the weight its own decompressor gives."""
    from compressed_tensors.compressors import BaseCompressor

    scheme = ct_scheme(fmt, bits, group, sym)
    K = w.shape[1]
    if fmt == "float-quantized":
        if group > 0:
            _, scale, _ = fp8_blocks(w, group)
        else:
            scale = (w.abs().amax(dim=1, keepdim=True) if group == -1 else w.abs().amax().reshape(1)) / 448
        state = {"weight": w.float(), "weight_scale": scale.float()}
    else:
        _, zero, scale = rtn(w, bits, K if group <= 0 else group, sym)
        if group == 0:  # a tensor's scale: the largest row's
            scale, zero = scale.float().amax().reshape(1).half(), zero[:1, 0]
        half = 1 << (bits - 1)
        state = {"weight": w.float(), "weight_scale": scale.float()}
        if not sym:
            state["weight_zero_point"] = (zero - half).to(torch.int8)
    compressor = BaseCompressor.load_from_registry(fmt)
    stored = compressor.compress(dict(state), scheme)
    deq = compressor.decompress(dict(stored), scheme)["weight"].float()
    return {k: v.contiguous() for k, v in stored.items()}, deq


def write(hf, out: Path, method: str, bits: int = 4, group: int = 32, sym: bool = True, fmt: str = "gptq",
          act_order: bool = False):  # fmt: skip
    """Write `hf` (a float transformers model) as a `method` ("gptq" | "awq" | "fp8") checkpoint in
    `out`; return the float model whose linears hold the checkpoint's dequantized values. `act_order`:
    GPTQ's desc_act, its groups made of inputs in a random order (one order per input the linears
    share: q, k, v; gate, up), given by g_idx."""
    ref = copy.deepcopy(hf)
    tensors: dict[str, torch.Tensor] = {}
    quantized = set()
    for name, mod in ref.named_modules():
        if name.rsplit(".", 1)[-1] not in LINEARS:
            continue
        w = mod.weight.data
        if method == "fp8":
            q8, scale8, deq8 = fp8_blocks(w)
            mod.weight.data.copy_(deq8)
            quantized.add(name)
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = q8, scale8
            continue
        if method == "compressed-tensors" and fmt not in ("", "pack-quantized"):
            stored, deq_ct = ct_plain(w, fmt, bits, group, sym)
            mod.weight.data.copy_(deq_ct)
            quantized.add(name)
            tensors.update({f"{name}.{k}": v for k, v in stored.items()})
            continue
        g = w.shape[1] if group == -1 else group
        K = w.shape[1]
        perm = torch.arange(K)
        if act_order:
            stem, last = name.rsplit(".", 1)
            together = dict.fromkeys(("q_proj", "k_proj", "v_proj"), ".qkv") | {"gate_proj": ".gate_up"}
            shared = stem + together.get(last, ".gate_up" if last == "up_proj" else "." + last)
            perm = torch.randperm(K, generator=torch.Generator().manual_seed(sum(map(ord, shared))))
        inv = torch.argsort(perm)
        q, zero, scale = rtn(w[:, perm], bits, g, sym)
        deq = ((q.view(w.shape[0], -1, g) - zero[..., None]).float() * scale.float()[..., None]).view(w.shape)
        q, deq = q[:, inv], deq[:, inv]  # back to the inputs' own order
        mod.weight.data.copy_(deq)
        quantized.add(name)
        if method == "gptq":  # [K/per, N]; zeros stored minus one (v1)
            tensors[f"{name}.qweight"] = pack_rows(q.t().contiguous(), bits)
            stored = zero - 1 if fmt == "gptq" else zero  # v1 keeps the zero minus one
            tensors[f"{name}.qzeros"] = pack_cols(stored.t().contiguous() & ((1 << bits) - 1), bits)
            tensors[f"{name}.scales"] = scale.t().contiguous()
            tensors[f"{name}.g_idx"] = (inv // g).to(torch.int32)  # input k is in group of its rank
        elif method == "compressed-tensors":  # its own packer: signed values, [N, K/per], zeros [N/per, G]
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            half = 1 << (bits - 1)
            tensors[f"{name}.weight_packed"] = pack_to_int32((q - half).to(torch.int8), bits)
            tensors[f"{name}.weight_scale"] = scale.contiguous()
            tensors[f"{name}.weight_shape"] = torch.tensor(list(w.shape))
            if not sym:
                zp = (zero - half).to(torch.int8)
                tensors[f"{name}.weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
        else:  # AWQ: [K, N/8] and [G, N/8]
            tensors[f"{name}.qweight"] = pack_cols(q.t().contiguous(), 4, awq=True)
            tensors[f"{name}.qzeros"] = pack_cols(zero.t().contiguous(), 4, awq=True)
            tensors[f"{name}.scales"] = scale.t().contiguous()
    for name, t in ref.state_dict().items():
        if name.removesuffix(".weight") not in quantized:
            tensors[name] = t.contiguous().clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = ref.config.to_dict() | {"architectures": [type(ref).__name__]}
    if method == "compressed-tensors":
        fmt = fmt or "pack-quantized"
        scheme = ct_scheme(fmt, bits, group, sym).model_dump(mode="json") | {"format": fmt}
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                      "config_groups": {"group_0": scheme}}  # fmt: skip
    elif method == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}  # fmt: skip
    elif method == "gptq":
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                      "desc_act": act_order, "checkpoint_format": fmt}  # fmt: skip
    else:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                      "zero_point": True, "version": "gemm"}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    return ref
