"""plan_memory: liveness of every materialised intermediate over the launch schedule, packed into one arena.

The schedule is the kernel groups of `form_kernels` in order (or one launch per node before kernel formation).
A value is materialised when it leaves its group (read by a later launch or a graph output); values produced and
consumed inside one fused kernel never reach memory. A buffer is live from the launch that writes it to its last
reader; graph outputs live to the end. Views (reshape, expand, unsqueeze, squeeze) launched on their own share their
input's buffer (one inside a fused kernel, e.g. `attn_res_row`, is a value the kernel writes), so do slices, selects,
transposes and permutes that only torch launches (library / view backends, which take any strides) read (MLA's
absorbed query halves: no copy), and so
do the parts of a `split` where the entry has one token per sequence (T = 1, decode: the column views of a fused
GEMM, `fuse_gemms`, are contiguous at batch 1, and a kernel that needs a contiguous input at B > 1 gets a copy of a
few KiB from its launcher); elsewhere (prefill) each part has its own buffer, written by the split's launch.
Not in the arena: graph inputs and parameters, and the cache values bound to persistent pools (KDA states updated
in place by `kda_fused`, KV / index-key caches extended by `cache_append`; see `bind_caches`).
Scratch: each launch's scratch buffers, as its backend declares them (`Backend.scratch`, e.g. the grouped MoE
GEMMs' h and per-slot outputs), are arena buffers live for that launch only (`ScratchSpec.buffer` names them), so
they share bytes with other launches' scratch and with dead values, never with the launch's own inputs and outputs.
Sizes are evaluated at the compile bounds `ctx.bounds` ({"B", "T", "L"} of the context's entry point; see
`k3c.context.bounds_bindings`). Packing: `k3c.memory.planner.plan_arena` (greedy by size, 256-byte alignment),
validated.
The pass stores the plan as `graph.memory_plan` and returns the graph unchanged otherwise.
"""

from __future__ import annotations

from collections import Counter

from k3c.context import CompileContext
from k3c.ir.graph import Graph, Value
from k3c.ir.kernels import check_spans, kernel_groups
from k3c.ir.types import nbytes
from k3c.memory.planner import Buffer, MemoryPlan, plan_arena, validate_plan
from k3c.passes.pipeline import register_pass

VIEW_OPS = frozenset({"reshape", "expand", "unsqueeze", "squeeze"})
#: views that are not contiguous in general: aliases only where torch launches read them (TORCH_BACKENDS)
STRIDED_VIEW_OPS = frozenset({"slice", "select", "transpose", "permute"})
TORCH_BACKENDS = frozenset({"library", "view"})
POOL_SUFFIXES = (".kda_state", ".conv_state", ".kv", ".index_k", ".index_k_scale", ".index_k_lo")


def pool_values(graph: Graph) -> set[Value]:
    """Values backed by persistent pools: cache inputs and the cache outputs written in place."""
    out = {v for v in graph.inputs if v.name.endswith(POOL_SUFFIXES)}
    out |= {v for k, v in graph.outputs.items() if k.endswith(POOL_SUFFIXES)}
    return out


def launch_index(graph: Graph) -> list[int]:
    """For each node, the index of its launch: the kernel schedule of `form_kernels` when the graph has one, else one
    launch per node. Raises IRError for an invalid schedule (`k3c.ir.kernels.check_spans`)."""
    if getattr(graph, "kernels", None) is None:
        return list(range(len(graph.nodes)))
    return [i for i, s in enumerate(check_spans(graph)) for _ in range(s.count)]


def liveness(graph: Graph, bindings: dict[str, int]) -> list[Buffer]:
    """One Buffer per arena value: (name, bytes at `bindings`, first launch, last launch)."""
    steps = launch_index(graph)
    views = VIEW_OPS | {"split"} if bindings.get("T") == 1 else VIEW_OPS
    root: dict[Value, Value] = {}
    outside = set(graph.inputs) | set(graph.params.values()) | pool_values(graph)
    first: dict[Value, int] = {}
    last: dict[Value, int] = {}
    size = Counter(steps)
    spans = getattr(graph, "kernels", None)
    torch_read = set()  # values every reader of which is a torch launch (library / view backends: any strides)
    if spans is not None:
        backend = [spans[i].backend for i in steps]
        at = {id(n): b for n, b in zip(graph.nodes, backend)}
        outs = set(graph.outputs.values())
        torch_read = {v for n in graph.nodes for v in n.outputs if v not in outs and graph.users(v)
                      and all(at[id(u)] in TORCH_BACKENDS for u in graph.users(v))}
    for node, i in zip(graph.nodes, steps):
        strided = node.op in STRIDED_VIEW_OPS and node.outputs[0] in torch_read
        if (node.op in views or strided) and node.inputs and size[i] == 1:  # a view launch; in a kernel it is computed
            for v in node.outputs:
                root[v] = root.get(node.inputs[0], node.inputs[0])
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


def scratch_buffers(graph: Graph, ctx: CompileContext, bindings: dict[str, int]) -> list[Buffer]:
    """One Buffer per scratch buffer the context's backends declare for the launches of `graph` (module docstring),
    live at its launch only, sized at `bindings`; none for a graph without a kernel schedule."""
    if getattr(graph, "kernels", None) is None:
        return []
    backends = {b.name: b for b in ctx.backends}
    return [Buffer(spec.buffer(group.name), nbytes(spec.type, bindings), i, i)
            for i, group in enumerate(kernel_groups(graph)) if group.backend in backends
            for spec in backends[group.backend].scratch(group, ctx)]


def plan_graph(graph: Graph, bindings: dict[str, int], alignment: int = 256,
               scratch: list[Buffer] = ()) -> MemoryPlan:
    """The arena plan of `graph` at `bindings` with the launches' `scratch` buffers, validated (no two
    simultaneously live buffers overlap)."""
    plan = plan_arena(liveness(graph, bindings) + list(scratch), alignment=alignment)
    validate_plan(plan)
    return plan


@register_pass("plan_memory")
def plan_memory(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `plan_memory` (module docstring): `graph.memory_plan` at `ctx.bounds`; the nodes are unchanged."""
    graph.memory_plan = plan_graph(graph, ctx.bounds, scratch=scratch_buffers(graph, ctx, ctx.bounds))
    return graph
