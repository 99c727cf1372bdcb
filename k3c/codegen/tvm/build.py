"""Compile an artifact's TVM kernels: all PrimFuncs in one IRModule, one `tvm.compile`, one output.

- x86-64 CPU: LLVM for `x86-64-v3` (AVX2 + FMA: every x86 laptop and server since 2013), exported as one shared
  library `cpu.so` that `cpu_runtime.c` makes loadable by apache-tvm-ffi alone (parallel loops on OpenMP threads).
- aarch64 CPU: the same kernels cross-compiled to one ELF object file `cpu-aarch64.o` (`aarch64-linux-gnu`,
  generic ARMv8-A with NEON); linking and running it is left to a machine of that architecture.
- CUDA: the CUDA C TVM generates for the module (`cuda.cu`), compiled on the GPU machine by the runtime.

Every build also returns the module's TIR as text (`<name>.tir.txt`) for reading. Builds are deterministic: the
same kernels give byte-identical files (fixed link directory, no build id, sorted functions).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from k3c.errors import UnsupportedError

X86_TARGET = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v3"}
AARCH64_TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}
CUDA_TARGET = {"kind": "cuda", "arch": "sm_90"}
_SHIM = Path(__file__).with_name("cpu_runtime.c")


def _module(funcs: dict[str, str]):
    import tvm
    from tvm.script import tirx as T
    from tvm.script.parser import parse

    prims = {}
    for name in sorted(funcs):
        try:
            prims[name] = parse(funcs[name], extra_vars={"T": T}).with_attr("global_symbol", name)
        except Exception as e:  # the parser reports a generator bug; name the kernel
            why = next((ln for ln in str(e).splitlines() if "error" in ln.lower()), str(e)[:200])
            raise UnsupportedError(f"TVM kernel {name}: the generated TIR does not parse: {why.strip()}") from e
    return tvm.IRModule(prims)


def build_cpu(funcs: dict[str, str], arch: str = "x86-64") -> dict[str, bytes]:
    """{file name: bytes} of the CPU kernels `funcs` ({symbol: TVMScript text}) for `arch` ("x86-64" ->
    `cpu.so` + `cpu.tir.txt`; "aarch64" -> `cpu-aarch64.o` + `cpu-aarch64.tir.txt`). Raises `UnsupportedError`
    for another arch or a kernel that does not parse; `subprocess.CalledProcessError` if the C compiler fails."""
    import tvm

    if arch not in ("x86-64", "aarch64"):
        raise UnsupportedError(f"TVM CPU kernels are built for x86-64 or aarch64, not {arch!r}")
    mod = _module(funcs)
    tir = mod.script().encode()
    lib = tvm.compile(mod, target=X86_TARGET if arch == "x86-64" else AARCH64_TARGET)
    with tempfile.TemporaryDirectory(prefix="k3c-tvm-") as tmp:
        work = Path(tmp) / "build"  # the same path inside every build: nothing path-dependent reaches the output
        work.mkdir()
        if arch == "aarch64":
            lib.mod.write_to_file(str(work / "kernels.o"))
            return {"cpu-aarch64.o": (work / "kernels.o").read_bytes(), "cpu-aarch64.tir.txt": tir}
        shim = work / "cpu_runtime.o"
        subprocess.run(["gcc", "-c", "-O2", "-fPIC", "-pthread", str(_SHIM), "-o", str(shim)], check=True,
                       capture_output=True)
        out = work / "cpu.so"
        lib.export_library(str(out), addons=[str(shim)], workspace_dir=str(work),
                           options=["-pthread", "-Wl,--build-id=none"])
        return {"cpu.so": out.read_bytes(), "cpu.tir.txt": tir}


def cuda_source(funcs: dict[str, str]) -> dict[str, bytes]:
    """{file name: bytes}: the CUDA C of the kernels `funcs` (`cuda.cu`) and their TIR (`cuda.tir.txt`)."""
    import tvm

    mod = _module(funcs)
    lib = tvm.compile(mod, target=tvm.target.Target(CUDA_TARGET, host=X86_TARGET))
    src = lib.mod.imports[0].inspect_source()
    return {"cuda.cu": src.encode(), "cuda.tir.txt": mod.script().encode()}
