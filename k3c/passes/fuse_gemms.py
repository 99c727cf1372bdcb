"""Pass `fuse_gemms` (kernels phase): linears that read the same input become one GEMM over concatenated weights.

A decode step is bound by its launch count as much as by its bytes: K3's blocks project one normed input through
several weights side by side (KDA's q / k / v / f_a / b / g projections, MLA's q_a with DSA's latent-KV + index-key
and index-weight projections and the output gate, the shared experts' gate / up with the latent routed-expert
down-projection, a dense MLP's gate / up). Here every such set

    y_i = linear(x, W_i)        W_i [N_i, K] parameters of one dtype, each read by this linear only

becomes `y = linear(x, cat(W_1, ..., W_n))` [.., ΣN_i] and `y_1, ..., y_n = split(y, [N_1, ..., N_n], dim=-1)`:
the same products (one GEMM streams the same weight bytes, in one launch instead of n). A linear whose only user
is itself a split along the last dim (`place_dsa`'s latent-KV + index-key projection) contributes that split's
parts directly, so no split of a split remains. The fused weight is the derived parameter
`<common prefix><name_1>-...-<name_n><common suffix>` (derivation "cat" along dim 0, `k3c.passes.derived`),
materialised and stored concatenated in the artifact (the sources are dropped, so no byte is stored twice); the
recipe and key depend on the graph only, so artifacts stay byte-identical.

Tensor parallelism: the pass runs after `shard_tp`, on the rank's shapes. A column-split weight is the derived
`<key>.shard`, and `cat` of the ranks' shards is each rank's slice of the fused output, so every rank's weight
file holds its own concatenation; replicated and split weights mix freely (both are what rank r computes).

The split's outputs are column views of the fused output: `plan_memory` binds them as views where a call has one
token per sequence (decode; contiguous at batch 1) and gives them their own buffers otherwise (prefill). Runs on
every entry point, so prefill and decode read the same stored weights. O(nodes).
"""

from __future__ import annotations

import os

from k3c.context import CompileContext
from k3c.ir.graph import Graph, Node, Value
from k3c.ir.rewrite import dce_in_place
from k3c.ir.types import TensorType
from k3c.passes.derived import add_derived_param, prune_unused_params
from k3c.passes.pipeline import register_pass

PASS = "fuse_gemms"


def _fusable(graph: Graph, n: Node, key_of: dict[Value, str]) -> bool:
    """A bias-free linear of a 2-D parameter weight that nothing else reads."""
    if n.op != "linear" or len(n.inputs) != 2:
        return False
    w = n.inputs[1]
    return (w in key_of and len(w.type.shape) == 2 and len(graph.users(w)) == 1 and not graph.is_output(w))


def _parts(graph: Graph, n: Node) -> tuple[list[Value], list]:
    """The values linear `n` provides and their widths: its output, or the parts of the split that is its only
    user (a split along the last dim)."""
    y = n.outputs[0]
    users = graph.users(y)
    if len(users) == 1 and not graph.is_output(y):
        s = users[0]
        if s.op == "split" and s.attrs.get("dim") in (-1, len(y.type.shape) - 1):
            return list(s.outputs), list(s.attrs["sizes"])
    return [y], [n.inputs[1].type.shape[0]]


def fused_key(keys: list[str]) -> str:
    """`<common prefix><distinct middles joined by -><common suffix>` of parameter keys, cut at dots:
    ["m.l1.q.weight", "m.l1.k.weight"] -> "m.l1.q-k.weight"."""
    split = [k.split(".") for k in keys]
    pre = len(os.path.commonprefix(split))
    suf = len(os.path.commonprefix([s[pre:][::-1] for s in split]))
    middles = [".".join(s[pre:len(s) - suf]) for s in split]
    return ".".join([*split[0][:pre], "-".join(middles), *split[0][len(split[0]) - suf:]])


def _fuse(graph: Graph, lins: list[Node], key_of: dict[Value, str]) -> None:
    x, first = lins[0].inputs[0], lins[0]
    keys = [key_of[n.inputs[1]] for n in lins]
    ws = [n.inputs[1] for n in lins]
    rows = sum(w.type.shape[0] for w in ws)
    w = add_derived_param(graph, fused_key(keys), TensorType((rows, ws[0].type.shape[1]), ws[0].type.dtype), "cat",
                          keys, {"dim": 0})
    old, sizes = [], []
    for n in lins:
        vals, widths = _parts(graph, n)
        old += vals
        sizes += widths
    name = f"{first.outputs[0].name}.fused"
    meta = {"pass": PASS, "layer": first.meta.get("layer"), "source": f"one GEMM for {len(lins)} projections"}
    with graph.inserting_before(first):
        y = graph.add("linear", x, w, name_hint=name, meta=meta)
        parts = graph.add_node("split", [y], {"sizes": sizes, "dim": -1}, meta=meta, name_hint=name)
    for o, p in zip(old, parts):
        graph.replace_all_uses(o, p)


@register_pass(PASS)
def fuse_gemms(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `fuse_gemms` (module docstring); mutates and returns `graph`."""
    key_of = {v: k for k, v in graph.params.items()}
    groups: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        if _fusable(graph, n, key_of):
            groups.setdefault((n.inputs[0], n.inputs[1].type.dtype), []).append(n)
    fused = [lins for lins in groups.values() if len(lins) > 1]
    if not fused:
        return graph
    for lins in fused:
        _fuse(graph, lins, key_of)
    dce_in_place(graph)
    prune_unused_params(graph, [key_of[n.inputs[1]] for lins in fused for n in lins])
    return graph
