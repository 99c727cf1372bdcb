"""Shape and indexing ops: reshape, permute, transpose, expand, slice, select, unsqueeze, squeeze, cat, stack,
split, pad, index_select, gather, scatter, embedding.

Dim attrs (`shape`, `start`, `end`, `sizes`, `pads`, `index`) may be symbolic strings (`"L+T"`, `"T-1"`); the
interpreter evaluates them before calling `ref`. `reshape` is the only reshaping op (the frontend maps aten
`view`, `_unsafe_view`, `reshape`, `flatten`, `unflatten` to it); reshape/expand/(un)squeeze cost no bytes (views).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3c.errors import IRError
from k3c.ir.ops.registry import Attr, need_dtype, need_eq, norm_axis, op, zero_cost
from k3c.ir.types import TensorType, dim, numel

_INDEX = {"i64", "i32"}


@op("reshape", inputs=["x"], attrs={"shape": Attr("dims")}, kind="shape", bytes=zero_cost, flops=zero_cost,
    ref=lambda a, x: [x.reshape(a["shape"])])
def _reshape(attrs, x):
    """reshape(x) {shape}: same elements, new shape; at most one -1 (inferred, may be symbolic)."""
    shape = [dim(d) for d in attrs["shape"]]
    if sum(1 for d in shape if d == -1) > 1:
        raise IRError(f"reshape: more than one -1 in {attrs['shape']}")
    known = 1
    for d in shape:
        if d != -1:
            known = known * d
    total = numel(x)
    if -1 in shape:
        rest = dim(total / known) if not (isinstance(total, int) and isinstance(known, int)) else None
        if rest is None:
            if known == 0 or total % known:
                raise IRError(f"reshape: {x} cannot become {attrs['shape']}")
            rest = total // known
        shape = [rest if d == -1 else d for d in shape]
    else:
        need_eq("reshape", total, dim(known), f"element count of {x} vs shape {attrs['shape']}")
    return [TensorType(tuple(shape), x.dtype)]


@op("permute", inputs=["x"], attrs={"dims": Attr("ints")}, kind="shape", flops=zero_cost,
    ref=lambda a, x: [x.permute(a["dims"]).contiguous()])
def _permute(attrs, x):
    """permute(x) {dims}: out.shape[i] = x.shape[dims[i]]."""
    dims = [norm_axis(d, x.rank, "permute") for d in attrs["dims"]]
    if sorted(dims) != list(range(x.rank)):
        raise IRError(f"permute: {attrs['dims']} is not a permutation of rank {x.rank}")
    return [x.with_shape(x.shape[d] for d in dims)]


@op("transpose", inputs=["x"], attrs={"dim0": Attr("int"), "dim1": Attr("int")}, kind="shape", flops=zero_cost,
    ref=lambda a, x: [x.transpose(a["dim0"], a["dim1"]).contiguous()])
def _transpose(attrs, x):
    """transpose(x) {dim0, dim1}: swap two dims."""
    a, b = norm_axis(attrs["dim0"], x.rank, "transpose"), norm_axis(attrs["dim1"], x.rank, "transpose")
    s = list(x.shape)
    s[a], s[b] = s[b], s[a]
    return [x.with_shape(s)]


@op("expand", inputs=["x"], attrs={"shape": Attr("dims")}, kind="shape", bytes=zero_cost, flops=zero_cost,
    ref=lambda a, x: [x.expand(a["shape"])])
def _expand(attrs, x):
    """expand(x) {shape}: broadcast size-1 dims (and new leading dims) to `shape`; -1 keeps a dim."""
    shape = [dim(d) for d in attrs["shape"]]
    if len(shape) < x.rank:
        raise IRError(f"expand: shape {attrs['shape']} has lower rank than {x}")
    lead = len(shape) - x.rank
    out = list(shape[:lead])
    for d, t in zip(shape[lead:], x.shape):
        if d == -1:
            out.append(t)
        elif t == 1 or t == d:
            out.append(d)
        else:
            raise IRError(f"expand: {x} cannot expand to {attrs['shape']}")
    return [x.with_shape(out)]


def _slice_bounds(attrs, size):
    start = dim(attrs["start"])
    end = size if attrs["end"] is None else dim(attrs["end"])
    if isinstance(start, int) and start < 0:
        start = size + start
    if isinstance(end, int) and end < 0:
        end = size + end
    if isinstance(end, int) and isinstance(size, int):
        end = min(end, size)
    return start, end


def _slice_ref(a, x):
    d = a["dim"]
    start, end = _slice_bounds(a, x.shape[d])
    idx = [slice(None)] * x.dim()
    idx[d] = slice(start, end, a["step"])
    return [x[tuple(idx)].contiguous()]


@op("slice", inputs=["x"], attrs={"dim": Attr("int"), "start": Attr("dim", 0), "end": Attr("dim", None),
                                  "step": Attr("int", 1)}, kind="shape", flops=zero_cost, ref=_slice_ref)
def _slice(attrs, x):
    """slice(x) {dim, start=0, end=None (to the end), step=1}: x[..., start:end:step, ...]; bounds may be symbolic."""
    d = norm_axis(attrs["dim"], x.rank, "slice")
    if attrs["step"] < 1:
        raise IRError("slice: step must be >= 1")
    start, end = _slice_bounds(attrs, x.shape[d])
    length = dim((end - start + attrs["step"] - 1) // attrs["step"]) if attrs["step"] != 1 else dim(end - start)
    if isinstance(length, int) and length < 0:
        raise IRError(f"slice: empty/negative range {attrs} on {x}")
    s = list(x.shape)
    s[d] = length
    return [x.with_shape(s)]


@op("select", inputs=["x"], attrs={"dim": Attr("int"), "index": Attr("dim")}, kind="shape", flops=zero_cost,
    ref=lambda a, x: [x.select(a["dim"], a["index"]).contiguous()])
def _select(attrs, x):
    """select(x) {dim, index}: x[..., index, ...] dropping that dim; index may be negative or symbolic (`T-1`)."""
    d = norm_axis(attrs["dim"], x.rank, "select")
    return [x.with_shape(x.shape[:d] + x.shape[d + 1:])]


@op("unsqueeze", inputs=["x"], attrs={"dim": Attr("int")}, kind="shape", bytes=zero_cost, flops=zero_cost,
    ref=lambda a, x: [x.unsqueeze(a["dim"])])
def _unsqueeze(attrs, x):
    """unsqueeze(x) {dim}: insert a size-1 dim at `dim` (range -rank-1..rank)."""
    d = norm_axis(attrs["dim"], x.rank + 1, "unsqueeze")
    return [x.with_shape(x.shape[:d] + (1,) + x.shape[d:])]


def _squeeze_ref(a, x):
    dims = [d % x.dim() for d in a["dims"]] if a["dims"] is not None else [i for i, s in enumerate(x.shape) if s == 1]
    return [x.reshape([s for i, s in enumerate(x.shape) if i not in dims])]


@op("squeeze", inputs=["x"], attrs={"dims": Attr("ints", None)}, kind="shape", bytes=zero_cost, flops=zero_cost,
    ref=_squeeze_ref)
def _squeeze(attrs, x):
    """squeeze(x) {dims}: drop the listed dims, which must be 1 (dims=None: every static size-1 dim)."""
    if attrs["dims"] is None:
        dims = [i for i, s in enumerate(x.shape) if s == 1]
    else:
        dims = [norm_axis(d, x.rank, "squeeze") for d in attrs["dims"]]
        for d in dims:
            if x.shape[d] != 1:
                raise IRError(f"squeeze: dim {d} of {x} is not 1")
    return [x.with_shape(s for i, s in enumerate(x.shape) if i not in dims)]


@op("cat", inputs=["*xs"], attrs={"dim": Attr("int", 0)}, kind="shape", flops=zero_cost,
    ref=lambda a, *xs: [torch.cat(xs, a["dim"])])
def _cat(attrs, *xs):
    """cat(*xs) {dim}: concatenate along dim (sizes add symbolically: `L` and `T` give `L + T`)."""
    r = xs[0].rank
    d = norm_axis(attrs["dim"], r, "cat")
    total = 0
    for x in xs:
        if x.rank != r or x.dtype != xs[0].dtype:
            raise IRError(f"cat: inputs {', '.join(map(str, xs))} differ in rank or dtype")
        for i in range(r):
            if i != d:
                need_eq("cat", x.shape[i], xs[0].shape[i], f"dim {i}")
        total = total + x.shape[d]
    s = list(xs[0].shape)
    s[d] = dim(total)
    return [xs[0].with_shape(s)]


@op("stack", inputs=["*xs"], attrs={"dim": Attr("int", 0)}, kind="shape", flops=zero_cost,
    ref=lambda a, *xs: [torch.stack(xs, a["dim"])])
def _stack(attrs, *xs):
    """stack(*xs) {dim}: stack equal-typed tensors along a new dim."""
    for x in xs[1:]:
        if x != xs[0]:
            raise IRError(f"stack: inputs {', '.join(map(str, xs))} differ")
    d = norm_axis(attrs["dim"], xs[0].rank + 1, "stack")
    s = xs[0].shape
    return [xs[0].with_shape(s[:d] + (len(xs),) + s[d:])]


def _split_ref(a, x):
    return [t.contiguous() for t in torch.split(x, list(a["sizes"]), a["dim"])]


@op("split", inputs=["x"], attrs={"sizes": Attr("dims"), "dim": Attr("int", 0)}, kind="shape", flops=zero_cost,
    ref=_split_ref)
def _split(attrs, x):
    """split(x) {sizes, dim}: one output per size; sizes must add up to the dim."""
    d = norm_axis(attrs["dim"], x.rank, "split")
    sizes = [dim(s) for s in attrs["sizes"]]
    need_eq("split", dim(sum(sizes[1:], sizes[0])), x.shape[d], "sizes must add up to the split dim")
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[d] = s
        outs.append(x.with_shape(shape))
    return outs


@op("pad", inputs=["x"], attrs={"pads": Attr("dims"), "value": Attr("float", 0.0)}, kind="shape",
    flops=zero_cost, ref=lambda a, x: [F.pad(x, list(a["pads"]), value=a["value"])])
def _pad(attrs, x):
    """pad(x) {pads, value}: constant pad, torch order (last dim first: [left, right, before, after, ...])."""
    pads = [dim(p) for p in attrs["pads"]]
    if len(pads) % 2 or len(pads) // 2 > x.rank:
        raise IRError(f"pad: bad pads {attrs['pads']} for {x}")
    s = list(x.shape)
    for i in range(len(pads) // 2):
        s[x.rank - 1 - i] = dim(s[x.rank - 1 - i] + pads[2 * i] + pads[2 * i + 1])
    return [x.with_shape(s)]


@op("index_select", inputs=["x", "index"], attrs={"dim": Attr("int")}, kind="shape", flops=zero_cost,
    ref=lambda a, x, i: [torch.index_select(x, a["dim"], i.long())])
def _index_select(attrs, x, index):
    """index_select(x, index: i64/i32 [n]) {dim}: rows `index` of dim -> that dim becomes n."""
    need_dtype("index_select", index, _INDEX, "index")
    if index.rank != 1:
        raise IRError(f"index_select: index must be 1-d, got {index}")
    d = norm_axis(attrs["dim"], x.rank, "index_select")
    s = list(x.shape)
    s[d] = index.shape[0]
    return [x.with_shape(s)]


@op("gather", inputs=["x", "index"], attrs={"dim": Attr("int")}, kind="shape", flops=zero_cost,
    ref=lambda a, x, i: [torch.gather(x, a["dim"], i.long())])
def _gather(attrs, x, index):
    """gather(x, index) {dim}: out[i][j] = x[index[i][j]][j] along dim (torch.gather); out has index's shape."""
    need_dtype("gather", index, _INDEX, "index")
    if index.rank != x.rank:
        raise IRError(f"gather: index {index} and x {x} differ in rank")
    norm_axis(attrs["dim"], x.rank, "gather")
    return [index.with_dtype(x.dtype)]


def _scatter_ref(a, x, i, src):
    if a["reduce"] == "add":
        return [torch.scatter_add(x, a["dim"], i.long(), src)]
    return [torch.scatter(x, a["dim"], i.long(), src)]


@op("scatter", inputs=["x", "index", "src"], attrs={"dim": Attr("int"), "reduce": Attr("str", "none",
                                                                                        ("none", "add"))},
    kind="shape", flops=lambda a, ins, outs: numel(ins[2]) if a["reduce"] == "add" else 0, ref=_scatter_ref)
def _scatter(attrs, x, index, src):
    """scatter(x, index, src) {dim, reduce="none"|"add"}: torch.scatter / scatter_add; out has x's type.

    With reduce="none" and repeated indices the winner is unspecified (as in torch).
    """
    need_dtype("scatter", index, _INDEX, "index")
    if src.dtype != x.dtype or index.rank != x.rank or src.rank != x.rank:
        raise IRError(f"scatter: x {x}, index {index}, src {src} disagree")
    norm_axis(attrs["dim"], x.rank, "scatter")
    return [x]


@op("embedding", inputs=["weight", "ids"], kind="shape", flops=zero_cost,
    ref=lambda a, w, i: [F.embedding(i.long(), w)])
def _embedding(attrs, w, ids):
    """embedding(weight [V, D], ids [...] i64/i32) -> [..., D] weight.dtype."""
    need_dtype("embedding", ids, _INDEX, "ids")
    if w.rank != 2:
        raise IRError(f"embedding: weight must be [V, D], got {w}")
    return [TensorType(ids.shape + (w.shape[1],), w.dtype)]
