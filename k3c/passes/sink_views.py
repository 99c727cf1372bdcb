"""Pass `sink_views` (kernels phase, before `form_kernels`): views move below what reads them, so that producers
and their elementwise readers become adjacent.

`form_kernels` fuses only nodes that are adjacent in the schedule: a rowwise group takes the elementwise nodes
that directly follow its row op, a pointwise group the next elementwise nodes. A view (reshape, unsqueeze, slice,
...) is a launch of its own (the view backend: no kernel, an alias) and separates what it stands between. Two
moves, both exact:

1. An elementwise op n reading a reshape of z, where z comes from an elementwise or row op with only views between
   it and n, becomes the reshape of n computed in z's shape: n(a, reshape(z)) -> reshape(n(reshape(a), z)), its
   other operands (of n's own shape, made before z) viewed in z's shape just before z's producer. n then follows
   z's producer directly and joins its kernel (elementwise ops do not see shapes).
2. A pure view moves below the nodes right after it that read its input but not the view ("siblings": they
   depend on what the view depends on, and the view's users come later still). A view only moves where it
   separates a producer from a reader that could join its kernel; views elsewhere stay, so no chain is cut.

The router's f32 copy of the normed MoE input (models/layers.py `F.linear(xf.float(), ...)`, xf a reshape of the
norm) is the case in the model:

    y = rms_norm(x); xf = reshape(y); c = cast(xf)   ->   y = rms_norm(x); c' = cast(y); xf = reshape(y); c = reshape(c')
    two launches (rowwise, pointwise)                    one rowwise launch (the cast is its epilogue)

Runs after the model lowerings, which match the frontend's shapes (here `lower_moe` matches the router reading
xf). Only side-effect-free views move (`cache_append` / `cache_write` write a pool, `cat` / `copy` are copies);
graph outputs and unused views stay. O(nodes).
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.ir.graph import Graph
from k3c.ir.ops import get_op
from k3c.ir.rewrite import dce_in_place
from k3c.passes.common import is_row_op, same_shape
from k3c.passes.pipeline import register_pass

PASS = "sink_views"
#: pure views: their only effect is an alias of their input
VIEWS = frozenset({"reshape", "unsqueeze", "squeeze", "select", "slice", "expand", "transpose", "permute"})


def _shape_attr(v) -> list:
    return [d if isinstance(d, int) else str(d) for d in v.type.shape]


def _elementwise_before_reshape(graph: Graph) -> int:
    """Move 1 (module docstring); returns the number of rewrites."""
    nodes = list(graph.nodes)
    pos = {id(n): i for i, n in enumerate(nodes)}
    count = 0
    for i, n in enumerate(nodes):
        if get_op(n.op).kind != "elementwise" or len(n.outputs) != 1 or graph.is_output(n.outputs[0]):
            continue
        views = [v for v in n.inputs if graph.producer(v) is not None and graph.producer(v).op == "reshape"]
        if len(views) != 1:
            continue
        view = graph.producer(views[0])
        z = view.inputs[0]
        zp = graph.producer(z)
        if zp is None or id(zp) not in pos or not (get_op(zp.op).kind == "elementwise" or is_row_op(zp)):
            continue
        if any(m.op not in VIEWS for m in nodes[pos[id(zp)] + 1:i]):
            continue                                    # n could not join z's kernel anyway
        others = [v for v in n.inputs if v is not views[0]]
        if not all(same_shape(v.type.shape, n.outputs[0].type.shape) for v in others) or \
                any(graph.producer(v) is not None and pos.get(id(graph.producer(v)), i) > pos[id(zp)] for v in others):
            continue                                    # broadcast, or made between z and n
        meta = {k: n.meta[k] for k in ("source", "layer") if k in n.meta} | {"pass": PASS}
        # the other operands are viewed in z's shape before z is made, so z's kernel and n stay adjacent
        inputs = [z if v is views[0] else
                  graph.add_node("reshape", [v], {"shape": _shape_attr(z)}, name_hint=v.name, meta=dict(meta),
                                 before=zp)[0] for v in n.inputs]
        y = graph.add_node(n.op, inputs, dict(n.attrs), name_hint=n.outputs[0].name, meta=dict(meta), before=n)[0]
        out = graph.add_node("reshape", [y], dict(view.attrs), name_hint=n.outputs[0].name, meta=dict(meta),
                             before=n)[0]
        graph.replace_all_uses(n.outputs[0], out)
        count += 1
    if count:
        dce_in_place(graph)
    return count


def _views_below_siblings(graph: Graph) -> None:
    """Move 2 (module docstring)."""
    nodes = list(graph.nodes)
    i = 0
    while i < len(nodes):
        v, j = nodes[i], i + 1
        if v.op in VIEWS and len(v.inputs) == 1 and len(v.outputs) == 1:
            while j < len(nodes) and v.inputs[0] in nodes[j].inputs and v.outputs[0] not in nodes[j].inputs:
                j += 1
            nodes[i:j] = nodes[i + 1:j] + [v]     # the siblings move up by one, the view below them
        i = j
    graph.nodes[:] = nodes


@register_pass(PASS)
def sink_views(graph: Graph, ctx: CompileContext) -> Graph:
    _elementwise_before_reshape(graph)
    _views_below_siblings(graph)
    return graph
