"""The runtime's library and view operations: what `form_kernels` leaves to torch rather than generated kernels.

Library ops are GEMM-like calls dispatched to torch (cuBLAS on GPUs): linear, matmul, einsum, embedding, conv1d,
and the few index/sort/creation ops. View ops are layout changes (reshape, slice, cat, ...). Each entry takes the
launch's attrs with dims already evaluated to ints and the input tensors, and returns the output tensors. These
mirror the IR ops' reference semantics (`k3c/ir/ops/`); the runtime keeps its own copy so that it never imports the
compiler. Raises ArtifactError for an op it does not know (an artifact from a newer compiler).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from k3c.errors import ArtifactError

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f8e4m3": torch.float8_e4m3fn,
          "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8, "bool": torch.bool}


def _slice(a, x):
    end = a["end"] if a.get("end") is not None else x.shape[a["dim"]]
    idx = [slice(None)] * x.dim()
    idx[a["dim"]] = slice(a.get("start", 0), end, a.get("step", 1))
    return [x[tuple(idx)]]


def _fp8_quantize(x):
    """x [..., D] -> (e4m3 [..., D], f32 scale [...]), x ~= scale * x8, scale = max|x| / 448 per row (1 for a zero
    row): `fp8_quantize` (k3c/ir/ops/model_attn.py; FP8 DSA index keys). A tensor divisor: correctly rounded on
    CUDA too (a Python scalar one is a multiply by its fp32 reciprocal there)."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    return [(xf / scale[..., None]).to(torch.float8_e4m3fn), scale]


def _e4m3_unit(x8, toward_zero):
    """Residual unit of e4m3 values (f32): ulp / 16 (2^(e - 7); 2^-13 below 2^-6), halved where `toward_zero` at a
    power of two of at least 2^-5."""
    bits = x8.float().view(torch.int32)
    e = (bits >> 23) & 255
    sh = e.clamp(min=121) - 7 - (((bits & 0x7FFFFF) == 0) & (e >= 122) & toward_zero).to(torch.int32)
    return (sh << 23).view(torch.float32)


def _fp8_split(x):
    """x [..., D] -> (e4m3 [..., D], f32 scale [...], u8 residuals [..., D / 2]): `fp8_split` (k3c/ir/ops/
    model_attn.py; `--dsa-index-keys fp8-rerank`): scale = 2^(floor(log2 max|x|) - 7) (1 for a zero row), e4m3
    rounded to nearest with ties upward, the residual in units of y's binade's ulp / 16 rounded and clamped to
    [-8, 7], + 8, two a byte (element 2i low). Exact or correctly rounded on any device (power-of-two scaling)."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), torch.frexp(amax).exponent - 8),
                        torch.ones_like(amax))
    y = xf / scale[..., None]
    x8 = y.to(torch.float8_e4m3fn)
    step = _e4m3_unit(x8, x8.float() < 0) * 16
    x8 = torch.where(y - x8.float() == step / 2, (x8.float() + step).to(torch.float8_e4m3fn), x8)
    r = y - x8.float()
    lo = torch.round(r / _e4m3_unit(x8, (r != 0) & ((r < 0) != (x8.float() < 0)))).clamp(-8, 7).to(torch.int32) + 8
    return [x8, scale, (lo[..., 0::2] | (lo[..., 1::2] << 4)).to(torch.uint8)]


def _reduce(fn):
    return lambda a, x: [fn(x, dim=a["dims"], keepdim=a.get("keepdim", False)) if a.get("dims") is not None else fn(x)]


LIBRARY_OPS = {
    "linear": lambda a, x, w, b=None: [F.linear(x, w, b)],
    "matmul": lambda a, x, y: [torch.matmul(x, y)],
    "einsum": lambda a, *xs: [torch.einsum(a["equation"], *xs)],
    "embedding": lambda a, w, ids: [F.embedding(ids.long(), w)],
    "conv1d": lambda a, x, w, b=None: [F.conv1d(x, w, b, stride=a.get("stride", 1), padding=a.get("padding", 0),
                                                dilation=a.get("dilation", 1), groups=a.get("groups", 1))],
    "scatter": lambda a, x, i, s: [x.scatter_add(a["dim"], i.long(), s) if a.get("reduce") == "add"
                                   else x.scatter(a["dim"], i.long(), s)],
    "gather": lambda a, x, i: [torch.gather(x, a["dim"], i.long())],
    "index_select": lambda a, x, i: [torch.index_select(x, a["dim"], i.long())],
    "cumsum": lambda a, x: [torch.cumsum(x, a["dim"]).to(x.dtype)],
    "softmax": lambda a, x: [torch.softmax(x.float(), a["dim"]).to(x.dtype)],
    "sum": _reduce(torch.sum), "mean": _reduce(torch.mean), "amax": _reduce(torch.amax), "amin": _reduce(torch.amin),
    "arange": lambda a: [torch.arange(a.get("start", 0), a["end"], a.get("step", 1), dtype=DTYPES[a.get("dtype", "i64")])],
    "zeros": lambda a: [torch.zeros(a["shape"], dtype=DTYPES[a["dtype"]])],
    "ones": lambda a: [torch.ones(a["shape"], dtype=DTYPES[a["dtype"]])],
    "full": lambda a: [torch.full(a["shape"], a["value"], dtype=DTYPES[a["dtype"]])],
    "constant": lambda a: [torch.tensor(a["value"], dtype=DTYPES[a["dtype"]]).reshape(a["shape"])],
    "cast": lambda a, x: [x.to(DTYPES[a["to"]])],
    "fp8_quantize": lambda a, x: _fp8_quantize(x),
    "fp8_split": lambda a, x: _fp8_split(x),
}
#: Layout ops; "cache_append" writes the new rows into the pool in place (performed by the view launcher).
VIEW_OPS = {
    "reshape": lambda a, x: [x.reshape(a["shape"])],
    "unsqueeze": lambda a, x: [x.unsqueeze(a["dim"])],
    "squeeze": lambda a, x: [x.squeeze(a["dims"]) if a.get("dims") is not None else x.squeeze()],
    "select": lambda a, x: [x.select(a["dim"], a["index"])],
    "slice": _slice,
    "expand": lambda a, x: [x.expand(a["shape"])],
    "transpose": lambda a, x: [x.transpose(a["dim0"], a["dim1"])],
    "permute": lambda a, x: [x.permute(a["dims"])],
    "split": lambda a, x: list(torch.split(x, a["sizes"], a.get("dim", 0))),
    "cat": lambda a, *xs: [torch.cat(xs, a.get("dim", 0))],
    "stack": lambda a, *xs: [torch.stack(xs, a.get("dim", 0))],
    "pad": lambda a, x: [F.pad(x, list(a["pads"]), value=a.get("value", 0.0))],
    "copy": lambda a, x: [x.clone()],
    "cache_append": None,
}
OPS = {**LIBRARY_OPS, **VIEW_OPS}


def _linear_into(a, out, x, w, b=None):
    torch.matmul(x, w.t(), out=out)  # F.linear has no out=; the same GEMM (x · wᵀ)
    if b is not None:
        out.add_(b)


def _einsum_into(a, out, *xs) -> bool:
    """A two-operand einsum as one batched GEMM (`torch.bmm`) written into `out`: the letters of both operands and
    the result are the batch, those of one operand and the result its rows (first operand) or columns (second), those
    of both operands only the contraction; e.g. MLA's absorbed "bthd,hdr->bthr" is a GEMM per head h whose result
    rows are strided views of `out` (no copy where cuBLAS takes the strides). Returns False, writing nothing, for
    other equations (one or three operands, a repeated letter, a letter summed within one operand) and for an `out`
    whose batch x rows x columns grouping is not a view."""
    ins, res = a["equation"].replace(" ", "").split("->")
    terms = ins.split(",")
    if len(terms) != 2 or any(len(set(t)) != len(t) for t in (*terms, res)):
        return False
    (p, q), (x, y) = terms, xs
    batch = [c for c in res if c in p and c in q]
    rows, cols = [c for c in res if c in p and c not in q], [c for c in res if c in q and c not in p]
    inner = [c for c in p if c in q and c not in res]
    if sorted(p) != sorted(batch + rows + inner) or sorted(q) != sorted(batch + inner + cols):
        return False
    size = {**dict(zip(p, x.shape)), **dict(zip(q, y.shape))}

    def n(cs):
        return math.prod(size[c] for c in cs)

    try:
        o = out.permute([res.index(c) for c in batch + rows + cols]).view(n(batch), n(rows), n(cols))
    except RuntimeError:  # the grouping needs a copy of out: decline
        return False
    xm = x.permute([p.index(c) for c in batch + rows + inner]).reshape(n(batch), n(rows), n(inner))
    ym = y.permute([q.index(c) for c in batch + inner + cols]).reshape(n(batch), n(inner), n(cols))
    torch.bmm(xm, ym, out=o)
    return True


def _embedding_into(a, out, w, ids):
    torch.index_select(w, 0, ids.reshape(-1).long(), out=out.view(-1, w.shape[1]))  # F.embedding has no out=


#: ops that can write their one output straight into its planned buffer (`out`, of the result's shape and dtype),
#: so a large result never exists twice (a temporary, then the copy into the arena): the peak stays the plan's. An
#: entry returns False to decline (nothing written).
INTO_OPS = {
    "linear": _linear_into,
    "matmul": lambda a, out, x, y: torch.matmul(x, y, out=out),
    "cat": lambda a, out, *xs: torch.cat(xs, a.get("dim", 0), out=out),
    "einsum": _einsum_into,
    "embedding": _embedding_into,
}
#: integer operands of INTO_OPS (index tensors), not required to have out's dtype: op -> their positions
INDEX_OPERANDS = {"embedding": (1,)}
#: ops whose result may be a view of their input (no new memory)
ALIASING = frozenset({"reshape", "unsqueeze", "squeeze", "select", "slice", "expand", "transpose", "permute", "split"})


def run_op_into(op: str, attrs: dict, inputs: list[torch.Tensor], out: torch.Tensor) -> bool:
    """Run `op` writing its single output into `out` where it can (`INTO_OPS`, inputs of out's dtype but the
    `INDEX_OPERANDS`); returns False (nothing done) otherwise, for `run_op` and a copy."""
    fn = INTO_OPS.get(op)
    index = INDEX_OPERANDS.get(op, ())
    if fn is None or not out.is_contiguous() or any(x.dtype != out.dtype for i, x in enumerate(inputs)
                                                     if i not in index):
        return False
    return fn(attrs, out, *inputs) is not False


def run_op(op: str, attrs: dict, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run library/view op `op`; raises ArtifactError if the runtime does not implement it."""
    fn = OPS.get(op)
    if fn is None:  # unknown, or cache_append (which needs the pool: the view launcher does it)
        raise ArtifactError(f"the artifact uses op '{op}', which this runtime does not implement")
    if inputs:  # results follow their inputs' device (a `torch.device` mode would cost every call ~50 us)
        return fn(attrs, *inputs)
    with torch.device("cpu"):
        return fn(attrs)
