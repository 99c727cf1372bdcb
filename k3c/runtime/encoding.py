"""Deterministic byte encodings of artifact files: canonical JSON and safetensors (sorted headers, aligned data).

Runtime code: the standard library, torch and k3c.errors only.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Mapping

import torch

from k3c.errors import ArtifactError

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def canonical_json(obj: Any, what: str = "JSON") -> bytes:
    """UTF-8 JSON with sorted keys, 2-space indent, fixed separators and a trailing newline.
    Raises ArtifactError (naming `what`) for NaN/inf or values JSON cannot hold."""
    try:
        text = json.dumps(obj, sort_keys=True, indent=2, separators=(",", ": "), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ArtifactError(f"{what}: cannot be written as JSON: {err}") from None
    return (text + "\n").encode("utf-8")


def safetensors_chunks(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None):
    """Yield the bytes of a safetensors file for `tensors` (any device/layout; written as CPU contiguous).

    Header keys sorted; data ordered by element size (desc) then name, so every tensor is aligned to its element
    size; metadata `{"format": "pt", **metadata}` (str -> str). Raises ArtifactError for unsupported dtypes,
    non-str names or metadata."""
    meta = {"format": "pt", **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ArtifactError("safetensors metadata must map str to str")
    items = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__" or not isinstance(t, torch.Tensor):
            raise ArtifactError(f"safetensors: bad entry {name!r} (need str name -> torch.Tensor)")
        if t.dtype not in _ST_DTYPES:
            raise ArtifactError(f"safetensors: tensor '{name}' has unsupported dtype {t.dtype}")
        items[name] = t.detach().to("cpu").contiguous()
    order = sorted(items, key=lambda n: (-items[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name in order:
        t = items[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    yield struct.pack("<Q", len(head)) + head
    for name in order:
        if items[name].numel():
            yield memoryview(items[name].reshape(-1).view(torch.uint8).numpy())
