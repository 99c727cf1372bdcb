"""Pass `canonicalize` (cleanup phase): the decomposed chains the frontend produces become single registry ops.

torch.export shows the model's norms and activations as ATen arithmetic; later passes and the kernel former want
one op per concept. Rules (rewrite engine `k3c.ir.rewrite`, applied to fixpoint, dead nodes removed):

- RMSNorm, K3-SPEC.md "Decoder layer" / models/layers.py `RMSNorm`:
      mul(x, rsqrt(add(mean(x², -1, keepdim), eps)))            -> rms_norm(x) {eps}     (x f32; x² = pow 2 or x·x)
      mul(rms_norm(x), w)  with w a [D] param (or cast of one)  -> rms_norm(x, w) {eps}
      cast(rms_norm(cast(x, f32), w?), x.dtype)                 -> rms_norm(x, w?) {eps}    (x bf16/f16)
  The weight is folded only when it is a graph parameter: the AttnRes keys (`V·rsqrt(mean(V²)+eps)`, no weight,
  then a dot with `norm.weight ⊙ proj.weight[0]`) stay `rms_norm(V)` followed by that product.
- l2norm (K3-SPEC.md "KDA layer"): mul(x, rsqrt(add(sum(x², -1, keepdim), eps))) -> l2norm(x) {eps, dim=-1}, and
  the same cast folding as rms_norm.
- silu: mul(x, sigmoid(x)) -> silu(x).  softmax: exp(x - amax(x,d)) / sum(exp(x - amax(x,d)), d) -> softmax(x) {dim=d}
  (an existing `softmax` node is left as it is).  linear: matmul(x, transpose(w)) with w [out,in] -> linear(x, w).
- No-ops: cast to the same dtype, reshape / expand to the same type, reshape of a reshape, transpose of a dim with
  itself, identity permute, full slice, squeeze(unsqueeze(x, d), [d]).
- cast(cast(x, A), B) -> cast(x, B) when x -> A is exact (A represents every value of x.dtype), so the pair
  rounds once either way; -> x when B is x.dtype.
- cat drops inputs of static size 0 along the cat dim (the AttnRes `zeros([0,B,T,D])` seed while no block is
  sealed); a cat left with one input is that input.

Every rule is exact or differs from the decomposed chain only by fp32 rounding (the registry references compute
in fp32 exactly as models/layers.py does). `norm_parts`, `rms_parts` and `l2_parts` recognise a norm in either
form (op or decomposed chain) for model passes such as `fuse_kda`.
"""

from __future__ import annotations

import re

from k3c.context import CompileContext
from k3c.ir.graph import Graph, Node, Value
from k3c.ir.rewrite import Match, P, Rule, X, apply_rules
from k3c.ir.types import dims_equal
from k3c.passes.common import L2_CHAINS, RMS_CHAINS
from k3c.passes.pipeline import register_pass

# x -> A exact: every value of x's dtype is a value of A (so cast(cast(x, A), B) == cast(x, B)).
_EXACT = {
    "bf16": {"f32"}, "f16": {"f32"}, "f8e4m3": {"bf16", "f16", "f32"},
    "bool": {"u8", "i32", "i64", "bf16", "f16", "f32"}, "u8": {"i32", "i64", "bf16", "f16", "f32"},
    "i32": {"i64"},
}
_HALF = {"bf16", "f16"}


def _types_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.rank == b.rank and all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def _is_f32(v: Value) -> bool:
    return v.type.dtype == "f32"


# ---- rules ----------------------------------------------------------------------------------------------------
def _rules(graph: Graph) -> list[Rule]:
    params = set(graph.params.values())

    def param_like(v: Value) -> Value | None:
        """The param behind `v` (itself, or the input of a cast of a param), else None."""
        if v in params:
            return v
        p = graph.producer(v)
        if p is not None and p.op == "cast" and p.inputs[0] in params:
            return p.inputs[0]
        return None

    def norm_chain(op: str):
        def build(g: Graph, m: Match):
            x = m["x"]
            if not _is_f32(x):  # the chain computed in a narrow dtype is not what the fp32 op computes
                return None
            attrs = {"eps": m["eps"].attrs["scalar"]}
            if op == "l2norm":
                attrs["dim"] = -1
            return g.add_node(op, [x], attrs, name_hint=_hint(m))[0]

        return build

    def fold_weight(g: Graph, m: Match):
        rms, w = m["rms"], m["w"]
        if len(rms.inputs) != 1:
            return None
        x = rms.inputs[0]
        p = param_like(w)
        if p is None or p.type.rank != 1 or not dims_equal(p.type.shape[0], x.type.shape[-1]):
            return None
        if w.type.dtype != x.type.dtype:  # mul needs one dtype: w (or its cast) is in x's dtype already
            return None
        return g.add_node("rms_norm", [x, p], dict(rms.attrs), name_hint=_hint(m))[0]

    def input_is_cast(n: Node) -> bool:
        p = graph.producer(n.inputs[0])
        return p is not None and p.op == "cast"

    def fold_casts(g: Graph, m: Match):
        outer, norm = m["root"], m["norm"]
        inner = g.producer(norm.inputs[0])
        x = inner.inputs[0]
        if x.type.dtype not in _HALF or inner.attrs["to"] != "f32" or outer.attrs["to"] != x.type.dtype:
            return None
        return g.add_node(norm.op, [x] + norm.inputs[1:], dict(norm.attrs), name_hint=_hint(m))[0]

    def noop(g: Graph, m: Match):
        node = m["root"]
        x = node.inputs[0]
        return x if _types_equal(x.type, node.outputs[0].type) else None

    def cast_cast(g: Graph, m: Match):
        outer, inner = m["root"], m["inner"]
        x = inner.inputs[0]
        if inner.attrs["to"] not in _EXACT.get(x.type.dtype, ()):
            return None
        if outer.attrs["to"] == x.type.dtype:
            return x
        return g.add_node("cast", [x], {"to": outer.attrs["to"]}, name_hint=_hint(m))[0]

    def reshape_reshape(g: Graph, m: Match):
        return g.add_node("reshape", [m["inner"].inputs[0]], {"shape": m["root"].attrs["shape"]}, name_hint=_hint(m))[0]

    def transpose_self(g: Graph, m: Match):
        n = m["root"]
        r = n.inputs[0].type.rank
        return n.inputs[0] if n.attrs["dim0"] % r == n.attrs["dim1"] % r else None

    def permute_id(g: Graph, m: Match):
        n = m["root"]
        r = n.inputs[0].type.rank
        return n.inputs[0] if [d % r for d in n.attrs["dims"]] == list(range(r)) else None

    def full_slice(g: Graph, m: Match):
        n = m["root"]
        a = n.attrs
        if a["start"] == 0 and a["end"] is None and a["step"] == 1:
            return n.inputs[0]
        return None

    def squeeze_unsqueeze(g: Graph, m: Match):
        sq, un = m["root"], m["inner"]
        x = un.inputs[0]
        r = x.type.rank + 1
        dims = sq.attrs["dims"]
        if dims is not None and len(dims) == 1 and dims[0] % r == un.attrs["dim"] % r:
            return x
        return None

    def cat_drop_empty(g: Graph, m: Match):
        n = m["root"]
        d = n.attrs["dim"] % n.outputs[0].type.rank
        keep = [x for x in n.inputs if not (isinstance(x.type.shape[d], int) and x.type.shape[d] == 0)]
        if len(n.inputs) == 1:
            return n.inputs[0]
        if len(keep) == len(n.inputs) or not keep:
            return None
        if len(keep) == 1:
            return keep[0]
        return g.add_node("cat", keep, dict(n.attrs), name_hint=_hint(m))[0]

    def silu(g: Graph, m: Match):
        return g.add_node("silu", [m["x"]], name_hint=_hint(m))[0]

    def softmax(g: Graph, m: Match):
        mx, sm = m["mx"], m["sm"]
        r = m["x"].type.rank
        d1, d2 = mx.attrs["dims"], sm.attrs["dims"]
        if not (mx.attrs["keepdim"] and sm.attrs["keepdim"] and d1 is not None and d2 is not None
                and len(d1) == 1 and len(d2) == 1 and d1[0] % r == d2[0] % r):
            return None
        return g.add_node("softmax", [m["x"]], {"dim": d1[0]}, name_hint=_hint(m))[0]

    def linear(g: Graph, m: Match):
        t, x = m["t"], m["x"]
        w = t.inputs[0]
        if w.type.rank != 2 or {t.attrs["dim0"] % 2, t.attrs["dim1"] % 2} != {0, 1} or x.type.rank < 2:
            return None
        return g.add_node("linear", [x, w], name_hint=_hint(m))[0]

    norm_any = ("rms_norm", "l2norm")
    e = P("exp", P("sub", X("x"), P("amax", X("x"), name="mx")), name="e")
    rules = [Rule(p, norm_chain("rms_norm"), "rms_norm") for p in RMS_CHAINS]
    rules += [Rule(p, norm_chain("l2norm"), "l2norm") for p in L2_CHAINS]
    rules += [
        Rule(P("mul", P("rms_norm", any_inputs=True, single_use=True, name="rms"), X("w"), name="root"),
             fold_weight, "rms_norm_weight"),
        Rule(P("mul", X("w"), P("rms_norm", any_inputs=True, single_use=True, name="rms"), name="root"),
             fold_weight, "rms_norm_weight"),
        Rule(P("cast", P(norm_any, any_inputs=True, single_use=True, name="norm", where=input_is_cast), name="root"),
             fold_casts, "norm_casts"),
        Rule(P("cast", X(), name="root"), noop, "noop_cast"),
        Rule(P("cast", P("cast", X(), name="inner"), name="root"), cast_cast, "cast_cast"),
        Rule(P(("reshape", "expand"), X(), name="root"), noop, "noop_view"),
        Rule(P("reshape", P("reshape", X(), name="inner", single_use=True), name="root"), reshape_reshape,
             "reshape_reshape"),
        Rule(P("transpose", X(), name="root"), transpose_self, "noop_transpose"),
        Rule(P("permute", X(), name="root"), permute_id, "noop_permute"),
        Rule(P("slice", X(), name="root"), full_slice, "noop_slice"),
        Rule(P("squeeze", P("unsqueeze", X(), name="inner"), name="root"), squeeze_unsqueeze, "squeeze_unsqueeze"),
        Rule(P("cat", any_inputs=True, name="root"), cat_drop_empty, "cat_empty"),
        Rule(P("mul", X("x"), P("sigmoid", X("x"), single_use=True)), silu, "silu"),
        Rule(P("mul", P("sigmoid", X("x"), single_use=True), X("x")), silu, "silu"),
        Rule(P("div", e, P("sum", e, name="sm")), softmax, "softmax"),
        Rule(P("matmul", X("x"), P("transpose", X(), name="t")), linear, "linear"),
    ]
    return rules


def _hint(m: Match) -> str:
    """A readable name for a rewrite's result: the root's output name without its numeric suffix."""
    return re.sub(r"(\.\d+)+$", "", m.root.outputs[0].name) or "c"


def canonicalize_in_place(graph: Graph) -> int:
    """Apply the canonical rules to `graph` itself; returns the number of rewrites."""
    return apply_rules(graph, _rules(graph), "canonicalize")


@register_pass("canonicalize")
def canonicalize(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `canonicalize`: `graph` with the rules of the module docstring applied (mutated in place, returned)."""
    canonicalize_in_place(graph)
    return graph
