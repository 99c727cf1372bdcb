"""Pass `sink_views` (kernels phase, before `form_kernels`): views move below what reads them, so that producers
and their elementwise readers become adjacent.

`form_kernels` fuses only nodes that are adjacent in the schedule: a rowwise group takes the elementwise nodes
that directly follow its row op, a pointwise group the next elementwise nodes. A view (reshape, unsqueeze, slice,
...) is a launch of its own (the view backend: no kernel, an alias) and separates what it stands between. Two
moves, both exact:

1. A one-input elementwise op of a reshape becomes the reshape of that op: u(reshape(x)) -> reshape(u(x)), so u
   reads x's producer directly (elementwise ops do not see shapes).
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
from k3c.ir.graph import Graph, Node
from k3c.ir.ops import get_op
from k3c.ir.rewrite import dce_in_place
from k3c.passes.pipeline import register_pass

PASS = "sink_views"
#: pure views: their only effect is an alias of their input
VIEWS = frozenset({"reshape", "unsqueeze", "squeeze", "select", "slice", "expand", "transpose", "permute"})


def _unary_elementwise(n: Node) -> bool:
    return len(n.inputs) == 1 and len(n.outputs) == 1 and get_op(n.op).kind == "elementwise"


def _elementwise_before_reshape(graph: Graph) -> int:
    """Move 1 (module docstring); returns the number of rewrites."""
    count = 0
    for n in list(graph.nodes):
        view = graph.producer(n.inputs[0]) if _unary_elementwise(n) else None
        if view is None or view.op != "reshape" or graph.is_output(n.outputs[0]):
            continue
        meta = {k: n.meta[k] for k in ("source", "layer") if k in n.meta} | {"pass": PASS}
        y = graph.add_node(n.op, [view.inputs[0]], dict(n.attrs), name_hint=n.outputs[0].name, meta=dict(meta),
                           before=n)[0]
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
