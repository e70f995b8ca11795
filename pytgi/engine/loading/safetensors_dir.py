"""A model directory's safetensors files, read one tensor at a time as views of their mappings."""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from pytgi.core.errors import UnsupportedModel

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a directory's safetensors files, one at a time, as a view of the file's read-only
    mapping (the consumer copies it where it goes); once consumed, its pages are let go from the
    process (they stay in the page cache), so loading holds the model once, not the files beside it."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{path} has no *.safetensors weights (pytgi does not load .bin checkpoints)")
    for file in files:
        with open(file, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (size,) = struct.unpack("<Q", mm[:8])
        header = json.loads(mm[8 : 8 + size])
        header.pop("__metadata__", None)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = (8 + size + o for o in info["data_offsets"])
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            if end == begin:  # an empty tensor has no bytes to view
                yield name, torch.empty(info["shape"], dtype=dtype)
                continue
            with warnings.catch_warnings():  # a read-only buffer: nothing writes to these views
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(mm, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin)
            yield name, flat.view(info["shape"])
            start = begin // mmap.PAGESIZE * mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
