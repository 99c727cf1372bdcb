"""Pass `form_kernels` (kernels phase): cut the schedule into launches, each claimed by a backend.

Two steps. The fusion proposal walks the nodes in schedule order, first rule wins:
- model-level ops (`MODEL_OPS`): one group each, kind = the op name;
- layout ops (`VIEW_OPS`): one group each, kind = the op name;
- row ops over the last dim (rms_norm, layer_norm, l2norm, softmax, sum / mean / amax / amin) on f32 / bf16 / f16:
  a "rowwise" group; the directly following elementwise nodes whose output shape equals the row op's output shape
  and which read a value of the group join it as its epilogue (rms_norm then `mul` by a vector);
- elementwise ops (`kind="elementwise"` in the registry, except `copy`) on non-fp8 values of rank <= 5: a
  "pointwise" group; a maximal run of consecutive such nodes with equal output shapes forms one group (inputs may
  broadcast to that shape);
- anything else (GEMMs, einsum, embedding, gather/scatter, sort/topk, creation ops, collectives, ...): one group
  each, kind = the op name.
Then each `attn_res_merge` whose output only a following rowwise group's norm reads becomes a row op itself
(`fuse_attn_res_rows`): the pointwise group that computes its partial (the residual adds) and the reshapes between
them (views that keep the rows), the merge and the norm group (with its epilogue) form one "attn_res_row" group,
one program per row instead of three launches (K3: per sublayer). The pointwise outputs read elsewhere (the
residual stream) stay outputs of the fused group. Only where the backend that would take the merge also takes
the fused kind (Triton; TVM keeps the three launches).
Then each proposed group goes to the first backend of `ctx.backends` (the target's claim order, see
`k3c.codegen.backend`) that claims it; a fused group nobody claims is offered node by node (`assign_backends`).

The result is `graph.kernels`: `KernelSpan`s (name `<entry>_k<NNNN>_<kind>`, numbered in schedule order, backend,
kind, node range), consecutive runs of the schedule, so the dependencies between launches stay those of the node
order. The pass changes no node. `k3c.ir.kernels.kernel_groups(graph)` resolves the spans into typed
`KernelGroup`s with the values each launch reads and writes.
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.errors import UnsupportedError
from k3c.ir.graph import Graph, Node, Value, describe
from k3c.ir.kernels import KernelSpan
from k3c.ir.types import dims_equal
from k3c.passes.common import NORM_ROW_OPS, is_elementwise, is_row_op, same_shape
from k3c.passes.pipeline import register_pass

MODEL_OPS = frozenset({"kda_fused", "mla_attention", "dsa_index_topk", "attn_res_inter", "attn_res_merge",
                       "moe_route", "moe_experts"})
VIEW_OPS = frozenset({"reshape", "unsqueeze", "squeeze", "select", "slice", "expand", "transpose", "permute",
                      "split", "cat", "stack", "pad", "copy", "cache_write", "cache_append"})
def fusion_kind(node: Node) -> str:
    """The kind of group `node` starts or joins (module docstring): a model op's name, "rowwise", "pointwise", or
    the op's own name (a single-node launch: view, library)."""
    if node.op in MODEL_OPS or node.op in VIEW_OPS:
        return node.op
    if is_row_op(node):
        return "rowwise"
    if is_elementwise(node):
        return "pointwise"
    return node.op


def group_name(index: int, kind: str, entry: str | None = None) -> str:
    """`decode_k0042_pointwise`: the entry point, the launch's position in the schedule and its kind."""
    return (f"{entry}_" if entry else "") + f"k{index:04d}_{kind}"


def propose_groups(graph: Graph) -> list[tuple[str, list[Node]]]:
    """The fusion proposal for `graph`'s schedule as (kind, nodes), in order; does not change the graph."""
    groups: list[tuple[str, list[Node]]] = []
    open_shape = None          # output shape of the open pointwise / rowwise group that may still grow
    open_values: set[Value] = set()
    for node in graph.nodes:
        kind = fusion_kind(node)
        if kind == "pointwise" and open_shape is not None:
            gkind = groups[-1][0]
            fits = same_shape(node.outputs[0].type.shape, open_shape)
            chained = gkind == "pointwise" or any(v in open_values for v in node.inputs)
            if fits and chained:
                groups[-1][1].append(node)
                open_values.update(node.outputs)
                continue
        groups.append((kind, [node]))
        if kind in ("pointwise", "rowwise"):
            open_shape, open_values = node.outputs[0].type.shape, set(node.outputs)
        else:
            open_shape, open_values = None, set()
    return groups


def _rows(shape: tuple) -> list:
    """The row dims of a shape (all but the last, size-1 dims dropped): reshapes that keep them keep the rows."""
    return [d for d in shape[:-1] if not (isinstance(d, int) and d == 1)]


def _same_rows(a: Value, b: Value) -> bool:
    ra, rb = _rows(a.type.shape), _rows(b.type.shape)
    return (a.type.rank >= 1 and b.type.rank >= 1 and dims_equal(a.type.shape[-1], b.type.shape[-1])
            and len(ra) == len(rb) and all(dims_equal(x, y) for x, y in zip(ra, rb)))


def _merge_row_group(graph: Graph, groups: list[tuple[str, list[Node]]], i: int) -> int | None:
    """For the attn_res_merge group at `groups[i]`: the index of the first group of its fused row group (module
    docstring), or None when it does not fuse: groups [first, i + 1] are ([pointwise,] reshape*, merge, rowwise), the
    reshapes a chain from the pointwise group (or a group input) to the merge's partial, every value of the
    pointwise group with the merge's rows."""
    merge = groups[i][1][0]
    h, partial = merge.outputs[0], merge.inputs[2]
    if i + 1 >= len(groups) or groups[i + 1][0] != "rowwise":
        return None
    norm = groups[i + 1][1][0]
    if norm.op not in NORM_ROW_OPS or norm.inputs[0] is not h or graph.is_output(h) or \
            any(u is not norm for u in graph.users(h)) or h in norm.inputs[1:]:
        return None
    first, want = i, partial
    while first > 0 and groups[first - 1][0] == "reshape":
        (view,) = groups[first - 1][1]
        if view.outputs[0] is not want or not _same_rows(view.inputs[0], h):
            break
        first, want = first - 1, view.inputs[0]
    if first > 0 and groups[first - 1][0] == "pointwise":
        nodes = groups[first - 1][1]
        made = {v for n in nodes for v in n.outputs}
        if want in made and all(_same_rows(v, h) for n in nodes for v in list(n.inputs) + n.outputs):
            return first - 1
    return first


def fuse_attn_res_rows(graph: Graph, groups: list[tuple[str, list[Node]]]) -> list[tuple[str, list[Node]]]:
    """`groups` (the proposal) with every fusable AttnRes merge and its neighbours as one "attn_res_row" group
    (module docstring)."""
    spans = {}                                           # first group -> merge group, of each fused run
    for j, (kind, _) in enumerate(groups):
        if kind == "attn_res_merge":
            start = _merge_row_group(graph, groups, j)
            if start is not None:
                spans[start] = j
    out: list[tuple[str, list[Node]]] = []
    i = 0
    while i < len(groups):
        if i in spans:
            out.append(("attn_res_row", [n for _, nodes in groups[i:spans[i] + 2] for n in nodes]))
            i = spans[i] + 2
        else:
            out.append(groups[i])
            i += 1
    return out


def assign_backends(proposal: list[tuple[str, list[Node]]], backends) -> list[tuple[str, str, list[Node]]]:
    """(backend, kind, nodes) per launch: each proposed group goes to the first of `backends` that claims it; a
    fused group no backend claims is split into its nodes, each offered as a group of one of the same kind and
    then as a single op (kind = the op's name). Raises UnsupportedError naming the op, the backends and their
    reasons (`Backend.why_not`) when no backend claims a node."""
    out: list[tuple[str, str, list[Node]]] = []
    for kind, nodes in proposal:
        owner = next((b.name for b in backends if b.claims(kind, nodes)), None)
        if owner is not None:
            out.append((owner, kind, nodes))
            continue
        for node in nodes:
            for k in dict.fromkeys((kind, node.op)):
                owner = next((b.name for b in backends if b.claims(k, [node])), None)
                if owner is not None:
                    out.append((owner, k, [node]))
                    break
            else:
                why = [f"{b.name}: {r}" for b in backends if (r := b.why_not(kind, [node]))]
                raise UnsupportedError(f"no backend implements {describe(node)} (kind {kind}; backends in claim "
                                       f"order: {', '.join(b.name for b in backends)})"
                                       + "".join(f"; {w}" for w in why))
    return out


@register_pass("form_kernels")
def form_kernels(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `form_kernels`: set `graph.kernels` to the launches (module docstring); the nodes are unchanged.

    Deterministic: the same graph and context always give the same launches and names.
    """
    proposal = propose_groups(graph)
    merger = next((b for b in ctx.backends if b.claims("attn_res_merge", [])), None)
    if merger is not None and merger.claims("attn_res_row", []):
        proposal = fuse_attn_res_rows(graph, proposal)
    spans, at = [], 0
    for i, (backend, kind, nodes) in enumerate(assign_backends(proposal, ctx.backends)):
        spans.append(KernelSpan(group_name(i, kind, ctx.entry), backend, kind, at, len(nodes)))
        at += len(nodes)
    graph.kernels = spans
    return graph
