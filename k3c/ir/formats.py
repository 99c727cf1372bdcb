"""Weight storage formats the IR knows besides plain dtypes: MXFP4 (OCP Microscaling Formats spec v1.0).

MXFP4 stores a weight matrix W [R, C] (C a multiple of 32) as two uint8 tensors, the compressed-tensors layout of
the published checkpoints: `packed` [R, C/2], two E2M1 codes per byte (element 2j in the low nibble, 2j+1 in the
high one; code bit 3 the sign, bits 2..1 the exponent, bit 0 the mantissa: spec §5.3.3, Table 5), and `scale`
[R, C/32], one E8M0 exponent per 32 consecutive values of a row (2^(s − 127); spec §5.4.1, 255 = NaN). So a
weight costs 4 + 8/32 = 4.25 bits. `mxfp4_dequantize` is the IR's reference decoding, written from the spec
independently of the checkpoint reader in models/checkpoint.py (the tests compare the two).
"""

from __future__ import annotations

import torch

MXFP4_GROUP = 32                          # values per E8M0 scale
MXFP4_BITS = 4 + 8 / MXFP4_GROUP          # bits per weight, scales included
WEIGHT_FORMATS = ("dense", "mxfp4")


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """E2M1 code (int, 0..15) -> fp32 value: (−1)^s · 2^(e−1) · (1 + m/2) for e > 0, (−1)^s · m/2 for e = 0."""
    code = code.to(torch.int32)
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = torch.where(e > 0, torch.exp2((e - 1).float()) * (1 + m.float() / 2), m.float() / 2)
    return torch.where(s == 1, -mag, mag)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 packed [..., C/2] + uint8 E8M0 scale [..., C/32] -> fp32 [..., C] (leading dims: e.g. experts)."""
    lo, hi = e2m1_value(packed & 0x0F), e2m1_value(packed >> 4)
    vals = torch.stack([lo, hi], -1).flatten(-2)                                    # element 2j = low nibble
    exp = torch.exp2(scale.float() - 127).masked_fill(scale == 255, float("nan"))
    return (vals.unflatten(-1, (-1, MXFP4_GROUP)) * exp.unsqueeze(-1)).flatten(-2)
