"""Pass `lower_attn_res`: Block AttnRes in its two-phase inference form (AttnRes paper, Algorithm 1).

Matches (after `cleanup`) every direct AttnRes read of K3-SPEC.md "Decoder layer" / `models.layers.attn_res`:

    S  = cat(blocks, unsqueeze(partial, 0))                    # blocks: the chain of sealed cats, [n,B,T,D]
    lg = sum(mul(rms_norm(S) {eps}, q), dims=[-1])              # q = norm.weight ⊙ proj.weight[0]  [D]
    h  = sum(mul(unsqueeze(softmax(lg, dim=0), -1), S), dims=[0])        (optional casts around S and h)

(`rms_norm` without weight, or its decomposed pow/mean/add/rsqrt/mul chain.) The sealed blocks b_0..b_{n-1} are
read off the cat chain, so sites are grouped by the exact set of sealed blocks they see: one group per AttnRes
block (the sublayers between two seals, the final readout in the last group). It produces, per group,

    queries = cat(unsqueeze(q_i, 0) for every site i)          [Q,D]   (param-only; hoisted before the group)
    (o, lse) = attn_res_inter(queries, b_0, …, b_{n-1}) {eps}    [Q,B,T,D] f32, [Q,B,T] f32

placed right before the group's first site, and per site `h = attn_res_merge(o, lse, partial, queries)
{index=i, eps}` (online softmax with the partial sum; exact). A site that sees no sealed block (layer 0's attention
read: one source) becomes `partial` itself. The direct form is then dead and removed. O(nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

from k3c.context import CompileContext
from k3c.ir.graph import Graph, Node, Value
from k3c.ir.rewrite import dce_in_place
from k3c.passes.common import reorder, skip_cast
from k3c.passes.pipeline import register_pass


@dataclass
class AttnResSite:
    """One direct AttnRes read: its softmax node, the value `h` it produces, the sealed blocks, partial, query."""

    softmax: Node
    out: Value  # the final sum's output [B,T,D] (replaced)
    sealed: list[Value]
    partial: Value
    query: Value  # [D]
    eps: float


def _prod(graph: Graph, v: Value, op: str | tuple) -> Node | None:
    n = graph.producer(v)
    ops = (op,) if isinstance(op, str) else op
    return n if n is not None and n.op in ops else None


def _axis(d: int, rank: int) -> int:
    return d % rank if rank else d


def rms_keys(graph: Graph, v: Value) -> tuple[Value, float] | None:
    """(x, eps) when `v` = x · rsqrt(mean(x², -1) + eps), as `rms_norm(x) {eps}` (no weight) or decomposed."""
    n = graph.producer(v)
    if n is None:
        return None
    if n.op == "rms_norm" and len(n.inputs) == 1:
        return n.inputs[0], n.attrs["eps"]
    if n.op != "mul" or len(n.inputs) != 2:
        return None
    for x, r in (n.inputs, n.inputs[::-1]):
        rs = _prod(graph, r, "rsqrt")
        ad = rs and _prod(graph, rs.inputs[0], "add")
        if not ad or len(ad.inputs) != 1 or ad.attrs.get("scalar") is None:
            continue
        mn = _prod(graph, ad.inputs[0], "mean")
        if not mn or not mn.attrs.get("keepdim") or [_axis(d, x.type.rank) for d in mn.attrs["dims"]] != \
                [x.type.rank - 1]:
            continue
        pw = _prod(graph, mn.inputs[0], "pow")
        if pw and pw.inputs[0] is x and pw.attrs.get("exponent") == 2.0:
            return x, ad.attrs["scalar"]
    return None


def _flatten_sources(graph: Graph, v: Value, memo: dict) -> list[Value] | None:
    """The [B,T,D] sources stacked in `v` [n,B,T,D] by cat(dim 0) / unsqueeze(dim 0) chains; None if unknown."""
    if v in memo:
        return memo[v]
    out: list[Value] | None = None
    if v.type.rank >= 1 and v.type.shape[0] == 0:
        out = []
    else:
        n = graph.producer(v)
        if n is not None and n.op == "cat" and _axis(n.attrs["dim"], v.type.rank) == 0:
            out = []
            for x in n.inputs:
                sub = _flatten_sources(graph, x, memo)
                if sub is None:
                    out = None
                    break
                out += sub
        elif n is not None and n.op == "unsqueeze" and _axis(n.attrs["dim"], v.type.rank) == 0:
            out = [n.inputs[0]]
    memo[v] = out
    return out


def _single_user(graph: Graph, v: Value, op: str) -> Node | None:
    us = graph.users(v)
    if len(us) != 1 or graph.is_output(v) or us[0].op != op:
        return None
    return us[0]


def match_site(graph: Graph, sm: Node, memo: dict) -> AttnResSite | None:
    """The AttnRes read whose source softmax is `sm`, or None (see the module docstring for the pattern)."""
    lg = sm.inputs[0]
    if lg.type.rank != 3 or _axis(sm.attrs["dim"], 3) != 0:
        return None
    sn = _prod(graph, lg, "sum")
    if not sn or sn.attrs.get("keepdim") or [_axis(d, 4) for d in sn.attrs["dims"]] != [3]:
        return None
    mu = _prod(graph, sn.inputs[0], "mul")
    if not mu or len(mu.inputs) != 2:
        return None
    q = kn = None
    for a, b in (mu.inputs, mu.inputs[::-1]):
        if a.type.rank == 4 and b.type.rank == 1:
            kn, q = a, b
    if kn is None:
        return None
    rk = rms_keys(graph, kn)
    if rk is None:
        return None
    vf, eps = rk
    S = skip_cast(graph, vf)
    # forward: unsqueeze(-1) -> mul(·, S) -> sum(dims=[0])
    un = _single_user(graph, sm.outputs[0], "unsqueeze")
    if not un or _axis(un.attrs["dim"], 4) != 3:
        return None
    wm = _single_user(graph, un.outputs[0], "mul")
    if not wm or len(wm.inputs) != 2:
        return None
    other = wm.inputs[1] if wm.inputs[0] is un.outputs[0] else wm.inputs[0]
    if skip_cast(graph, other) is not S:
        return None
    fs = _single_user(graph, wm.outputs[0], "sum")
    if not fs or fs.attrs.get("keepdim") or [_axis(d, 4) for d in fs.attrs["dims"]] != [0]:
        return None
    srcs = _flatten_sources(graph, S, memo)
    if not srcs:
        return None
    return AttnResSite(sm, fs.outputs[0], srcs[:-1], srcs[-1], q, float(eps))


def _param_chain(graph: Graph, v: Value, params: set) -> list[Node] | None:
    """Every node computing `v` from parameters only (topological), or None if `v` reads anything else."""
    seen: dict[int, Node] = {}
    order: list[Node] = []

    def visit(x: Value) -> bool:
        if x in params:
            return True
        n = graph.producer(x)
        if n is None:
            return False
        if id(n) in seen:
            return True
        seen[id(n)] = n
        if not all(visit(i) for i in n.inputs):
            return False
        order.append(n)
        return True

    return order if visit(v) else None


@register_pass("lower_attn_res")
def lower_attn_res(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `lower_attn_res` (module docstring): direct AttnRes reads -> attn_res_inter / attn_res_merge."""
    memo: dict = {}
    sites = [s for n in graph.nodes if n.op == "softmax" for s in [match_site(graph, n, memo)] if s is not None]
    if not sites:
        return graph
    pos = {id(n): i for i, n in enumerate(graph.nodes)}
    params = set(graph.params.values())
    groups: dict[tuple, list[AttnResSite]] = {}
    for s in sites:
        groups.setdefault((tuple(id(b) for b in s.sealed), s.eps), []).append(s)

    before: dict[int, list[Node]] = {}
    moved: set[int] = set()
    n0 = len(graph.nodes)

    def take_new() -> list[Node]:
        nonlocal n0
        new, n0 = graph.nodes[n0:], len(graph.nodes)
        return new

    for (_, eps), group in groups.items():
        first = min(group, key=lambda s: pos[id(s.softmax)])
        meta = {"pass": "lower_attn_res", "layer": first.softmax.meta.get("layer"), "source": "AttnRes block"}
        if not first.sealed:  # one source: softmax weight 1, h = partial exactly
            for s in group:
                h = s.partial
                if h.type != s.out.type:
                    h = graph.add("cast", h, to=s.out.type.dtype, meta=meta)
                    before.setdefault(id(s.softmax), []).extend(take_new())
                graph.replace_all_uses(s.out, h)
            continue
        anchor = first.softmax
        hoist: list[Node] = []
        chains = [_param_chain(graph, s.query, params) for s in group]
        if any(c is None for c in chains):  # a query computed from activations: leave this group direct
            continue
        for chain in chains:  # the queries are param-only: compute them all before the group's first read
            for n in chain:
                if id(n) not in moved and pos[id(n)] > pos[id(anchor)]:
                    moved.add(id(n))
                    hoist.append(n)
        hoist.sort(key=lambda n: pos[id(n)])
        qs = [graph.add("unsqueeze", s.query if s.query.type.dtype == "f32" else
                        graph.add("cast", s.query, to="f32"), dim=0) for s in group]
        queries = qs[0] if len(qs) == 1 else graph.add("cat", *qs, dim=0, name_hint="attn_res.queries")
        o, lse = graph.add_node("attn_res_inter", [queries, *first.sealed], {"eps": eps},
                                name_hint="attn_res.inter", meta=meta)
        for n in take_new():
            n.meta.update({k: v for k, v in meta.items() if v is not None})
            hoist.append(n)
        before.setdefault(id(anchor), []).extend(hoist)
        for i, s in enumerate(group):
            m = {"pass": "lower_attn_res", "layer": s.softmax.meta.get("layer"), "source": "AttnRes merge"}
            h = graph.add_node("attn_res_merge", [o, lse, s.partial, queries], {"index": i, "eps": eps},
                               meta=m, name_hint="attn_res.merge")[0]
            if h.type != s.out.type:
                h = graph.add("cast", h, to=s.out.type.dtype, meta=m)
            before.setdefault(id(s.softmax), []).extend(take_new())
            graph.replace_all_uses(s.out, h)
    reorder(graph, before, moved)
    dce_in_place(graph)
    return graph
