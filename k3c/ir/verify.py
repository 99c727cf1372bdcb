"""Structural verifier: `verify(graph)` raises `IRError` naming the node at fault (op, output, source, layer).

Checks, in one O(n) walk (plus one type inference per node):
- every value name is unique; node inputs are defined before use (graph inputs, params, earlier outputs);
  a value defined nowhere in the graph is reported as dangling, one defined later as used before its definition;
- every op is registered, its attrs match the schema (every attr present, defaults filled) and are JSON data
  (dim strings need not be in canonical `dim_str` form: "L + 1" and "L+1" both pass);
- every node's output types equal its op's inference from its input types (dims compared symbolically);
- graph outputs exist; every dim uses only symbols in `graph.symbols`;
- a kernel schedule, when present, covers the nodes consecutively (`ir/kernels.check_spans`);
- the def-use index matches the node lists (a pass edited `node.inputs` without `set_input`/`rebuild_index`).
"""

from __future__ import annotations

from k3c.errors import IRError, K3CError
from k3c.ir.graph import Graph, Node, Value, check_json, describe
from k3c.ir.kernels import check_spans
from k3c.ir.types import TensorType, dims_equal


def _types_equal(a: TensorType, b: TensorType) -> bool:
    if a == b:
        return True
    return (a.dtype == b.dtype and a.rank == b.rank
            and all(dims_equal(x, y) for x, y in zip(a.shape, b.shape)))


def _check_symbols(graph: Graph, t: TensorType, where: str) -> None:
    extra = t.symbols() - graph.symbols
    if extra:
        raise IRError(f"{where}: type {t} uses unknown symbol(s) {', '.join(sorted(extra))} "
                      f"(graph symbols: {', '.join(sorted(graph.symbols))})")


def verify(graph: Graph, *, check_index: bool = True) -> None:
    """Raise `IRError` (naming the node) if `graph` is malformed; return None if it is well formed."""
    from k3c.ir.ops import get_op

    names: set[str] = set()
    defined: set[Value] = set()
    later: dict[Value, Node] = {v: n for n in graph.nodes for v in n.outputs}

    def define(v: Value, where: str) -> None:
        if v.name in names:
            raise IRError(f"{where}: value name %{v.name} is defined twice")
        if v in defined:
            raise IRError(f"{where}: value %{v.name} is defined twice")
        names.add(v.name)
        defined.add(v)
        _check_symbols(graph, v.type, where)

    for v in graph.inputs:
        define(v, f"input %{v.name}")
    for key, v in graph.params.items():
        define(v, f"param {key}")

    for node in graph.nodes:
        where = describe(node)
        for v in node.inputs:
            if not isinstance(v, Value):
                raise IRError(f"{where}: input {v!r} is not a Value")
            if v not in defined:
                if v in later:
                    raise IRError(f"{where}: reads %{v.name} before it is defined (by {describe(later[v])})")
                raise IRError(f"{where}: reads %{v.name}, a dangling value not defined in this graph")
        try:
            opdef = get_op(node.op)
        except K3CError as e:
            raise IRError(f"{where}: {e}") from None
        check_json(node.attrs, f"{where}: attrs")
        try:
            norm = opdef.normalize_attrs(node.attrs)
        except IRError as e:
            raise IRError(f"{where}: {e}") from None
        if set(norm) != set(node.attrs):
            raise IRError(f"{where}: attrs {node.attrs} lack defaults (expected keys {sorted(norm)}; build nodes "
                          "with graph.add_node or OpDef.normalize_attrs)")
        try:
            expect = opdef.infer(node.attrs, [v.type for v in node.inputs])
        except IRError as e:
            raise IRError(f"{where}: inference fails: {e}") from None
        if len(expect) != len(node.outputs):
            raise IRError(f"{where}: has {len(node.outputs)} outputs, {node.op} defines {len(expect)}")
        for v, t in zip(node.outputs, expect):
            if not _types_equal(v.type, t):
                raise IRError(f"{where}: output %{v.name} has type {v.type} but {node.op} infers {t}")
        for v in node.outputs:
            define(v, where)

    for k, v in graph.outputs.items():
        if v not in defined:
            raise IRError(f"graph output {k!r} is %{v.name}, which the graph does not define")

    if getattr(graph, "kernels", None) is not None:
        check_spans(graph)
    if check_index:
        _check_index(graph)


def _check_index(graph: Graph) -> None:
    for node in graph.nodes:
        for v in node.outputs:
            if graph.producer(v) is not node:
                raise IRError(f"{describe(node)}: def-use index is stale for %{v.name} (call graph.rebuild_index())")
        for v in node.inputs:
            if node not in graph._users.get(v, {}):
                raise IRError(f"{describe(node)}: def-use index misses its use of %{v.name} "
                              "(use graph.set_input or graph.rebuild_index())")
    live = {id(n) for n in graph.nodes}
    for v, users in graph._users.items():
        for u in users:
            if id(u) not in live or not any(x is v for x in u.inputs):
                raise IRError(f"def-use index lists {describe(u)} as a user of %{v.name}, which it is not "
                              "(call graph.rebuild_index())")
