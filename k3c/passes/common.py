"""Helpers shared by several passes: recognisers of normalisation chains, the kernel former's classes of nodes
(elementwise, row ops: `form_kernels`, `sink_views`), node-order surgery, and the
tensor-parallel rewrites that shard_tp and shard_experts share (parameter shards, collectives behind a value,
per-rank id maps).

Passes do not import each other; what two of them need lives here (or, for generic IR rewriting, in
`k3c.ir.rewrite`). Recognisers return the matched parts or None and never change the graph.
"""

from __future__ import annotations

from k3c.errors import ConfigError, IRError, UnsupportedError
from k3c.ir.graph import Graph, Node, Value
from k3c.ir.rewrite import P, X, match
from k3c.ir.types import TensorType, dims_equal
from k3c.passes.derived import add_derived_param, prune_unused_params


# ---- normalisation chains: x * rsqrt(reduce(x^2, -1, keepdim) + eps) ----------------------------------------------
def _last_dim_keep(node: Node) -> bool:
    """A reduction over the last dim only, keepdim=True."""
    dims, rank = node.attrs.get("dims"), node.inputs[0].type.rank
    return node.attrs.get("keepdim") is True and dims is not None and len(dims) == 1 and dims[0] in (-1, rank - 1)


def _eps_add(node: Node) -> bool:
    return len(node.inputs) == 1 and node.attrs.get("scalar") is not None


def _square(name: str) -> tuple:
    return (P("pow", X(name), attrs={"exponent": 2.0}, single_use=True),
            P("mul", X(name), X(name), single_use=True))


def _norm_chain(reduce_op: str) -> list[P]:
    """x * rsqrt(reduce(x², -1, keepdim) + eps), both operand orders, x² as pow or x·x; root captured 'root'."""
    pats = []
    for sq in _square("x"):
        r = P("rsqrt", P("add", P(reduce_op, sq, where=_last_dim_keep, single_use=True, name="red"),
                         where=_eps_add, single_use=True, name="eps"), single_use=True)
        pats += [P("mul", X("x"), r, name="root"), P("mul", r, X("x"), name="root")]
    return pats


RMS_CHAINS = _norm_chain("mean")
L2_CHAINS = _norm_chain("sum")


def _chain_parts(graph: Graph, v: Value, pats: list[P]) -> tuple[Value, float, list[Node]] | None:
    node = graph.producer(v)
    if node is None or node.op != "mul":
        return None
    for pat in pats:
        m = match(graph, pat, node)
        if m is not None:
            return m["x"], m["eps"].attrs["scalar"], list(m.nodes)
    return None


def l2_parts(graph: Graph, v: Value) -> tuple[Value, float, list[Node]] | None:
    """If `v` is an l2norm over the last dim (op or decomposed chain): (x, eps, matched nodes), else None."""
    node = graph.producer(v)
    if node is not None and node.op == "l2norm" and node.attrs["dim"] in (-1, v.type.rank - 1):
        return node.inputs[0], node.attrs["eps"], [node]
    return _chain_parts(graph, v, L2_CHAINS)


def rms_parts(graph: Graph, v: Value) -> tuple[Value, Value | None, float, list[Node]] | None:
    """If `v` is an RMSNorm over the last dim, with or without weight, as the op or the decomposed chain (weight
    as a trailing `mul` by a [D] value): (x, weight or None, eps, matched nodes), else None."""
    node = graph.producer(v)
    if node is None:
        return None
    if node.op == "rms_norm":
        return node.inputs[0], (node.inputs[1] if len(node.inputs) > 1 else None), node.attrs["eps"], [node]
    if node.op == "mul" and len(node.inputs) == 2:
        for a, w in (node.inputs, node.inputs[::-1]):
            if w.type.rank == 1 and dims_equal(w.type.shape[0], v.type.shape[-1]) and len(graph.users(a)) == 1:
                inner = rms_parts(graph, a)
                if inner is not None and inner[1] is None:
                    return inner[0], w, inner[2], inner[3] + [node]
    got = _chain_parts(graph, v, RMS_CHAINS)
    return None if got is None else (got[0], None, got[1], got[2])


# ---- node order -------------------------------------------------------------------------------------------------
def skip_cast(graph: Graph, v: Value) -> Value:
    """`v` with any chain of `cast` producers peeled off."""
    n = graph.producer(v)
    while n is not None and n.op == "cast":
        v = n.inputs[0]
        n = graph.producer(v)
    return v


def reorder(graph: Graph, before: dict[int, list[Node]], moved: set[int]) -> None:
    """Rebuild `graph.nodes` in one sweep: every node listed in `before[id(anchor)]` is emitted (in list order)
    right before `anchor` instead of at its own place (new nodes appended at the end, moved nodes); nodes in
    `moved` (ids) leave their place. Raises `IRError` if that loses or duplicates a node."""
    placed = moved | {id(m) for lst in before.values() for m in lst}
    out: list[Node] = []
    for n in graph.nodes:
        out.extend(before.get(id(n), ()))
        if id(n) not in placed:
            out.append(n)
    if len(out) != len(graph.nodes):
        raise IRError(f"reorder lost or duplicated nodes ({len(graph.nodes)} -> {len(out)}): an anchor is missing")
    graph.nodes = out


# ---- tensor-parallel shards (shard_tp, shard_experts) -------------------------------------------------------------
def shard_param(graph: Graph, key: str, dim: int, parts: int) -> Value:
    """Replace parameter `key` by `<key>.shard`: a rank's block of `parts` along `dim` (derivation "shard", so each
    rank's weight file holds its own block under the same key). Uses of the old value are redirected and it is
    dropped. Raises `ConfigError` naming the key when `parts` does not divide the dim."""
    old = graph.params[key]
    size = old.type.shape[dim]
    if not isinstance(size, int) or size % parts:
        raise ConfigError(f"--tp/--ep {parts} does not divide dim {dim} of parameter {key} {old.type}")
    shape = list(old.type.shape)
    shape[dim] = size // parts
    new = add_derived_param(graph, key + ".shard", old.type.with_shape(shape), "shard", [key],
                            {"dim": dim, "parts": parts})
    graph.replace_all_uses(old, new, check_type=False)
    prune_unused_params(graph, [key])
    return new


def wrap_value(graph: Graph, x: Value, op: str, pass_name: str, **attrs) -> Value:
    """Insert `op(x, **attrs)` right after x's producer and make every other reader of `x` (and the graph outputs)
    read the result instead; returns it. Used to put a collective behind a partial result."""
    node = graph.producer(x)
    with graph.inserting_after(node):
        y = graph.add(op, x, name_hint=f"{x.name}.{op}", meta={**node.meta, "pass": pass_name}, **attrs)
    graph.replace_all_uses(x, y, exclude=[graph.producer(y)], check_type=False)
    return y


def local_rows(graph: Graph, key: str, ids: Value, before: Node, pass_name: str, missing: str,
               parts: int) -> Value:
    """`ids` (i64, any shape) mapped through this rank's row map of parameter `key` (a derived i64 [n, 1]
    parameter `<key>.local_ids`, derivation "local_index": global row -> local row, else `missing`, "zero_row"
    or "minus_one"), as embedding(map, ids) reshaped to ids' shape; inserted before `before`. Vocabulary-parallel
    embeddings (shard_tp) and partitioned experts (shard_experts) renumber their ids this way."""
    n = graph.params[key].type.shape[0]
    rmap = add_derived_param(graph, key + ".local_ids", TensorType((n, 1), "i64"), "local_index", [key],
                             {"parts": parts, "missing": missing})
    meta = {**before.meta, "pass": pass_name}
    with graph.inserting_before(before):
        local = graph.add("embedding", rmap, ids, name_hint=f"{ids.name}.local", meta=meta)
        return graph.add("reshape", local, shape=[d if isinstance(d, int) else str(d) for d in ids.type.shape],
                         name_hint=f"{ids.name}.local", meta=meta)


# ---- node classes of the kernel former (form_kernels, sink_views) ----------------------------------------------
#: Row ops always over the last dim / with a `dim` attr / with a `dims` attr.
NORM_ROW_OPS = frozenset({"rms_norm", "layer_norm"})
DIM_ROW_OPS = frozenset({"l2norm", "softmax"})
REDUCE_ROW_OPS = frozenset({"sum", "mean", "amax", "amin"})
ROW_DTYPES = frozenset({"f32", "bf16", "f16"})
#: The generated pointwise kernels index through per-dim broadcast strides for at most this many dims.
MAX_POINTWISE_RANK = 5


def _op_kind(op: str) -> str:
    from k3c.ir.ops import get_op

    try:
        return get_op(op).kind
    except UnsupportedError:
        return "other"


def is_elementwise(node: Node) -> bool:
    """True when `node` can be computed by a generated pointwise kernel: a registry elementwise op other than
    `copy` (a view-backend copy), one output of rank <= 5, no fp8 value."""
    if node.op == "copy" or _op_kind(node.op) != "elementwise" or len(node.outputs) != 1:
        return False
    vals = list(node.inputs) + node.outputs
    return all(v.type.dtype != "f8e4m3" for v in vals) and node.outputs[0].type.rank <= MAX_POINTWISE_RANK


def is_row_op(node: Node) -> bool:
    """True when `node` is a norm / softmax / reduction over the last dim of a tensor of rank >= 1, with only
    f32/bf16/f16 inputs and outputs."""
    x = node.inputs[0].type if node.inputs else None
    if x is None or x.rank < 1 or any(v.type.dtype not in ROW_DTYPES for v in node.inputs + node.outputs):
        return False
    if node.op in NORM_ROW_OPS:
        return True
    if node.op in DIM_ROW_OPS:
        return node.attrs["dim"] % x.rank == x.rank - 1
    if node.op in REDUCE_ROW_OPS:
        dims = node.attrs["dims"]
        dims = list(range(x.rank)) if dims is None else [d % x.rank for d in dims]
        return dims == [x.rank - 1]
    return False


def same_shape(a: tuple, b: tuple) -> bool:
    """Provably equal symbolic shapes (same rank, every dim equal)."""
    return len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b))
