"""Dead code elimination: remove nodes none of whose outputs reach a graph output.

A node is live when it has side effects (`OpDef.effects`: cache writes), when its op is not in the registry
(kept, so the verifier can name it), or when one of its outputs is a graph output or read by a live node.
One reverse sweep, O(nodes + edges).
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.ir.graph import Graph
from k3c.ir.rewrite import dce_in_place
from k3c.passes.pipeline import register_pass


@register_pass("dce")
def dce(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `dce`: `graph` without its dead nodes (mutated in place and returned)."""
    dce_in_place(graph)
    return graph
