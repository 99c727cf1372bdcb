"""TVM kernel for "kda_fused" groups: the whole KDA mixer between the input projections and o_proj, for any number
of new tokens T (decode T = 1, chunked prefill T > 1) in one kernel.

Exact semantics: `kda_fused_ref` in `k3c/ir/ops/model_kda.py` (K3-SPEC.md "KDA layer"). One parallel iteration
per (batch row b, head h) owns that head's state S [K, V] (fp32, updated in place in the `state` output, which may
be the same tensor as the `state` input) and its 3·K conv-state channels [W]; it walks the T tokens in order:

    x_c = silu(Σ_w conv_w[c, w] · [conv_state_c[1:] | x_t,c]_w)  for the q, k, v channels; conv state shifts
    q = l2norm(q) · K^-0.5 ; k = l2norm(k) ; g = lower_bound · sigmoid(exp(A_log_h) · (f + dt_bias))  (or
    −exp(A_log_h) · softplus(f + dt_bias)) ; β = sigmoid(beta)
    S ← Diag(exp g) S ; r = kᵀS ; S ← S + β k (v − r)ᵀ ; o = Sᵀq            (two passes over S per token)
    y_t = rms_norm(o; o_norm, eps) ⊙ sigmoid(gate_t)

The recurrence is sequential in T (this kernel does not use the chunked WY form); its cost is 4·K·V FLOPs per token
and head, read and written from the state in cache. A bf16 state (`--kda-state bf16`) raises UnsupportedError at
compile time: the CPU loop works in the state output itself, which would round it after every token instead of once
per call (`kda_fused_ref`).

CUDA schedule: one thread block per (b, h) of K threads. Thread j owns column j of S, held in registers over the
T tokens (kᵀS and Sᵀq are per-thread sums over the rows; S is read and written once, coalesced), and channel j of
the q, k, v convolutions; the token's q | k | v and exp g sit in shared memory, the two l2 norms and the output
norm reduce across the block.
"""

from __future__ import annotations

from k3c.codegen.tvm import generator
from k3c.codegen.tvm.script import Func, single_node, dim_expr, f32, load, store_value
from k3c.errors import UnsupportedError
from k3c.ir.ops.model_kda import KDA_FUSED_INPUTS

_NAMES = ["q", "k", "v", "f", "beta", "gate", "q_conv", "k_conv", "v_conv", "A_log", "dt_bias", "o_norm",
          "state_in", "conv_in", "y", "state", "conv"]


@generator("kda_fused")
def gen_kda_fused(name: str, group, device: str) -> str:
    node = single_node(group)
    state = node.inputs[KDA_FUSED_INPUTS.index("state")].type.dtype
    if state != "f32":
        raise UnsupportedError(f"--kda-state {state} (kda_state_dtype): the tvm backend keeps the KDA state in f32 "
                               f"only; compile with --kda-state f32, or --backend triton on a GPU target")
    a = node.attrs
    H, K = a["heads"], a["head_dim"]
    W = node.inputs[6].type.shape[2]
    HK = H * K
    B, Tn = (dim_expr(d) for d in node.inputs[0].type.shape[:2])
    dt = {n: v.type.dtype for n, v in zip(_NAMES, list(node.inputs) + list(node.outputs))}
    f = Func(name, group.inputs, group.outputs, device,
             f"kda_fused, {H} heads of {K}, conv width {W}, gate {a['gate']}", names=_NAMES,
             noalias=False)
    ld = lambda n, i: load(n, i, dt[n])  # noqa: E731
    gate_of = lambda fb: (f"{f32(a['lower_bound'])} * T.sigmoid(a * {fb})" if a["gate"] == "lower_bound" else  # noqa
                          f"-a * T.Select({fb} > {f32(20.0)}, {fb}, T.log1p(T.exp(T.min({fb}, {f32(20.0)}))))")
    if device == "cuda":
        _kda_cuda(f, a, H, K, W, B, Tn, dt, ld, gate_of)
        return f.text()
    with f.parallel("bh", f"{B} * {H}"):
        f.emit(f"b = bh // {H}", f"h = bh % {H}")
        s0 = f"bh * {K * K}"
        with f.block(f"for e in T.serial({K * K}):"):
            f.emit(f"state[{s0} + e] = state_in[{s0} + e]")
        with f.block(f"for e in T.serial({3 * K * W}):"):  # this head's q, k, v channels of the conv state
            f.emit(f"c = (e // {K * W}) * {HK} + h * {K} + (e // {W}) % {K}",
                   f"conv[(b * {3 * HK} + c) * {W} + e % {W}] = conv_in[(b * {3 * HK} + c) * {W} + e % {W}]")
        x = f.local(3 * K, name="x")   # q | k | v of this token after conv + silu
        g = f.local(K, name="g")       # exp(g): the per-key decay
        r = f.local(K, name="r")       # kᵀS, then the output o = Sᵀq
        acc = f.local(4, name="acc")
        f.emit(f"a = T.exp({ld('A_log', 'h')})")
        with f.block(f"for t in T.serial({Tn}):"):
            f.emit(f"row = (b * {Tn} + t) * {HK} + h * {K}")
            with f.block(f"for e in T.serial({3 * K}):"):
                f.emit(f"ch = (e // {K}) * {HK} + h * {K} + e % {K}", f"cb = (b * {3 * HK} + ch) * {W}",
                       f"xin = T.Select(e < {K}, {ld('q', f'row + e')}, T.Select(e < {2 * K}, "
                       f"{ld('k', f'row + e - {K}')}, {ld('v', f'row + e - {2 * K}')}))")
                wgt = lambda w: (f"T.Select(e < {K}, {ld('q_conv', f'(h * {K} + e) * {W} + {w}')}, T.Select("  # noqa
                                 f"e < {2 * K}, {ld('k_conv', f'(h * {K} + e - {K}) * {W} + {w}')}, "
                                 f"{ld('v_conv', f'(h * {K} + e - {2 * K}) * {W} + {w}')}))")
                terms = [f"{wgt(w)} * {ld('conv', f'cb + {w + 1}')}" for w in range(W - 1)]
                f.emit(f"cy = {' + '.join(terms + [f'{wgt(W - 1)} * xin'])}")
                for w in range(W - 1):
                    f.emit(f"conv[cb + {w}] = conv[cb + {w + 1}]")
                f.emit(f"conv[cb + {W - 1}] = {store_value('xin', dt['conv'])}",
                       "x[e] = cy * T.sigmoid(cy)")
            f.emit(f"acc[0] = {f32(0.0)}", f"acc[1] = {f32(0.0)}")
            with f.block(f"for i in T.serial({K}):"):
                f.emit("acc[0] = acc[0] + x[i] * x[i]", f"acc[1] = acc[1] + x[{K} + i] * x[{K} + i]")
            f.emit(f"qs = T.rsqrt(acc[0] + {f32(1e-6)}) * {f32(K ** -0.5)}",
                   f"ks = T.rsqrt(acc[1] + {f32(1e-6)})",
                   f"bt = T.sigmoid({ld('beta', f'(b * {Tn} + t) * {H} + h')})")
            with f.block(f"for i in T.serial({K}):"):
                fb = f"({ld('f', 'row + i')} + {ld('dt_bias', f'h * {K} + i')})"
                f.emit(f"fb = {fb}")
                f.emit(f"g[i] = T.exp({gate_of('fb')})", f"x[i] = x[i] * qs", f"x[{K} + i] = x[{K} + i] * ks",
                       f"r[i] = {f32(0.0)}")
            with f.block(f"for i in T.serial({K}):"):  # S <- Diag(exp g) S ; r = kᵀS
                with f.block(f"for j in T.serial({K}):"):
                    f.emit(f"s = state[{s0} + i * {K} + j] * g[i]", f"state[{s0} + i * {K} + j] = s",
                           f"r[j] = r[j] + x[{K} + i] * s")
            with f.block(f"for j in T.serial({K}):"):
                f.emit(f"r[j] = bt * (x[{2 * K} + j] - r[j])")  # β (v − kᵀS), then reused for o
                f.emit(f"g[j] = {f32(0.0)}")
            with f.block(f"for i in T.serial({K}):"):  # S += k (β (v − r))ᵀ ; o = Sᵀq
                with f.block(f"for j in T.serial({K}):"):
                    f.emit(f"s = state[{s0} + i * {K} + j] + x[{K} + i] * r[j]", f"state[{s0} + i * {K} + j] = s",
                           "g[j] = g[j] + x[i] * s")
            f.emit(f"acc[2] = {f32(0.0)}")
            with f.block(f"for j in T.serial({K}):"):
                f.emit("acc[2] = acc[2] + g[j] * g[j]")
            f.emit(f"inv = T.rsqrt(acc[2] / {f32(float(K))} + {f32(a['eps'])})")
            with f.block(f"for j in T.serial({K}):"):  # rms_norm(o; o_norm) ⊙ sigmoid(gate)
                out = f"g[j] * inv * {ld('o_norm', 'j')} * T.sigmoid({ld('gate', 'row + j')})"
                f.emit(f"y[row + j] = {store_value(out, dt['y'])}")
    return f.text()


def _kda_cuda(f: Func, a: dict, H: int, K: int, W: int, B: str, Tn: str, dt: dict, ld, gate_of) -> None:
    """The CUDA schedule of `gen_kda_fused` (module docstring): block (b, h), thread j = `tx` < K."""
    HK = H * K
    if K > 1024:
        raise UnsupportedError(f"{f.name}: the CUDA KDA kernel runs a thread per key dim, at most 1024, not {K}")
    with f.cuda_blocks("bh", f"{B} * {H}", K):
        f.emit(f"b = bh // {H}", f"h = bh % {H}", "j = T.Cast(\"int64\", tx)", f"s0 = bh * {K * K}")
        x = f.shared(3 * K, name="x")   # q | k | v of the token after conv + silu (then q, k normalized)
        g = f.shared(K, name="g")       # exp(g)
        acc = f.local(2, name="acc")
        col = f.local(K, name="col")    # column j of S, in registers for all the tokens (unrolled loops)
        with f.block(f"for i in T.unroll({K}):"):
            f.emit(f"col[i] = state_in[s0 + i * {K} + j]")
        for p in range(3):
            f.emit(f"cb{p} = (b * {3 * HK} + {p * HK} + h * {K} + j) * {W}")
            with f.block(f"for w in T.serial({W}):"):
                f.emit(f"conv[cb{p} + w] = conv_in[cb{p} + w]")
        f.emit(f"a = T.exp({ld('A_log', 'h')})")
        with f.block(f"for t in T.serial({Tn}):"):
            f.emit(f"row = (b * {Tn} + t) * {HK} + h * {K}")
            for p, (src, wb) in enumerate((("q", "q_conv"), ("k", "k_conv"), ("v", "v_conv"))):
                cb, wt = f"cb{p}", lambda w: ld(wb, f"(h * {K} + j) * {W} + {w}")  # noqa: B023
                f.emit(f"xin{p} = {ld(src, 'row + j')}")
                terms = [f"{wt(w)} * {ld('conv', f'{cb} + {w + 1}')}" for w in range(W - 1)]
                f.emit(f"cy{p} = {' + '.join(terms + [f'{wt(W - 1)} * xin{p}'])}")
                for w in range(W - 1):
                    f.emit(f"conv[{cb} + {w}] = conv[{cb} + {w + 1}]")
                f.emit(f"conv[{cb} + {W - 1}] = {store_value(f'xin{p}', dt['conv'])}")
            f.emit("xq = cy0 * T.sigmoid(cy0)", "xk = cy1 * T.sigmoid(cy1)")
            qq, kk = f.allreduce("xq * xq"), f.allreduce("xk * xk")
            fb = f"({ld('f', 'row + j')} + {ld('dt_bias', f'h * {K} + j')})"
            f.emit(f"x[j] = xq * T.rsqrt({qq} + {f32(1e-6)}) * {f32(K ** -0.5)}",
                   f"x[{K} + j] = xk * T.rsqrt({kk} + {f32(1e-6)})", f"x[{2 * K} + j] = cy2 * T.sigmoid(cy2)",
                   f"fb = {fb}", f"g[j] = T.exp({gate_of('fb')})",
                   f"bt = T.sigmoid({ld('beta', f'(b * {Tn} + t) * {H} + h')})")
            f.sync()
            f.emit(f"acc[0] = {f32(0.0)}")
            with f.block(f"for i in T.unroll({K}):"):  # S <- Diag(exp g) S ; r_j = (kᵀS)_j
                f.emit("col[i] = col[i] * g[i]", f"acc[0] = acc[0] + x[{K} + i] * col[i]")
            f.emit(f"u = bt * (x[{2 * K} + j] - acc[0])", f"acc[1] = {f32(0.0)}")
            with f.block(f"for i in T.unroll({K}):"):  # S += k uᵀ ; o_j = (Sᵀq)_j
                f.emit(f"col[i] = col[i] + x[{K} + i] * u", "acc[1] = acc[1] + x[i] * col[i]")
            oo = f.allreduce("acc[1] * acc[1]")
            out = (f"acc[1] * T.rsqrt({oo} / {f32(float(K))} + {f32(a['eps'])}) * {ld('o_norm', 'j')} * "
                   f"T.sigmoid({ld('gate', 'row + j')})")
            f.emit(f"y[row + j] = {store_value(out, dt['y'])}")
            f.sync()  # x and g are rewritten by the next token
        with f.block(f"for i in T.unroll({K}):"):
            f.emit(f"state[s0 + i * {K} + j] = col[i]")
