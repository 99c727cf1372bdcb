"""The Triton backend: generated Triton kernels, one Python module per launch (`kernels/<name>.py`).

Claims every group kind that has a Triton emitter (`registered_kinds`: pointwise, rowwise and the model ops). On a
CUDA target the kernels run compiled; on a CPU the runtime runs them in Triton's interpreter (fp32 only), which is a
test vehicle for these kernels, not a deployment path (CPU targets prefer TVM). The runtime's `triton` launcher
(`k3c.runtime.launchers.triton`) imports each module and calls its `launch` (the kernel ABI, `k3c.ir.kernels`), with
the launch's planned scratch buffers where its kind declares some (`k3c.codegen.triton.scratch`).
"""

from __future__ import annotations

from k3c.codegen.backend import Backend, Emission, ScratchSpec, register_backend
from k3c.codegen.triton import emit, registered_kinds, scratch_for, weight_layouts_for
from k3c.ir.graph import Node
from k3c.ir.kernels import KernelGroup


@register_backend
class TritonBackend(Backend):
    name = "triton"
    generates = True

    def claims(self, kind: str, nodes: list[Node]) -> bool:
        return kind in registered_kinds()

    def emit(self, groups: list[KernelGroup], ctx) -> Emission:
        out = Emission()
        for g in groups:
            out.files[self.module(g)] = emit(g)
            out.index[g.name] = {"backend": self.name, "kind": g.kind, "ir_nodes": g.ir_nodes, "file": self.module(g)}
        return out

    def launch_record(self, group: KernelGroup) -> dict:
        return {"module": self.module(group)}

    def scratch(self, group: KernelGroup, ctx) -> list[ScratchSpec]:
        return scratch_for(group)

    def weight_layouts(self, group: KernelGroup) -> dict[str, str]:
        return weight_layouts_for(group)

    @staticmethod
    def module(group: KernelGroup) -> str:
        return f"kernels/{group.name}.py"
