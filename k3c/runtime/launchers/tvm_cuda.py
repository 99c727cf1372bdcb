"""The launcher of the "tvm" backend on a CUDA device: TVM's CUDA C of the artifact (`kernels/cuda.cu`), compiled
once to a cubin by NVRTC, launched with torch tensors through the CUDA driver API (`cuda-python`'s
`cuda.bindings`, the optional `gpu` dependency).

The artifact keeps TVM's CUDA C and its launch table `kernels/cuda.launch.json` (`k3c.codegen.tvm.build`
`cuda_launches`): per PrimFunc, its tensors' names in ABI order (`params`), the global-memory scratch buffers TVM's
host code would allocate (`workspaces`) and the kernels it launches, in order, each with its arguments (a tensor or
scratch buffer by name, or an integer expression of the sizes), grid, block and dynamic shared memory. This
launcher does what that host code does, on torch's current stream: scratch buffers come from torch's allocator,
so a CUDA graph capture (`k3c.runtime.graphs`) records the launches like any other.

The cubin for the GPU's architecture is `kernels/cache/tvm-cuda/sm_<major><minor>/<sha256 of cuda.cu>.cubin`: read
from the artifact when it ships one (`k3c finalize` adds it, `compiled` holds what this load compiled), else
compiled at load (NVRTC, a few seconds; the CUDA headers it needs are found by `cuda.pathfinder`). This module
imports torch and `cuda.bindings` only, never `tvm` nor the compiler.
Errors: ArtifactError (a malformed launch table, a kernel missing from the cubin), RuntimeInputError (no
`cuda-python`, NVRTC or driver failures: named with the first line of their log).
"""

from __future__ import annotations

import ast
import ctypes
import hashlib
import json
from typing import Callable

import torch

from k3c.errors import ArtifactError, RuntimeInputError
from k3c.runtime.launchers import Launcher

SOURCE = "kernels/cuda.cu"
LAUNCH_TABLE = "kernels/cuda.launch.json"
CACHE = "kernels/cache/tvm-cuda"
_CTYPES = {"ptr": ctypes.c_void_p, "int64": ctypes.c_int64, "int32": ctypes.c_int32, "uint32": ctypes.c_uint32}
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_SIZES = ("s_B", "s_T", "s_L")


def size_expr(text: str) -> Callable[[dict], int]:
    """The integer expression `text` (Python syntax: ints, s_B / s_T / s_L, + - * // %, parentheses) as a function
    of the sizes {"B", "T", "L"}. Raises ValueError for anything else (it is data, never `eval`ed)."""
    def build(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return lambda s, v=node.value: v
        if isinstance(node, ast.Name) and node.id in _SIZES:
            return lambda s, k=node.id[2:]: s[k]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            a = build(node.operand)
            return lambda s: -a(s)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            op, a, b = _OPS[type(node.op)], build(node.left), build(node.right)
            return lambda s: op(a(s), b(s))
        raise ValueError(f"not a size expression: {ast.unparse(node)}")

    return build(ast.parse(text, mode="eval").body)


def cubin_name(device: torch.device, source: bytes) -> str:
    """The artifact path of the cubin of `source` (TVM's CUDA C) for `device`'s architecture."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{CACHE}/sm_{major}{minor}/{hashlib.sha256(source).hexdigest()}.cubin"


def _check(result, what: str):
    """The values of a `cuda.bindings` call's result tuple; raises RuntimeInputError unless its status is 0."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeInputError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


def compile_cubin(source: bytes, arch: str) -> bytes:
    """The cubin of CUDA C `source` for `arch` ("sm_90"), compiled by NVRTC. Raises RuntimeInputError without
    cuda-python or when NVRTC fails (with the first error of its log)."""
    try:
        from cuda.bindings import nvrtc
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        raise RuntimeInputError("TVM's CUDA kernels need cuda-python (pip install 'k3c[gpu]')") from None
    includes = sorted({d for d in (find_nvidia_header_directory(lib) for lib in ("cudart", "cccl")) if d})
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device"] + \
        [f"--include-path={d}".encode() for d in includes]
    prog = _check(nvrtc.nvrtcCreateProgram(source, b"cuda.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            first = next((ln for ln in log.decode(errors="replace").splitlines() if "error" in ln), "")
            raise RuntimeInputError(f"NVRTC could not compile the TVM kernels for {arch}: {first.strip()}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class CudaModule:
    """A cubin loaded into `device`'s primary context (the one torch uses). `function(name)` -> a kernel handle;
    raises ArtifactError for a name the cubin lacks."""

    def __init__(self, cubin: bytes, device: torch.device):
        from cuda.bindings import driver

        self.driver = driver
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # creates torch's primary context, current on this thread
            _check(driver.cuInit(0), "cuInit")
            self.module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")

    def function(self, name: str):
        err, fn = self.driver.cuModuleGetFunction(self.module, name.encode())
        if int(err) != 0:
            raise ArtifactError(f"{SOURCE}: no kernel {name!r} in its cubin ({err!r})")
        return fn

    def launch(self, fn, grid, block, shared: int, params: tuple, types: tuple, stream: int) -> None:
        """Launch kernel `fn` on `stream` (a CUDA stream handle, an int) with `params` of ctypes `types`."""
        _check(self.driver.cuLaunchKernel(fn, *grid, *block, shared, self.driver.CUstream(stream), (params, types), 0),
               "cuLaunchKernel")


class _Plan:
    """One PrimFunc's launches, with its size expressions parsed (the launch table's entry for it)."""

    def __init__(self, symbol: str, info: dict, module: CudaModule):
        try:
            self.params = list(info["params"])
            self.workspaces = [(n, size_expr(e), getattr(torch, dt)) for n, (e, dt) in info["workspaces"].items()]
            self.kernels = [(module.function(k["name"]), [size_expr(g) for g in k["grid"]], tuple(k["block"]),
                             size_expr(k["shared"]), [(kind, a if kind == "ptr" else size_expr(a))
                                                      for kind, a in k["args"]],
                             tuple(_CTYPES[kind] for kind, _ in k["args"])) for k in info["kernels"]]
        except (KeyError, TypeError, ValueError, AttributeError, SyntaxError) as e:
            raise ArtifactError(f"{LAUNCH_TABLE}: bad entry for {symbol!r} ({type(e).__name__}: {e})") from None


class CudaKernels:
    """TVM's CUDA kernels of one module on `device`: the `cubin` loaded, launched as its launch `table` (the
    parsed `cuda.launch.json`) says. `run(symbol, ...)` does what TVM's host code of PrimFunc `symbol` does."""

    def __init__(self, cubin: bytes, table: dict, device: torch.device):
        self.device, self.table = device, table
        self.module = CudaModule(cubin, device)
        self._plans: dict[str, _Plan] = {}

    def plan(self, symbol: str) -> _Plan:
        """The parsed launches of `symbol`; raises ArtifactError if the table has none."""
        if symbol not in self._plans:
            if symbol not in self.table:
                raise ArtifactError(f"{LAUNCH_TABLE}: no entry for kernel {symbol!r}")
            self._plans[symbol] = _Plan(symbol, self.table[symbol], self.module)
        return self._plans[symbol]

    def run(self, symbol: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], sizes: dict) -> None:
        """Launch `symbol` on contiguous CUDA `inputs` into preallocated `outputs` at `sizes` {B, T, L}, on torch's
        current stream (scratch buffers from torch's allocator)."""
        plan = self.plan(symbol)
        bufs = dict(zip(plan.params, inputs + outputs))
        for name, numel, dtype in plan.workspaces:
            bufs[name] = torch.empty(numel(sizes), dtype=dtype, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for fn, grid, block, shared, args, types in plan.kernels:
            g = [e(sizes) for e in grid]
            if min(g) <= 0:
                continue  # nothing to compute (an empty batch or chunk)
            vals = tuple(bufs[a].data_ptr() if kind == "ptr" else a(sizes) for kind, a in args)
            self.module.launch(fn, g, block, shared(sizes), vals, types, stream)


def load_kernels(art, device: torch.device) -> tuple[CudaKernels, dict[str, bytes]]:
    """The TVM CUDA kernels of artifact `art` on `device`, and {artifact path: cubin} for a cubin compiled here
    (empty when the artifact ships the one for this architecture). Raises ArtifactError (no CUDA source: a CPU
    artifact; a bad launch table), RuntimeInputError (compiling failed)."""
    if SOURCE not in art.files:
        raise ArtifactError(f"{art.path}: its TVM kernels are CPU code (no {SOURCE}); load it on device 'cpu'")
    source = art.read_bytes(SOURCE)
    rel = cubin_name(device, source)
    compiled = {}
    if rel in art.files:
        cubin = art.read_bytes(rel)
    else:
        major, minor = torch.cuda.get_device_capability(device)
        cubin = compiled[rel] = compile_cubin(source, f"sm_{major}{minor}")
    try:
        table = json.loads(art.read_text(LAUNCH_TABLE))
    except (KeyError, ValueError) as e:
        raise ArtifactError(f"{art.path}: {LAUNCH_TABLE} is missing or not JSON ({e})") from None
    return CudaKernels(cubin, table, device), compiled


class TvmCudaLauncher(Launcher):
    """Runs the artifact's TVM launches on a CUDA device (module docstring). `compiled`: {artifact path: cubin}
    compiled at this load (empty when the artifact shipped the cubin)."""

    def __init__(self, art, device, launches: list[dict], workdir):
        super().__init__(art, device, launches, workdir)
        self.kernels, self.compiled = load_kernels(art, device)
        for ln in launches:  # every launch's table entry parses and names kernels of the cubin
            self.kernels.plan(ln["symbol"])

    def launch(self, frame, ln: dict) -> None:
        outs = [frame.out(n) for n in ln["outputs"]]
        for n, o in zip(ln["outputs"], outs):
            if o is None:
                raise ArtifactError(f"kernel {ln['name']} output {n} has no buffer in plan.json")
        self.kernels.run(ln["symbol"], [frame.env[n].contiguous() for n in ln["inputs"]], outs, frame.sizes)
        frame.env.update(zip(ln["outputs"], outs))
