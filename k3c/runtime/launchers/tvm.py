"""Launcher of TVM kernels: an artifact's `kernels/cpu.so` loaded with apache-tvm-ffi, called with torch tensors.

The library holds one exported PrimFunc per distinct kernel (several launches may share one); every function takes
the launch's input tensors, then its output tensors (contiguous, at the IR shapes of the call's sizes; an output may
be the same tensor as an input: in-place states), then the sizes B, T, L as integers (see
`k3c.codegen.tvm.script`). Tensors cross by DLPack without copies. This module imports only torch and `tvm_ffi`
(the 3 MB runtime wheel), never `tvm` nor the compiler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from k3c.errors import ArtifactError


class TvmLibrary:
    """A loaded `kernels/cpu.so`. Raises `ArtifactError` if the file is missing or not a loadable library."""

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
