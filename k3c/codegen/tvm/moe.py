"""TVM kernels for the MoE block: "moe_route" (sigmoid router with the selection bias, top-k, renormalised weights)
and "moe_experts" (the chosen experts' GLU MLPs, weighted and summed per token).

Exact semantics: `moe_route_ref` / `moe_experts_ref` in `k3c/ir/ops/model_moe.py` (K3-SPEC.md "MLP and Stable
LatentMoE"; router: DeepSeek-V3 §2.1.2), all in fp32:

    route:   s = sigmoid(logits) ; ids = top-k of s + bias (ties to the lowest id) ;
             weights = s[ids] / (Σ s[ids] + 1e-20) · scaling   (renormalize=False: s[ids] · scaling)
    experts: y_n = Σ_i weights[n, i] · w2_e act(w1_e z_n, w3_e z_n), e = ids[n, i] (ids < 0 skipped);
             act = SiTU-GLU β·tanh(g/β)·sigmoid(g) · β_lin·tanh(u/β_lin), or SwiGLU silu(g)·u

moe_experts runs in two parallel phases so that a single token still uses every core: (token, slot, hidden unit)
computes the activation into a scratch buffer [N, k, I], then (token, output feature) sums the down projections.
The reference rounds the expert GEMMs to z's dtype; this kernel keeps them in fp32 (closer to the exact value).
"""

from __future__ import annotations

from k3c.codegen.tvm import generator
from k3c.codegen.tvm.attention import _same_io
from k3c.codegen.tvm.script import Func, dim_expr, f32, load, store_value


@generator("moe_route")
def gen_moe_route(name: str, group, device: str) -> str:
    (node,) = group.nodes
    _same_io(group, node)
    logits, bias = node.inputs
    N, E = dim_expr(logits.type.shape[0]), logits.type.shape[1]
    k, a = node.attrs["top_k"], node.attrs
    f = Func(name, group.inputs, group.outputs, device, f"moe_route (top-{k} of {E} experts)",
             names=["logits", "bias", "weights", "ids"])
    with f.parallel("n", N):
        val = f.local(k, name="val")   # s + bias of the chosen, decreasing
        pos = f.local(k, "int64", name="pos")
        p = f.local(2, "int64", name="p")
        f.emit("p[0] = T.int64(0)")
        with f.block(f"for e in T.serial({E}):"):
            f.emit(f"x = T.sigmoid(logits[n * {E} + e]) + {load('bias', 'e', bias.type.dtype)}")
            f.insert_sorted("val", "pos", "p", k, "x", 'T.Cast("int64", e)')
        tot = " + ".join(f"T.sigmoid(logits[n * {E} + pos[{i}]])" for i in range(k))
        f.emit(f"norm = {f32(a['scaling'])} / ({tot} + {f32(1e-20)})" if a["renormalize"] else
               f"norm = {f32(a['scaling'])}")
        with f.block(f"for i in T.serial({k}):"):
            f.emit(f"weights[n * {k} + i] = T.sigmoid(logits[n * {E} + pos[i]]) * norm",
                   f"ids[n * {k} + i] = pos[i]")
    return f.text()


@generator("moe_experts")
def gen_moe_experts(name: str, group, device: str) -> str:
    (node,) = group.nodes
    _same_io(group, node)
    z, weights, ids, w1, w3, w2 = node.inputs
    N, D = dim_expr(z.type.shape[0]), z.type.shape[1]
    k = ids.type.shape[1]
    E, I = w1.type.shape[0], w1.type.shape[1]
    a = node.attrs
    names = ["z", "weights", "ids", "w1", "w3", "w2", "y"]
    dt = {n: v.type.dtype for n, v in zip(names, list(node.inputs) + list(node.outputs))}
    f = Func(name, group.inputs, group.outputs, device,
             f"moe_experts ({a['act']} GLU, {E} experts of {D} -> {I} -> {D}, top-{k})", names=names)
    f.emit(f'hid = T.alloc_buffer(({N} * {k * I},), "float32")  # act(w1 z, w3 z) per token, slot, unit')
    with f.parallel("nsi", f"{N} * {k * I}"):
        f.emit(f"n = nsi // {k * I}", f"i = nsi % {I}", f"e = ids[nsi // {I}]")
        with f.block("if e < 0:"):
            f.emit(f"hid[nsi] = {f32(0.0)}")
        f.emit("else:")
        f.depth += 1
        zl = lambda d: load("z", f"n * {D} + {d}", dt["z"])  # noqa: E731
        f.dot("gv", D, lambda d: f"{load('w1', f'(e * {I} + i) * {D} + {d}', dt['w1'])} * {zl(d)}")
        f.dot("uv", D, lambda d: f"{load('w3', f'(e * {I} + i) * {D} + {d}', dt['w3'])} * {zl(d)}")
        if a["act"] == "situ":
            b, bl = f32(a["situ_beta"]), f32(a["situ_linear_beta"])
            f.emit(f"hid[nsi] = {b} * T.tanh(gv / {b}) * T.sigmoid(gv) * ({bl} * T.tanh(uv / {bl}))")
        else:
            f.emit("hid[nsi] = gv * T.sigmoid(gv) * uv")
        f.depth -= 1
    with f.parallel("nd", f"{N} * {D}"):
        f.emit(f"n = nd // {D}", f"d = nd % {D}")
        acc = f.local(1, name="acc")
        f.emit(f"acc[0] = {f32(0.0)}")
        with f.block(f"for s in T.serial({k}):"):
            f.emit(f"e = ids[n * {k} + s]")
            with f.block("if e >= 0:"):
                f.dot("dv", I, lambda i: f"{load('w2', f'(e * {D} + d) * {I} + {i}', dt['w2'])} * "
                                         f"hid[(n * {k} + s) * {I} + {i}]")
                f.emit(f"acc[0] = acc[0] + weights[n * {k} + s] * dv")
        f.emit(f"y[nd] = {store_value('acc[0]', dt['y'])}")
    return f.text()
