"""Text form of a graph: one line per node, deterministic, for dumps, diffs and tests.

    # k3c graph: 1 inputs, 1 params, 2 nodes, 1 outputs; symbols B,T
    input %x : bf16[B,T,64]
    param %w : bf16[32,64]
    %0 = linear(%x, %w) : bf16[B,T,32]  # frontend | layer 3 | h = self.proj(x)
    (%1, %2) = split(%0) {sizes=[16,16], dim=2} : (bf16[B,T,16], bf16[B,T,16])
    output y = %1

Attrs equal to their schema default are left out; values print as JSON. The trailing comment holds
`meta["pass"]`, the layer, the kernel (after `form_kernels`) and `meta["source"]`, when present.
"""

from __future__ import annotations

import json

from k3c.errors import UnsupportedError
from k3c.ir.graph import Graph, Node
from k3c.ir.kernels import kernel_of


def format_attrs(node: Node) -> str:
    """`{k=v, ...}` of the node's non-default attrs (JSON values), or "" when there are none."""
    try:
        from k3c.ir.ops import REQUIRED, get_op

        schema = get_op(node.op).attrs
    except UnsupportedError:
        schema, REQUIRED = {}, None
    parts = []
    for k, v in node.attrs.items():
        spec = schema.get(k)
        if spec is not None and spec.default is not REQUIRED and _same(spec.default, v):
            continue
        parts.append(f"{k}={json.dumps(v, separators=(',', ':'))}")
    return "{" + ", ".join(parts) + "}" if parts else ""


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def format_node(node: Node, kernel: str | None = None) -> str:
    """One line for `node` (see the module docstring); `kernel`: the launch it runs in, if scheduled."""
    outs = [f"%{v.name}" for v in node.outputs]
    lhs = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"
    types = [str(v.type) for v in node.outputs]
    ty = types[0] if len(types) == 1 else "(" + ", ".join(types) + ")"
    attrs = format_attrs(node)
    line = f"{lhs} = {node.op}({', '.join('%' + v.name for v in node.inputs)})" + (f" {attrs}" if attrs else "")
    line += f" : {ty}"
    comment = []
    if node.meta.get("pass"):
        comment.append(str(node.meta["pass"]))
    if node.meta.get("layer") is not None:
        comment.append(f"layer {node.meta['layer']}")
    if kernel:  # after form_kernels: the launch this node runs in
        comment.append(f"kernel {kernel}")
    if node.meta.get("source"):
        comment.append(" ".join(str(node.meta["source"]).split()))
    return line + ("  # " + " | ".join(comment) if comment else "")


def print_graph(graph: Graph) -> str:
    """The whole graph as text: header, inputs, params (by checkpoint key), nodes, outputs; ends with a newline."""
    lines = [f"# k3c graph: {len(graph.inputs)} inputs, {len(graph.params)} params, {len(graph.nodes)} nodes, "
             f"{len(graph.outputs)} outputs; symbols {','.join(sorted(graph.symbols))}"]
    lines += [f"input %{v.name} : {v.type}" for v in graph.inputs]
    for key, v in graph.params.items():
        lines.append(f"param %{v.name} : {v.type}" + (f"  # key {key}" if key != v.name else ""))
    kernel = kernel_of(graph)
    lines += [format_node(n, kernel.get(id(n))) for n in graph.nodes]
    lines += [f"output {k} = %{v.name}" for k, v in graph.outputs.items()]
    return "\n".join(lines) + "\n"
