"""networkx and Graphviz views of a graph, for analysis and drawing.

`to_networkx(g)`: a `networkx.DiGraph` whose nodes are the IR nodes (key = position in `g.nodes`, attributes
`op`, `kind`, `layer`, `outputs`, `label`) plus one node per graph input (`"in:NAME"`), param (`"param:KEY"`) and
output (`"out:NAME"`); an edge u -> v carries `values` (names) and `types` (strings) of the values flowing.
`to_dot(g, group_by_layer=True)`: DOT source with one cluster per `meta["layer"]` and a colour per op kind.
`render(dot_source, path, fmt)`: needs the `dot` binary (Debian package graphviz); raises `UnsupportedError`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

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
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(dot_source: str, path: str | Path, fmt: str = "svg") -> Path:
    """Render DOT source to `path` (+ suffix) with the graphviz package; returns the written file path.

    Raises `UnsupportedError` when the `dot` binary is not installed.
    """
    if shutil.which("dot") is None:
        raise UnsupportedError("rendering needs the graphviz `dot` binary (apt-get install graphviz); "
                               "the DOT source can still be written with to_dot()")
    import graphviz

    out = graphviz.Source(dot_source).render(outfile=str(Path(path).with_suffix("." + fmt)), format=fmt,
                                            cleanup=True)
    return Path(out)
