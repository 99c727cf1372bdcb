"""TVM kernels for Block Attention Residuals: "attn_res_inter" (phase 1: all pseudo-queries over the sealed blocks)
and "attn_res_merge" (phase 2: online-softmax merge with the current block's partial sum).

Exact semantics: `attn_res_inter_ref` / `attn_res_merge_ref` in `k3c/ir/ops/model_attn.py` (K3-SPEC.md "Block
Attention Residuals"; AttnRes paper, Algorithm 1). One parallel iteration per token (b, t); keys are the blocks'
rows RMS-normalised without weight, K(x) = x · rsqrt(mean(x²) + eps), all in fp32:

    inter: logits[i, n] = K(b_n) · queries[i] ; lse_i = logsumexp_n ; o[i] = Σ_n exp(logits[i, n] − lse_i) b_n
    merge: l_p = K(partial) · queries[index] ; m = logaddexp(lse[index], l_p) ;
           h = exp(lse[index] − m) · o[index] + exp(l_p − m) · partial

CUDA: attn_res_inter runs a thread block per (pseudo-query, token), attn_res_merge one per token; their threads
stride over the width and the row sums (x², x·q) reduce across the block.
"""

from __future__ import annotations

from k3c.codegen.tvm import generator
from k3c.codegen.tvm.script import Func, single_node, dim_expr, f32, load, row_threads, store_value


@generator("attn_res_inter")
def gen_attn_res_inter(name: str, group, device: str) -> str:
    node = single_node(group)
    queries, *blocks = node.inputs
    Q, D = queries.type.shape
    N = len(blocks)
    B, Tn = (dim_expr(d) for d in blocks[0].type.shape[:2])
    names = ["queries"] + [f"b{n}" for n in range(N)] + ["o", "lse"]
    dt = {n: v.type.dtype for n, v in zip(names, node.inputs)}
    eps = f32(node.attrs["eps"])
    f = Func(name, group.inputs, group.outputs, device,
             f"attn_res_inter ({Q} pseudo-queries over {N} blocks of width {D})", names=names)
    blk = lambda n, d: load(f"b{n}", f"bt * {D} + {d}", dt[f"b{n}"])  # noqa: E731
    out = lambda w: (f"o[(i * {B} * {Tn} + bt) * {D} + d] = "  # noqa: E731  o[i, bt, d] = Σ_n w(n) b_n[bt, d]
                     + " + ".join(f"{w(n)} * {blk(n, 'd')}" for n in range(N)))
    if device == "cuda":  # a block per (query, token): the block's two row sums per sealed block across threads
        nt = row_threads(D)
        with f.cuda_blocks("ibt", f"{Q} * {B} * {Tn}", nt):
            f.emit(f"i = ibt // ({B} * {Tn})", f"bt = ibt % ({B} * {Tn})")
            lg = f.local(N, name="lg")
            for n in range(N):
                p = f.local(2)
                f.emit(f"{p}[0] = {f32(0.0)}", f"{p}[1] = {f32(0.0)}")
                with f.strided("d", D, nt):
                    f.emit(f"x = {blk(n, 'd')}", f"{p}[0] = {p}[0] + x * x",
                           f"{p}[1] = {p}[1] + x * {load('queries', f'i * {D} + d', dt['queries'])}")
                f.emit(f"lg[{n}] = {f.allreduce(f'{p}[1]')} * T.rsqrt({f.allreduce(f'{p}[0]')} / "
                       f"{f32(float(D))} + {eps})")
            _softmax(f, lambda n: f"lg[{n}]", N, f"lse[i * {B} * {Tn} + bt]", "tx == 0")
            with f.strided("d", D, nt):
                f.emit(out(lambda n: f"lg[{n}]"))
        return f.text()
    with f.parallel("bt", f"{B} * {Tn}"):
        lg = f.local(Q * N, name="lg")   # logits[i, n], then the softmax weights
        acc = f.local(1, name="acc")
        for n in range(N):
            f.emit(f"acc[0] = {f32(0.0)}")
            with f.block(f"for d in T.serial({D}):"):
                f.emit(f"x = {blk(n, 'd')}", "acc[0] = acc[0] + x * x")
            f.emit(f"r{n} = T.rsqrt(acc[0] / {f32(float(D))} + {eps})")
            with f.block(f"for i in T.serial({Q}):"):
                f.dot("qb", D, lambda d: f"{blk(n, d)} * "  # noqa: B023
                                         f"{load('queries', f'i * {D} + {d}', dt['queries'])}")
                f.emit(f"lg[i * {N} + {n}] = qb * r{n}")
        with f.block(f"for i in T.serial({Q}):"):
            _softmax(f, lambda n: f"lg[i * {N} + {n}]", N, f"lse[i * {B} * {Tn} + bt]", None)
            with f.block(f"for d in T.serial({D}):"):
                f.emit(out(lambda n: f"lg[i * {N} + {n}]"))
    return f.text()


def _softmax(f: Func, lg, N: int, lse_at: str, guard: str | None) -> None:
    """Emit lse = logsumexp_n lg(n) over the N logits `lg(n)` (buffer elements), stored at `lse_at` (under `guard`,
    if given), then lg(n) <- exp(lg(n) - lse): the blocks' softmax weights."""
    mx = lg(0)
    for n in range(1, N):
        mx = f"T.max({mx}, {lg(n)})"
    f.emit(f"mx = {mx}", f"lse_i = mx + T.log({' + '.join(f'T.exp({lg(n)} - mx)' for n in range(N))})")
    if guard:
        with f.block(f"if {guard}:"):
            f.emit(f"{lse_at} = lse_i")
    else:
        f.emit(f"{lse_at} = lse_i")
    f.emit(*(f"{lg(n)} = T.exp({lg(n)} - lse_i)" for n in range(N)))


@generator("attn_res_merge")
def gen_attn_res_merge(name: str, group, device: str) -> str:
    node = single_node(group)
    o, lse, partial, queries = node.inputs
    D = queries.type.shape[1]
    B, Tn = (dim_expr(d) for d in partial.type.shape[:2])
    i = node.attrs["index"]
    names = ["o", "lse", "partial", "queries", "h"]
    dt = {n: v.type.dtype for n, v in zip(names, list(node.inputs) + list(node.outputs))}
    f = Func(name, group.inputs, group.outputs, device,
             f"attn_res_merge (pseudo-query {i}, width {D})", names=names)
    if device == "cuda":  # a block per token: the two row sums across the block
        nt = row_threads(D)
        with f.cuda_blocks("bt", f"{B} * {Tn}", nt):
            acc = f.local(2, name="acc")
            f.emit(f"acc[0] = {f32(0.0)}", f"acc[1] = {f32(0.0)}")
            with f.strided("d", D, nt):
                f.emit(f"x = {load('partial', f'bt * {D} + d', dt['partial'])}", "acc[0] = acc[0] + x * x",
                       f"acc[1] = acc[1] + x * {load('queries', f'{i * D} + d', dt['queries'])}")
            f.emit(f"lp = {f.allreduce('acc[1]')} * T.rsqrt({f.allreduce('acc[0]')} / {f32(float(D))} + "
                   f"{f32(node.attrs['eps'])})")
            _merge_weights(f, f"{load('lse', f'{i} * {B} * {Tn} + bt', dt['lse'])}")
            with f.strided("d", D, nt):
                _merge_store(f, i, B, Tn, D, dt)
        return f.text()
    with f.parallel("bt", f"{B} * {Tn}"):
        acc = f.local(2, name="acc")
        f.emit(f"acc[0] = {f32(0.0)}", f"acc[1] = {f32(0.0)}")
        with f.block(f"for d in T.serial({D}):"):
            f.emit(f"x = {load('partial', f'bt * {D} + d', dt['partial'])}", "acc[0] = acc[0] + x * x",
                   f"acc[1] = acc[1] + x * {load('queries', f'{i * D} + d', dt['queries'])}")
        f.emit(f"lp = acc[1] * T.rsqrt(acc[0] / {f32(float(D))} + {f32(node.attrs['eps'])})")
        _merge_weights(f, f"{load('lse', f'{i} * {B} * {Tn} + bt', dt['lse'])}")
        with f.block(f"for d in T.serial({D}):"):
            _merge_store(f, i, B, Tn, D, dt)
    return f.text()


def _merge_weights(f: Func, lse: str) -> None:
    """Emit the merge weights wo, wp of the sealed blocks' output (log-sum-exp `lse`) and the partial block (its
    logit `lp`): m = logaddexp(lse, lp), written stably as max + log1p(exp(−|lse − lp|))."""
    f.emit(f"li = {lse}", "m = T.max(li, lp) + T.log1p(T.exp(-T.abs(li - lp)))", "wo = T.exp(li - m)",
           "wp = T.exp(lp - m)")


def _merge_store(f: Func, i: int, B: str, Tn: str, D: int, dt: dict) -> None:
    """Emit h[bt, d] = wo · o[i, bt, d] + wp · partial[bt, d]."""
    val = (f"wo * {load('o', f'({i} * {B} * {Tn} + bt) * {D} + d', dt['o'])} + "
           f"wp * {load('partial', f'bt * {D} + d', dt['partial'])}")
    f.emit(f"h[bt * {D} + d] = {store_value(val, dt['h'])}")
