"""Elementwise ops: unary math, binary arithmetic / comparison / logic with numpy broadcasting, where, clamp, cast.

Binary ops take two tensors of one dtype (k3c has no implicit promotion: the frontend inserts `cast`), or one
tensor and a `scalar` attr (float) with `reverse=True` meaning `scalar ∘ x` instead of `x ∘ scalar`. Arithmetic
keeps the input dtype; comparisons return `bool`; logical ops take and return `bool`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3c.errors import IRError
from k3c.ir.ops.registry import Attr, broadcast_shapes, need_dtype, op, per_elem, same_dtype
from k3c.ir.types import TensorType, torch_dtype

_BINARY_ATTRS = {"scalar": Attr("float", None), "reverse": Attr("bool", False)}


def _binary_infer(name: str, result: str | None, bool_in: bool):
    """result: None keeps the input dtype, else a fixed output dtype."""

    def infer(attrs, x, y=None):
        if y is None:
            if attrs["scalar"] is None:
                raise IRError(f"{name} with one input needs the scalar attr")
            shape, dt = x.shape, x.dtype
        else:
            if attrs["scalar"] is not None:
                raise IRError(f"{name} takes a scalar attr or a second input, not both")
            dt = same_dtype(name, x, y)
            shape = broadcast_shapes(name, x.shape, y.shape)
        if bool_in:
            need_dtype(name, x, {"bool"})
        return [TensorType(shape, result or dt)]

    return infer


def _binary_ref(fn, keep_dtype: bool):
    """Scalars stay Python numbers (as aten's `.Scalar` overloads see them); results are cast to the IR dtype."""

    def ref(attrs, x, y=None):
        dt = x.dtype if keep_dtype else torch.bool
        if y is None:
            s = attrs["scalar"]
            if x.dtype == torch.bool:
                s = bool(s)
            elif not x.dtype.is_floating_point and float(s).is_integer():
                s = int(s)
            r = fn(s, x) if attrs["reverse"] else fn(x, s)
        else:
            r = fn(x, y)
        return [r.to(dt)]

    return ref


def _scalar_ok(tfn, pyop):
    """Use the torch function for two tensors, Python operators (which accept a scalar on either side) otherwise."""
    return lambda a, b: tfn(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else pyop(a, b)


def _as_tensor_pair(tfn):
    def f(a, b):
        ref_t = a if torch.is_tensor(a) else b
        a = a if torch.is_tensor(a) else torch.tensor(a, dtype=ref_t.dtype)
        b = b if torch.is_tensor(b) else torch.tensor(b, dtype=ref_t.dtype)
        return tfn(a, b)

    return f


_ARITH = {
    "add": _scalar_ok(torch.add, lambda a, b: a + b),
    "sub": _scalar_ok(torch.sub, lambda a, b: a - b),
    "mul": _scalar_ok(torch.mul, lambda a, b: a * b),
    "div": _scalar_ok(torch.div, lambda a, b: a / b),
    "maximum": _as_tensor_pair(torch.maximum),
    "minimum": _as_tensor_pair(torch.minimum),
}
_COMPARE = {
    "eq": _scalar_ok(torch.eq, lambda a, b: a == b),
    "ne": _scalar_ok(torch.ne, lambda a, b: a != b),
    "lt": _scalar_ok(torch.lt, lambda a, b: a < b),
    "le": _scalar_ok(torch.le, lambda a, b: a <= b),
    "gt": _scalar_ok(torch.gt, lambda a, b: a > b),
    "ge": _scalar_ok(torch.ge, lambda a, b: a >= b),
}
_LOGIC = {k: _as_tensor_pair(f) for k, f in
          {"logical_and": torch.logical_and, "logical_or": torch.logical_or, "logical_xor": torch.logical_xor}.items()}


for _name, _fn in _ARITH.items():
    op(_name, inputs=["x", "y?"], attrs=_BINARY_ATTRS, kind="elementwise", ref=_binary_ref(_fn, True),
       flops=per_elem(1))(_binary_infer(_name, None, False))
for _name, _fn in _COMPARE.items():
    op(_name, inputs=["x", "y?"], attrs=_BINARY_ATTRS, kind="elementwise", ref=_binary_ref(_fn, False),
       flops=per_elem(1))(_binary_infer(_name, "bool", False))
for _name, _fn in _LOGIC.items():
    op(_name, inputs=["x", "y?"], attrs=_BINARY_ATTRS, kind="elementwise", ref=_binary_ref(_fn, False),
       flops=per_elem(1))(_binary_infer(_name, "bool", True))


# ---- unary ----------------------------------------------------------------------------------------------------
def _float_unary(name: str, fn, flops: int = 1, attrs: dict | None = None, floats_only: bool = True):
    def infer(a, x):
        if floats_only:
            need_dtype(name, x, {"f32", "bf16", "f16"})
        return [x]

    op(name, inputs=["x"], attrs=attrs or {}, kind="elementwise", ref=lambda a, x: [fn(a, x).to(x.dtype)],
       flops=per_elem(flops))(infer)


_float_unary("exp", lambda a, x: torch.exp(x))
_float_unary("log", lambda a, x: torch.log(x))
_float_unary("sqrt", lambda a, x: torch.sqrt(x))
_float_unary("rsqrt", lambda a, x: torch.rsqrt(x), 2)
_float_unary("sigmoid", lambda a, x: torch.sigmoid(x), 4)
_float_unary("tanh", lambda a, x: torch.tanh(x), 4)
_float_unary("silu", lambda a, x: F.silu(x), 5)
_float_unary("reciprocal", lambda a, x: torch.reciprocal(x))
_float_unary("softplus", lambda a, x: F.softplus(x, beta=a["beta"], threshold=a["threshold"]), 4,
             {"beta": Attr("float", 1.0), "threshold": Attr("float", 20.0)})
_float_unary("gelu", lambda a, x: F.gelu(x, approximate=a["approximate"]), 8,
             {"approximate": Attr("str", "none", ("none", "tanh"))})
_float_unary("pow", lambda a, x: torch.pow(x, a["exponent"]), 1, {"exponent": Attr("float")})
_float_unary("neg", lambda a, x: torch.neg(x), 1, floats_only=False)
_float_unary("abs", lambda a, x: torch.abs(x), 1, floats_only=False)
_float_unary("relu", lambda a, x: torch.relu(x), 1, floats_only=False)


@op("logical_not", inputs=["x"], kind="elementwise", ref=lambda a, x: [torch.logical_not(x)], flops=per_elem(1))
def _logical_not(attrs, x):
    """logical_not(x: bool[...]) -> bool[...]"""
    need_dtype("logical_not", x, {"bool"})
    return [x]


def _clamp_ref(a, x):
    return [torch.clamp(x, min=a["min"], max=a["max"]).to(x.dtype)]


@op("clamp", inputs=["x"], attrs={"min": Attr("float", None), "max": Attr("float", None)}, kind="elementwise",
    ref=_clamp_ref, flops=per_elem(2))
def _clamp(attrs, x):
    """clamp(x) {min?, max?}: elementwise clamp; at least one bound."""
    if attrs["min"] is None and attrs["max"] is None:
        raise IRError("clamp needs min or max")
    return [x]


@op("cast", inputs=["x"], attrs={"to": Attr("dtype")}, kind="elementwise",
    ref=lambda a, x: [x.to(torch_dtype(a["to"]))], flops=per_elem(0))
def _cast(attrs, x):
    """cast(x) {to}: convert to dtype `to` (round to nearest even for floats, torch semantics)."""
    return [x.with_dtype(attrs["to"])]


@op("where", inputs=["cond", "x", "y"], kind="elementwise",
    ref=lambda a, c, x, y: [torch.where(c, x, y)], flops=per_elem(1))
def _where(attrs, c, x, y):
    """where(cond: bool, x, y) -> x where cond else y; broadcasting; x and y share a dtype."""
    need_dtype("where", c, {"bool"}, "cond")
    dt = same_dtype("where", x, y)
    return [TensorType(broadcast_shapes("where", c.shape, x.shape, y.shape), dt)]


@op("masked_fill", inputs=["x", "mask"], attrs={"value": Attr("float")}, kind="elementwise",
    ref=lambda a, x, m: [x.masked_fill(m, a["value"])], flops=per_elem(1))
def _masked_fill(attrs, x, m):
    """masked_fill(x, mask: bool) {value}: x with `value` where mask (mask broadcasts to x; value may be ±inf)."""
    need_dtype("masked_fill", m, {"bool"}, "mask")
    if broadcast_shapes("masked_fill", x.shape, m.shape) != tuple(x.shape):
        raise IRError(f"masked_fill: mask {m} does not broadcast to {x}")
    return [x]


@op("copy", inputs=["x"], kind="elementwise", ref=lambda a, x: [x.clone()], flops=per_elem(0))
def _copy(attrs, x):
    """copy(x): a materialised copy (same type)."""
    return [x]
