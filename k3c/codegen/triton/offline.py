"""Compile a Triton or Gluon kernel for a GPU on a machine without one, and read what the binary costs.

`triton.compile` with an explicit `GPUTarget` runs the whole pipeline (TTIR → TTGIR → LLVM → PTX → cubin) with
Triton's bundled ptxas; Triton's bundled cuobjdump then gives the cubin's resource usage and SASS. The static
cost scripts (benchmarks/mx_static_cost.py, benchmarks/kda_prep_static.py) and the CPU tests that compile the
Gluon kernels (Gluon has no interpreter) use it. Not a runtime path: artifacts compile on the GPU machine
(`k3c finalize`).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_RESOURCE = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")


def compile_for(kernel, signature: dict[str, str], constexprs: dict, *, num_warps: int, maxnreg: int | None = None,
                num_stages: int | None = None, capability: int = 90, divisible=None):
    """The `CompiledKernel` of `kernel` (`@triton.jit` or `@gluon.jit`) for CUDA compute capability `capability`
    (90: sm_90a, the H200), without a GPU. signature: every argument's Triton type ("*bf16", "i32", "fp32", ...)
    by name; arguments named in `constexprs` are typed "constexpr" whatever the signature says. divisible: the
    arguments specialised as multiples of 16 (`tt.divisibility`, as Triton's launcher does for 16-byte aligned
    pointers and sizes); None: every pointer. Raises KeyError naming arguments the signature lacks, and
    Triton's `CompilationError` for code the compiler refuses."""
    names = list(kernel.arg_names)
    missing = [n for n in names if n not in signature and n not in constexprs]
    if missing:
        raise KeyError(f"{kernel.__name__}: no type for argument(s) {missing}")
    types = {n: "constexpr" if n in constexprs else signature[n] for n in names}
    if divisible is None:
        divisible = [n for n in names if types[n].startswith("*")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if types[n] != "constexpr"}
    source = (GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource)(kernel, types, constexprs, attrs)
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
               **({"num_stages": num_stages} if num_stages is not None else {})}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """Triton's bundled `cuobjdump <flag>` (-sass, -res-usage) of a cubin, as text."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], check=True, capture_output=True, text=True).stdout


def resources(cubin: bytes) -> dict[str, int]:
    """The cubin's kernel's REG (registers per thread), STACK and LOCAL (bytes per thread: spills) and SHARED
    (static shared bytes per CTA; Triton's shared memory is dynamic: `CompiledKernel.metadata.shared`)."""
    return {k: int(v) for k, v in _RESOURCE.findall(cuobjdump(cubin, "-res-usage"))}


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(byte address, instruction text without the trailing ';') of every SASS instruction of the cubin."""
    return [(int(a, 16), ins) for a, ins in _INSTRUCTION.findall(cuobjdump(cubin, "-sass"))]
