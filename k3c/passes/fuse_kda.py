"""Pass `fuse_kda` (model phase): each KDA token mixer between its input projections and o_proj becomes one
`kda_fused` node (K3-SPEC.md "KDA layer"; op and reference: `k3c/ir/ops/model_kda.py`).

Matched structurally from every `kda_recurrence` node, walking to its producers and users (layer names are not
used). What one KDA layer must look like (models/layers.py `KDA.forward`; casts marked `cast?` are optional, they
appear when the projections are bf16; norms may be the canonical ops or their decomposed chains):

    raw    = transpose(cast?(cat(qp, kp, vp, dim=-1)), 1, 2)               qp, kp, vp [B,T,H·K]: projection outputs
    window = cat(cast?(conv_state, f32), raw, dim=-1)                       conv_state [B,3·H·K,W]
    new_cs = cast?(slice(window, dim=2, start=-W))                          -> the layer's new conv state
    y      = transpose(silu(slice(conv1d(window, cast?(cat(wq, wk, wv)), groups=3HK), dim=2, start=1)), 1, 2)
    q4, k4, v4 = reshape(split(y, [HK, HK, HK], -1)[i], [B,T,H,K])        split outputs 0, 1, 2 in that order
    q = mul(l2norm(q4, eps=1e-6), K^-0.5) ;  k = l2norm(k4, eps=1e-6) ;  v = v4
    f4 = reshape(add(cast?(f), cast?(dt_bias)), [B,T,H,K])                  f = f_b_proj output
    a  = reshape(exp(slice?(cast?(A_log), 0, H)), [H, 1])
    g  = mul(sigmoid(mul(a, f4)), lower_bound)                              K3 (gate="lower_bound")
    g  = mul(neg(a), softplus(f4))                                          Kimi Linear (gate="softplus")
    beta = sigmoid(cast?(b))                                                b = b_proj output [B,T,H]
    (o, new_state) = kda_recurrence(q, k, v, g, beta, cast?(state, f32)) {scale=1}
    out = cast?(mul(reshape(rms_norm(o, o_norm, eps), [B,T,HK]), sigmoid(cast?(gate))))   -> o_proj's input
    stored = cast?(new_state, bf16)        where the state is stored in bf16 (a bf16 `state`; `--kda-state bf16`)

becomes `(out, new_state, new_cs) = kda_fused(qp, kp, vp, f, b, gate, wq, wk, wv, A_log, dt_bias, o_norm, state,
conv_state) {heads=H, head_dim=K, gate, lower_bound, eps}` (state, conv state and their new values in the storage
dtypes: the casts of a bf16 state, and of a conv state stored in the projections' dtype, fold in, `kda_fused_ref`),
placed just before the node that produced `out`; the
matched nodes die. Every piece is checked (ops, attrs, shapes, the q/k/v channel order shared by the projections,
the conv weights, the conv state and the split); a KDA layer that differs, or whose intermediate values are used
outside the layer, raises `IRError` naming its `kda_recurrence` node and the piece. Nothing is skipped silently.
Works for prefill (T symbolic) and decode (T = 1), any head_dim.
"""

from __future__ import annotations

import math

from k3c.context import CompileContext
from k3c.errors import IRError
from k3c.ir.graph import Graph, Node, Value, describe
from k3c.ir.rewrite import shape_error
from k3c.ir.types import TensorType, dims_equal
from k3c.passes.common import l2_parts, rms_parts
from k3c.ir.rewrite import dce_in_place
from k3c.passes.pipeline import register_pass

L2NORM_EPS = 1e-6  # K3-SPEC.md "KDA layer": l2norm eps, hard-wired in kda_fused


def _shape_is(t: TensorType, shape: tuple) -> bool:
    return t.rank == len(shape) and all(dims_equal(a, b) for a, b in zip(t.shape, shape))


def _types_equal(a: TensorType, b: TensorType) -> bool:
    return a.dtype == b.dtype and _shape_is(a, b.shape)


def _axis(a: int, rank: int) -> int:
    return a % rank


class _KDAMatch:
    """Walks one KDA layer from its `kda_recurrence` node; collects the interior nodes and the fused op's operands."""

    def __init__(self, graph: Graph, rec: Node):
        self.g, self.rec = graph, rec
        self.interior: dict[int, Node] = {id(rec): rec}

    # ---- helpers ----------------------------------------------------------------------------------------------
    def fail(self, what: str, found: Value | Node | None = None) -> IRError:
        return shape_error(self.g, "fuse_kda", f"the KDA layer of {describe(self.rec)}", what, found)

    def take(self, v: Value, ops: str | tuple, what: str, n_inputs: int | None = None) -> Node:
        ops = ops if isinstance(ops, tuple) else (ops,)
        p = self.g.producer(v)
        if p is None or p.op not in ops or (n_inputs is not None and len(p.inputs) != n_inputs):
            raise self.fail(f"{what}: expected {'/'.join(ops)}", v)
        self.interior[id(p)] = p
        return p

    def uncast(self, v: Value, to: str = "f32") -> Value:
        """Skip one `cast` to `to` in front of `v` (it becomes interior); returns the value before it. A cast
        that something else also reads is kept (the fused op then reads its f32 result: the same values)."""
        p = self.g.producer(v)
        if p is not None and p.op == "cast" and p.attrs["to"] == to and len(self.g.users(v)) == 1 \
                and not self.g.is_output(v):
            self.interior[id(p)] = p
            return p.inputs[0]
        return v

    def need_shape(self, v: Value, shape: tuple, what: str) -> None:
        if not _shape_is(v.type, shape):
            raise self.fail(f"{what} is {v.type}, expected [{','.join(map(str, shape))}]")

    def is_transpose12(self, n: Node) -> bool:
        r = n.inputs[0].type.rank
        return r == 3 and {_axis(n.attrs["dim0"], r), _axis(n.attrs["dim1"], r)} == {1, 2}

    # ---- the walk ---------------------------------------------------------------------------------------------
    def run(self) -> dict:
        g, rec = self.g, self.rec
        q4, k4, v4, g4, beta3, state = rec.inputs
        if rec.attrs["scale"] != 1.0:
            raise self.fail(f"kda_recurrence scale {rec.attrs['scale']} (expected 1: q is scaled by K^-0.5)")
        B, T, H, K = q4.type.shape
        if not (isinstance(H, int) and isinstance(K, int)):
            raise self.fail(f"heads and head_dim must be static, q is {q4.type}")
        HK = H * K
        self.need_shape(v4, (B, T, H, K), "v (value head_dim must equal head_dim)")
        state, new_state = self.stored_state(state, rec.outputs[1])
        self.need_shape(state, (B, H, K, K), "the recurrent state")

        # q = l2norm(q4) * K^-0.5 ; k = l2norm(k4)
        qs = self.take(q4, "mul", "q scaling (mul by K^-0.5)", 1)
        if not math.isclose(qs.attrs["scalar"], K ** -0.5, rel_tol=1e-9):
            raise self.fail(f"q is scaled by {qs.attrs['scalar']}, expected K^-0.5 = {K ** -0.5}")
        q4r = self.l2(qs.inputs[0], "q")
        k4r = self.l2(k4, "k")

        # short conv: split -> reshape per q/k/v
        heads = []
        split = None
        for i, (v, name) in enumerate(((q4r, "q"), (k4r, "k"), (v4, "v"))):
            rs = self.take(v, "reshape", f"{name} head split (reshape to [B,T,H,K])")
            self.need_shape(rs.inputs[0], (B, T, HK), f"{name} before the head split")
            sp = self.take(rs.inputs[0], "split", f"{name} from the conv output split")
            if split is None:
                split = sp
            if sp is not split or sp.outputs[i] is not rs.inputs[0]:
                raise self.fail(f"{name} is not output {i} of one q/k/v split", sp)
            heads.append(rs)
        if len(split.outputs) != 3 or _axis(split.attrs["dim"], 3) != 2:
            raise self.fail("the conv output split must give 3 parts along the last dim", split)
        tr = self.take(split.inputs[0], "transpose", "conv output transpose [B,3HK,T] -> [B,T,3HK]")
        if not self.is_transpose12(tr):
            raise self.fail("conv output transpose must swap dims 1 and 2", tr)
        si = self.take(tr.inputs[0], "silu", "silu after the short conv")
        sl = self.take(si.inputs[0], "slice", "slice [:, :, 1:] of the conv output")
        self.need_slice(sl, 1, "conv output slice must drop the first position ([:, :, 1:])")
        conv = self.take(sl.inputs[0], "conv1d", "the depthwise causal conv", 2)
        a = conv.attrs
        if (a["groups"], a["stride"], a["padding"], a["dilation"]) != (3 * HK, 1, 0, 1):
            raise self.fail(f"conv1d must be depthwise over 3·H·K = {3 * HK} channels, stride 1, no padding", conv)
        window, cw = conv.inputs
        wcat = self.take(self.uncast(cw), "cat", "conv weights cat(q_conv1d, k_conv1d, v_conv1d)", 3)
        if _axis(wcat.attrs["dim"], 3) != 0:
            raise self.fail("conv weights must be concatenated along dim 0", wcat)
        win = self.take(window, "cat", "conv window cat(conv_state, raw inputs)", 2)
        if _axis(win.attrs["dim"], 3) != 2:
            raise self.fail("conv window must be concatenated along the time dim", win)
        conv_f32, raw = win.inputs
        Wd = conv_f32.type.shape[-1]
        self.need_shape(conv_f32, (B, 3 * HK, Wd), "conv state")
        if conv_f32.type.dtype != "f32" or not isinstance(Wd, int):
            raise self.fail(f"conv state is {conv_f32.type}, expected f32 [B,{3 * HK},W]")
        conv_state = self.uncast(conv_f32)          # stored narrower: read through cast(conv_state, f32)
        for w in wcat.inputs:
            self.need_shape(w, (HK, 1, Wd), "a conv weight")
        rt = self.take(self.uncast(raw), "transpose", "raw conv inputs transpose [B,T,3HK] -> [B,3HK,T]")
        if not self.is_transpose12(rt):
            raise self.fail("raw conv input transpose must swap dims 1 and 2", rt)
        qkv = self.take(self.uncast(rt.inputs[0]), "cat", "cat(q_proj, k_proj, v_proj)", 3)
        if _axis(qkv.attrs["dim"], 3) != 2:
            raise self.fail("q/k/v projections must be concatenated along the last dim", qkv)
        qp, kp, vp = qkv.inputs
        for v, name in ((qp, "q"), (kp, "k"), (vp, "v")):
            self.need_shape(v, (B, T, HK), f"{name} projection")
        new_cs = None
        for u in g.users(window):
            if u is conv:
                continue
            if u.op == "slice" and new_cs is None:
                W_ = Wd
                size = window.type.shape[2]
                st = u.attrs["start"]
                ok = _axis(u.attrs["dim"], 3) == 2 and u.attrs["step"] == 1 and (
                    u.attrs["end"] is None or dims_equal(u.attrs["end"], size)) and (
                    st == -W_ or dims_equal(st, size - W_))
                if ok:
                    self.interior[id(u)] = u
                    new_cs = u.outputs[0]
                    continue
            raise self.fail("the conv window is read by something else than the conv and the new conv state "
                            "slice [:, :, -W:]", u)
        if new_cs is None:
            raise self.fail("no new conv state (slice [:, :, -W:] of the conv window)")
        if conv_state is not conv_f32:
            new_cs = self.stored_conv(conv_state, new_cs, qp.type.dtype)

        # decay gate
        gate_kind, lower_bound, a2, f4 = self.decay(g4)
        a_log = self.a_log(a2, H)
        f, dt_bias = self.f_in(f4, B, T, H, K)

        # beta
        bs = self.take(beta3, "sigmoid", "beta = sigmoid(b_proj(x))")
        b = self.uncast(bs.inputs[0])
        self.need_shape(b, (B, T, H), "b projection")

        # output side: rms_norm per head, reshape, sigmoid gate, cast
        o = rec.outputs[0]
        rs_out = self.find_forward(o, lambda n: n.op == "reshape" and _shape_is(n.outputs[0].type, (B, T, HK)))
        if rs_out is None:
            raise self.fail("no reshape of the normalised output to [B,T,H·K] after the recurrence")
        self.interior[id(rs_out)] = rs_out
        parts = rms_parts(g, rs_out.inputs[0])
        if parts is None or parts[0] is not o or parts[1] is None:
            raise self.fail("the recurrence output must go through a per-head RMSNorm with weight (o_norm)",
                            rs_out.inputs[0])
        _, o_norm, eps, nodes = parts
        self.interior.update((id(n), n) for n in nodes)
        o_norm = self.uncast(o_norm)
        self.need_shape(o_norm, (K,), "o_norm weight")
        users = g.users(rs_out.outputs[0])
        if len(users) != 1 or users[0].op != "mul" or len(users[0].inputs) != 2:
            raise self.fail("the normalised output must be multiplied by the sigmoid output gate",
                            users[0] if users else None)
        gm = users[0]
        self.interior[id(gm)] = gm
        other = gm.inputs[1] if gm.inputs[0] is rs_out.outputs[0] else gm.inputs[0]
        gs = self.take(other, "sigmoid", "output gate sigmoid(g_proj(x))")
        gate = self.uncast(gs.inputs[0])
        self.need_shape(gate, (B, T, HK), "output gate projection")
        out = gm.outputs[0]
        users = g.users(out)
        if len(users) == 1 and users[0].op == "cast" and not g.is_output(out):
            self.interior[id(users[0])] = users[0]
            out = users[0].outputs[0]
        if out.type.dtype != qp.type.dtype:
            raise self.fail(f"the layer output {out.type} is not in the projections' dtype {qp.type.dtype}")

        for v, name in ((f, "f"), (b, "b"), (gate, "gate"), (kp, "k"), (vp, "v")):
            if v.type.dtype not in ("f32", "bf16", "f16"):
                raise self.fail(f"{name} projection has dtype {v.type.dtype}")
        attrs = {"heads": H, "head_dim": K, "gate": gate_kind, "eps": float(eps)}
        if lower_bound is not None:
            attrs["lower_bound"] = float(lower_bound)
        return {"inputs": [qp, kp, vp, f, b, gate, *wcat.inputs, a_log, dt_bias, o_norm, state, conv_state],
                "attrs": attrs, "exits": [out, new_state, new_cs]}

    def stored_state(self, state: Value, new: Value) -> tuple[Value, Value]:
        """(state, new state) as stored: f32 ones as they are; a bf16 store, `cast(S_bf16, f32)` in and
        `cast(new, bf16)` as the only reader of the new state, with both casts folded in."""
        stored = self.uncast(state)
        if stored.type.dtype == "f32" and stored is state:
            return state, new
        users = self.g.users(new)
        if stored.type.dtype != "bf16" or len(users) != 1 or users[0].op != "cast" \
                or users[0].attrs["to"] != "bf16" or self.g.is_output(new):
            raise self.fail(f"the recurrent state must be f32, or bf16 read through cast(state, f32) with the new "
                            f"state's only reader a cast to bf16; it is {stored.type}", state)
        self.interior[id(users[0])] = users[0]
        return stored, users[0].outputs[0]

    def stored_conv(self, stored: Value, new: Value, dtype: str) -> Value:
        """The new conv state as stored, for a conv state read through `cast(stored, f32)`: `stored` must be in
        the projections' `dtype` (exact for the raw inputs it holds) and the new state's only reader a cast back to
        it (folded in)."""
        users = self.g.users(new)
        if stored.type.dtype != dtype or len(users) != 1 or users[0].op != "cast" \
                or users[0].attrs["to"] != dtype or self.g.is_output(new):
            raise self.fail(f"a conv state stored narrower than f32 must be in the projections' dtype {dtype}, read "
                            f"through cast(·, f32) and written through one cast back; it is {stored.type}", stored)
        self.interior[id(users[0])] = users[0]
        return users[0].outputs[0]

    def l2(self, v: Value, name: str) -> Value:
        parts = l2_parts(self.g, v)
        if parts is None:
            raise self.fail(f"{name} must be l2-normalised over head_dim", v)
        x, eps, nodes = parts
        if not math.isclose(eps, L2NORM_EPS, rel_tol=1e-9):
            raise self.fail(f"{name} l2norm eps {eps}, kda_fused uses {L2NORM_EPS}")
        self.interior.update((id(n), n) for n in nodes)
        return x

    def need_slice(self, n: Node, start: int, what: str) -> None:
        a, r = n.attrs, n.inputs[0].type.rank
        size = n.inputs[0].type.shape[-1]
        if not (_axis(a["dim"], r) == r - 1 and a["start"] == start and a["step"] == 1
                and (a["end"] is None or dims_equal(a["end"], size))):
            raise self.fail(what, n)

    def decay(self, g4: Value) -> tuple[str, float | None, Value, Value]:
        """(gate kind, lower bound, a [H,1], f4 [B,T,H,K]) of the decay gate producing `g4`."""
        m = self.take(g4, "mul", "decay gate (lower_bound·sigmoid(a·f) or -a·softplus(f))")
        if len(m.inputs) == 1:  # K3: lower_bound * sigmoid(a * f)
            lb = m.attrs["scalar"]
            if not lb < 0:
                raise self.fail(f"decay gate lower bound {lb} must be negative", m)
            sg = self.take(m.inputs[0], "sigmoid", "sigmoid of the lower-bounded decay gate")
            am = self.take(sg.inputs[0], "mul", "a·f inside the decay gate", 2)
            x, y = am.inputs
            a2, f4 = (x, y) if x.type.rank == 2 else (y, x)
            return "lower_bound", lb, a2, f4
        x, y = m.inputs  # Kimi Linear: -a * softplus(f)
        px = self.g.producer(x)
        if px is not None and px.op == "softplus":
            x, y = y, x
        ng = self.take(x, "neg", "-a of the softplus decay gate")
        sp = self.take(y, "softplus", "softplus of the decay gate")
        if (sp.attrs["beta"], sp.attrs["threshold"]) != (1.0, 20.0):
            raise self.fail("softplus decay gate must use beta 1, threshold 20", sp)
        return "softplus", None, ng.inputs[0], sp.inputs[0]

    def a_log(self, a2: Value, H: int) -> Value:
        rs = self.take(a2, "reshape", "exp(A_log) reshaped to [H,1]")
        self.need_shape(a2, (H, 1), "exp(A_log) per head")
        ex = self.take(rs.inputs[0], "exp", "exp(A_log)")
        v = ex.inputs[0]
        for _ in range(2):  # A_log.float()[:H]: a cast and / or a slice, in either order
            v = self.uncast(v)
            p = self.g.producer(v)
            if p is not None and p.op == "slice":
                a = p.attrs
                if not (p.inputs[0].type.rank == 1 and a["start"] == 0 and a["step"] == 1 and a["end"] == H):
                    raise self.fail("A_log may only be sliced to its first H entries", p)
                self.interior[id(p)] = p
                v = p.inputs[0]
        if v.type.rank != 1 or not v.type.is_concrete() or v.type.shape[0] < H:
            raise self.fail(f"A_log {v.type} must be a vector of >= {H} entries", v)
        return v

    def f_in(self, f4: Value, B, T, H: int, K: int) -> tuple[Value, Value]:
        self.need_shape(f4, (B, T, H, K), "decay gate input f")
        rs = self.take(f4, "reshape", "f + dt_bias reshaped to [B,T,H,K]")
        ad = self.take(rs.inputs[0], "add", "f_b_proj(...) + dt_bias", 2)
        x, y = ad.inputs
        if x.type.rank == 1:
            x, y = y, x
        f, dt = self.uncast(x), self.uncast(y)
        self.need_shape(f, (B, T, H * K), "f_b_proj output")
        self.need_shape(dt, (H * K,), "dt_bias")
        return f, dt

    def find_forward(self, v: Value, want, limit: int = 12) -> Node | None:
        """The first node (breadth first over users, at most `limit` nodes) satisfying `want`."""
        seen, frontier = 0, [v]
        while frontier and seen < limit:
            nxt = []
            for x in frontier:
                for u in self.g.users(x):
                    seen += 1
                    if want(u):
                        return u
                    nxt += u.outputs
            frontier = nxt
        return None


def fuse_kda_in_place(graph: Graph) -> int:
    """Fuse every KDA layer of `graph`; returns the number of `kda_fused` nodes made. Raises `IRError`."""
    outputs = {id(v) for v in graph.outputs.values()}
    plans = []
    for rec in [n for n in graph.nodes if n.op == "kda_recurrence"]:
        mt = _KDAMatch(graph, rec)
        plan = mt.run()
        exits = {id(v) for v in plan["exits"]}
        for n in mt.interior.values():
            for v in n.outputs:
                if id(v) in exits:
                    continue
                if id(v) in outputs:
                    raise mt.fail(f"interior value %{v.name} is a graph output")
                for u in graph.users(v):
                    if id(u) not in mt.interior:
                        raise mt.fail(f"interior value %{v.name} is also read outside the layer", u)
        plans.append((rec, plan))
    placed: dict[int, list[Node]] = {}
    for rec, plan in plans:
        out = plan["exits"][0]
        anchor = graph.producer(out)
        layer = rec.meta.get("layer")
        n0 = len(graph.nodes)
        new = graph.add_node("kda_fused", plan["inputs"], plan["attrs"],
                             names=[(f"l{layer}.kda" if layer is not None else "kda") + s
                                    for s in ("", ".state", ".conv_state")],
                             meta={"pass": "fuse_kda", "layer": layer,
                                   "source": "KDA mixer: short conv, l2norm, gates, delta rule, o_norm, output gate"})
        placed.setdefault(id(anchor), []).extend(graph.nodes[n0:])
        del graph.nodes[n0:]
        for old, nv in zip(plan["exits"], new):
            if not _types_equal(old.type, nv.type):
                raise IRError(f"fuse_kda: {describe(rec)}: kda_fused gives {nv.type} where the layer had {old.type}")
            graph.replace_all_uses(old, nv, check_type=False)
    if plans:
        graph.nodes = [x for n in graph.nodes for x in (*placed.get(id(n), ()), n)]
        dce_in_place(graph)
        graph.toposort()  # a reader of a new state placed before the fused node (none in the model) moves after it
    return len(plans)


@register_pass("fuse_kda")
def fuse_kda(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `fuse_kda`: every KDA layer becomes one `kda_fused` node (see the module docstring). In place."""
    fuse_kda_in_place(graph)
    return graph
