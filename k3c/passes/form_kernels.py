"""Pass `form_kernels` (kernels phase): cut the schedule into kernel groups and pick each group's backend.

Nodes are walked in schedule (graph) order; every node gets three meta stamps:
- `meta["kernel"]`: its group's name, `k<NNNN>_<kind>` numbered from 0 in schedule order (`k0042_pointwise`);
- `meta["backend"]`: "triton", "library" or "view" (see `k3c.codegen.groups`);
- `meta["kind"]`: the generator (triton) or the single op (library / view).

Rules, first match wins:
- model-level ops (`MODEL_OPS`): one triton group each, kind = the op name;
- layout ops (`VIEW_OPS`): one view group each, kind = the op name;
- row ops over the last dim (rms_norm, layer_norm, l2norm, softmax, sum / mean / amax / amin) on f32 / bf16 / f16:
  a triton "rowwise" group; the directly following elementwise nodes whose output shape equals the row op's
  output shape and which read a value of the group join it as its epilogue (rms_norm then `mul` by a vector);
- elementwise ops (`kind="elementwise"` in the registry, except `copy`) on non-fp8 values of rank <= 5: a triton
  "pointwise" group; a maximal run of consecutive such nodes with equal output shapes forms one group (inputs may
  broadcast to that shape);
- anything else (GEMMs, einsum, embedding, gather/scatter, sort/topk, creation ops, collectives, a softmax over
  another dim, fp8 elementwise, ...): one library group each, kind = the op name; the runtime performs it.

Groups are consecutive runs of the schedule, so the dependencies between launches stay those of the node order.
The pass changes no computation: it only writes meta. `kernel_groups(graph)` rebuilds the `KernelGroup`s from
the stamps, with the values each group reads and writes.
"""

from __future__ import annotations

from k3c.codegen.groups import KernelGroup
from k3c.errors import IRError, UnsupportedError
from k3c.ir.graph import Graph, Node, Value, describe
from k3c.ir.types import dims_equal
from k3c.passes.pipeline import register_pass

MODEL_OPS = frozenset({"kda_fused", "mla_attention", "dsa_index_topk", "attn_res_inter", "attn_res_merge",
                       "moe_route", "moe_experts"})
VIEW_OPS = frozenset({"reshape", "unsqueeze", "squeeze", "select", "slice", "expand", "transpose", "permute",
                      "split", "cat", "stack", "pad", "copy", "cache_write", "cache_append"})
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


def classify(node: Node) -> tuple[str, str]:
    """(backend, kind) of the group that `node` starts or joins (see the module docstring)."""
    if node.op in MODEL_OPS:
        return "triton", node.op
    if node.op in VIEW_OPS:
        return "view", node.op
    if is_row_op(node):
        return "triton", "rowwise"
    if is_elementwise(node):
        return "triton", "pointwise"
    return "library", node.op


def same_shape(a: tuple, b: tuple) -> bool:
    """Provably equal symbolic shapes (same rank, every dim equal)."""
    return len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b))


def plan_groups(graph: Graph) -> list[tuple[str, str, list[Node]]]:
    """The groups of `graph`'s schedule as (backend, kind, nodes), in order; does not change the graph."""
    groups: list[tuple[str, str, list[Node]]] = []
    open_shape = None          # output shape of the open pointwise / rowwise group that may still grow
    open_values: set[Value] = set()
    for node in graph.nodes:
        backend, kind = classify(node)
        if kind == "pointwise" and open_shape is not None:
            gkind = groups[-1][1]
            fits = same_shape(node.outputs[0].type.shape, open_shape)
            chained = gkind == "pointwise" or any(v in open_values for v in node.inputs)
            if fits and chained:
                groups[-1][2].append(node)
                open_values.update(node.outputs)
                continue
        groups.append((backend, kind, [node]))
        if kind in ("pointwise", "rowwise"):
            open_shape, open_values = node.outputs[0].type.shape, set(node.outputs)
        else:
            open_shape, open_values = None, set()
    return groups


def group_name(index: int, kind: str) -> str:
    """`k0042_pointwise`: the group's position in the schedule and its kind."""
    return f"k{index:04d}_{kind}"


@register_pass("form_kernels")
def form_kernels(graph: Graph) -> Graph:
    """Pass `form_kernels`: stamp `kernel` / `backend` / `kind` into every node's meta (in place; returns `graph`).

    Deterministic: the same graph always gets the same groups and names. The computation is unchanged.
    """
    for i, (backend, kind, nodes) in enumerate(plan_groups(graph)):
        name = group_name(i, kind)
        for node in nodes:
            node.meta["kernel"], node.meta["backend"], node.meta["kind"] = name, backend, kind
    return graph


def kernel_groups(graph: Graph) -> list[KernelGroup]:
    """The `KernelGroup`s of a graph stamped by `form_kernels`, in schedule order.

    `inputs`: values read by the group's nodes and defined outside it (graph inputs and params included), in
    first-use order. `outputs`: values defined in the group and read by a node of another group or a graph
    output, in definition order. Raises `IRError` if a node has no stamp, or a group is not one consecutive run
    of the schedule or mixes backends / kinds.
    """
    groups: list[KernelGroup] = []
    seen: set[str] = set()
    for node in graph.nodes:
        name = node.meta.get("kernel")
        if name is None:
            raise IRError(f"{describe(node)} has no kernel group; run the form_kernels pass first")
        if groups and groups[-1].name == name:
            g = groups[-1]
            if (node.meta.get("backend"), node.meta.get("kind")) != (g.backend, g.kind):
                raise IRError(f"kernel group {name} mixes {g.backend}/{g.kind} and "
                              f"{node.meta.get('backend')}/{node.meta.get('kind')} ({describe(node)})")
            g.nodes.append(node)
            continue
        if name in seen:
            raise IRError(f"kernel group {name} is not one consecutive run of the schedule ({describe(node)})")
        seen.add(name)
        groups.append(KernelGroup(name, node.meta.get("backend"), node.meta.get("kind"), [node]))
    graph_outputs = set(graph.outputs.values())
    for g in groups:
        members = set(g.nodes)
        defined = {v for n in g.nodes for v in n.outputs}
        reads: dict[Value, None] = {}
        for n in g.nodes:
            for v in n.inputs:
                if v not in defined:
                    reads.setdefault(v, None)
        g.inputs = list(reads)
        g.outputs = [v for n in g.nodes for v in n.outputs
                     if v in graph_outputs or any(u not in members for u in graph.users(v))]
    return groups
