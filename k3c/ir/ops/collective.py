"""Collectives: the ops whose result depends on the other ranks of a tensor-parallel group (kind "collective").

    all_reduce(x) {group}                 every rank gets Σ_r x_r
    reduce_scatter(x) {group, dim}        Σ_r x_r cut in `group` equal chunks along `dim`; rank r keeps chunk r
    all_gather(x) {group, dim}            every rank gets cat(x_0 .. x_{g-1}, dim)
    reduce_scatter_tokens(x [..., D])     Σ_r x_r with the leading dims flattened into N tokens, zero-padded to
        {group}  -> [1, ceil(N/g), D]     g·ceil(N/g) rows; rank r keeps rows [r·n, (r+1)·n)   (n = ceil(N/g))
    all_gather_tokens(x [1, n, D])        cat of every rank's rows, the padding dropped, reshaped to `shape`
        {group, shape} -> shape           (the inverse of the two token scatters)
    shard_tokens(x [..., D]) {group}      rank r's rows of x as reduce_scatter_tokens cuts them; no traffic (x is
        -> [1, ceil(N/g), D]              the same on every rank)

The token forms are what `split_allreduce` uses: a token shard is always [1, n, D], so the row-wise ops between a
reduce-scatter and the next all-gather (residual adds, the AttnRes merge, RMSNorm) keep their rank-3 signatures,
and any token count (decode at batch 1 included) splits over any group size: the padded rows are zeros, which
every row-wise op maps to finite values that the all-gather drops.

One graph serves every rank: a collective's output type does not depend on the rank, only its values do. The
single-process reference (`ref`) is the group of one (identity up to the token layout); a group of g needs every
rank's input at once: `simulate_collective(name, attrs, shards)` computes all ranks' outputs, and
`k3c.ir.interp_ranks.interpret_ranks` runs a graph on g simulated ranks with it. The runtime maps these ops onto
torch.distributed (`k3c/runtime/launchers/collective.py`).
"""

from __future__ import annotations

from typing import Callable

import sympy
import torch

from k3c.errors import IRError, UnsupportedError
from k3c.ir.ops.registry import Attr, norm_axis, op
from k3c.ir.types import TensorType, dim, itemsize, numel

Shards = list[torch.Tensor]


def _total(shards: Shards) -> torch.Tensor:
    return torch.stack(shards).sum(0).to(shards[0].dtype)


def token_rows(n_tokens: int, group: int) -> int:
    """Rows of one rank's token shard: ceil(n_tokens / group)."""
    return -(-n_tokens // group)


def _token_chunks(x: torch.Tensor, group: int) -> Shards:
    """x [..., D] as `group` chunks [1, ceil(N/g), D] of its zero-padded flattened rows."""
    rows = x.reshape(-1, x.shape[-1])
    n = token_rows(rows.shape[0], group)
    padded = torch.zeros((n * group, rows.shape[1]), dtype=x.dtype)
    padded[:rows.shape[0]] = rows
    return [c.unsqueeze(0).contiguous() for c in padded.chunk(group, 0)]


def _gather_tokens(attrs: dict, shards: Shards) -> torch.Tensor:
    shape = attrs["shape"]
    n = 1
    for d in shape[:-1]:
        n *= d
    return torch.cat([s[0] for s in shards], 0)[:n].reshape(shape).contiguous()


#: name -> fn(attrs, shards) -> outputs, rank by rank (attrs with dims already evaluated to ints).
SIMULATE: dict[str, Callable[[dict, Shards], Shards]] = {
    "all_reduce": lambda a, xs: [_total(xs).clone() for _ in xs],
    "reduce_scatter": lambda a, xs: [c.contiguous() for c in _total(xs).chunk(a["group"], a["dim"])],
    "all_gather": lambda a, xs: [torch.cat(xs, a["dim"]) for _ in xs],
    "reduce_scatter_tokens": lambda a, xs: _token_chunks(_total(xs), a["group"]),
    "all_gather_tokens": lambda a, xs: [_gather_tokens(a, xs) for _ in xs],
    "shard_tokens": lambda a, xs: [_token_chunks(x, a["group"])[r] for r, x in enumerate(xs)],
}


def simulate_collective(name: str, attrs: dict, shards: Shards) -> Shards:
    """Run collective `name` over all ranks at once: `shards[r]` is rank r's input; returns each rank's output.

    `attrs` as on the node (defaults filled in here; symbolic dims must already be ints). Raises `IRError` if
    len(shards) != group, `UnsupportedError` for an op that is not a collective.
    """
    if name not in SIMULATE:
        raise UnsupportedError(f"{name!r} is not a collective (collectives: {', '.join(sorted(SIMULATE))})")
    attrs = {"group": 1, "dim": 0, **attrs}
    if len(shards) != attrs["group"]:
        raise IRError(f"{name}: {len(shards)} shards for a group of {attrs['group']}")
    if name in ("reduce_scatter", "all_gather"):
        attrs["dim"] = norm_axis(attrs["dim"], shards[0].dim(), name)
    return SIMULATE[name](attrs, shards)


def _ref(name: str):
    def ref(attrs, x):
        if attrs["group"] != 1:
            raise UnsupportedError(f"{name} over a group of {attrs['group']} needs all ranks: interpret the graph "
                                   "with k3c.ir.interp_ranks.interpret_ranks")
        return simulate_collective(name, attrs, [x])

    return ref


def wire_bytes(name: str, attrs: dict, x: TensorType, out: TensorType):
    """Bytes one rank sends for this collective on a ring (Patarasuk & Yuan 2009): all-reduce 2(g−1)/g · |x|,
    reduce-scatter (g−1)/g · |x|, all-gather (g−1)/g · |out|, shard_tokens 0. Symbolic in the graph's dims."""
    g = attrs["group"]
    size = {"all_reduce": 2 * numel(x) * itemsize(x.dtype), "reduce_scatter": numel(x) * itemsize(x.dtype),
            "reduce_scatter_tokens": numel(out) * g * itemsize(x.dtype),
            "all_gather": numel(out) * itemsize(out.dtype),
            "all_gather_tokens": numel(x) * g * itemsize(x.dtype), "shard_tokens": 0}[name]
    return dim(sympy.sympify(size) * (g - 1) / g)


def _group(name: str, attrs: dict) -> int:
    if attrs["group"] < 1:
        raise IRError(f"{name}: group must be >= 1, got {attrs['group']}")
    return attrs["group"]


def _token_shard_type(name: str, attrs: dict, x: TensorType) -> list[TensorType]:
    g = _group(name, attrs)
    if x.rank < 2:
        raise IRError(f"{name}: expects [..., D] with at least one token dim, got {x}")
    n = sympy.Integer(1)
    for d in x.shape[:-1]:
        n = n * sympy.sympify(d)
    return [TensorType((1, dim(sympy.ceiling(n / g)), x.shape[-1]), x.dtype)]


def _sum_flops(a, ins, outs):
    return numel(ins[0])


@op("all_reduce", inputs=["x"], attrs={"group": Attr("int", 1), "reduce": Attr("str", "sum", ("sum",))},
    kind="collective", ref=_ref("all_reduce"), flops=_sum_flops)
def _all_reduce(attrs, x):
    """all_reduce(x) {group, reduce="sum"} -> x's type: the sum over the group's ranks."""
    _group("all_reduce", attrs)
    return [x]


@op("reduce_scatter", inputs=["x"], attrs={"group": Attr("int", 1), "dim": Attr("int", 0)}, kind="collective",
    ref=_ref("reduce_scatter"), flops=_sum_flops)
def _reduce_scatter(attrs, x):
    """reduce_scatter(x) {group, dim}: sum over ranks, each rank keeps 1/group of `dim` (must divide exactly)."""
    g, d = _group("reduce_scatter", attrs), norm_axis(attrs["dim"], x.rank, "reduce_scatter")
    size = x.shape[d]
    if isinstance(size, int) and size % g:
        raise IRError(f"reduce_scatter: dim {d} of {x} is not divisible by {g}")
    s = list(x.shape)
    s[d] = size // g if isinstance(size, int) else dim(size / g)
    return [x.with_shape(s)]


@op("all_gather", inputs=["x"], attrs={"group": Attr("int", 1), "dim": Attr("int", 0)}, kind="collective",
    ref=_ref("all_gather"), flops=lambda a, ins, outs: 0)
def _all_gather(attrs, x):
    """all_gather(x) {group, dim}: concatenation of every rank's x along `dim` (rank order)."""
    g, d = _group("all_gather", attrs), norm_axis(attrs["dim"], x.rank, "all_gather")
    s = list(x.shape)
    s[d] = dim(s[d] * g)
    return [x.with_shape(s)]


@op("reduce_scatter_tokens", inputs=["x"], attrs={"group": Attr("int", 1)}, kind="collective",
    ref=_ref("reduce_scatter_tokens"), flops=_sum_flops)
def _reduce_scatter_tokens(attrs, x):
    """reduce_scatter_tokens(x [..., D]) {group} -> [1, ceil(N/group), D]: summed, this rank's padded token rows."""
    return _token_shard_type("reduce_scatter_tokens", attrs, x)


@op("shard_tokens", inputs=["x"], attrs={"group": Attr("int", 1)}, kind="collective", ref=_ref("shard_tokens"),
    flops=lambda a, ins, outs: 0)
def _shard_tokens(attrs, x):
    """shard_tokens(x [..., D]) {group} -> [1, ceil(N/group), D]: this rank's padded token rows of a replicated x."""
    return _token_shard_type("shard_tokens", attrs, x)


@op("all_gather_tokens", inputs=["x"], attrs={"group": Attr("int", 1), "shape": Attr("dims")}, kind="collective",
    ref=_ref("all_gather_tokens"), flops=lambda a, ins, outs: 0)
def _all_gather_tokens(attrs, x):
    """all_gather_tokens(x [1, n, D]) {group, shape [..., D]} -> shape: every rank's rows, padding dropped."""
    g = _group("all_gather_tokens", attrs)
    shape = tuple(dim(d) for d in attrs["shape"])
    if x.rank != 3 or x.shape[0] != 1:
        raise IRError(f"all_gather_tokens: expects a token shard [1, n, D], got {x}")
    want = _token_shard_type("all_gather_tokens", {"group": g}, TensorType(shape, x.dtype))[0]
    if want.shape[2] != x.shape[2] or sympy.simplify(sympy.sympify(want.shape[1]) - sympy.sympify(x.shape[1])) != 0:
        raise IRError(f"all_gather_tokens: shard {x} does not match shape {list(shape)} over {g} ranks")
    return [TensorType(shape, x.dtype)]
