"""Dead code elimination: remove nodes none of whose outputs reach a graph output.

A node is live when it has side effects (`OpDef.effects`: cache writes), when its op is not in the registry
(kept, so the verifier can name it), or when one of its outputs is a graph output or read by a live node.
One reverse sweep, O(nodes + edges).
"""

from __future__ import annotations

from k3c.errors import UnsupportedError
from k3c.ir.graph import Graph, Value
from k3c.passes.pipeline import register_pass


def _has_effects(op: str) -> bool:
    from k3c.ir.ops import get_op

    try:
        return get_op(op).effects
    except UnsupportedError:
        return True


def dce_in_place(graph: Graph) -> int:
    """Remove dead nodes from `graph` itself; returns how many were removed."""
    live: set[Value] = set(graph.outputs.values())
    dead = []
    for node in reversed(graph.nodes):
        if _has_effects(node.op) or any(v in live for v in node.outputs):
            live.update(node.inputs)
        else:
            dead.append(node)
    graph.remove_nodes(dead)
    return len(dead)


@register_pass("dce")
def dce(graph: Graph) -> Graph:
    """Pass `dce`: `graph` without its dead nodes (mutated in place and returned)."""
    dce_in_place(graph)
    return graph
