#!/usr/bin/env python
"""A GPTQ checkpoint (AutoGPTQ's v1 layout: 4-bit, symmetric, group 128, no desc_act) of a Hugging Face
bf16 model directory, by round to nearest, one tensor at a time: for comparing pytgi's GPTQ path with
its GGUF path on the same random-weight model (benchmarks/make_shaped.py;
docs/history/issue-43-pre-quantized.md).

    .venv/bin/python benchmarks/make_gptq.py /tmp/llama/llama3b-hf /tmp/llama/llama3b-gptq
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytgi.engine.loading.safetensors_dir import iter_safetensors
from tests.quant_checkpoints import LINEARS, pack_cols, pack_rows, rtn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    files: dict[str, str] = {}
    n = 0

    def flush() -> None:
        nonlocal shard, n
        if shard:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(args.out / name), metadata={"format": "pt"})
            files.update(dict.fromkeys(shard, name))
            shard = {}

    for name, t in iter_safetensors(args.src):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            q, zero, scale = rtn(t.float(), 4, args.group, True)
            shard[f"{module}.qweight"] = pack_rows(q.t().contiguous(), 4)
            shard[f"{module}.qzeros"] = pack_cols((zero - 1).t().contiguous() & 15, 4)
            shard[f"{module}.scales"] = scale.t().contiguous()
            shard[f"{module}.g_idx"] = (torch.arange(t.shape[1]) // args.group).to(torch.int32)
        else:
            shard[name] = t.clone()
        if sum(x.nbytes for x in shard.values()) > 1 << 30:
            flush()
    flush()
    (args.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    cfg = json.loads((args.src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": args.group, "sym": True,
                                  "desc_act": False, "checkpoint_format": "gptq"}  # fmt: skip
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in args.src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, args.out / f.name)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
