"""plan_memory: liveness of every materialised intermediate over the launch schedule, packed into one arena.

The schedule is the kernel groups of `form_kernels` in order (or one launch per node before kernel formation).
A value is materialised when it leaves its group (read by a later launch or a graph output); values produced and
consumed inside one fused kernel never reach memory. A buffer is live from the launch that writes it to its last
reader; graph outputs live to the end. Views (reshape, expand, unsqueeze, squeeze) share their input's buffer.
Not in the arena: graph inputs and parameters, and the cache values bound to persistent pools (KDA states updated
in place by `kda_fused`, KV / index-key caches extended by `cache_append`; see `bind_caches`).
Sizes are evaluated at the compile bounds `graph.bounds` ({"B", "T", "L"}, set by the driver; see
`bounds_bindings`). Packing: `k3c.memory.planner.plan_arena` (greedy by size, 256-byte alignment), validated.
The pass stores the plan as `graph.memory_plan` and returns the graph unchanged otherwise.
"""

from __future__ import annotations

from k3c.errors import ConfigError, IRError
from k3c.ir.graph import Graph, Value
from k3c.ir.types import nbytes
from k3c.memory.planner import Buffer, MemoryPlan, plan_arena, validate_plan
from k3c.passes.pipeline import register_pass

VIEW_OPS = frozenset({"reshape", "expand", "unsqueeze", "squeeze"})
POOL_SUFFIXES = (".kda_state", ".conv_state", ".kv", ".index_k")


def bounds_bindings(entry: str, max_batch: int, max_seq: int, max_prefill: int) -> dict[str, int]:
    """Symbol values at the compile bounds for `entry` ("prefill" or "decode"). Raises ConfigError on bad bounds."""
    if min(max_batch, max_seq, max_prefill) < 1 or max_prefill > max_seq:
        raise ConfigError(f"bounds must satisfy 1 <= --max-prefill ({max_prefill}) <= --max-seq ({max_seq}) and "
                          f"--max-batch ({max_batch}) >= 1")
    T = max_prefill if entry == "prefill" else 1
    return {"B": max_batch, "T": T, "L": max_seq - T}


def pool_values(graph: Graph) -> set[Value]:
    """Values backed by persistent pools: cache inputs and the cache outputs written in place."""
    out = {v for v in graph.inputs if v.name.endswith(POOL_SUFFIXES)}
    out |= {v for k, v in graph.outputs.items() if k.endswith(POOL_SUFFIXES)}
    return out


def launch_index(graph: Graph) -> list[int]:
    """For each node, the index of its launch: kernel groups from `form_kernels` meta, else one per node."""
    idx, names, prev = [], {}, None
    for i, node in enumerate(graph.nodes):
        k = node.meta.get("kernel")
        if k is None:
            idx.append(len(names))
            names[("node", i)] = True
            continue
        if k != prev and k in names:
            raise IRError(f"plan_memory: kernel {k} is not a contiguous run of the schedule")
        if k not in names:
            names[k] = True
        idx.append(len(names) - 1)
        prev = k
    return idx


def liveness(graph: Graph, bindings: dict[str, int]) -> list[Buffer]:
    """One Buffer per arena value: (name, bytes at `bindings`, first launch, last launch)."""
    steps = launch_index(graph)
    root: dict[Value, Value] = {}
    outside = set(graph.inputs) | set(graph.params.values()) | pool_values(graph)
    first: dict[Value, int] = {}
    last: dict[Value, int] = {}
    for node, i in zip(graph.nodes, steps):
        if node.op in VIEW_OPS and node.inputs:
            root[node.output] = root.get(node.inputs[0], node.inputs[0])
        for v in node.inputs:
            r = root.get(v, v)
            if r not in outside and first.get(r, i) < i:  # read by a later launch: materialised
                last[r] = i
        for v in node.outputs:
            if v not in root and v not in outside:
                first[v] = i
    end = steps[-1] if steps else 0
    for v in graph.outputs.values():
        r = root.get(v, v)
        if r in first:
            last[r] = end
    return [Buffer(v.name, nbytes(v.type, bindings), first[v], last[v]) for v in first if v in last]


def plan_graph(graph: Graph, bindings: dict[str, int], alignment: int = 256) -> MemoryPlan:
    """The arena plan of `graph` at `bindings`, validated (no two simultaneously live buffers overlap)."""
    plan = plan_arena(liveness(graph, bindings), alignment=alignment)
    validate_plan(plan)
    return plan


@register_pass("plan_memory")
def plan_memory(graph: Graph) -> Graph:
    bounds = getattr(graph, "bounds", None)
    if not bounds:
        raise IRError("plan_memory: the graph has no compile bounds (graph.bounds = {'B': ..., 'T': ..., 'L': ...})")
    graph.memory_plan = plan_graph(graph, bounds)
    return graph
