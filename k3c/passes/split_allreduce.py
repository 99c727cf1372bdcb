"""Pass `split_allreduce` (parallel phase): each all-reduce of a token-carrying partial sum becomes a reduce-scatter
over tokens, the row-wise work behind it runs on the rank's token shard, and an all-gather restores the full
tokens in front of the next op that needs them (K3 report, "AttnRes under tensor parallelism"); no-op at tp = 1.

    y = all_reduce(x)                      s = reduce_scatter_tokens(x)           [1, ceil(N/g), D]
    h = add(r, y); m = attn_res_merge(..)  ->  h_s = add(r_s, s); m_s = attn_res_merge(.., h_s, ..)
    n = rms_norm(m); q = linear(n, W_col)       n_s = rms_norm(m_s); q = linear(all_gather_tokens(n_s), W_col)

The token-local ops that run on shards: elementwise add / sub / mul / div and rms_norm (every token-carrying
input of the output's shape), `attn_res_inter` and `attn_res_merge` (all token-carrying inputs sharded), and a
reshape that only regroups the token dims ([B,T,D] <-> [B·T,D]: the shard is [1,n,D] either way). Everything else,
linears included (a column-parallel weight needs every token), reads the all-gathered value. A replicated
token-carrying input of a sharded op (the routed-expert output meeting the shared experts' sum) is cut to the
rank's rows by `shard_tokens`, which sends nothing. So each token's residual stream and AttnRes block states
live on exactly one rank, and the AttnRes inter-block attention (n sealed blocks × D per token) is computed once
per token instead of once per rank. Bytes on the wire: a ring reduce-scatter plus all-gather equals one
all-reduce; the saving is in the row-wise work and the AttnRes state, 1/g per rank.

The split is chosen by cost at the compile bounds: it needs at least one real token per rank (max_batch · T >= tp,
T = 1 for decode). Below that the padded one-row shards still travel to every rank: full K3.1 Pro at TP=8, decode
at batch 1 would send 44.9 MiB per rank and step against 5.8 MiB of plain all-reduces, so such an entry keeps its
all-reduces (and its AttnRes state is one token per rank anyway).

One graph serves every rank (shard shapes are rank-independent; which rows a rank holds is the collectives'
semantics). Dead originals are removed. O(nodes).
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.errors import IRError
from k3c.ir.graph import Graph, Node, Value, describe
from k3c.ir.rewrite import dce_in_place
from k3c.ir.types import dims_equal
from k3c.passes.pipeline import register_pass

PASS = "split_allreduce"
ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "rms_norm"})
ATTN_RES = frozenset({"attn_res_inter", "attn_res_merge"})


@register_pass(PASS)
def split_allreduce(graph: Graph, ctx: CompileContext) -> Graph:
    if ctx.tp == 1 or ctx.max_batch * ctx.bounds["T"] < ctx.tp:
        return graph
    _Splitter(graph, ctx.tp).run()
    dce_in_place(graph)
    return graph


def _tokens(v: Value):
    n = 1
    for d in v.type.shape[:-1]:
        n = n * d
    return n


class _Splitter:
    def __init__(self, graph: Graph, group: int):
        self.g, self.group = graph, group
        self.sharded: dict[Value, Value] = {}
        self.gathered: dict[Value, Value] = {}
        self.cut: dict[Value, Value] = {}
        self.carries = set(graph.inputs)  # values that depend on the tokens or the caches
        for n in graph.nodes:
            if any(v in self.carries for v in n.inputs):
                self.carries.update(n.outputs)

    def run(self) -> None:
        g = self.g
        for node in list(g.nodes):
            if node.op == "all_reduce" and node.inputs[0] in self.carries and node.inputs[0].type.rank >= 2:
                self.sharded[node.output] = self._add("reduce_scatter_tokens", [node.inputs[0]], node,
                                                      group=self.group)
            elif any(v in self.sharded for v in node.inputs):
                if self._local(node):
                    self._shard(node)
                else:
                    for i, v in enumerate(node.inputs):
                        if v in self.sharded:
                            g.set_input(node, i, self._gather(v, node))
        for k, v in list(g.outputs.items()):
            if v in self.sharded:
                g.outputs[k] = self._gather(v, None)

    # ---- which nodes run on token shards ------------------------------------------------------------------------
    def _local(self, node: Node) -> bool:
        ins = [v for v in node.inputs if v in self.carries]
        if node.op in ATTN_RES:
            return all(v in self.sharded for v in ins)
        if node.op in ELEMENTWISE:
            return len(node.outputs) == 1 and all(v.type.shape == node.output.type.shape for v in ins)
        if node.op == "reshape":
            x, y = node.inputs[0], node.output
            return (x.type.shape[-1] == y.type.shape[-1] and y.type.rank >= 2
                    and dims_equal(_tokens(x), _tokens(y)))
        return False

    def _shard(self, node: Node) -> None:
        if node.op == "reshape":
            self.sharded[node.output] = self.sharded[node.inputs[0]]
            return
        ins = [self.sharded.get(v) or (self._cut(v, node) if v in self.carries else v) for v in node.inputs]
        outs = self.g.add_node(node.op, ins, node.attrs, name_hint=f"{node.outputs[0].name}.shard",
                               meta={**node.meta, "pass": PASS}, before=node)
        self.sharded.update(zip(node.outputs, outs))

    # ---- collectives ---------------------------------------------------------------------------------------------
    def _add(self, op: str, ins: list[Value], before: Node | None, **attrs) -> Value:
        meta = {**(before.meta if before is not None else {}), "pass": PASS}
        (out,) = self.g.add_node(op, ins, attrs, name_hint=f"{ins[0].name}.{op}", meta=meta, before=before)
        return out

    def _gather(self, v: Value, before: Node | None) -> Value:
        if v not in self.gathered:
            s = self.sharded[v]
            if s.type.rank != 3 or v.type.rank < 2 or s.type.shape[-1] != v.type.shape[-1]:
                raise IRError(f"{PASS}: cannot all-gather %{v.name} {v.type} from its shard {s.type}")
            shape = [d if isinstance(d, int) else str(d) for d in v.type.shape]
            self.gathered[v] = self._add("all_gather_tokens", [s], before, group=self.group, shape=shape)
        return self.gathered[v]

    def _cut(self, v: Value, before: Node) -> Value:
        if v not in self.cut:
            if v.type.rank < 2:
                raise IRError(f"{PASS}: {describe(before)} reads %{v.name} {v.type}, which has no token dims")
            self.cut[v] = self._add("shard_tokens", [v], before, group=self.group)
        return self.cut[v]
