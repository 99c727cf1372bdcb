"""TVM code generation: kernel groups -> TIR PrimFuncs (TVMScript text) -> one LLVM shared library or CUDA C.

A generator turns one `KernelGroup` into the TVMScript text of one PrimFunc with the calling convention of
`k3c.codegen.tvm.script` (tensors, then the sizes s_B, s_T, s_L), for a device ("cpu": LLVM, "cuda": CUDA C).
Generators register by group kind:

    @generator("pointwise")
    def gen_pointwise(symbol: str, group: KernelGroup, device: str) -> str: ...

`emit(group, symbol, device)` dispatches on `group.kind` (library groups on their op name: "linear", "matmul").
`emit_all` emits a list of groups and shares one PrimFunc among the groups whose kernels are identical (the layers
of a model repeat the same few: k3-tiny's 101 decode kernels are 14 functions), which keeps the one LLVM build per
artifact short. `k3c.codegen.tvm.build` parses the texts into one IRModule and compiles it. Generators are
deterministic: the same group always gives the same text.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from k3c.errors import UnsupportedError

Generator = Callable[[str, object, str], str]

_GENERATORS: dict[str, Generator] = {}
_LOADED = False


def generator(kind: str) -> Callable[[Generator], Generator]:
    """Decorator registering the TVM generator of groups of `kind` (one per kind)."""
    def deco(fn: Generator) -> Generator:
        prev = _GENERATORS.get(kind)
        if prev is not None and (prev.__module__, prev.__qualname__) != (fn.__module__, fn.__qualname__):
            raise UnsupportedError(f"TVM kind {kind!r} has two generators ({prev.__module__}, {fn.__module__})")
        _GENERATORS[kind] = fn
        return fn

    return deco


def _load_all() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for info in pkgutil.iter_modules(__path__):
            if info.name not in ("script", "build", "backend"):
                importlib.import_module(f"{__name__}.{info.name}")


def kinds() -> list[str]:
    """Sorted group kinds that have a TVM generator."""
    _load_all()
    return sorted(_GENERATORS)


def emit(group, symbol: str, device: str) -> str:
    """TVMScript text of the PrimFunc `symbol` computing `group` on `device` ("cpu" | "cuda").

    Raises `UnsupportedError` naming the group when no generator handles its kind, and whatever the generator
    raises for a group it cannot generate (`UnsupportedError` naming the node)."""
    _load_all()
    fn = _GENERATORS.get(group.kind)
    if fn is None:
        raise UnsupportedError(f"no TVM generator for kernel kind {group.kind!r} (group {group.name}; "
                               f"generators: {', '.join(sorted(_GENERATORS))})")
    return fn(symbol, group, device)


def emit_all(groups, device: str) -> tuple[dict[str, str], dict[str, str]]:
    """({symbol: TVMScript text}, {group name: symbol}) for `groups` on `device`: one PrimFunc per distinct kernel,
    named after the first group (in the given order) that uses it. Raises what `emit` raises."""
    funcs: dict[str, str] = {}
    by_text: dict[str, str] = {}
    symbol_of: dict[str, str] = {}
    for group in groups:
        text = emit(group, "kernel", device)
        sym = by_text.get(text)
        if sym is None:
            sym = by_text[text] = group.name
            funcs[sym] = text.replace("def kernel(", f"def {sym}(", 1)
        symbol_of[group.name] = sym
    return funcs, symbol_of
