"""Triton code generation: the emitter registry and what every generated kernel module shares.

An emitter turns one triton `KernelGroup` (see `k3c.ir.kernels`) into the source text of a standalone Python
module implementing the kernel ABI (`NAME`, `IR_NODES`, `launch(inputs, outputs, sizes)`). Emitters register by
kind:

    @emitter("pointwise")
    def emit_pointwise(group: KernelGroup) -> str: ...

`emit(group)` dispatches on `group.kind`. The generators of this package (pointwise, rowwise) register on import;
for any other kind, `emit` first imports the package's other public modules (e.g. the model-op kernels), which
register theirs. Emitters must be deterministic: the same group always gives the same text.

Scratch: a kind whose launch function needs scratch memory registers its declaration the same way,
`@scratch("moe_experts") def moe_scratch(group) -> list[ScratchSpec]`; `scratch_for(group)` answers the backend's
`scratch` (`k3c.codegen.backend`), so `plan_memory` places the buffers in the arena. The launch function takes them
as `scratch` (name -> tensor) through `take_scratch`, which allocates as before when called without (tests and
benchmarks call launch functions directly).

Load-time weight layouts: a kind whose kernels read some weights in an order of their own (k3c.runtime.layouts)
registers `@weight_layout("moe_experts") def fn(group) -> dict[str, str]` (value name -> layout); the emitter
asks the same function, so the module's kernels and the runtime's re-laying agree (`weight_layouts_for`).

Shared pieces of generated modules: `module_header` (comment with the IR lines, imports, NAME, IR_NODES) and
`launch_head` (the launcher's signature, argument checks and unpacking).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

import torch

from k3c.errors import UnsupportedError
from k3c.ir.kernels import KernelGroup

Emitter = Callable[[KernelGroup], str]
ScratchFn = Callable[[KernelGroup], list]

_EMITTERS: dict[str, Emitter] = {}
_SCRATCH: dict[str, ScratchFn] = {}
_LAYOUTS: dict[str, Callable[[KernelGroup], dict]] = {}
_SEARCHED = False  # whether `_load_all` has imported the package's other modules


def _registrar(table: dict, kind: str, what: str) -> Callable:
    """A decorator registering its function in `table` under `kind`; it raises `UnsupportedError` naming `what`
    if a different function already holds the kind (re-registering the same function, as a module reload does,
    is allowed)."""
    def deco(fn):
        prev = table.get(kind)
        if prev is not None and (prev.__module__, prev.__qualname__) != (fn.__module__, fn.__qualname__):
            raise UnsupportedError(f"triton kind {kind!r} has two {what} ({prev.__module__}, {fn.__module__})")
        table[kind] = fn
        return fn

    return deco


def emitter(kind: str) -> Callable[[Emitter], Emitter]:
    """Decorator registering `fn` as the generator of triton groups of `kind`; raises `UnsupportedError` if a
    different function already holds the kind."""
    return _registrar(_EMITTERS, kind, "emitters")


def scratch(kind: str) -> Callable[[ScratchFn], ScratchFn]:
    """Decorator registering `fn(group) -> list[ScratchSpec]` as the scratch declaration of triton groups of
    `kind` (module docstring); raises `UnsupportedError` if a different function already holds the kind."""
    return _registrar(_SCRATCH, kind, "scratch declarations")


def weight_layout(kind: str) -> Callable:
    """Decorator registering `fn(group) -> {value name: layout}` as the load-time weight layouts of triton groups
    of `kind` (module docstring); raises `UnsupportedError` if a different function already holds the kind."""
    return _registrar(_LAYOUTS, kind, "weight layout declarations")


def weight_layouts_for(group: KernelGroup) -> dict[str, str]:
    """The weights (value name -> layout) a launch of triton group `group` reads in a load-time layout; none for a
    kind without a declaration."""
    _load_all()
    fn = _LAYOUTS.get(group.kind)
    return fn(group) if fn is not None else {}


def scratch_for(group: KernelGroup) -> list:
    """The scratch buffers (`k3c.codegen.backend.ScratchSpec`) one launch of triton group `group` needs; none for a
    kind without a declaration."""
    _load_all()
    fn = _SCRATCH.get(group.kind)
    return fn(group) if fn is not None else []


def take_scratch(scratch, name, shape, dtype, device):
    """Scratch tensor `name` of a launch function: the planned buffer `scratch[name]` (`scratch`: name -> tensor,
    the arena views the runtime hands over), or a new torch.empty(shape, dtype, device) when `scratch` is None (a
    stand-alone call). Raises ValueError when a planned buffer is missing or its shape or dtype is not
    (shape, dtype): the compiler's declaration and the launch function disagree. Copied into kernel modules."""
    if scratch is None:
        return torch.empty(shape, dtype=dtype, device=device)
    t = scratch.get(name)
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        got = "missing" if t is None else f"{t.dtype}{list(t.shape)}"
        raise ValueError(f"planned scratch {name!r}: {got}, the launch needs {dtype}{list(shape)}")
    return t


def _load_all() -> None:
    global _SEARCHED
    if not _SEARCHED:
        _SEARCHED = True
        for info in pkgutil.iter_modules(__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{__name__}.{info.name}")


def registered_kinds() -> list[str]:
    """Sorted kinds that have an emitter (after importing the package's emitter modules)."""
    _load_all()
    return sorted(_EMITTERS)


def emit(group: KernelGroup) -> str:
    """The source of the kernel module implementing `group` (a triton group; see `k3c.ir.kernels`).

    Raises `UnsupportedError` naming the kind when no emitter handles it, and whatever the emitter raises for a
    group it cannot generate (also `UnsupportedError`, naming the node).
    """
    if group.backend != "triton":
        raise UnsupportedError(f"kernel group {group.name} has backend {group.backend!r}; only triton groups "
                               "are generated")
    fn = _EMITTERS.get(group.kind)
    if fn is None:
        _load_all()
        fn = _EMITTERS.get(group.kind)
    if fn is None:
        raise UnsupportedError(f"no triton emitter for kernel kind {group.kind!r} (group {group.name}; emitters: "
                               f"{', '.join(sorted(_EMITTERS)) or 'none'})")
    return fn(group)


def one_node(group: KernelGroup, op: str):
    """(node, input positions, output positions): the group's single node of `op` and where each of its inputs /
    outputs sits in the launch lists. Raises UnsupportedError for any other group."""
    if len(group.nodes) != 1 or group.nodes[0].op != op:
        raise UnsupportedError(f"{group.name}: the {op} emitter takes one {op} node, got "
                               f"{[n.op for n in group.nodes]}")
    node = group.nodes[0]
    ins, outs = group.inputs or node.inputs, group.outputs or node.outputs
    try:
        return node, [ins.index(v) for v in node.inputs], [outs.index(v) for v in node.outputs]
    except ValueError:
        raise UnsupportedError(f"{group.name}: group inputs/outputs do not cover the {op} node's values") from None


def module_header(group: KernelGroup, summary: str, generator: str, takes_views: bool = False) -> list[str]:
    """The opening lines every generated module shares: a comment naming the group, the IR lines it implements,
    the values it reads and writes, then the imports, `NAME`, `IR_NODES` and, with `takes_views`,
    `TAKES_VIEWS = True` (its launch takes inputs of any strides; `k3c.ir.kernels`).

    `summary`: one line saying what the kernel does; `generator`: the module that emitted it.
    """
    from k3c.ir.printer import format_node

    lines = [f"# k3c kernel {group.name} ({group.backend} / {group.kind}): {summary}",
             f"# Generated by {generator}; edit the generator, not this file.", "#",
             "# IR nodes it implements (k3c text form):"]
    lines += [f"#   {format_node(n)}" for n in group.nodes]
    lines += ["#", "# launch(inputs, outputs, sizes): " + ("inputs of any strides, contiguous outputs" if takes_views
                                                           else "contiguous tensors") + ", in this order"]
    lines += [f"#   inputs[{i}]  %{v.name} : {v.type}" for i, v in enumerate(group.inputs)]
    lines += [f"#   outputs[{i}] %{v.name} : {v.type}" for i, v in enumerate(group.outputs)]
    lines += ["", "import torch", "import triton", "import triton.language as tl", "",
              f"NAME = {group.name!r}", f"IR_NODES = {group.ir_nodes!r}"]
    lines += ["TAKES_VIEWS = True  # launch() indexes strided inputs in place (k3c.ir.kernels)"] if takes_views else []
    return lines + [""]



def model_module(group: KernelGroup, summary: str, generator: str, semantics: str, consts, kernels, launcher,
                 body: str, takes_views: bool = False) -> str:
    """A model-op kernel module: the shared header, a line naming the exact semantics (`semantics`: where the op's
    reference lives), the specialisation constants (name, value, comment), the sources of `kernels` (`@triton.jit` or
    `@gluon.jit` kernels, or plain helper functions the launcher calls) and of the launcher copied from the generator
    module, then the ABI `launch` (`body`; with `takes_views` it receives inputs of any strides, `TAKES_VIEWS`)."""
    import inspect

    lines = module_header(group, summary, generator, takes_views) + [f"# Exact semantics: {semantics}"]
    lines += [f"{k} = {v!r}" + (f"  # {c}" if c else "") for k, v, c in consts]
    sources = [inspect.getsource(getattr(k, "fn", k)) for k in kernels]
    if any(src.startswith("@gluon.jit") for src in sources):       # Gluon kernels: their language's imports
        lines += ["from triton.experimental import gluon", "from triton.experimental.gluon import language as gl"]
    parts = ["\n".join(lines) + "\n"] + sources
    parts.append(inspect.getsource(launcher))
    return "\n\n".join(parts + [body])


def unpack(var: str, names: list[str]) -> str:
    """`a, b = var` (or `a, = var`) for the launcher."""
    return f"{', '.join(names)}{',' if len(names) == 1 else ''} = {var}" if names else f"assert not {var}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def launch_head(group: KernelGroup, ins: list[str], outs: list[str], doc: str, shape_expr: str,
                shape_doc: str, skip_first_check: bool = False) -> list[str]:
    """The launcher's opening lines: signature, docstring, a ValueError for wrong tensor counts, the unpacking,
    `shape = <shape_expr>` and a ValueError for every output (but the first, with `skip_first_check`) of
    another shape."""
    ni, no = len(group.inputs), len(group.outputs)
    lines = ["def launch(inputs: list[torch.Tensor], outputs: list[torch.Tensor], sizes: dict[str, int]) -> None:",
             f'    """{doc}"""',
             f"    if len(inputs) != {ni} or len(outputs) != {no}:",
             f'        raise ValueError(f"{{NAME}} takes {_count(ni, "input")} and {_count(no, "output")}, got '
             f'{{len(inputs)}} and {{len(outputs)}}")',
             f"    {unpack('inputs', ins)}", f"    {unpack('outputs', outs)}",
             f"    shape = {shape_expr}  # {shape_doc}"]
    for o in outs[1:] if skip_first_check else outs:
        lines += [f"    if tuple({o}.shape) != shape:",
                  f'        raise ValueError(f"{{NAME}}: output {o} has shape {{list({o}.shape)}}, not {{list(shape)}}")']
    return lines


from k3c.codegen.triton import pointwise as _pointwise  # noqa: E402,F401  (registers "pointwise")
from k3c.codegen.triton import rowwise as _rowwise  # noqa: E402,F401  (registers "rowwise")
