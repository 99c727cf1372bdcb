"""Kernel groups: what `form_kernels` hands to the code generators, and the kernel ABI they must implement.

A `KernelGroup` is a run of consecutive IR nodes executed as one launch:
- `backend`: "triton" (a generated kernel module), "library" (a torch/cuBLAS call the runtime makes: GEMMs,
  einsum, embedding) or "view" (layout ops the runtime performs on tensor views: reshape, slice, cat, ...);
- `kind`: for triton groups the generator that emits it: "pointwise" (a fused chain of elementwise ops),
  "rowwise" (rms_norm / layer_norm / l2norm / softmax over the last dim, with a pointwise epilogue allowed) or the
  model-level op it implements ("kda_fused", "mla_attention", "dsa_index_topk", "attn_res_inter",
  "attn_res_merge", "moe_route", "moe_experts"); for library/view groups the single op name;
- `inputs` / `outputs`: the values read from / written to memory, in launch order. Values produced and consumed
  inside the group never reach memory.

Kernel ABI (every generated module in the artifact's `kernels/` directory):

    NAME: str                      # the group name, e.g. "k0042_pointwise"
    IR_NODES: list[str]            # output value names of the IR nodes it implements (the kernel -> IR sidecar)
    def launch(inputs: list[Tensor], outputs: list[Tensor], sizes: dict[str, int]) -> None

`inputs` and `outputs` are contiguous tensors with exactly the IR types of the group's values at the call's
sizes (symbols B, T, L bound in `sizes`); outputs are preallocated (arena or pool views) and must be fully written.
An output may be the same tensor as an input when the IR value is a persistent state updated in place
(`kda_fused`'s state and conv state). The module imports only torch, triton and the standard library, so that the
runtime can load it without the compiler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3c.ir.graph import Node, Value

BACKENDS = ("triton", "library", "view")


@dataclass
class KernelGroup:
    """One launch: a contiguous run of `nodes` of the schedule (see the module docstring)."""

    name: str
    backend: str
    kind: str
    nodes: list[Node]
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)

    @property
    def ir_nodes(self) -> list[str]:
        return [v.name for n in self.nodes for v in n.outputs]
