"""Derived parameters: weights a pass computes at compile time from checkpoint weights.

A pass that folds weights (absorb_mla: kv_b_proj split per head into W_UK / W_UV; place_dsa: the latent-KV and
indexer-key projections stacked into one GEMM) adds the result as an ordinary graph parameter under a new key and
records how to compute it in `graph.derived_params`:

    graph.derived_params = {new_key: {"op": "mla_w_uk", "from": [checkpoint keys], "attrs": {...}}}

`materialize_params(graph, params)` computes every derived key from the checkpoint tensors in `params` (the weight
exporter and the interpreter tests use it). Derivations are pure functions in `DERIVATIONS` (op name ->
fn(attrs, *tensors) -> tensor); the result must have exactly the parameter's declared type.

Note: `derived_params` is an attribute of the graph object; `Graph.copy()` and the JSON serializer do not know it
yet, so `copy_derived(src, dst)` carries it over where a graph is copied after these passes.
"""

from __future__ import annotations

from typing import Callable

import torch

from k3c.errors import CheckpointError, IRError
from k3c.ir.graph import Graph, Value
from k3c.ir.ops import get_op
from k3c.ir.types import TensorType, torch_dtype


def _mla_w_uk(attrs: dict, w: torch.Tensor) -> torch.Tensor:
    """kv_b_proj.weight [H·(nope+vd), r] -> W_UK [H, nope, r] (the key part, per head)."""
    H, nope, vd = attrs["heads"], attrs["nope"], attrs["v_dim"]
    return w.reshape(H, nope + vd, w.shape[-1])[:, :nope].contiguous()


def _mla_w_uv(attrs: dict, w: torch.Tensor) -> torch.Tensor:
    """kv_b_proj.weight [H·(nope+vd), r] -> W_UV [H, vd, r] (the value part, per head)."""
    H, nope, vd = attrs["heads"], attrs["nope"], attrs["v_dim"]
    return w.reshape(H, nope + vd, w.shape[-1])[:, nope:].contiguous()


def _shard(attrs: dict, w: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s block of `parts` equal blocks of w along `dim` (column/row-parallel weights, experts)."""
    return w.chunk(attrs["parts"], attrs["dim"])[attrs["rank"]].contiguous()


def _vocab_shard(attrs: dict, w: torch.Tensor) -> torch.Tensor:
    """Embedding [V, D] -> rank r's rows [r·V/p, (r+1)·V/p) and one zero row [V/p + 1, D] (vocab-parallel)."""
    rows = w.chunk(attrs["parts"], 0)[attrs["rank"]]
    return torch.cat([rows, rows.new_zeros((1, w.shape[1]))]).contiguous()


def _local_index(attrs: dict, w: torch.Tensor) -> torch.Tensor:
    """i64 [n, 1] for a tensor of n = w.shape[0] rows split in `parts` blocks: global row i -> its row in rank r's
    block; outside it, `missing`: "zero_row" (vocab: the zero row V/p of `vocab_shard`) or "minus_one" (experts:
    −1, which moe_experts skips)."""
    n = w.shape[0]
    per = n // attrs["parts"]
    i = torch.arange(n) - attrs["rank"] * per
    missing = per if attrs["missing"] == "zero_row" else -1
    return torch.where((i >= 0) & (i < per), i, torch.full_like(i, missing)).reshape(n, 1)


def _ir_op(attrs: dict, *ws: torch.Tensor) -> torch.Tensor:
    """One IR op (`attrs["op"]` with its attributes `attrs["attrs"]`) applied to weights: its reference
    implementation, so the result is exactly what the node computes (`fold_params`)."""
    opdef = get_op(attrs["op"])
    return opdef.ref(opdef.concrete_attrs(attrs["attrs"], {}), *ws)[0].contiguous()


#: op name -> fn(attrs, *source tensors) -> derived tensor. `attrs` also carries the "rank" being materialised.
DERIVATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "mla_w_uk": _mla_w_uk,
    "mla_w_uv": _mla_w_uv,
    "cat": lambda attrs, *ws: torch.cat(ws, attrs.get("dim", 0)),
    "shard": _shard,
    "vocab_shard": _vocab_shard,
    "local_index": _local_index,
    "ir": _ir_op,
}
#: derivations whose result depends on the rank (tensor-parallel shards; `k3c.parallel`)
RANKED = frozenset({"shard", "vocab_shard", "local_index"})


def derived_params(graph: Graph) -> dict[str, dict]:
    """The graph's derivation records (created empty on first use)."""
    d = getattr(graph, "derived_params", None)
    if d is None:
        d = graph.derived_params = {}
    return d


def copy_derived(src: Graph, dst: Graph) -> Graph:
    """Copy `src`'s derivation records onto `dst` (for a graph made by `src.copy()`); returns `dst`."""
    if getattr(src, "derived_params", None):
        dst.derived_params = {k: {**v, "from": list(v["from"]), "attrs": dict(v["attrs"])}
                              for k, v in src.derived_params.items()}
    return dst


def add_derived_param(graph: Graph, key: str, type: TensorType, op: str, sources: list[str],
                      attrs: dict | None = None) -> Value:
    """Declare parameter `key` of `type`, computed by derivation `op` from checkpoint keys `sources`.

    Sources that are themselves derived are resolved by `materialize_params`. Returns the parameter's value (the
    existing one when `key` is already declared with the same recipe). Raises `IRError` for an unknown op or a
    clash with a different recipe.
    """
    if op not in DERIVATIONS:
        raise IRError(f"unknown derivation {op!r} (known: {', '.join(sorted(DERIVATIONS))})")
    rec = {"op": op, "from": list(sources), "attrs": dict(attrs or {})}
    table = derived_params(graph)
    if key in graph.params:
        if table.get(key) != rec or graph.params[key].type != type:
            raise IRError(f"parameter {key!r} already exists with another derivation or type")
        return graph.params[key]
    table[key] = rec
    return graph.add_param(key, type)


def materialize_params(graph: Graph, params: dict[str, torch.Tensor], rank: int = 0) -> dict[str, torch.Tensor]:
    """Tensors for every parameter of `graph`: taken from `params` (checkpoint key -> tensor) or, for derived keys
    not given there, computed from their recipe (recursively) for tensor-parallel rank `rank`. Raises
    `CheckpointError` naming a missing source, and `IRError` when a derived tensor does not have the declared
    type."""
    table = getattr(graph, "derived_params", None) or {}
    cache: dict[str, torch.Tensor] = {}

    def get(key: str, stack: tuple = ()) -> torch.Tensor:
        if key in params:
            return params[key]
        if key in cache:
            return cache[key]
        rec = table.get(key)
        if rec is None:
            raise CheckpointError(f"parameter {key!r} is neither given nor derived" +
                                  (f" (needed for {stack[-1]!r})" if stack else ""))
        if key in stack:
            raise IRError(f"derived parameter {key!r} depends on itself")
        srcs = [get(s, stack + (key,)) for s in rec["from"]]
        with torch.no_grad():
            t = DERIVATIONS[rec["op"]]({**rec["attrs"], "rank": rank}, *srcs)
        v = graph.params.get(key)
        if v is not None:
            want = tuple(int(d) for d in v.type.shape)
            if tuple(t.shape) != want or t.dtype != torch_dtype(v.type.dtype):
                raise IRError(f"derived parameter {key!r}: {rec['op']} gave {t.dtype}{list(t.shape)}, "
                              f"declared {v.type}")
        cache[key] = t
        return t

    return {k: get(k) for k in graph.params}


def rank_dependent(graph: Graph, key: str) -> bool:
    """True when parameter `key` differs between tensor-parallel ranks (a `RANKED` recipe, directly or below)."""
    table = getattr(graph, "derived_params", None) or {}
    rec = table.get(key)
    return rec is not None and (rec["op"] in RANKED or any(rank_dependent(graph, s) for s in rec["from"]))


def prune_unused_params(graph: Graph, keys) -> list[str]:
    """Drop the parameters among `keys` that no node reads any more; returns the dropped keys."""
    dropped = []
    for k in keys:
        v = graph.params.get(k)
        if v is not None and not graph.users(v) and not graph.is_output(v):
            del graph.params[k]
            graph._users.pop(v, None)
            graph._names.discard(v.name)
            dropped.append(k)
    return dropped
