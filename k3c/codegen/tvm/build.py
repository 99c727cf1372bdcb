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

import json
import re
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
        raise UnsupportedError(f"the target's field 'arch' is {arch!r}: TVM CPU kernels are built for x86-64 or "
                               "aarch64")
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
    """{file name: bytes}: the CUDA C of the kernels `funcs` (`cuda.cu`), their TIR (`cuda.tir.txt`) and how to
    launch them (`cuda.launch.json`: per PrimFunc, `cuda_launches` plus `params`, its tensors' names in ABI order).
    Raises `UnsupportedError` for a launch whose sizes the runtime could not evaluate (`size_expr`)."""
    import tvm
    from tvm.tirx.build import split_host_device_mods

    mod = _module(funcs)
    target = tvm.target.Target(CUDA_TARGET, host=X86_TARGET)
    # StorageRewrite merges a let-bound local into the shared result buffer of a cross-thread reduction (every
    # thread then rewrites the shared value in place: a race, seen in TVM 0.27); nvcc allocates registers anyway.
    with tvm.transform.PassContext(config={"tirx.disable_storage_rewrite": True}):
        lib = tvm.compile(mod, target=target)
    src = lib.mod.imports[0].inspect_source()
    lowered = tvm.tirx.get_default_tir_pipeline(target)[0](tvm.tirx.transform.BindTarget(target)(mod))
    host, _ = split_host_device_mods(lowered)
    ctypes = kernel_param_types(src)
    launches = {}
    for name in sorted(funcs):
        info = cuda_launches(host[name].script(), ctypes)
        info["params"] = re.findall(r"(\w+)_h: T\.handle", funcs[name])
        launches[name] = info
    return {"cuda.cu": src.encode(), "cuda.tir.txt": mod.script().encode(),
            "cuda.launch.json": json.dumps(launches, indent=1, sort_keys=True).encode()}


_KERNEL_DECL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\)')
_INT_CTYPES = {"int64_t": "int64", "int": "int32", "uint": "uint32", "unsigned int": "uint32"}


def kernel_param_types(src: str) -> dict[str, list[str]]:
    """{kernel name: its parameters' kinds, in order} from TVM's CUDA C `src`: "ptr" for a pointer, else the
    integer type ("int64", "int32", "uint32"). Raises `UnsupportedError` for another parameter type."""
    out = {}
    for name, params in _KERNEL_DECL.findall(src):
        kinds = []
        for p in filter(None, (q.strip() for q in params.split(","))):
            ctype = p.rsplit(" ", 1)[0].replace("__restrict__", "").strip()
            if ctype.endswith("*"):
                kinds.append("ptr")
            elif ctype in _INT_CTYPES:
                kinds.append(_INT_CTYPES[ctype])
            else:
                raise UnsupportedError(f"CUDA kernel {name}: parameter {p!r} is neither a pointer nor an integer")
        out[name] = kinds
    return out


def cuda_launches(host_script: str, ctypes: dict[str, list[str]]) -> dict:
    """How TVM's host code of one PrimFunc launches its CUDA kernels, read from the lowered host TIR (TVMScript)
    and the kernels' parameter types `ctypes` (`kernel_param_types`):
    {"kernels": [{"name", "args": [["ptr", buffer] | [int type, expr]], "grid": [x, y, z], "block": [x, y, z],
    "shared": expr}], "workspaces": {name: [elements expr, dtype]}}, in launch order. Expressions are Python over
    s_B, s_T, s_L (ints, + - * // %; `k3c.runtime.launchers.tvm_cuda.size_expr` evaluates them); "shared" is the
    dynamic shared memory in bytes."""
    import ast

    from k3c.runtime.launchers.tvm_cuda import size_expr

    lets: dict[str, str] = {}
    out = {"kernels": [], "workspaces": {}}

    def expr(node, check: bool = True) -> str:
        text = re.sub(r"T\.u?int(?:32|64)\((-?\d+)\)", r"\1", ast.unparse(node))
        text = re.sub(r"\bcse_v\d+\b", lambda m: f"({lets[m.group(0)]})", text)
        try:
            if check:
                size_expr(text)
        except ValueError:
            raise UnsupportedError(f"a CUDA launch size the runtime cannot evaluate: {text}") from None
        return text

    for node in ast.walk(ast.parse(host_script)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            lets[node.target.id] = expr(node.value, check=False)  # checked where a launch uses it
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func) == "T.alloc_buffer":
            dtype = next((a.value for a in node.value.args[1:2] if isinstance(a, ast.Constant)), "float32")
            out["workspaces"][node.targets[0].id] = [expr(node.value.args[0].elts[0]), dtype]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "T.call_ffi_kernel":
            name, *args = node.args
            tags = next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "launch_params")
            params, dims = args[:len(args) - len(tags)], dict(zip(tags, args[len(args) - len(tags):]))
            kinds = ctypes[name.value]
            if len(kinds) != len(params):
                raise UnsupportedError(f"CUDA kernel {name.value}: {len(params)} arguments for {len(kinds)} parameters")
            axis = lambda tag: [expr(dims[f"{tag}.{a}"]) if f"{tag}.{a}" in dims else "1" for a in "xyz"]  # noqa
            out["kernels"].append({
                "name": name.value, "grid": axis("blockIdx"), "block": [int(b) for b in axis("threadIdx")],
                "shared": expr(dims["tirx.use_dyn_shared_memory"]) if "tirx.use_dyn_shared_memory" in dims else "0",
                "args": [["ptr", a.value.id] if kind == "ptr" else [kind, expr(a)] for a, kind in zip(params, kinds)]})
    return out
