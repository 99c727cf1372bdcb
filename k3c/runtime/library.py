"""The runtime's library and view operations: what `form_kernels` leaves to torch rather than generated kernels.

Library ops are GEMM-like calls dispatched to torch (cuBLAS on GPUs): linear, matmul, einsum, embedding, conv1d,
and the few index/sort/creation ops. View ops are layout changes (reshape, slice, cat, ...). Each entry takes the
launch's attrs with dims already evaluated to ints and the input tensors, and returns the output tensors. These
mirror the IR ops' reference semantics (`k3c/ir/ops/`); the runtime keeps its own copy so that it never imports the
compiler. Raises ArtifactError for an op it does not know (an artifact from a newer compiler).
"""

from __future__ import annotations

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


#: ops that can write their one output straight into its planned buffer (`out`, of the result's shape and dtype),
#: so a large result never exists twice (a temporary, then the copy into the arena): the peak stays the plan's
INTO_OPS = {
    "linear": _linear_into,
    "matmul": lambda a, out, x, y: torch.matmul(x, y, out=out),
    "cat": lambda a, out, *xs: torch.cat(xs, a.get("dim", 0), out=out),
}
#: ops whose result may be a view of their input (no new memory)
ALIASING = frozenset({"reshape", "unsqueeze", "squeeze", "select", "slice", "expand", "transpose", "permute", "split"})


def run_op_into(op: str, attrs: dict, inputs: list[torch.Tensor], out: torch.Tensor) -> bool:
    """Run `op` writing its single output into `out` where it can (`INTO_OPS`, inputs of out's dtype); returns
    False (nothing done) otherwise, for `run_op` and a copy."""
    fn = INTO_OPS.get(op)
    if fn is None or not out.is_contiguous() or any(x.dtype != out.dtype for x in inputs):
        return False
    fn(attrs, out, *inputs)
    return True


def run_op(op: str, attrs: dict, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run library/view op `op`; raises ArtifactError if the runtime does not implement it."""
    fn = OPS.get(op)
    if fn is None:  # unknown, or cache_append (which needs the pool: the view launcher does it)
        raise ArtifactError(f"the artifact uses op '{op}', which this runtime does not implement")
    if inputs:  # results follow their inputs' device (a `torch.device` mode would cost every call ~50 us)
        return fn(attrs, *inputs)
    with torch.device("cpu"):
        return fn(attrs)
