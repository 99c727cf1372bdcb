"""Reference interpreter: run a graph node by node with each op's torch `ref`.

Used to prove passes (interpret before and after on random inputs) and as the oracle for generated kernels.
Values are freed right after their last use, so peak memory follows the graph's liveness, not its size.
"""

from __future__ import annotations

from typing import Callable

import torch

from k3c.errors import IRError, K3CError, RuntimeInputError
from k3c.ir.graph import Graph, Node, Value, describe
from k3c.ir.types import DTYPES, dtype_of, torch_dtype

Trace = Callable[[Node, list, list], None]


def bind_symbols(graph: Graph, tensors: dict[Value, torch.Tensor],
                 bindings: dict[str, int] | None = None) -> dict[str, int]:
    """Symbol values from the shapes of the graph's input and param tensors.

    A dim that is a bare symbol binds it; every other dim is then checked. Raises `RuntimeInputError` for
    inconsistent or unbindable shapes or a wrong rank.
    """
    out = dict(bindings or {})
    for v, t in tensors.items():
        if t.dim() != v.type.rank:
            raise RuntimeInputError(f"%{v.name} expects {v.type}, got shape {tuple(t.shape)}")
        for d, n in zip(v.type.shape, t.shape):
            if not isinstance(d, int) and d.is_Symbol:
                if out.setdefault(d.name, int(n)) != int(n):
                    raise RuntimeInputError(f"%{v.name}: {d.name} = {n} but {d.name} = {out[d.name]} elsewhere")
    for v, t in tensors.items():
        try:
            want = v.type.concrete_shape(out)
        except IRError as e:
            raise RuntimeInputError(f"%{v.name} ({v.type}): {e}") from None
        if want != tuple(t.shape):
            raise RuntimeInputError(f"%{v.name} expects {v.type} = {list(want)} under {out}, got {list(t.shape)}")
    return out


def _check_dtype(v: Value, t: torch.Tensor) -> None:
    if t.dtype != torch_dtype(v.type.dtype):
        raise RuntimeInputError(f"%{v.name} expects dtype {v.type.dtype}, got {t.dtype}")


def interpret(graph: Graph, inputs: dict[str, torch.Tensor], params: dict[str, torch.Tensor], *,
              bindings: dict[str, int] | None = None, trace: Trace | None = None,
              check_types: bool = True) -> dict[str, torch.Tensor]:
    """Run `graph` on CPU tensors: `inputs` by input name, `params` by checkpoint key; returns outputs by name.

    `trace(node, input_tensors, output_tensors)` is called after every node. With `check_types`, each ref result
    is checked against the node's output types evaluated under the symbol bindings. Raises
    `RuntimeInputError` for missing/mis-shaped inputs and `IRError` naming the node whose ref fails or
    returns the wrong shape/dtype.
    """
    from k3c.ir.ops import get_op

    env: dict[Value, torch.Tensor] = {}
    for v in graph.inputs:
        if v.name not in inputs:
            raise RuntimeInputError(f"missing graph input %{v.name} ({v.type})")
        env[v] = inputs[v.name]
    for key, v in graph.params.items():
        if key not in params:
            raise RuntimeInputError(f"missing parameter {key} ({v.type})")
        env[v] = params[key]
    for v, t in env.items():
        _check_dtype(v, t)
    binds = bind_symbols(graph, env, bindings)

    last_use: dict[Value, int] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.inputs:
            last_use[v] = i
    keep = {v for v in graph.outputs.values()}

    for i, node in enumerate(graph.nodes):
        opdef = get_op(node.op)
        try:
            args = [env[v] for v in node.inputs]
        except KeyError as e:
            raise IRError(f"{describe(node)}: input {e} has no value (graph not verified?)") from None
        attrs = opdef.concrete_attrs(node.attrs, binds)
        try:
            outs = opdef.ref(attrs, *args)
        except K3CError:
            raise
        except Exception as e:  # a torch error inside a reference is reported against the node
            raise IRError(f"{describe(node)}: reference failed: {type(e).__name__}: {e}") from e
        if len(outs) != len(node.outputs):
            raise IRError(f"{describe(node)}: ref returned {len(outs)} tensors for {len(node.outputs)} outputs")
        if check_types:
            for v, t in zip(node.outputs, outs):
                _check_result(node, v, t, binds)
        if trace is not None:
            trace(node, args, outs)
        for v, t in zip(node.outputs, outs):
            if v in last_use or v in keep:
                env[v] = t
        for v in node.inputs:
            if last_use.get(v) == i and v not in keep:
                env.pop(v, None)
    return {k: env[v] for k, v in graph.outputs.items()}


def _check_result(node: Node, v: Value, t: torch.Tensor, binds: dict[str, int]) -> None:
    want = v.type.concrete_shape(binds)
    if tuple(t.shape) != want or t.dtype != torch_dtype(v.type.dtype):
        got = f"{dtype_of(t.dtype) if t.dtype in _KNOWN else t.dtype}[{','.join(map(str, t.shape))}]"
        raise IRError(f"{describe(node)}: ref produced {got} for %{v.name} : {v.type} "
                      f"(= [{','.join(map(str, want))}] with {binds})")


_KNOWN = {td for td, _ in DTYPES.values()}

