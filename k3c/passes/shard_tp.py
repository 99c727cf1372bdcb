"""Pass `shard_tp` (parallel phase): split attention, KDA, dense MLP, shared experts, embedding and lm_head over
`ctx.tp` ranks (the layout of `k3c.parallel`); a no-op at tp = 1.

One graph serves every rank. A split weight becomes the derived parameter `<key>.shard` (derivation "shard": the
rank's block, see `k3c.passes.derived`), so the graph only names it and each rank's weight file holds its own block
under that key; per-head caches (KDA state, conv state) get their per-rank shapes. Then every node's output type
is inferred again in schedule order, adjusting the attrs that carry a head count: `kda_fused.heads`, the `shape` of
a reshape whose input shrank (the first static dim divisible by tp is the head or feature dim, which comes before
the per-head dims in every layout of the model), and the `shape` of an `expand` that broadcasts a replicated value
to the heads of a `cat` partner (MLA's naive form: cat(k_nope, expand(k_pe)), `k3c.passes.mla_forms`): it follows
the partner's split dims. Finally the communication:

    row-parallel linear y = x_r W_rᵀ        ->  all_reduce(y)                 (partial sums over the ranks)
    lm_head (vocabulary slice)              ->  all_gather(logits, dim=-1)
    embedding(W, tokens)                    ->  all_reduce(embedding(W_r ∪ 0, embedding(map_r, tokens)))

where W_r ∪ 0 is the rank's vocabulary rows plus a zero row and map_r (`<key>.local_ids`, derivation
"local_index") sends a token outside the rank's rows to that zero row, so the all-reduce of the partial embeddings
is the full lookup.
`split_allreduce` later turns the all-reduces into reduce-scatter / all-gather pairs around AttnRes.
Raises ConfigError naming a parameter or cache that tp does not divide. O(nodes + params).
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.errors import ConfigError, IRError
from k3c.ir.graph import Graph, Node, describe
from k3c.ir.ops import get_op
from k3c.ir.types import TensorType
from k3c.parallel import EMBEDDING, cache_split, param_split
from k3c.passes.common import local_rows, shard_param, wrap_value
from k3c.passes.derived import add_derived_param, prune_unused_params
from k3c.passes.pipeline import register_pass

PASS = "shard_tp"


@register_pass(PASS)
def shard_tp(graph: Graph, ctx: CompileContext) -> Graph:
    tp = ctx.tp
    if tp == 1:
        return graph
    before = {id(n): [v.type for v in n.inputs] for n in graph.nodes}
    row_outputs, vocab_outputs, embeddings = [], [], []
    for n in graph.nodes:
        if n.op == "linear" and len(n.inputs) >= 2 and n.inputs[1] in graph.params.values():
            kind = param_split(n.inputs[1].name, ctx.ep).kind
            if kind == "row":
                row_outputs.append(n.output)
            elif n.inputs[1].name == "lm_head.weight":
                vocab_outputs.append(n.output)
        elif n.op == "embedding" and n.inputs[0].name == EMBEDDING:
            embeddings.append(n)
    for key in list(graph.params):
        split = param_split(key, ctx.ep)
        if split.kind in ("column", "row") and not key.endswith((".w1", ".w3", ".w2")):
            shard_param(graph, key, split.dim, tp)
    for v in graph.inputs:
        split = cache_split(v.name)
        if split.sharded:
            size = v.type.shape[split.dim]
            if not isinstance(size, int) or size % tp:
                raise ConfigError(f"--tp {tp} does not divide dim {split.dim} of cache {v.name} {v.type}")
            shape = list(v.type.shape)
            shape[split.dim] = size // tp
            v.type = v.type.with_shape(shape)
    _reinfer(graph, before, tp)
    for y in row_outputs:
        wrap_value(graph, y, "all_reduce", PASS, group=tp)
    for y in vocab_outputs:
        wrap_value(graph, y, "all_gather", PASS, group=tp, dim=-1)
    for node in embeddings:
        _vocab_parallel(graph, node, tp)
    return graph


def _reinfer(graph: Graph, before: dict[int, list[TensorType]], tp: int) -> None:
    """Infer every node's output types again after the parameter and cache shapes changed."""
    for node in graph.nodes:
        if node.op == "cat":
            _follow_cat(graph, node)
        if [v.type for v in node.inputs] == before.get(id(node)):
            continue
        if node.op == "kda_fused":
            node.attrs = {**node.attrs, "heads": node.attrs["heads"] // tp}
        elif node.op == "reshape":
            node.attrs = {**node.attrs, "shape": _split_shape(node, tp)}
        try:
            outs = get_op(node.op).infer(node.attrs, [v.type for v in node.inputs])
        except IRError as e:
            raise IRError(f"{PASS}: cannot split {describe(node)} over {tp} ranks: {e}") from None
        for v, t in zip(node.outputs, outs):
            v.type = t


def _follow_cat(graph: Graph, cat: Node) -> None:
    """Re-target each `expand` input of `cat` whose broadcast dims no longer match the other inputs (which lost
    their heads to the split) to those inputs' sizes; the expand's own input is replicated, so it is unchanged."""
    d = cat.attrs["dim"] % cat.inputs[0].type.rank
    shaped = [v for v in cat.inputs if (p := graph.producer(v)) is None or p.op != "expand"]
    if not shaped:
        return
    want = shaped[0].type.shape
    for v in cat.inputs:
        node = graph.producer(v)
        if node is None or node.op != "expand" or v.type.rank != len(want):
            continue
        shape = [v.type.shape[i] if i == d else want[i] for i in range(len(want))]
        if shape != list(v.type.shape):
            node.attrs = {**node.attrs, "shape": [s if isinstance(s, int) else str(s) for s in shape]}
            (v.type,) = get_op("expand").infer(node.attrs, [node.inputs[0].type])


def _split_shape(node: Node, tp: int) -> list:
    shape = list(node.attrs["shape"])
    for i, d in enumerate(shape):
        if isinstance(d, int) and d > 1 and d % tp == 0:
            shape[i] = d // tp
            return shape
    raise IRError(f"{PASS}: no dim of reshape {describe(node)} {shape} splits over {tp} ranks")


def _vocab_parallel(graph: Graph, node: Node, tp: int) -> None:
    w, tokens = node.inputs
    V, D = w.type.shape
    if V % tp:
        raise ConfigError(f"--tp {tp} does not divide vocab_size = {V} ({EMBEDDING} {w.type})")
    local = local_rows(graph, EMBEDDING, tokens, node, PASS, "zero_row", tp)
    table = add_derived_param(graph, EMBEDDING + ".shard", TensorType((V // tp + 1, D), w.type.dtype),
                              "vocab_shard", [EMBEDDING], {"parts": tp})
    graph.set_input(node, 0, table)
    graph.set_input(node, 1, local)
    prune_unused_params(graph, [EMBEDDING])
    wrap_value(graph, node.output, "all_reduce", PASS, group=tp)
