"""networkx and Graphviz views of a graph, for analysis and drawing.

`to_networkx(g)`: a `networkx.DiGraph` whose nodes are the IR nodes (key = position in `g.nodes`, attributes
`op`, `kind`, `layer`, `outputs`, `label`) plus one node per graph input (`"in:NAME"`), param (`"param:KEY"`) and
output (`"out:NAME"`); an edge u -> v carries `values` (names) and `types` (strings) of the values flowing.
`to_dot(g, group_by_layer=True)`: DOT source with one cluster per `meta["layer"]` and a colour per op kind.
`block_dot(g, block)`: one layer (`k3c.ir.views.layer_block`) with the values entering and leaving it;
`collapsed_dot(g)`: the whole model with one box per layer (`k3c.ir.views.collapse`). Every drawing has a legend
of the op-kind colours.
`render(dot_source, fmt)` (the drawing's bytes): needs the `dot` binary (Debian package graphviz); raises
`UnsupportedError`.
"""

from __future__ import annotations

import shutil

import networkx

from k3c.errors import UnsupportedError
from k3c.ir.graph import Graph

KIND_COLOURS = {"elementwise": "#cfe8fc", "reduce": "#fde2b8", "shape": "#e6e6e6", "linalg": "#c8f0c8",
                "create": "#f4f4d0", "model": "#f9c0c0", "collective": "#e0c8f8", "other": "#ffffff",
                "io": "#ffffff"}


def _kind(op: str) -> str:
    from k3c.ir.ops import all_ops

    d = all_ops().get(op)
    return d.kind if d is not None else "other"


def to_networkx(graph: Graph) -> networkx.DiGraph:
    """The dataflow graph as a `networkx.DiGraph` (see the module docstring for keys and attributes)."""
    G = networkx.DiGraph()
    src: dict = {}
    for v in graph.inputs:
        G.add_node(f"in:{v.name}", op="input", kind="io", layer=None, outputs=[v.name], label=f"%{v.name}")
        src[v] = f"in:{v.name}"
    for key, v in graph.params.items():
        G.add_node(f"param:{key}", op="param", kind="io", layer=None, outputs=[v.name], label=key)
        src[v] = f"param:{key}"
    for i, n in enumerate(graph.nodes):
        G.add_node(i, op=n.op, kind=_kind(n.op), layer=n.meta.get("layer"), outputs=[v.name for v in n.outputs],
                   label=f"{n.op} -> {', '.join('%' + v.name for v in n.outputs)}")
        for v in n.inputs:
            _edge(G, src.get(v), i, v)
        for v in n.outputs:
            src[v] = i
    for k, v in graph.outputs.items():
        G.add_node(f"out:{k}", op="output", kind="io", layer=None, outputs=[], label=k)
        _edge(G, src.get(v), f"out:{k}", v)
    return G


def _edge(G, u, w, v) -> None:
    if u is None:
        return
    if G.has_edge(u, w):
        d = G.edges[u, w]
        if v.name not in d["values"]:
            d["values"].append(v.name)
            d["types"].append(str(v.type))
    else:
        G.add_edge(u, w, values=[v.name], types=[str(v.type)])


def _q(s: str) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(graph: Graph, group_by_layer: bool = True) -> str:
    """DOT source of the graph; nodes of one `meta["layer"]` share a cluster when `group_by_layer`."""
    G = to_networkx(graph)
    lines = ["digraph k3c {", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontname="monospace"];']
    clusters: dict = {}
    for n, d in G.nodes(data=True):
        shape = "ellipse" if d["kind"] == "io" else "box"
        line = f"  {_q(n)} [label={_q(d['label'])}, fillcolor={_q(KIND_COLOURS.get(d['kind'], '#ffffff'))}, " \
               f"shape={shape}];"
        if group_by_layer and d["layer"] is not None:
            clusters.setdefault(d["layer"], []).append(line)
        else:
            lines.append(line)
    for layer in sorted(clusters, key=lambda x: (str(type(x)), x)):
        lines.append(f"  subgraph {_q('cluster_layer_' + str(layer))} {{")
        lines.append(f"    label={_q('layer ' + str(layer))};")
        lines += ["  " + ln for ln in clusters[layer]]
        lines.append("  }")
    for u, w, d in G.edges(data=True):
        lines.append(f"  {_q(u)} -> {_q(w)} [label={_q(', '.join(d['types']))}];")
    return "\n".join(lines + legend(G.nodes[n]["kind"] for n in G) + ["}"]) + "\n"


def legend(kinds) -> list[str]:
    """DOT lines of a legend cluster: one swatch per op kind in `kinds` (sorted), in the kind's colour."""
    used = sorted(set(kinds))
    lines = ['  subgraph "cluster_legend" {', '    label="legend: op kind"; style=dashed;']
    lines += [f"    {_q('legend:' + k)} [label={_q(k)}, fillcolor={_q(KIND_COLOURS.get(k, '#ffffff'))}];"
              for k in used]
    lines += [f"    {_q('legend:' + a)} -> {_q('legend:' + b)} [style=invis];" for a, b in zip(used, used[1:])]
    return lines + ["  }"]


def block_dot(graph: Graph, block) -> str:
    """DOT source of one `Block`: its nodes (op, outputs, types), and ellipses for the values entering and leaving."""
    sub = networkx.DiGraph()
    src: dict = {}
    for v in block.inputs:
        sub.add_node(f"in:{v.name}", kind="io", label=f"%{v.name} : {v.type}")
        src[v] = f"in:{v.name}"
    for i, n in enumerate(block.nodes):
        sub.add_node(i, kind=_kind(n.op), label=f"{n.op} -> {', '.join('%' + v.name for v in n.outputs)}")
        for v in n.inputs:
            _edge(sub, src.get(v), i, v)
        for v in n.outputs:
            src[v] = i
    for v in block.outputs:
        sub.add_node(f"out:{v.name}", kind="io", label=f"%{v.name}")
        _edge(sub, src[v], f"out:{v.name}", v)
    return _draw(sub, block.name)


def collapsed_dot(graph: Graph) -> str:
    """DOT source of the whole graph with one box per run of a layer (`views.block_label`) and one per
    node outside the layers; edges carry the number of values flowing between two boxes."""
    from k3c.ir.views import block_label, collapse

    sub = networkx.DiGraph()
    src: dict = {}  # graph inputs and parameters are left out: several per layer would swamp the drawing
    for b in collapse(graph):
        if b.layer is None:
            n = b.nodes[0]
            sub.add_node(b.name, kind=_kind(n.op), label=f"{n.op} -> {', '.join('%' + v.name for v in n.outputs)}")
        else:
            sub.add_node(b.name, kind="model", label=block_label(b))
        for v in b.inputs:
            _edge(sub, src.get(v), b.name, v)
        for v in b.outputs:
            src[v] = b.name
    for k, v in graph.outputs.items():
        sub.add_node(f"out:{k}", kind="io", label=k)
        _edge(sub, src.get(v), f"out:{k}", v)
    return _draw(sub, "layers", count_edges=True)


def _draw(G: networkx.DiGraph, name: str, count_edges: bool = False) -> str:
    lines = [f"digraph {_q(name)} {{", "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="monospace"];']
    for n, d in G.nodes(data=True):
        shape = "ellipse" if d["kind"] == "io" else "box"
        lines.append(f"  {_q(n)} [label={_q(d['label'])}, fillcolor={_q(KIND_COLOURS.get(d['kind'], '#ffffff'))}, "
                     f"shape={shape}];")
    for u, w, d in G.edges(data=True):
        label = f"{len(d['values'])} values" if count_edges and len(d["values"]) > 1 else ", ".join(d["types"])
        lines.append(f"  {_q(u)} -> {_q(w)} [label={_q(label)}];")
    return "\n".join(lines + legend(d["kind"] for _, d in G.nodes(data=True)) + ["}"]) + "\n"


def render(dot_source: str, fmt: str = "svg") -> bytes:
    """The drawing of DOT source in format `fmt` (svg, png, pdf), made by the graphviz package's `dot` process
    (`graphviz.Source.pipe`: no file is written; the caller writes the bytes where it wants them).

    Raises `UnsupportedError` when the `dot` binary is not installed.
    """
    if shutil.which("dot") is None:
        raise UnsupportedError("rendering needs the graphviz `dot` binary (apt-get install graphviz); "
                               "the DOT source can still be written with to_dot()")
    import graphviz

    return graphviz.Source(dot_source).pipe(format=fmt)
