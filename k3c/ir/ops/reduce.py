"""Reductions and scans: sum, mean, amax, amin, softmax, log_softmax, cumsum, topk, sort, argsort.

Reductions keep the input dtype (`sum` of bf16 is bf16, as in torch); `dims=None` reduces every dim.
`topk`, `sort` and `argsort` are stable: ties keep the lowest index first (torch.topk does not promise this).
"""

from __future__ import annotations

import torch

from k3c.errors import IRError
from k3c.ir.ops.registry import Attr, need_dtype, norm_axis, op, per_elem
from k3c.ir.types import TensorType, dim, numel

_RED = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin}
_RED_ATTRS = {"dims": Attr("ints", None), "keepdim": Attr("bool", False)}


def _red_dims(name: str, attrs: dict, x: TensorType) -> list[int]:
    dims = list(range(x.rank)) if attrs["dims"] is None else [norm_axis(d, x.rank, name) for d in attrs["dims"]]
    if len(set(dims)) != len(dims):
        raise IRError(f"{name}: repeated dims {attrs['dims']}")
    return sorted(dims)


def _red_infer(name: str):
    def infer(attrs, x):
        if name == "mean":
            need_dtype(name, x, {"f32", "bf16", "f16"})
        dims = _red_dims(name, attrs, x)
        if attrs["keepdim"]:
            shape = [1 if i in dims else d for i, d in enumerate(x.shape)]
        else:
            shape = [d for i, d in enumerate(x.shape) if i not in dims]
        return [TensorType(tuple(shape), x.dtype)]

    return infer


def _red_ref(fn):
    def ref(attrs, x):
        dims = list(range(x.dim())) if attrs["dims"] is None else list(attrs["dims"])
        if not dims:
            return [x.clone()]
        return [fn(x, dim=dims, keepdim=attrs["keepdim"]).to(x.dtype)]

    return ref


for _name, _fn in _RED.items():
    op(_name, inputs=["x"], attrs=_RED_ATTRS, kind="reduce", ref=_red_ref(_fn),
       flops=lambda a, ins, outs: numel(ins[0]))(_red_infer(_name))


def _softmax_infer(name):
    def infer(attrs, x):
        need_dtype(name, x, {"f32", "bf16", "f16"})
        norm_axis(attrs["dim"], x.rank, name)
        return [x]

    return infer


op("softmax", inputs=["x"], attrs={"dim": Attr("int", -1)}, kind="reduce",
   ref=lambda a, x: [torch.softmax(x, a["dim"])], flops=per_elem(5))(_softmax_infer("softmax"))
op("log_softmax", inputs=["x"], attrs={"dim": Attr("int", -1)}, kind="reduce",
   ref=lambda a, x: [torch.log_softmax(x, a["dim"])], flops=per_elem(5))(_softmax_infer("log_softmax"))


@op("cumsum", inputs=["x"], attrs={"dim": Attr("int")}, kind="reduce",
    ref=lambda a, x: [torch.cumsum(x, a["dim"]).to(x.dtype)], flops=per_elem(1))
def _cumsum(attrs, x):
    """cumsum(x) {dim}: inclusive prefix sum along dim, same type."""
    norm_axis(attrs["dim"], x.rank, "cumsum")
    return [x]


def _stable_sort(x, d, descending):
    return torch.sort(x, dim=d, descending=descending, stable=True)


def _topk_ref(a, x):
    v, i = _stable_sort(x, a["dim"], a["largest"])
    k = a["k"]
    return [v.narrow(a["dim"], 0, k).contiguous(), i.narrow(a["dim"], 0, k).contiguous()]


@op("topk", inputs=["x"], attrs={"k": Attr("dim"), "dim": Attr("int", -1), "largest": Attr("bool", True)},
    kind="reduce", ref=_topk_ref, flops=lambda a, ins, outs: numel(ins[0]) * 2)
def _topk(attrs, x):
    """topk(x) {k, dim=-1, largest=True} -> (values [.., k, ..] x.dtype, indices i64); ties: lowest index first."""
    d = norm_axis(attrs["dim"], x.rank, "topk")
    k = dim(attrs["k"])
    if isinstance(k, int) and isinstance(x.shape[d], int) and k > x.shape[d]:
        raise IRError(f"topk: k={k} > size {x.shape[d]} of dim {d}")
    shape = list(x.shape)
    shape[d] = k
    return [TensorType(tuple(shape), x.dtype), TensorType(tuple(shape), "i64")]


@op("sort", inputs=["x"], attrs={"dim": Attr("int", -1), "descending": Attr("bool", False)}, kind="reduce",
    ref=lambda a, x: list(_stable_sort(x, a["dim"], a["descending"])),
    flops=lambda a, ins, outs: numel(ins[0]) * 2)
def _sort(attrs, x):
    """sort(x) {dim, descending} -> (sorted values, i64 indices); stable."""
    norm_axis(attrs["dim"], x.rank, "sort")
    return [x, x.with_dtype("i64")]


@op("argsort", inputs=["x"], attrs={"dim": Attr("int", -1), "descending": Attr("bool", False)}, kind="reduce",
    ref=lambda a, x: [_stable_sort(x, a["dim"], a["descending"])[1]],
    flops=lambda a, ins, outs: numel(ins[0]) * 2)
def _argsort(attrs, x):
    """argsort(x) {dim, descending} -> i64 indices of a stable sort."""
    norm_axis(attrs["dim"], x.rank, "argsort")
    return [x.with_dtype("i64")]
