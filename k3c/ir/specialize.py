"""Bind symbolic dims to values: `specialize(graph, {"T": 1})` turns the prefill graph into the decode graph.

Every value type and every dim / dims attr is substituted and simplified; node output types are then re-inferred
by the registry and must agree with the substituted ones (so a specialisation that breaks an op's typing is an
`IRError` naming the node, not a silent wrong graph). The graph's symbol set loses the bound symbols.
"""

from __future__ import annotations

from k3c.errors import IRError
from k3c.ir.graph import Graph, describe
from k3c.ir.ops import get_op
from k3c.ir.types import TensorType, dim, dims_equal, symbol


def specialize(graph: Graph, bindings: dict[str, int], pass_name: str = "specialize") -> Graph:
    """A copy of `graph` with each symbol in `bindings` replaced by its int value. Raises IRError on a conflict."""
    g = graph.copy()
    subs = {symbol(k): int(v) for k, v in bindings.items()}

    def sub(d):
        return d if isinstance(d, int) else dim(d.xreplace(subs))

    cache: dict[TensorType, TensorType] = {}
    for v in g.values():
        t = v.type
        if t not in cache:
            cache[t] = TensorType(tuple(sub(d) for d in t.shape), t.dtype)
        v.type = cache[t]
    for node in g.nodes:
        opdef = get_op(node.op)
        for k, spec in opdef.attrs.items():
            val = node.attrs.get(k)
            if val is None or spec.kind not in ("dim", "dims"):
                continue
            one = lambda x: x if isinstance(x, int) else (lambda d: d if isinstance(d, int) else str(d))(sub(dim(x)))  # noqa: E731
            node.attrs[k] = one(val) if spec.kind == "dim" else [one(x) for x in val]
        node.attrs = opdef.normalize_attrs(node.attrs)
        inferred = opdef.infer(node.attrs, [v.type for v in node.inputs])
        for out, t in zip(node.outputs, inferred):
            if out.type.rank != t.rank or out.type.dtype != t.dtype or not all(
                    dims_equal(a, b) for a, b in zip(out.type.shape, t.shape)):
                raise IRError(f"{pass_name}: {describe(node)}: output {out.type} but the op infers {t}")
            out.type = t
    g.symbols = set(g.symbols) - set(bindings)
    return g
