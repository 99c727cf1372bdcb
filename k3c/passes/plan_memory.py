"""plan_memory: liveness of every intermediate over the node schedule, packed into one arena at the compile bounds.

The schedule is the graph's node order (one launch per node until kernel formation groups them). A value is live
from the node that defines it to its last reader; graph outputs live to the end of the schedule. Views (reshape,
expand, unsqueeze, squeeze) share their input's buffer, so a view's readers extend the base buffer's lifetime.
Inputs (tokens, caches) and parameters are not in the arena: caches live in persistent pools
(`k3c.memory.pools`), weights in the weight pool. Sizes are evaluated at the bounds (B = max batch, T = max tokens
of the entry, L = the largest cached length with T more tokens still fitting in max_seq, N = AttnRes blocks are
concrete already). The packing is `k3c.memory.planner.plan_arena` (greedy by size, 256-byte alignment).
"""

from __future__ import annotations

from k3c.errors import ConfigError
from k3c.ir.graph import Graph, Value
from k3c.ir.types import nbytes
from k3c.memory.planner import Buffer, MemoryPlan, plan_arena, validate_plan

VIEW_OPS = frozenset({"reshape", "expand", "unsqueeze", "squeeze"})


def bounds_bindings(entry: str, max_batch: int, max_seq: int, max_prefill: int) -> dict[str, int]:
    """Symbol values at the compile bounds for `entry` ("prefill" or "decode"). Raises ConfigError on bad bounds."""
    if min(max_batch, max_seq, max_prefill) < 1 or max_prefill > max_seq:
        raise ConfigError(f"bounds must satisfy 1 <= max_prefill ({max_prefill}) <= max_seq ({max_seq}) and "
                          f"max_batch ({max_batch}) >= 1")
    T = max_prefill if entry == "prefill" else 1
    return {"B": max_batch, "T": T, "L": max_seq - T}


def liveness(graph: Graph, bindings: dict[str, int]) -> list[Buffer]:
    """One Buffer per arena value: (name, bytes at `bindings`, first node index, last node index)."""
    root: dict[Value, Value] = {}
    outside = set(graph.inputs) | set(graph.params.values())
    first: dict[Value, int] = {}
    last: dict[Value, int] = {}
    for i, node in enumerate(graph.nodes):
        if node.op in VIEW_OPS and node.inputs:
            base = root.get(node.inputs[0], node.inputs[0])
            root[node.output] = base
        for v in node.inputs:
            r = root.get(v, v)
            if r not in outside:
                last[r] = i
        for v in node.outputs:
            if v not in root:
                first[v] = i
                last.setdefault(v, i)
    end = len(graph.nodes) - 1
    for v in graph.outputs.values():
        r = root.get(v, v)
        if r in first:
            last[r] = end
    return [Buffer(v.name, nbytes(v.type, bindings), first[v], last[v]) for v in first]


def plan_graph(graph: Graph, bindings: dict[str, int], alignment: int = 256) -> MemoryPlan:
    """The arena plan of `graph` at `bindings`, validated (no two simultaneously live buffers overlap)."""
    plan = plan_arena(liveness(graph, bindings), alignment=alignment)
    validate_plan(plan)
    return plan
