"""The launcher of the "tvm" backend on the CPU: the artifact's `kernels/cpu.so` loaded with apache-tvm-ffi, called
with torch tensors (`tvm_launcher` picks it, or `k3c.runtime.launchers.tvm_cuda` for an artifact's CUDA kernels on a
GPU).

The library holds one exported PrimFunc per distinct kernel (launches record theirs as `symbol`; several may share
one). A function takes the launch's input tensors, then its output tensors (contiguous, at the IR shapes of the
call's sizes; an output may be the same tensor as an input: in-place states), then the sizes B, T, L as integers
(`k3c.codegen.tvm.script`). Tensors cross by DLPack without copies; the library runs its parallel loops on its
own thread pool (`K3C_NUM_THREADS`, default: every core). This module imports torch and `tvm_ffi` (the 3 MB
runtime wheel) only, never `tvm` nor the compiler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from k3c.errors import ArtifactError
from k3c.runtime.launchers import Launcher

LIBRARY = "kernels/cpu.so"


class TvmLibrary:
    """A loaded TVM kernel library. Raises `ArtifactError` if the file is missing or not a loadable library."""

    def __init__(self, path: str | Path):
        import tvm_ffi

        self.path = Path(path)
        if not self.path.is_file():
            raise ArtifactError(f"{self.path}: the TVM kernel library is missing")
        try:
            self.module = tvm_ffi.load_module(str(self.path))
        except Exception as e:  # a truncated or foreign file: name it, in one line
            raise ArtifactError(f"{self.path}: not a loadable TVM kernel library ({type(e).__name__})") from None
        self._functions: dict[str, Callable] = {}

    def function(self, symbol: str) -> Callable:
        """The kernel function `symbol`; raises `ArtifactError` if the library does not export it."""
        fn = self._functions.get(symbol)
        if fn is None:
            try:
                fn = self.module[symbol]
            except Exception:
                raise ArtifactError(f"{self.path}: no kernel {symbol!r} in the TVM library") from None
            self._functions[symbol] = fn
        return fn


def launch(fn: Callable, inputs: list[torch.Tensor], outputs: list[torch.Tensor], sizes: dict[str, int]) -> None:
    """Run TVM kernel `fn` on contiguous `inputs` into preallocated contiguous `outputs` at `sizes` {B, T, L}."""
    fn(*inputs, *outputs, sizes["B"], sizes["T"], sizes["L"])


def tvm_launcher(art, device, launches: list[dict], workdir: Path) -> Launcher:
    """The launcher of the artifact's TVM kernels on `device`: `TvmLauncher` on the CPU, `TvmCudaLauncher` on a
    CUDA GPU (imported only then). Raises `ArtifactError` on another device type."""
    if device.type == "cuda":
        from k3c.runtime.launchers.tvm_cuda import TvmCudaLauncher

        return TvmCudaLauncher(art, device, launches, workdir)
    if device.type != "cpu":
        raise ArtifactError(f"{art.path}: TVM kernels run on 'cpu' or 'cuda', not {device}")
    return TvmLauncher(art, device, launches, workdir)


class TvmLauncher(Launcher):
    """Runs the artifact's TVM launches on the CPU. Raises `ArtifactError` for an artifact without a CPU library
    (its kernels are CUDA code), a missing library or symbol."""

    def __init__(self, art, device, launches: list[dict], workdir: Path):
        super().__init__(art, device, launches, workdir)
        if LIBRARY not in art.files:
            raise ArtifactError(f"{art.path}: its TVM kernels are CUDA code (no {LIBRARY}); load it on 'cuda'")
        path = Path(workdir) / "cpu.so"  # read through the artifact (hash-checked), loaded from a file
        path.write_bytes(art.read_bytes(LIBRARY))
        self.library = TvmLibrary(path)
        self.functions = {ln["name"]: self.library.function(ln["symbol"]) for ln in launches}

    def launch(self, frame, ln: dict) -> None:
        outs = [frame.out(n) for n in ln["outputs"]]
        for n, o in zip(ln["outputs"], outs):
            if o is None:
                raise ArtifactError(f"kernel {ln['name']} output {n} has no buffer in plan.json")
        launch(self.functions[ln["name"]], [frame.env[n].contiguous() for n in ln["inputs"]], outs, frame.sizes)
        frame.env.update(zip(ln["outputs"], outs))
