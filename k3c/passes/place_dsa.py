"""Pass `place_dsa`: the DSA lightning indexer placed and joined with the latent KV path (K3-SPEC.md "Gated DSA").

Per DSA layer i (a `dsa_index_topk` node whose keys are the `layers.i.index_k` cache), it
1. joins the indexer key projection with the latent KV write: `linear(x, kv_a_proj_with_mqa.weight)` and
   `linear(x, indexer.wk.weight)` become one GEMM over the stacked weight (a derived parameter
   `<layer>.self_attn.kv_a_proj_with_indexer_wk.weight` = cat([kv_a_proj_with_mqa.weight, indexer.wk.weight]))
   split into (c, k_pe, k_idx); the indexer's `k_norm` and its cache append are scheduled right after the
   latent cache append, so both per-token cache entries (576 latent + 128 index values) are written together
   (FP8 index keys, `k3c.frontend.index_keys`: the keys' `fp8_quantize` or `fp8_split` and the scale (and
   residual) caches' appends with them);
2. makes the sparse attention consume the indices directly: `mla_attention(…, idx)` (built by `absorb_mla`; if
   that pass did not run, the dense mask scatter `scatter(zeros, idx + 1, ones)[..., 1:]` is replaced here with
   the same builder), and sets the guard `dense_max_keys = topk` on it: while the context has ≤ topk keys the
   dense causal path runs (exactly equal: the indexer then selects every visible key). The −1 slots of idx are
   only read by `mla_attention`, which masks them; no gather/index_select ever sees them;
3. schedules `dsa_index_topk` as early as its inputs allow: it and its private producers (wq_b, weights_proj,
   the key path above) move up to right after the layer input and the q-LoRA latent are ready.
Other nodes keep their relative order. O(nodes).
"""

from __future__ import annotations

import heapq

from k3c.context import CompileContext
from k3c.ir.graph import Graph, Node, Value
from k3c.ir.types import TensorType
from k3c.passes.mla_forms import lower_mla_layers
from k3c.ir.rewrite import dce_in_place
from k3c.passes.derived import add_derived_param, prune_unused_params
from k3c.passes.pipeline import register_pass


def _p(graph: Graph, v: Value, op: str) -> Node | None:
    n = graph.producer(v)
    return n if n is not None and n.op == op else None


def _join_key_projection(graph: Graph, prefix: str, key_of: dict) -> list[Node]:
    """Step 1 for layer `prefix` ("layers.i."): fuse the two projections; returns the cache-write nodes to
    schedule together (empty when the layer does not have the expected shape)."""
    kv_out, ik_out = graph.outputs.get(prefix + "kv"), graph.outputs.get(prefix + "index_k")
    kv_cat = kv_out is not None and _p(graph, kv_out, "cat")
    ik_cat = ik_out is not None and _p(graph, ik_out, "cat")
    if not kv_cat or not ik_cat or len(kv_cat.inputs) != 2 or len(ik_cat.inputs) != 2:
        return []
    new_kv = _p(graph, kv_cat.inputs[1], "cat")
    quant = _p(graph, ik_cat.inputs[1], "fp8_quantize") or _p(graph, ik_cat.inputs[1], "fp8_split")  # FP8 keys
    ln = _p(graph, quant.inputs[0] if quant else ik_cat.inputs[1], "layer_norm")
    side = [graph.outputs.get(prefix + "index_k" + s) for s in ("_scale", "_lo")[:len(quant.outputs) - 1]] \
        if quant else []                                          # the scale (and residual) caches' appends
    side_cats = [v is not None and _p(graph, v, "cat") for v in side]
    if not new_kv or len(new_kv.inputs) != 2 or not ln or not all(side_cats):
        return []
    norm = graph.producer(new_kv.inputs[0])
    split = graph.producer(new_kv.inputs[1])
    if norm is None or split is None or split.op != "split" or len(split.outputs) != 2:
        return []
    lin_kv, lin_ik = _p(graph, split.inputs[0], "linear"), _p(graph, ln.inputs[0], "linear")
    group = [norm, new_kv, kv_cat, ln, *([quant, ik_cat, *side_cats] if quant else [ik_cat])]
    if not lin_kv or not lin_ik or len(lin_kv.inputs) != 2 or len(lin_ik.inputs) != 2:
        return group
    x, w_kv, w_ik = lin_kv.inputs[0], lin_kv.inputs[1], lin_ik.inputs[1]
    if lin_ik.inputs[0] is not x or w_kv not in key_of or w_ik not in key_of or w_kv.type.dtype != w_ik.type.dtype:
        return group
    if any(len(graph.users(v)) != 1 or graph.is_output(v) for v in (lin_kv.outputs[0], lin_ik.outputs[0])):
        return group
    k_kv, k_ik = key_of[w_kv], key_of[w_ik]
    base = k_kv[:-len("kv_a_proj_with_mqa.weight")] if k_kv.endswith("kv_a_proj_with_mqa.weight") else k_kv + "."
    n_kv, n_ik = w_kv.type.shape[0], w_ik.type.shape[0]
    w = add_derived_param(graph, base + "kv_a_proj_with_indexer_wk.weight",
                          TensorType((n_kv + n_ik, w_kv.type.shape[1]), w_kv.type.dtype), "cat", [k_kv, k_ik],
                          {"dim": 0})
    meta = {"pass": "place_dsa", "layer": lin_kv.meta.get("layer"), "source": "latent KV + index key projection"}
    with graph.inserting_before(lin_kv):
        fused = graph.add("linear", x, w, name_hint=f"l{prefix.split('.')[1]}.kv_index_proj", meta=meta)
        sizes = [*split.attrs["sizes"], n_ik]
        parts = graph.add_node("split", [fused], {"sizes": sizes, "dim": -1}, meta=meta,
                               name_hint=f"l{prefix.split('.')[1]}.kv_index_proj")
    for old, new in zip(split.outputs + lin_ik.outputs, parts):
        graph.replace_all_uses(old, new)
    return [graph.producer(fused), graph.producer(parts[0]), *group]


def _private_producers(graph: Graph, node: Node, stop: set) -> list[Node]:
    """`node` and the producers (transitively) whose every use is inside that set, topologically ordered."""
    inside = {id(node)}
    out = [node]
    frontier = [node]
    while frontier:
        n = frontier.pop()
        for v in n.inputs:
            p = graph.producer(v)
            if p is None or id(p) in inside or v in stop:
                continue
            if all(id(u) in inside for x in p.outputs for u in graph.users(x)) and \
                    not any(graph.is_output(x) for x in p.outputs):
                inside.add(id(p))
                out.append(p)
                frontier.append(p)
    return out


def schedule_asap(graph: Graph, movable: set[int], key: dict[int, float]) -> None:
    """Reorder `graph.nodes`: every node in `movable` (ids) is emitted as soon as all its inputs are, ties by
    `key` (a position); the other nodes keep their order. Nodes only move earlier. O(n log n)."""
    avail: set[Value] = set(graph.inputs) | set(graph.params.values())
    missing: dict[int, int] = {}
    waiting: dict[Value, list[Node]] = {}
    ready: list = []
    for n in graph.nodes:
        if id(n) in movable:
            need = {v for v in n.inputs if v not in avail}
            missing[id(n)] = len(need)
            for v in need:
                waiting.setdefault(v, []).append(n)
            if not need:
                heapq.heappush(ready, (key[id(n)], id(n), n))
    out: list[Node] = []

    def emit(n: Node) -> None:
        out.append(n)
        for v in n.outputs:
            for u in waiting.pop(v, ()):
                missing[id(u)] -= 1
                if missing[id(u)] == 0:
                    heapq.heappush(ready, (key[id(u)], id(u), u))

    def drain() -> None:
        while ready:
            emit(heapq.heappop(ready)[2])

    drain()
    for n in graph.nodes:
        if id(n) not in movable:
            emit(n)
            drain()
    if len(out) != len(graph.nodes):
        from k3c.errors import IRError

        raise IRError("schedule_asap: a movable node never became ready (graph not topologically sorted?)")
    graph.nodes = out


@register_pass("place_dsa")
def place_dsa(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `place_dsa` (module docstring)."""
    tops = [n for n in graph.nodes if n.op == "dsa_index_topk"]
    if not tops:
        return graph
    # 2. the sparse attention reads idx (absorb_mla normally did this already)
    def consumers(t: Node) -> list[Node]:
        return [u for u in graph.users(t.outputs[0]) if u.op == "mla_attention"]

    if any(not consumers(t) for t in tops):
        lower_mla_layers(graph, ctx.bounds, pass_name="place_dsa", only_sparse=True)
    for t in tops:
        for att in consumers(t):
            if att.attrs["dense_max_keys"] != t.attrs["topk"]:
                att.attrs["dense_max_keys"] = t.attrs["topk"]
                att.meta["pass"] = "place_dsa"
    # 1. join the index key projection / cache write with the latent KV write
    key_of = {v: k for k, v in graph.params.items()}
    groups: list[list[Node]] = []
    for t in tops:
        prefix = next((k[:-len("index_k")] for k, v in graph.outputs.items()
                       if v is t.inputs[2] and k.endswith(".index_k")), None)
        groups.append(_join_key_projection(graph, prefix, key_of) if prefix is not None else [])
    dce_in_place(graph)
    for k in set(graph.params) - set(key_of.values()):  # the fused weights' sources are now unread
        rec = getattr(graph, "derived_params", {}).get(k)
        if rec and rec["op"] == "cat":
            prune_unused_params(graph, rec["from"])
    # 3. schedule: the cache-write group and the indexer as early as their inputs allow
    pos = {id(n): float(i) for i, n in enumerate(graph.nodes)}
    movable: set[int] = set()
    for t, group in zip(tops, groups):
        group = [n for n in group if id(n) in pos]
        movable.update(id(n) for n in group)
        stop = set(graph.inputs) | set(graph.params.values())
        movable.update(id(n) for n in _private_producers(graph, t, stop))
    schedule_asap(graph, movable, pos)
    for n in graph.nodes:
        if n.op == "dsa_index_topk":
            n.meta.setdefault("pass", "place_dsa")
    return graph
