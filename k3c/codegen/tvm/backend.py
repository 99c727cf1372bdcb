"""The TVM backend: which kernel groups it generates, and the files it adds to an artifact's `kernels/`.

It claims every group of a kind with a TVM generator (pointwise, rowwise and the model ops; `kinds()`), on:
- a CPU target of arch x86-64: `kernels/cpu.so` (all kernels of both entries, one shared library loaded by the
  runtime's `k3c.runtime.launchers.tvm` with apache-tvm-ffi) and `kernels/cpu.tir.txt`;
- a CPU target of arch aarch64: `kernels/cpu-aarch64.o` (cross-compiled, not run here) and its TIR;
- a CUDA target (`--backend tvm`): `kernels/cuda.cu` (CUDA C) and `kernels/cuda.tir.txt`.
GEMMs, embedding and the other library groups stay library calls on CPU (torch's oneDNN/MKL GEMMs: see
BENCHMARKS.md for the measurement). Each launch it implements names its PrimFunc (`symbol`): layers that compute
the same thing share one.
"""

from __future__ import annotations

from k3c.codegen.tvm import emit_all, kinds
from k3c.codegen.tvm.build import build_cpu, cuda_source
from k3c.errors import UnsupportedError

LAUNCHER = "tvm"


def device_of(target) -> tuple[str, str]:
    """("cpu" | "cuda", arch) of a `k3c.targets.Target`; raises `UnsupportedError` for a ROCm target."""
    if target.kind == "cpu":
        return "cpu", target.arch
    if target.kind == "cuda":
        return "cuda", target.arch
    raise UnsupportedError(f"the TVM backend generates CPU and CUDA code, not {target.kind} ({target.name})")


def claims(group) -> bool:
    """Whether the TVM backend generates `group` (a generated-kernel group of a kind it has a generator for)."""
    return group.backend not in ("library", "view") and group.kind in kinds()


def build(groups: dict[str, object], target) -> tuple[dict[str, bytes], dict[str, str]]:
    """({file under kernels/: bytes}, {launch name: PrimFunc symbol}) for `groups` ({launch name: KernelGroup},
    in schedule order) on `target`. Raises `UnsupportedError` for a group it cannot generate."""
    device, arch = device_of(target)
    named = []
    for name, group in groups.items():
        g = type(group)(name, group.backend, group.kind, group.nodes, group.inputs, group.outputs)
        named.append(g)
    funcs, symbol_of = emit_all(named, device)
    files = build_cpu(funcs, arch) if device == "cpu" else cuda_source(funcs)
    return files, symbol_of
