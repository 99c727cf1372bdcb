"""Common subexpression elimination: merge nodes computing the same op on the same inputs with equal attrs.

Two nodes are equal when op, input values (by identity, after earlier merges), attrs (compared exactly: JSON
text with sorted keys, so 1, 1.0 and true differ) and output types are equal. Ops with side effects or
nondeterminism (`OpDef.effects`) and unregistered ops are never merged. No algebra (no commutativity): `a + b`
and `b + a` stay two nodes. The first node is kept; the later one's uses are redirected and it is removed.
"""

from __future__ import annotations

import json

from k3c.context import CompileContext
from k3c.errors import UnsupportedError
from k3c.ir.graph import Graph
from k3c.passes.pipeline import register_pass


def _mergeable(op: str) -> bool:
    from k3c.ir.ops import get_op

    try:
        return not get_op(op).effects
    except UnsupportedError:
        return False


def cse_in_place(graph: Graph) -> int:
    """Merge duplicate nodes of `graph` in place; returns how many nodes were removed."""
    seen: dict[tuple, list] = {}
    ids: dict = {}
    merged = []
    for node in graph.nodes:
        if not _mergeable(node.op):
            continue
        key = (node.op, tuple(id(v) for v in node.inputs), json.dumps(node.attrs, sort_keys=True),
               tuple(str(v.type) for v in node.outputs))
        first = seen.get(key)
        if first is None:
            seen[key] = node.outputs
            ids.update({id(v): v for v in node.inputs})  # keep input objects alive while their ids are keys
            continue
        for old, new in zip(node.outputs, first):
            graph.replace_all_uses(old, new)
        merged.append(node)
    graph.remove_nodes(merged)
    return len(merged)


@register_pass("cse")
def cse(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `cse`: `graph` with duplicate pure nodes merged (mutated in place and returned)."""
    cse_in_place(graph)
    return graph
