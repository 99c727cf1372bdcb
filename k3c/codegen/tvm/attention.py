"""TVM kernels for "mla_attention" (latent attention: absorbed MQA over the latent cache or plain MHA; dense causal
or restricted to the DSA top-k) and "dsa_index_topk" (the lightning indexer's scores and their top-k).

Exact semantics: `mla_attention_ref` and `dsa_index_topk_ref` in `k3c/ir/ops/model_attn.py` (K3-SPEC.md "Gated
MLA", "Gated DSA"). Query t of T new tokens sits at absolute position S − T + t of S keys and sees keys
s ≤ S − T + t.

mla_attention: one parallel iteration per (b, t, h); an online softmax (running max m, sum l, fp32 accumulator of
Dv values) over the visible keys, all of them (dense, or while S ≤ dense_max_keys) or the positions listed in
idx[b, t, :] (−1 = none). dsa_index_topk: one parallel iteration per (b, t); score[s] = Σ_j w_j · relu(q_j · k_s)
over the visible keys, then the top-k kept in a sorted list by insertion (decreasing score, ties to the lowest
position, as a stable sort), −1 in the slots beyond the visible count.

CUDA: mla_attention runs one thread block per (b, t, h) (`_mla_cuda`) over tiles of `CUDA_ROW_THREADS // 2` keys:
each warp scores 32 of them (lanes striding over D against the query in shared memory, a warp reduction per key),
the tile's max and sum reduce across the block, then each thread updates its share of the Dv accumulators from
the tile's probabilities (coalesced value rows). dsa_index_topk keeps the naive schedule (one thread per (b, t)).
"""

from __future__ import annotations

from k3c.codegen.tvm import generator
from k3c.codegen.tvm.script import CUDA_ROW_THREADS, WARP, Func, single_node, dim_expr, f32, load, store_value
from k3c.errors import UnsupportedError


@generator("mla_attention")
def gen_mla_attention(name: str, group, device: str) -> str:
    node = single_node(group)
    a = node.attrs
    q = node.inputs[0]
    absorbed = a["absorbed"]
    has_idx = node.inputs[-1].type.dtype in ("i64", "i32") and len(node.inputs) > (2 if absorbed else 3)
    names = ["q", "k"] + ([] if absorbed else ["v"]) + (["idx"] if has_idx else []) + ["o"]
    B, Tn, H, D = (dim_expr(d) for d in q.type.shape)
    S = dim_expr(node.inputs[1].type.shape[1])
    Dv = a["v_dim"] if absorbed else node.inputs[2].type.shape[3]
    if not all(isinstance(x, int) for x in (q.type.shape[2], q.type.shape[3], Dv)):
        raise UnsupportedError(f"{group.name}: mla_attention needs constant heads and head dims, got {q.type}")
    dt = {n: v.type.dtype for n, v in zip(names, list(node.inputs) + list(node.outputs))}
    topk = node.inputs[-1].type.shape[2] if has_idx else None
    f = Func(name, group.inputs, group.outputs, device,
             f"mla_attention ({'absorbed latent MQA' if absorbed else 'MHA'}, {H} heads, D {D}, Dv {Dv}"
             f"{', DSA top-' + str(topk) if has_idx else ''}, scale {a['scale']:.6g})", names=names)
    # flat offsets of key s's first element and of its value row
    krow = (lambda s: f"(b * {S} + {s}) * {D}") if absorbed else (lambda s: f"((b * {S} + {s}) * {H} + h) * {D}")
    vrow = (lambda s: f"(b * {S} + {s}) * {D}") if absorbed else (lambda s: f"((b * {S} + {s}) * {H} + h) * {Dv}")
    vbuf = "k" if absorbed else "v"
    if device == "cuda":
        _mla_cuda(f, a, (B, Tn, H, D, S, Dv), krow, vrow, vbuf, dt, topk if has_idx else None)
        return f.text()
    with f.parallel("bth", f"{B} * {Tn} * {H}"):
        f.emit(f"h = bth % {H}", f"t = (bth // {H}) % {Tn}", f"b = bth // ({H} * {Tn})",
               f"qrow = bth * {D}", f"last = {S} - {Tn} + t" if a["causal"] else f"last = {S} - 1")
        acc = f.local(Dv, name="acc")
        st = f.local(3, name="st")  # running max m, running sum l, the score being summed
        f.emit(f"st[0] = {f32(float('-inf'))}", f"st[1] = {f32(0.0)}")
        with f.block(f"for d in T.serial({Dv}):"):
            f.emit(f"acc[d] = {f32(0.0)}")

        def visit(s: str):
            f.emit(f"st[2] = {f32(0.0)}")
            with f.block(f"for d in T.serial({D}):"):
                f.emit(f"st[2] = st[2] + {load('q', 'qrow + d', dt['q'])} * {load('k', krow(s) + ' + d', dt['k'])}")
            f.emit(f"x = st[2] * {f32(a['scale'])}", "m = T.max(st[0], x)", "corr = T.exp(st[0] - m)",
                   "p = T.exp(x - m)", "st[0] = m", "st[1] = st[1] * corr + p")
            with f.block(f"for d in T.serial({Dv}):"):
                f.emit(f"acc[d] = acc[d] * corr + p * {load(vbuf, vrow(s) + ' + d', dt[vbuf])}")

        guard = a.get("dense_max_keys")
        if has_idx:
            dense_if = f"if {S} <= {guard}:" if guard is not None else None
            if dense_if:
                with f.block(dense_if), f.block("for s in T.serial(last + 1):"):
                    visit("s")
                f.emit("else:")
                f.depth += 1
            with f.block(f"for j in T.serial({topk}):"):
                f.emit(f"s = idx[(b * {Tn} + t) * {topk} + j]")
                with f.block("if s >= 0 and s <= last:" if a["causal"] else "if s >= 0:"):
                    visit("s")
            if dense_if:
                f.depth -= 1
        else:
            with f.block("for s in T.serial(last + 1):"):
                visit("s")
        with f.block(f"for d in T.serial({Dv}):"):
            f.emit(f"o[bth * {Dv} + d] = {store_value('acc[d] / st[1]', dt['o'])}")
    return f.text()


@generator("dsa_index_topk")
def gen_dsa_index_topk(name: str, group, device: str) -> str:
    node = single_node(group)
    qi, w, ki = node.inputs
    topk = node.attrs["topk"]
    B, Tn, J, D = (dim_expr(d) for d in qi.type.shape)
    Lk = dim_expr(ki.type.shape[1])
    dt = {"q": qi.type.dtype, "w": w.type.dtype, "k": ki.type.dtype}
    f = Func(name, group.inputs, group.outputs, device,
             f"dsa_index_topk (top-{topk} of {J} indexer heads of dim {D})", names=["q", "w", "k", "idx"])
    with f.parallel("bt", f"{B} * {Tn}"):
        f.emit(f"b = bt // {Tn}", f"t = bt % {Tn}", f"last = {Lk} - {Tn} + t")
        val = f.local(topk, name="val")
        pos = f.local(topk, "int64", name="pos")
        n = f.local(2, "int64", name="n")  # entries of the sorted list, insertion slot
        sc = f.local(2, name="sc")
        f.emit("n[0] = T.int64(0)")
        with f.block("for s in T.serial(last + 1):"):
            f.emit(f"sc[0] = {f32(0.0)}")
            with f.block(f"for j in T.serial({J}):"):
                f.dot("qk", D, lambda d: f"{load('q', f'(bt * {J} + j) * {D} + {d}', dt['q'])} * "
                                         f"{load('k', f'(b * {Lk} + s) * {D} + {d}', dt['k'])}")
                f.emit(f"sc[0] = sc[0] + {load('w', f'bt * {J} + j', dt['w'])} * T.max(qk, {f32(0.0)})")
            f.insert_sorted("val", "pos", "n", topk, "sc[0]", "s")
        with f.block(f"for j in T.serial({topk}):"):
            f.emit(f"idx[bt * {topk} + j] = T.Select(T.Cast(\"int64\", j) < n[0], pos[j], T.int64(-1))")
    return f.text()


def _mla_cuda(f: Func, a: dict, dims: tuple, krow, vrow, vbuf: str, dt: dict,
              topk: int | None) -> None:
    """The CUDA schedule of `gen_mla_attention` (module docstring): block (b, t, h), `nt` threads; the online
    softmax over tiles of nt keys (running max st[0], sum st[1]), the same visible keys as the CPU schedule."""
    B, Tn, H, D, S, Dv = dims
    nt = CUDA_ROW_THREADS // 2
    nc = -(-Dv // nt)
    with f.cuda_blocks("bth", f"{B} * {Tn} * {H}", nt, warps=True):
        f.emit(f"h = bth % {H}", f"t = (bth // {H}) % {Tn}", f"b = bth // ({H} * {Tn})",
               f"last = {S} - {Tn} + t" if a["causal"] else f"last = {S} - 1")
        qs, ps, ks = f.shared(D, name="qs"), f.shared(nt, name="ps"), f.shared(nt, "int64", name="ks")
        scs = f.shared(nt, name="scs")  # the tile's scores
        acc, st = f.local(nc, name="acc"), f.local(3, name="st")
        with f.strided("d", D, nt):
            f.emit(f"qs[d] = {load('q', f'bth * {D} + d', dt['q'])}")
        with f.block(f"for c in T.serial({nc}):"):
            f.emit(f"acc[c] = {f32(0.0)}")
        f.emit(f"st[0] = {f32(float('-inf'))}", f"st[1] = {f32(0.0)}")
        f.sync()

        def tiles(count: str, key: str, valid: str) -> None:
            """The tile loop over `count` candidate keys; `key` / `valid`: thread tx's key of the tile at jj."""
            with f.block(f"for tile in T.serial(({count} + {nt - 1}) // {nt}):"):
                # the tile's scores: warp w takes keys w·32 .. w·32 + 31, its lanes striding over D (coalesced)
                with f.block(f"for kk in T.serial({WARP}):"):
                    f.emit(f"jj = tile * {nt} + T.Cast(\"int64\", w * {WARP} + kk)", f"s = {key}", f"ok = {valid}")
                    part = f.local(1)
                    f.emit(f"{part}[0] = {f32(0.0)}")
                    krs = krow(f"T.Select(ok, s, T.int64(0))")
                    with f.strided("d", D, WARP, lane="lane"):
                        f.emit(f"{part}[0] = {part}[0] + qs[d] * {load('k', f'{krs} + d', dt['k'])}")
                    f.emit(f"sc = {f.allreduce(f'{part}[0]', lane='lane')}")
                    with f.block("if lane == 0:"):
                        f.emit(f"scs[w * {WARP} + kk] = sc * {f32(a['scale'])}")
                f.sync()
                f.emit(f"jj = tile * {nt} + T.Cast(\"int64\", tx)", f"s = {key}", f"ok = {valid}")
                f.emit(f"st[2] = T.Select(ok, scs[tx], {f32(float('-inf'))})")
                f.emit(f"m = T.max(st[0], {f.allreduce('st[2]', 'max')})",
                       f"p = T.Select(ok, T.exp(st[2] - m), {f32(0.0)})",
                       f"corr = T.Select(st[0] == {f32(float('-inf'))}, {f32(0.0)}, T.exp(st[0] - m))")
                f.emit(f"st[1] = st[1] * corr + {f.allreduce('p')}", "st[0] = m",
                       "ps[tx] = p", "ks[tx] = T.Select(ok, s, T.int64(0))")
                f.sync()
                with f.block(f"for c in T.serial({nc}):"):
                    f.emit(f"d = c * {nt} + tx")
                    with f.block(f"if d < {Dv}:"):
                        f.emit("acc[c] = acc[c] * corr")
                        with f.block(f"for u in T.serial({nt}):"):  # p = 0 (key 0) past the valid keys
                            vrs = vrow("ks[u]")
                            f.emit(f"acc[c] = acc[c] + ps[u] * {load(vbuf, f'{vrs} + d', dt[vbuf])}")
                f.sync()

        dense = lambda: tiles("last + 1", "jj", "jj <= last")  # noqa: E731
        guard = a.get("dense_max_keys")
        if topk is None:
            dense()
        else:
            slot = f"idx[(b * {Tn} + t) * {topk} + T.min(jj, {topk - 1})]"
            sparse = lambda: tiles(  # noqa: E731
                str(topk), f'T.Select(jj < {topk}, T.Cast("int64", {slot}), T.int64(-1))',
                "s >= 0 and s <= last" if a["causal"] else "s >= 0")
            if guard is None:
                sparse()
            else:
                with f.block(f"if {S} <= {guard}:"):
                    dense()
                with f.block("else:"):
                    sparse()
        with f.block(f"for c in T.serial({nc}):"):
            f.emit(f"d = c * {nt} + tx")
            with f.block(f"if d < {Dv}:"):
                f.emit(f"o[bth * {Dv} + d] = {store_value('acc[c] / st[1]', dt['o'])}")
