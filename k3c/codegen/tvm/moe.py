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
On CUDA each experts phase runs one warp per output, (token, slot, hidden unit) then (token, output feature): the
lanes stride over the dot (coalesced along the weight rows) and reduce with warp shuffles. moe_route runs a block
per token, its threads holding the E candidates, the top-k taken in k rounds of a block-wide max (the value, then
the lowest id among equal values).
MXFP4 experts (weight_format "mxfp4") are read packed and decoded per element in the dot loops (`mxfp4_load`).
The reference rounds the expert GEMMs to z's dtype; this kernel keeps them in fp32 (closer to the exact value).
"""

from __future__ import annotations

from k3c.codegen.tvm import generator
from k3c.codegen.tvm.script import Func, dim_expr, f32, load, row_threads, single_node, store_value
from k3c.errors import UnsupportedError


@generator("moe_route")
def gen_moe_route(name: str, group, device: str) -> str:
    node = single_node(group)
    logits, bias = node.inputs
    N, E = dim_expr(logits.type.shape[0]), logits.type.shape[1]
    k, a = node.attrs["top_k"], node.attrs
    f = Func(name, group.inputs, group.outputs, device, f"moe_route (top-{k} of {E} experts)",
             names=["logits", "bias", "weights", "ids"])
    if device == "cuda":
        _route_cuda(f, N, E, k, a, bias.type.dtype)
        return f.text()
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


def mxfp4_load(buf: str, scale: str, row: str, col: str, cols: int) -> str:
    """fp32 value of element (row, col) of an MXFP4 matrix of `cols` columns (k3c.ir.formats): the code is nibble
    col % 2 of byte `buf`[row · cols/2 + col / 2], decoded as m/2 for the exponent bits e = 0 and as the fp32 bit
    pattern (e, m) + (126 << 1) shifted to the exponent field otherwise, times the E8M0 scale `scale`[row · cols/32 +
    col / 32] built as the fp32 pattern s << 23 (s = 0, 2^-127, reads as 0)."""
    code = f'((T.Cast("int32", {buf}[{row} * {cols // 2} + {col} // 2]) >> ({col} % 2 * 4)) & 15)'
    mag = f"({code} & 7)"
    val = (f'T.Select({mag} < 2, T.Cast("float32", {mag}) * T.float32(0.5), '
           f'T.reinterpret("float32", ({mag} + 252) << 22))')
    exp = f'T.reinterpret("float32", T.Cast("int32", {scale}[{row} * {cols // 32} + {col} // 32]) << 23)'
    return f"(T.Select({code} >= 8, T.float32(0.0) - {val}, {val}) * {exp})"


@generator("moe_experts")
def gen_moe_experts(name: str, group, device: str) -> str:
    node = single_node(group)
    z, weights, ids, w1, w3, w2 = node.inputs[:6]
    mx = node.attrs["weight_format"] == "mxfp4"
    N, D = dim_expr(z.type.shape[0]), z.type.shape[1]
    k = ids.type.shape[1]
    E, I = w1.type.shape[0], w1.type.shape[1]
    a = node.attrs
    names = ["z", "weights", "ids", "w1", "w3", "w2"] + (["s1", "s3", "s2"] if mx else []) + ["y"]
    dt = {n: v.type.dtype for n, v in zip(names, list(node.inputs) + list(node.outputs))}

    def w(buf: str, row: str, col: str, cols: int) -> str:
        """fp32 element (row, col) of expert weight `buf` ([rows, cols] per row of all experts)."""
        if mx:
            return mxfp4_load(buf, {"w1": "s1", "w3": "s3", "w2": "s2"}[buf], row, col, cols)
        return load(buf, f"{row} * {cols} + {col}", dt[buf])

    f = Func(name, group.inputs, group.outputs, device,
             f"moe_experts ({a['act']} GLU, {E} experts of {D} -> {I} -> {D}, top-{k}"
             f"{', MXFP4 weights' if mx else ''})", names=names)
    f.emit(f'hid = T.alloc_buffer(({N} * {k * I},), "float32")  # act(w1 z, w3 z) per token, slot, unit')
    act = (f"{f32(a['situ_beta'])} * T.tanh(gv / {f32(a['situ_beta'])}) * T.sigmoid(gv) * "
           f"({f32(a['situ_linear_beta'])} * T.tanh(uv / {f32(a['situ_linear_beta'])}))" if a["act"] == "situ"
           else "gv * T.sigmoid(gv) * uv")
    if device == "cuda":
        _experts_cuda(f, N, D, k, I, dt, w, act)
        return f.text()
    with f.parallel("nsi", f"{N} * {k * I}"):
        f.emit(f"n = nsi // {k * I}", f"i = nsi % {I}", f"e = ids[nsi // {I}]")
        with f.block("if e < 0:"):
            f.emit(f"hid[nsi] = {f32(0.0)}")
        f.emit("else:")
        f.depth += 1
        zl = lambda d: load("z", f"n * {D} + {d}", dt["z"])  # noqa: E731
        f.dot("gv", D, lambda d: f"{w('w1', f'(e * {I} + i)', d, D)} * {zl(d)}")
        f.dot("uv", D, lambda d: f"{w('w3', f'(e * {I} + i)', d, D)} * {zl(d)}")
        f.emit(f"hid[nsi] = {act}")
        f.depth -= 1
    with f.parallel("nd", f"{N} * {D}"):
        f.emit(f"n = nd // {D}", f"d = nd % {D}")
        acc = f.local(1, name="acc")
        f.emit(f"acc[0] = {f32(0.0)}")
        with f.block(f"for s in T.serial({k}):"):
            f.emit(f"e = ids[n * {k} + s]")
            with f.block("if e >= 0:"):
                f.dot("dv", I, lambda i: f"{w('w2', f'(e * {D} + d)', i, I)} * hid[(n * {k} + s) * {I} + {i}]")
                f.emit(f"acc[0] = acc[0] + weights[n * {k} + s] * dv")
        f.emit(f"y[nd] = {store_value('acc[0]', dt['y'])}")
    return f.text()


def _experts_cuda(f: Func, N: str, D: int, k: int, I: int, dt: dict, w, act: str) -> None:
    """The CUDA schedule of moe_experts: the two phases of `gen_moe_experts`, one warp per output (module
    docstring). `w(buf, row, col, cols)` reads an expert weight element, `act` is the activation over gv, uv."""
    with f.cuda_warps("nsi", f"{N} * {k * I}"):
        f.emit(f"n = nsi // {k * I}", f"i = nsi % {I}", f"e = ids[nsi // {I}]")
        p = f.local(2, name="p")
        f.emit(f"p[0] = {f32(0.0)}", f"p[1] = {f32(0.0)}")
        with f.block("if e >= 0:"), f.strided("d", D, 32, lane="lane"):
            f.emit(f"zd = {load('z', f'n * {D} + d', dt['z'])}",
                   f"p[0] = p[0] + {w('w1', f'(e * {I} + i)', 'd', D)} * zd",
                   f"p[1] = p[1] + {w('w3', f'(e * {I} + i)', 'd', D)} * zd")
        f.emit(f"gv = {f.allreduce('p[0]', lane='lane')}", f"uv = {f.allreduce('p[1]', lane='lane')}")
        with f.block("if nsi_ok and lane == 0:"):
            f.emit(f"hid[nsi] = T.Select(e < 0, {f32(0.0)}, {act})")
    with f.cuda_warps("nd", f"{N} * {D}"):
        f.emit(f"n = nd // {D}", f"d = nd % {D}")
        acc = f.local(1, name="acc")
        f.emit(f"acc[0] = {f32(0.0)}")
        with f.block(f"for s in T.serial({k}):"):
            f.emit(f"e = ids[n * {k} + s]", f"ws = weights[n * {k} + s]")
            with f.block("if e >= 0:"), f.strided("i", I, 32, lane="lane"):
                f.emit(f"acc[0] = acc[0] + ws * {w('w2', f'(e * {D} + d)', 'i', I)} * hid[(n * {k} + s) * {I} + i]")
        f.emit(f"yv = {f.allreduce('acc[0]', lane='lane')}")
        with f.block("if nd_ok and lane == 0:"):
            f.emit(f"y[nd] = {store_value('yv', dt['y'])}")


def _route_cuda(f: Func, N: str, E: int, k: int, a: dict, bias_dtype: str) -> None:
    """The CUDA schedule of moe_route: block n, thread tx holds candidates e = tx, tx + nt, ... (s + bias, −inf once
    taken); round r takes the block's largest, ties to the lowest id, as the CPU's stable insertion does."""
    nt = row_threads(E)
    nc = -(-E // nt)
    if k > nt:
        raise UnsupportedError(f"{f.name}: the CUDA router picks at most {nt} experts, not {k}")
    ninf = f32(float("-inf"))
    with f.cuda_blocks("n", N, nt):
        cv = f.local(nc, name="cv")
        sel_s, sel_id = f.shared(k, name="sel_s"), f.shared(k, "int64", name="sel_id")
        tot = f.local(1, name="tot")
        f.emit(f"tot[0] = {f32(0.0)}")
        with f.block(f"for c in T.serial({nc}):"):
            f.emit(f"e = c * {nt} + tx")
            f.emit(f"cv[c] = T.Select(e < {E}, T.sigmoid(logits[n * {E} + T.min(e, {E - 1})]) + "
                   f"{load('bias', f'T.min(e, {E - 1})', bias_dtype)}, {ninf})")
        with f.block(f"for r in T.serial({k}):"):
            best = f.local(2, name="best")  # this thread's largest candidate and its id (as fp32: ids < 2^24)
            f.emit(f"best[0] = {ninf}", f"best[1] = {f32(float(E))}")
            with f.block(f"for c in T.serial({nc}):"), f.block("if cv[c] > best[0]:"):
                f.emit("best[0] = cv[c]", f'best[1] = T.Cast("float32", c * {nt} + tx)')
            f.emit(f"top = {f.allreduce('best[0]', 'max')}")
            f.emit(f"win = T.Cast(\"int64\", -{f.allreduce(f'T.Select(best[0] == top, -best[1], {ninf})', 'max')})")
            with f.block(f"if win % {nt} == T.Cast(\"int64\", tx):"):
                f.emit(f"cv[win // {nt}] = {ninf}")
            f.emit(f"sw = T.sigmoid(logits[n * {E} + win])", "tot[0] = tot[0] + sw")
            with f.block("if tx == 0:"):
                f.emit("sel_s[r] = sw", "sel_id[r] = win")
        f.emit(f"norm = {f32(a['scaling'])} / (tot[0] + {f32(1e-20)})" if a["renormalize"] else
               f"norm = {f32(a['scaling'])}")
        f.sync()
        with f.block(f"if tx < {k}:"):
            f.emit(f"weights[n * {k} + tx] = sel_s[tx] * norm", f"ids[n * {k} + tx] = sel_id[tx]")
