"""Pass `fold_params` (model phase): what depends on weights alone is computed once, at compile time.

The reference model casts and combines weights inside its forward (`models/layers.py`): the router multiplies by
`gate.weight.float()`, Block AttnRes scores with `norm_weight.float() * proj_weight[0].float()`. Traced, each is a
chain of elementwise and shape ops whose inputs are all parameters, and every call would run it again: at decode
the router's cast reads the bf16 gate weight, writes an f32 copy and the GEMM reads that copy (3 passes over the
weight where 1 suffices, and a launch), and each AttnRes site adds a launch.

Here every elementwise node whose inputs are all parameters, and every shape op (select, reshape, ...) of
parameters that only such nodes read, becomes a derived parameter (`k3c.passes.derived`, derivation "ir": the
node's own op reference, so the folded tensor is exactly what the node computes) whose key spells the
computation, e.g. `model.layers.1.block_sparse_moe.gate.weight.cast-f32`. Keys depend on the graph only, so
prefill and decode share the stored tensor and artifacts stay byte-identical; parameters nothing reads any more
are dropped (`prune_unused_params`), so a cast weight is stored once, in its folded dtype. A node is not folded
when its result would be more than twice the bytes of its inputs (a broadcast product of weights is cheaper to
recompute than to store). Runs before `shard_tp`, so a folded weight shards like the weight it came from.
A `cat` or `stack` of parameters copies at every call; it is folded too (Block AttnRes stacks one query row per
sublayer into `attn_res.queries`), when every source is replicated over tensor-parallel ranks (the stacked key
has no split of its own). A key longer than MAX_KEY characters keeps its first source and op and ends in a
hash of the full spelling (the recipe in `graph.derived_params` lists every source). O(nodes).
"""

from __future__ import annotations

import hashlib
import json
import re

from k3c.context import CompileContext
from k3c.ir.graph import Graph, Node, Value
from k3c.ir.ops import get_op
from k3c.ir.rewrite import dce_in_place
from k3c.ir.types import nbytes
from k3c.parallel import REPLICATED, param_split
from k3c.passes.derived import add_derived_param, prune_unused_params
from k3c.passes.pipeline import register_pass

PASS = "fold_params"
#: a folded result may be at most this many times its inputs' bytes (a bf16 -> f32 cast is 2)
MAX_GROWTH = 2
#: shape ops that copy their inputs at run time (the others are views)
COPYING = frozenset({"cat", "stack"})
#: longest spelled key; longer ones end in a hash
MAX_KEY = 200


def _nbytes(v: Value) -> int:
    return nbytes(v.type)


def _key(n: Node, sources: list[str]) -> str:
    """The derived key: the first source, the op with its attribute values (those set: not None or False), the
    other sources (`<src0>.<op>[-<attr values>][.<src1>...]`, in the characters value names allow)."""
    vals = "-".join(re.sub(r"[^\w.\-]", "", json.dumps(n.attrs[k], sort_keys=True)) for k in sorted(n.attrs)
                    if n.attrs[k] is not None and n.attrs[k] is not False)
    key = ".".join([sources[0], n.op + (f"-{vals}" if vals else "")] + sources[1:])
    if len(key) <= MAX_KEY:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"{sources[0]}.{n.op}{f'-{vals}' if vals else ''}.{len(sources) - 1}-more-{digest}"


def _foldable(graph: Graph, n: Node, key_of: dict[Value, str], ctx: CompileContext) -> bool:
    if len(n.outputs) != 1 or not n.inputs or any(v not in key_of for v in n.inputs):
        return False
    y = n.outputs[0]
    if graph.is_output(y) or not y.type.is_concrete() or _nbytes(y) > MAX_GROWTH * sum(_nbytes(v) for v in n.inputs):
        return False
    kind = get_op(n.op).kind
    if kind == "elementwise":
        return True
    if kind != "shape":
        return False
    if n.op in COPYING:
        return all(param_split(key_of[v], ctx.ep) == REPLICATED for v in n.inputs)
    # a view of weights is folded only into a computation or copy that reads it: a weight a GEMM reads through a
    # reshape stays the checkpoint's tensor
    return all(get_op(u.op).kind == "elementwise" or u.op in COPYING for u in graph.users(y))


@register_pass(PASS)
def fold_params(graph: Graph, ctx: CompileContext) -> Graph:
    key_of = {v: k for k, v in graph.params.items()}
    folded = []
    for n in list(graph.nodes):                 # topological: a folded node's users come after it
        if not _foldable(graph, n, key_of, ctx):
            continue
        sources = [key_of[v] for v in n.inputs]
        key = _key(n, sources)
        p = add_derived_param(graph, key, n.outputs[0].type, "ir", sources, {"op": n.op, "attrs": n.attrs})
        graph.replace_all_uses(n.outputs[0], p)
        key_of[p] = key
        folded.append(n)
    if folded:
        dce_in_place(graph)
        prune_unused_params(graph, sorted({k for n in folded for k in (key_of[v] for v in n.inputs)}))
    return graph
