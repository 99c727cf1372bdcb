"""Linear algebra and tensor creation: matmul, linear, conv1d, arange, full, zeros, ones, tril, triu, constant.

matmul/linear/conv1d compute in the input dtype (torch CPU accumulates bf16 GEMMs in fp32 and rounds once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3c.errors import IRError
from k3c.ir.ops.registry import Attr, broadcast_shapes, need_eq, op, same_dtype, zero_cost
from k3c.ir.types import TensorType, dim, numel, torch_dtype


def _matmul_flops(a, ins, outs):
    return numel(outs[0]) * ins[0].shape[-1] * 2


@op("matmul", inputs=["a", "b"], kind="linalg", ref=lambda at, a, b: [torch.matmul(a, b)], flops=_matmul_flops)
def _matmul(attrs, a, b):
    """matmul(a [..., M, K], b [..., K, N]) -> [..., M, N]; batch dims broadcast; rank >= 2 each, one dtype."""
    dt = same_dtype("matmul", a, b)
    if a.rank < 2 or b.rank < 2:
        raise IRError(f"matmul: inputs must have rank >= 2 (got {a}, {b}); unsqueeze vectors first")
    need_eq("matmul", a.shape[-1], b.shape[-2], f"contraction dims of {a} and {b}")
    batch = broadcast_shapes("matmul", a.shape[:-2], b.shape[:-2])
    return [TensorType(batch + (a.shape[-2], b.shape[-1]), dt)]


@op("linear", inputs=["x", "weight", "bias?"], kind="linalg", flops=_matmul_flops,
    ref=lambda at, x, w, b=None: [F.linear(x, w, b)])
def _linear(attrs, x, w, b=None):
    """linear(x [..., in], weight [out, in], bias? [out]) -> [..., out] = x @ weight.T + bias; one dtype."""
    same_dtype("linear", x, w, *([b] if b is not None else []))
    if w.rank != 2:
        raise IRError(f"linear: weight must be [out, in], got {w}")
    need_eq("linear", x.shape[-1], w.shape[1], f"in features of {x} and weight {w}")
    if b is not None and (b.rank != 1 or dim(b.shape[0] - w.shape[0]) != 0):
        raise IRError(f"linear: bias {b} does not match weight {w}")
    return [x.with_shape(x.shape[:-1] + (w.shape[0],))]


_CONV_ATTRS = {"stride": Attr("int", 1), "padding": Attr("int", 0), "dilation": Attr("int", 1),
               "groups": Attr("int", 1)}


def _conv_ref(a, x, w, b=None):
    return [F.conv1d(x, w, b, stride=a["stride"], padding=a["padding"], dilation=a["dilation"], groups=a["groups"])]


@op("conv1d", inputs=["x", "weight", "bias?"], attrs=_CONV_ATTRS, kind="linalg", ref=_conv_ref,
    flops=lambda a, ins, outs: numel(outs[0]) * ins[1].shape[1] * ins[1].shape[2] * 2)
def _conv1d(attrs, x, w, b=None):
    """conv1d(x [B, Cin, T], weight [Cout, Cin/groups, W], bias? [Cout]) {stride, padding, dilation, groups}.

    torch.nn.functional.conv1d semantics (NCL layout); depthwise is groups = Cin = Cout.
    Output length = (T + 2·padding − dilation·(W−1) − 1) // stride + 1.
    """
    same_dtype("conv1d", x, w, *([b] if b is not None else []))
    if x.rank != 3 or w.rank != 3:
        raise IRError(f"conv1d: x must be [B, C, T] and weight [Cout, Cin/groups, W], got {x}, {w}")
    g = attrs["groups"]
    need_eq("conv1d", dim(w.shape[1] * g), x.shape[1], "weight in-channels x groups vs x channels")
    t = dim((x.shape[2] + 2 * attrs["padding"] - attrs["dilation"] * (w.shape[2] - 1) - 1) // attrs["stride"] + 1)
    return [x.with_shape((x.shape[0], w.shape[0], t))]


# ---- creation ---------------------------------------------------------------------------------------------------
def _arange_ref(a):
    return [torch.arange(a["start"], a["end"], a["step"], dtype=torch_dtype(a["dtype"]))]


@op("arange", inputs=[], attrs={"start": Attr("dim", 0), "end": Attr("dim"), "step": Attr("int", 1),
                                "dtype": Attr("dtype", "i64")}, kind="create", ref=_arange_ref, flops=zero_cost)
def _arange(attrs):
    """arange() {start=0, end, step=1, dtype=i64}: [start, end) by step; end may be symbolic (`L+T`)."""
    if attrs["step"] < 1:
        raise IRError("arange: step must be >= 1")
    n = dim((dim(attrs["end"]) - dim(attrs["start"]) + attrs["step"] - 1) // attrs["step"])
    return [TensorType((n,), attrs["dtype"])]


_FULL_ATTRS = {"shape": Attr("dims"), "dtype": Attr("dtype", "f32")}


def _full(value_of):
    def infer(attrs):
        return [TensorType(tuple(attrs["shape"]), attrs["dtype"])]

    def ref(attrs):
        return [torch.full(list(attrs["shape"]), value_of(attrs), dtype=torch_dtype(attrs["dtype"]))]

    return infer, ref


for _name, _val, _extra in (("full", lambda a: a["value"], {"value": Attr("float")}),
                            ("zeros", lambda a: 0, {}), ("ones", lambda a: 1, {})):
    _inf, _ref = _full(_val)
    _inf.__doc__ = f"{_name}() {{shape, dtype{', value' if _extra else ''}}}: a filled tensor (shape may be symbolic)."
    op(_name, inputs=[], attrs={**_FULL_ATTRS, **_extra}, kind="create", ref=_ref, flops=zero_cost)(_inf)


def _tri(name, fn):
    def infer(attrs, x):
        if x.rank < 2:
            raise IRError(f"{name}: input must have rank >= 2, got {x}")
        return [x]

    op(name, inputs=["x"], attrs={"diagonal": Attr("int", 0)}, kind="create", flops=zero_cost,
       ref=lambda a, x: [fn(x, a["diagonal"])])(infer)


_tri("tril", torch.tril)
_tri("triu", torch.triu)


def _constant_ref(a):
    return [torch.tensor(a["value"], dtype=torch_dtype(a["dtype"])).reshape(a["shape"])]


@op("constant", inputs=[], attrs={"value": Attr("json"), "shape": Attr("ints"), "dtype": Attr("dtype")},
    kind="create", ref=_constant_ref, flops=zero_cost)
def _constant(attrs):
    """constant() {value (nested list or number), shape, dtype}: a small literal (keep it under ~1k elements)."""
    import math

    def flat(v):
        return [y for x in v for y in flat(x)] if isinstance(v, list) else [v]

    vals = flat(attrs["value"])
    if len(vals) != math.prod(attrs["shape"]):
        raise IRError(f"constant: {len(vals)} values for shape {attrs['shape']}")
    if any(isinstance(v, (str, dict)) or v is None for v in vals):
        raise IRError("constant: values must be numbers or bools")
    return [TensorType(tuple(attrs["shape"]), attrs["dtype"])]


