"""layer_norm: LayerNorm over the last dim with optional weight and bias (torch.nn.functional.layer_norm)."""

from __future__ import annotations

import torch.nn.functional as F

from k3c.ir.ops.registry import Attr, need_dtype, need_eq, op, per_elem


@op("layer_norm", inputs=["x", "weight?", "bias?"], attrs={"eps": Attr("float", 1e-5)}, kind="reduce",
    flops=per_elem(8),
    ref=lambda a, x, w=None, b=None: [F.layer_norm(x, (x.shape[-1],), w, b, a["eps"])])
def _layer_norm(attrs, x, w=None, b=None):
    """layer_norm(x [..., D], weight? [D], bias? [D]) {eps}: (x - mean) / sqrt(var + eps) * weight + bias."""
    need_dtype("layer_norm", x, {"f32", "bf16", "f16"})
    for p in (w, b):
        if p is not None:
            need_eq("layer_norm", p.shape[-1], x.shape[-1], "normalized dim")
    return [x]
