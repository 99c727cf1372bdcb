"""The TVM backend: kernel groups compiled by TVM, all of an artifact's kernels in one build.

It claims every group of a kind with a TVM generator (`kinds()`: pointwise, rowwise and the model ops) whose values
it can compute (no fp8), and adds to the artifact, by target:
- a CPU of arch x86-64: `kernels/cpu.so` (one shared library for both entry points, loaded by the runtime's `tvm`
  launcher with apache-tvm-ffi) and `kernels/cpu.tir.txt`;
- a CPU of arch aarch64: `kernels/cpu-aarch64.o` (cross-compiled; not runnable by this runtime) and its TIR;
- a CUDA GPU (`--backend tvm`): `kernels/cuda.cu` (TVM's CUDA C) and `kernels/cuda.tir.txt`, not launched by
  this runtime (see README: Status).
On the CPU, a linear over a few rows (decode; `k3c.codegen.tvm.linear`) is a TVM GEMV; GEMMs, embedding and the
other library groups stay library calls (torch's GEMMs; BENCHMARKS.md "CPU" says why).
A launch record names the launch's PrimFunc (`symbol`): layers that compute the same thing share one, named after
the first launch (in schedule order) that uses it.
"""

from __future__ import annotations

from k3c.codegen.backend import Backend, Emission, register_backend
from k3c.codegen.tvm import emit, kinds
from k3c.codegen.tvm.build import build_cpu, cuda_source
from k3c.codegen.tvm.linear import is_gemv
from k3c.errors import UnsupportedError
from k3c.ir.graph import Node
from k3c.ir.kernels import KernelGroup


@register_backend
class TvmBackend(Backend):
    name = "tvm"
    generates = True

    def __init__(self, target):
        super().__init__(target)
        if target.kind not in ("cpu", "cuda"):
            raise UnsupportedError(f"the TVM backend generates CPU and CUDA code, not {target.kind} ({target.name})")
        self.device = "cpu" if target.kind == "cpu" else "cuda"
        self._text: dict[str, str] = {}      # group name -> PrimFunc text (with the placeholder name)
        self._symbol: dict[str, str] = {}    # PrimFunc text -> symbol

    def claims(self, kind: str, nodes: list[Node]) -> bool:
        if kind == "linear" and not (self.device == "cpu" and len(nodes) == 1 and is_gemv(nodes[0])):
            return False  # GEMMs and GPU linears: library calls
        return kind in kinds() and not _fp8(nodes)

    def why_not(self, kind: str, nodes: list[Node]) -> str | None:
        if kind in kinds() and _fp8(nodes):
            return ("it has no e4m3 (fp8) kernels: fp8 DSA index keys (--dsa-index-keys fp8 / fp8-rerank) need a "
                    "GPU target (Triton); keep --dsa-index-keys bf16 on a CPU target")
        return None

    def _symbol_of(self, group: KernelGroup) -> str:
        text = self._text.get(group.name)
        if text is None:
            text = self._text[group.name] = emit(group, "kernel", self.device)
        return self._symbol.setdefault(text, group.name)

    def launch_record(self, group: KernelGroup) -> dict:
        return {"symbol": self._symbol_of(group)}

    def emit(self, groups: list[KernelGroup], ctx) -> Emission:
        out = Emission()
        funcs = {}
        for g in groups:
            sym = self._symbol_of(g)
            funcs.setdefault(sym, self._text[g.name].replace("def kernel(", f"def {sym}(", 1))
            out.index[g.name] = {"backend": self.name, "kind": g.kind, "ir_nodes": g.ir_nodes, "symbol": sym}
        files = build_cpu(funcs, self.target.arch) if self.device == "cpu" else cuda_source(funcs)
        out.files.update((f"kernels/{rel}", data) for rel, data in files.items())
        return out


def _fp8(nodes: list[Node]) -> bool:
    return any(v.type.dtype == "f8e4m3" for n in nodes for v in list(n.inputs) + n.outputs)
