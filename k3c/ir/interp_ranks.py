"""The reference interpreter over simulated ranks: one process runs a tensor-parallel graph for every rank.

A graph after the `parallel` phase is the same for every rank (same shapes); only its weights and the values of its
collectives differ by rank. `interpret_ranks` runs the nodes in order for all ranks in lockstep: an ordinary node
runs its torch `ref` once per rank; a collective (`kind == "collective"`) takes every rank's input at once through
`simulate_collective`. Comparing its rank-0 outputs with `interpret` of the unsharded graph proves a parallel
rewrite exact in one process (`tests/passes/test_parallel.py`).
"""

from __future__ import annotations

import torch

from k3c.errors import IRError, K3CError, RuntimeInputError
from k3c.ir.graph import Graph, describe
from k3c.ir.interp import _check_dtype, _check_result, bind_symbols


def interpret_ranks(graph: Graph, inputs: list[dict[str, torch.Tensor]], params: list[dict[str, torch.Tensor]], *,
                    bindings: dict[str, int] | None = None) -> list[dict[str, torch.Tensor]]:
    """Run `graph` on `len(params)` simulated ranks: `inputs[r]` by input name, `params[r]` by parameter key (rank
    r's weights, e.g. `materialize_params(graph, ckpt, rank=r)`). Returns each rank's outputs by name.

    Raises `RuntimeInputError` for missing or mis-shaped inputs (or input lists of different lengths) and `IRError`
    naming the node whose reference fails or returns the wrong type.
    """
    from k3c.ir.ops import get_op, simulate_collective

    ranks = len(params)
    if len(inputs) != ranks or ranks < 1:
        raise RuntimeInputError(f"interpret_ranks: {len(inputs)} input sets for {ranks} ranks")
    envs: list[dict] = [{} for _ in range(ranks)]
    for r in range(ranks):
        for v in graph.inputs:
            if v.name not in inputs[r]:
                raise RuntimeInputError(f"rank {r}: missing graph input %{v.name} ({v.type})")
            envs[r][v] = inputs[r][v.name]
        for key, v in graph.params.items():
            if key not in params[r]:
                raise RuntimeInputError(f"rank {r}: missing parameter {key} ({v.type})")
            envs[r][v] = params[r][key]
        for v, t in envs[r].items():
            _check_dtype(v, t)
    binds = [bind_symbols(graph, env, bindings) for env in envs]
    if any(b != binds[0] for b in binds):
        raise RuntimeInputError(f"ranks bind different sizes: {binds}")
    binds = binds[0]

    last_use = {v: i for i, node in enumerate(graph.nodes) for v in node.inputs}
    keep = set(graph.outputs.values())
    for i, node in enumerate(graph.nodes):
        opdef = get_op(node.op)
        attrs = opdef.concrete_attrs(node.attrs, binds)
        args = [[env[v] for v in node.inputs] for env in envs]
        try:
            if opdef.kind == "collective":
                outs = [[o] for o in simulate_collective(node.op, attrs, [a[0] for a in args])]
            else:
                outs = [opdef.ref(attrs, *a) for a in args]
        except K3CError:
            raise
        except Exception as e:  # a torch error inside a reference is reported against the node
            raise IRError(f"{describe(node)}: reference failed: {type(e).__name__}: {e}") from e
        for env, res in zip(envs, outs):
            for v, t in zip(node.outputs, res):
                _check_result(node, v, t, binds)
                if v in last_use or v in keep:
                    env[v] = t
            for v in node.inputs:
                if last_use.get(v) == i and v not in keep:
                    env.pop(v, None)
    return [{k: env[v] for k, v in graph.outputs.items()} for env in envs]
