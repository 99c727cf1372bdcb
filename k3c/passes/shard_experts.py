"""Pass `shard_experts` (parallel phase): split the routed experts of every `moe_experts` over `ctx.tp` ranks; a no-op
at tp = 1.

The router stays replicated: every rank scores every token and picks the same top-k. Two layouts (`k3c.parallel`):
- expert parallel (`ctx.ep == tp`): rank r keeps experts [r·E/tp, (r+1)·E/tp) (`<key>.shard`, derivation
  "shard" along dim 0), and the router's ids pass through a per-rank map (`<w1>.local_ids`, derivation
  "local_index", missing = −1): a choice of another rank's expert becomes −1, which moe_experts skips;
- width split (`ctx.ep == 1`): every expert keeps all E experts with 1/tp of the intermediate width (w1/w3 rows,
  w2 columns), as a dense MLP splits.
MXFP4 experts split their packed values and scales alike (`k3c.parallel.param_split`).
Either way the result is a partial sum over the ranks, so it is all-reduced before the routed-expert norm.

Token dispatch is "all-gather + reduce-scatter over tokens", not all-to-all: with `split_allreduce` the MoE input
arrives through the all-gather that every column-parallel block needs anyway, and the partial result leaves through
a reduce-scatter, so dispatch and combine cost no collective of their own; all-to-all would send each token's
latent to its k experts' ranks (k·N·d per step, k = 16 in K3) and need a second exchange back, plus a
data-dependent count exchange that a CUDA graph cannot capture. One graph serves every rank: the map and the
expert blocks are rank data. Raises ConfigError naming the key that tp does not divide. O(nodes).
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.ir.graph import Graph
from k3c.parallel import param_split
from k3c.passes.common import local_rows, shard_param, wrap_value
from k3c.passes.pipeline import register_pass

PASS = "shard_experts"


@register_pass(PASS)
def shard_experts(graph: Graph, ctx: CompileContext) -> Graph:
    tp = ctx.tp
    if tp == 1:
        return graph
    for node in [n for n in graph.nodes if n.op == "moe_experts"]:
        ids, weights = node.inputs[2], node.inputs[3:]  # w1, w3, w2 and, in MXFP4, their scales
        if ctx.ep > 1:
            graph.set_input(node, 2, local_rows(graph, weights[0].name, ids, node, PASS, "minus_one", tp))
        for w in weights:  # shard_param redirects the node's inputs to the shards
            shard_param(graph, w.name, param_split(w.name, ctx.ep).dim, tp)
        wrap_value(graph, node.output, "all_reduce", PASS, group=tp)
    return graph
