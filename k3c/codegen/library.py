"""The library and view backends: launches the runtime carries out with torch calls instead of generated code.

- "library": one op per launch that a vendor library does at its best (GEMMs through cuBLAS / oneDNN, einsum,
  embedding, gather / scatter, sorts) or that is too rare to generate (creation ops);
- "view": layout ops on tensor views (reshape, slice, cat, ...) and the in-place cache append.

Both claim single-node groups whose op the runtime implements (`k3c.runtime.library.LIBRARY_OPS` / `VIEW_OPS`),
so the compiler never schedules an op the runtime cannot run. A launch record carries the node's attrs and which of
them are symbolic dims (evaluated at the call's sizes by the runtime).
"""

from __future__ import annotations

from k3c.codegen.backend import Backend, register_backend
from k3c.ir.graph import Node
from k3c.ir.kernels import KernelGroup
from k3c.ir.ops import get_op
from k3c.runtime.library import LIBRARY_OPS, VIEW_OPS


@register_backend
class LibraryBackend(Backend):
    name = "library"
    ops = LIBRARY_OPS

    def claims(self, kind: str, nodes: list[Node]) -> bool:
        return len(nodes) == 1 and kind == nodes[0].op and kind in self.ops

    def launch_record(self, group: KernelGroup) -> dict:
        (node,) = group.nodes
        spec = get_op(node.op).attrs
        return {"attrs": node.attrs, "dim_attrs": sorted(k for k, a in spec.items() if a.kind in ("dim", "dims")),
                "outputs": [v.name for v in node.outputs]}


@register_backend
class ViewBackend(LibraryBackend):
    name = "view"
    ops = VIEW_OPS
