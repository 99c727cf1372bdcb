"""The kernel schedule: how `form_kernels` hands launches to the code generators, the memory planner and the driver.

`form_kernels` cuts the node order into consecutive runs and records them on the graph as `graph.kernels`, a list
of `KernelSpan`s (name, backend, kind, first node index, node count): plain data that survives `Graph.copy` and
JSON. `kernel_groups(graph)` resolves the spans into `KernelGroup`s, with the nodes and the values each launch reads
and writes; every consumer (codegen, `plan_memory`, the schedule writer) takes those typed groups, never strings
from node metadata.

A `KernelGroup` is one launch:
- `backend`: the backend that claimed it ("triton", "tvm", "library", "view"; see `k3c.codegen.backend`);
- `kind`: what implements it: "pointwise" (a fused chain of elementwise ops), "rowwise" (a norm / softmax /
  reduction over the last dim with a pointwise epilogue), "attn_res_row" (an elementwise prologue, the AttnRes
  merge and a rowwise norm group over the same rows), a model-level op ("kda_fused", "mla_attention",
  "dsa_index_topk", "attn_res_inter", "attn_res_merge", "moe_route", "moe_experts"), or, for a single-node
  library / view launch, the op's name;
- `inputs` / `outputs`: values read from / written to memory, in launch order; values produced and consumed
  inside the group never reach memory.

Kernel ABI of generated kernels (every backend's launcher implements it):
    launch(inputs: list[Tensor], outputs: list[Tensor], sizes: dict[str, int]) -> None
`inputs` / `outputs` are tensors with exactly the IR types of the group's values at the call's sizes (symbols B,
T, L bound in `sizes`); outputs are contiguous, preallocated (arena or pool views) and must be fully written.
Inputs are contiguous too, unless the module declares `TAKES_VIEWS = True`: its `launch` then takes any strides and
indexes views it can (a decode GEMM's column slices: rows of one stride, unit-stride last dim) in place, copying
only what its kernels cannot index. An
output may be the same tensor as an input when the IR value is a persistent state updated in place.
`sizes` may also hold "lengths": an i32 [B] tensor on the device, the context of each sequence before the call's T
tokens (whole-step decode graphs, `k3c.runtime.graphs`); L is then the bound and the context-dependent kernels
(attention, the DSA indexer) read each row's length from it instead of deriving it from the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3c.errors import IRError
from k3c.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class KernelSpan:
    """One launch as graph data: nodes `graph.nodes[start:start + count]`."""

    name: str
    backend: str
    kind: str
    start: int
    count: int

    def to_json(self) -> list:
        return [self.name, self.backend, self.kind, self.start, self.count]

    @classmethod
    def from_json(cls, data) -> "KernelSpan":
        try:
            name, backend, kind, start, count = data
            return cls(str(name), str(backend), str(kind), int(start), int(count))
        except (TypeError, ValueError):
            raise IRError(f"kernel span {data!r}: expected [name, backend, kind, start, count]") from None


@dataclass
class KernelGroup:
    """One launch: a consecutive run of `nodes` of the schedule (see the module docstring)."""

    name: str
    backend: str
    kind: str
    nodes: list[Node]
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)

    @property
    def ir_nodes(self) -> list[str]:
        """Output value names of the IR nodes it implements (the kernel -> IR sidecar)."""
        return [v.name for n in self.nodes for v in n.outputs]


def group_name(index: int, kind: str) -> str:
    """`k0042_pointwise`: the launch's position in the schedule and its kind."""
    return f"k{index:04d}_{kind}"


def check_spans(graph: Graph) -> list[KernelSpan]:
    """`graph.kernels`, checked to cover the node list exactly once in order; raises IRError otherwise."""
    spans = getattr(graph, "kernels", None)
    if spans is None:
        raise IRError("the graph has no kernel schedule; run the form_kernels pass first")
    at, names = 0, set()
    for s in spans:
        if s.start != at or s.count < 1:
            raise IRError(f"kernel {s.name} covers nodes [{s.start}, {s.start + s.count}) but the schedule is at "
                          f"node {at}: the spans must cover the nodes consecutively")
        if s.name in names:
            raise IRError(f"kernel name {s.name} is used twice")
        names.add(s.name)
        at += s.count
    if at != len(graph.nodes):
        raise IRError(f"the kernel schedule covers {at} nodes but the graph has {len(graph.nodes)}: a pass changed "
                      "the nodes after form_kernels")
    return spans


def kernel_of(graph: Graph) -> dict[int, str]:
    """id(node) -> kernel name, for graphs with a schedule (empty otherwise); used by the printer."""
    spans = getattr(graph, "kernels", None)
    if not spans:
        return {}
    return {id(graph.nodes[i]): s.name for s in spans for i in range(s.start, min(s.start + s.count, len(graph.nodes)))}


def kernel_groups(graph: Graph) -> list[KernelGroup]:
    """The launches of a graph scheduled by `form_kernels`, in order, with their memory inputs and outputs.

    `inputs`: values read by the group's nodes and defined outside it (graph inputs and params included), in
    first-use order. `outputs`: values defined in the group and read by another group or a graph output, in
    definition order. Raises IRError when the graph has no valid schedule (`check_spans`).
    """
    groups = [KernelGroup(s.name, s.backend, s.kind, graph.nodes[s.start:s.start + s.count])
              for s in check_spans(graph)]
    graph_outputs = set(graph.outputs.values())
    for g in groups:
        members = set(map(id, g.nodes))
        defined = {v for n in g.nodes for v in n.outputs}
        reads: dict[Value, None] = {}
        for n in g.nodes:
            for v in n.inputs:
                if v not in defined:
                    reads.setdefault(v, None)
        g.inputs = list(reads)
        g.outputs = [v for n in g.nodes for v in n.outputs
                     if v in graph_outputs or any(id(u) not in members for u in graph.users(v))]
    return groups
