"""The MLA attention forms (match, choose, build), shared by the passes `absorb_mla` and `place_dsa`.

An MLA attention core becomes one `mla_attention` node, absorbed (MQA over the latent) where cheaper.

Matches (after `cleanup`) the decomposed attention core of `models.layers.MLA.forward` (K3-SPEC.md "Gated MLA"):

    kv  = cat(cache.kv, new latents, dim=1)                                   [B,S,r+rope]   (S = L+T)
    k_nope, v = split(reshape(linear(slice(kv, :r), kv_b_proj.weight)), [nope, vd])   [B,S,H,·]
    s   = einsum(q[..., :nope], k_nope) + einsum(q[..., nope:], kv[..., r:])  · scale  (optional cast)
    p   = softmax(masked_fill(s, ~mask, -inf))      mask = causal [& DSA hit(idx) from the index scatter]
    o   = einsum("bhts,bshd->bthd", p, v)                                     [B,T,H,vd]

and replaces `o` by one of two exact forms (DSA's mask becomes the `idx` input: see also `place_dsa`):
- absorbed (decode, T == 1, always; prefill when cheaper): kv_b_proj's key part is folded into the query and its
  value part into the output, so attention is MQA over the cached latent:
      q_lat = einsum("bthd,hdr->bthr", q_nope, W_UK)            W_UK [H,nope,r] = kv_b_proj.weight per head, key rows
      o_lat = mla_attention(cat(q_lat, q_pe), kv[, idx]) {absorbed=True, v_dim=r, scale}     [B,T,H,r]
      o     = einsum("bthr,hvr->bthv", o_lat, W_UV)             W_UV [H,vd,r] = the value rows
  W_UK / W_UV are new parameters `<kv_b_proj>.w_uk` / `.w_uv`, derived from `<kv_b_proj>.weight` (recorded in
  `graph.derived_params`; `k3c.passes.derived.materialize_params` computes them);
- naive: o = mla_attention(q, cat(k_nope, expand(k_pe)), v[, idx]) {absorbed=False, scale}.
For prefill the form with fewer FLOPs at the compile bounds (`CompileContext.bounds` {"B", "T", "L"}) wins,
unless the naive form's decompressed keys and values (B·S·H·(2·nope + rope + vd) elements,
S = L + T) would exceed `NAIVE_KV_BUDGET_BYTES`: at long contexts the naive form materialises the whole cache
decompressed (48 GiB per layer for K3 at 1M tokens), while the absorbed form reads the compressed cache in place.
`absorbed` records the choice, `meta["mla_form"]` the FLOP and byte counts it was made on.
Parameters no node reads any more (kv_b_proj in an all-absorbed graph) are dropped. O(nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

from k3c.ir.graph import Graph, Node, Value
from k3c.ir.rewrite import dce_in_place
from k3c.ir.types import TensorType, dim, dim_str, dims_equal, evaluate
from k3c.passes.common import reorder, skip_cast
from k3c.passes.derived import add_derived_param, prune_unused_params

#: Largest transient decompressed K/V the naive prefill form may materialise: 4 GiB, about 3 % of an H200's HBM
#: (a long-context prefill then runs absorbed, as vLLM and SGLang do past their context-chunk workspace).
NAIVE_KV_BUDGET_BYTES = 4 << 30


@dataclass
class MLAMatch:
    """The matched attention core of one MLA / DSA layer (see the module docstring)."""

    softmax: Node
    out: Value  # o [B,T,H,vd] (replaced)
    anchor: Node  # the node producing `out`: new nodes go right before it
    q: Value  # [B,T,H,nope+rope]
    q_nope: Value
    q_pe: Value
    kv: Value  # [B,S,r+rope]
    k_nope: Value  # [B,S,H,nope]
    k_pe: Value  # [B,S,rope]
    v: Value  # [B,S,H,vd]
    w_kv_b: Value  # param [H*(nope+vd), r]
    H: int
    nope: int
    rope: int
    vd: int
    r: int
    scale: float
    idx: Value | None  # DSA top-k indices [B,T,k] (−1 = none) or None (dense causal)


def _p(graph: Graph, v: Value, op: str) -> Node | None:
    n = graph.producer(v)
    return n if n is not None and n.op == op else None


def _ax(d: int, rank: int) -> int:
    return d % rank


def _eq(a, b) -> bool:
    return a is not None and b is not None and dims_equal(dim(a), dim(b))


def _slice(graph: Graph, v: Value, d: int) -> tuple[Value, object, object] | None:
    """(x, start, end) when `v` = slice(x) {dim=d, step=1}."""
    n = _p(graph, v, "slice")
    if n is None or _ax(n.attrs["dim"], n.inputs[0].type.rank) != d or n.attrs["step"] != 1:
        return None
    return n.inputs[0], n.attrs["start"], n.attrs["end"]


def is_causal_mask(graph: Graph, v: Value, T, S) -> bool:
    """`v` = [expand](le(unsqueeze(arange(0, S), 0), unsqueeze(arange(S − T, S), 1))): key s visible to query t."""
    n = graph.producer(v)
    if n is not None and n.op == "expand":
        n = graph.producer(n.inputs[0])
    if n is None or n.op != "le" or len(n.inputs) != 2:
        return False
    ua, ub = (_p(graph, x, "unsqueeze") for x in n.inputs)
    if not ua or not ub or ua.attrs["dim"] != 0 or ub.attrs["dim"] != 1:
        return False
    a, b = _p(graph, ua.inputs[0], "arange"), _p(graph, ub.inputs[0], "arange")
    if not a or not b or a.attrs["step"] != 1 or b.attrs["step"] != 1:
        return False
    return (_eq(a.attrs["start"], 0) and _eq(a.attrs["end"], S) and _eq(b.attrs["start"], dim(S) - dim(T))
            and _eq(b.attrs["end"], S))


def dsa_hit_indices(graph: Graph, v: Value, S) -> Value | None:
    """idx when `v` = unsqueeze(slice(scatter(zeros[B,T,S+1], idx + 1, ones), start=1), 1): the reference model's
    dense mask of the selected keys (−1 lands in the dropped column 0)."""
    un = _p(graph, v, "unsqueeze")
    sl = un and un.attrs["dim"] == 1 and _slice(graph, un.inputs[0], 2)
    if not sl or not _eq(sl[1], 1) or sl[2] is not None:
        return None
    sc = _p(graph, sl[0], "scatter")
    if not sc or _ax(sc.attrs["dim"], 3) != 2 or sc.attrs["reduce"] != "none":
        return None
    z, ad, ones = (graph.producer(x) for x in sc.inputs)
    if not z or z.op != "zeros" or not ones or ones.op != "ones" or not ad or ad.op != "add":
        return None
    if len(ad.inputs) != 1 or ad.attrs["scalar"] != 1.0 or not _eq(sc.inputs[0].type.shape[2], dim(S) + 1):
        return None
    idx = ad.inputs[0]
    return idx if idx.type.dtype == "i64" else None


def match_mla(graph: Graph, sm: Node, param_keys: dict) -> MLAMatch | None:
    """The MLA attention core whose softmax is `sm`, or None (pattern in the module docstring)."""
    if sm.op != "softmax" or sm.inputs[0].type.rank != 4 or _ax(sm.attrs["dim"], 4) != 3:
        return None
    mf = _p(graph, sm.inputs[0], "masked_fill")
    if not mf or mf.attrs["value"] != float("-inf"):
        return None
    nm = _p(graph, mf.inputs[1], "logical_not")
    sc = _p(graph, skip_cast(graph, mf.inputs[0]), "mul")
    if not nm or not sc or len(sc.inputs) != 1 or sc.attrs["scalar"] is None:
        return None
    add = _p(graph, skip_cast(graph, sc.inputs[0]), "add")
    if not add or len(add.inputs) != 2:
        return None
    e1, e2 = (graph.producer(x) for x in add.inputs)
    if e1 is None or e2 is None or e1.op != "einsum" or e2.op != "einsum":
        return None
    if e1.attrs["equation"] != "bthd,bshd->bhts":
        e1, e2 = e2, e1
    if e1.attrs["equation"] != "bthd,bshd->bhts" or e2.attrs["equation"] != "bthd,bsd->bhts":
        return None
    qn, kn = e1.inputs
    qp, kp = e2.inputs
    sn, sp, skp = _slice(graph, qn, 3), _slice(graph, qp, 3), _slice(graph, kp, 2)
    if not sn or not sp or not skp or sn[0] is not sp[0] or not _eq(sn[1], 0) or sp[2] is not None:
        return None
    q, nope = sn[0], sn[2]
    if not _eq(sp[1], nope):
        return None
    kv, r = skp[0], skp[1]
    sp_node = graph.producer(kn)
    if sp_node is None or sp_node.op != "split" or len(sp_node.outputs) != 2 or sp_node.outputs[0] is not kn:
        return None
    v = sp_node.outputs[1]
    rs = _p(graph, sp_node.inputs[0], "reshape")
    lin = rs and _p(graph, rs.inputs[0], "linear")
    if not lin or len(lin.inputs) != 2 or lin.inputs[1] not in param_keys:
        return None
    skv = _slice(graph, lin.inputs[0], 2)
    if not skv or skv[0] is not kv or not _eq(skv[1], 0) or not _eq(skv[2], r):
        return None
    users = graph.users(sm.outputs[0])
    if len(users) != 1 or users[0].op != "einsum" or users[0].attrs["equation"] != "bhts,bshd->bthd":
        return None
    pv = users[0]
    if pv.inputs[0] is not sm.outputs[0] or skip_cast(graph, pv.inputs[1]) is not v:
        return None
    # the mask: causal, or causal & the DSA index hit mask
    T, S = q.type.shape[1], kv.type.shape[1]
    mask, idx = nm.inputs[0], None
    if not is_causal_mask(graph, mask, T, S):
        la = _p(graph, mask, "logical_and")
        if not la or len(la.inputs) != 2:
            return None
        for a, b in (la.inputs, la.inputs[::-1]):
            if is_causal_mask(graph, a, T, S):
                idx = dsa_hit_indices(graph, b, S)
                if idx is not None:
                    break
        if idx is None:
            return None
    H, qd = q.type.shape[2], q.type.shape[3]
    vd, rope = v.type.shape[3], kp.type.shape[2]
    if not all(isinstance(x, int) for x in (H, qd, vd, rope, nope, r)) or qd != nope + rope:
        return None
    return MLAMatch(sm, pv.outputs[0], pv, q, qn, qp, kv, kn, kp, v, lin.inputs[1], H, nope, rope, vd, r,
                    sc.attrs["scalar"], idx)


def mla_flops(m: MLAMatch, T: int, L: int) -> dict[str, int]:
    """FLOPs of the two forms at T new and L cached tokens (S = L + T keys; a DSA query reads ≤ topk of them).

    naive:    kv_b_proj over all S keys + scores over nope+rope + P·V over vd
    absorbed: q_nope·W_UK + scores over r+rope + P·V over r + o_lat·W_UV
    """
    S = L + T
    keys = S if m.idx is None else min(S, int(m.idx.type.shape[2]))
    H, nope, rope, vd, r = m.H, m.nope, m.rope, m.vd, m.r
    naive = 2 * S * r * H * (nope + vd) + 2 * T * keys * H * (nope + rope + vd)
    absorbed = 2 * T * H * nope * r + 2 * T * keys * H * (2 * r + rope) + 2 * T * H * r * vd
    return {"absorbed": absorbed, "naive": naive}


def naive_kv_bytes(m: MLAMatch, B: int, T: int, L: int) -> int:
    """Bytes of the naive form's decompressed keys [B,S,H,nope+rope] and values [B,S,H,vd] at S = L + T."""
    item = {"f32": 4, "f64": 8}.get(m.kv.type.dtype, 2)
    return B * (L + T) * m.H * (2 * m.nope + m.rope + m.vd) * item


def _dims(t: TensorType) -> list:
    return [d if isinstance(d, int) else dim_str(d) for d in t.shape]


def build_mla(graph: Graph, m: MLAMatch, absorbed: bool, key_of: dict, meta: dict) -> Value:
    """Append the nodes of the chosen form (module docstring) and return the value replacing `m.out`."""
    mk = dict(meta)
    extra = [m.idx] if m.idx is not None else []
    tag = f"l{m.anchor.meta.get('layer')}.mla"
    if absorbed:
        wkey = key_of[m.w_kv_b]
        base = wkey[:-len(".weight")] if wkey.endswith(".weight") else wkey
        wt = m.w_kv_b.type
        rec = {"heads": m.H, "nope": m.nope, "v_dim": m.vd}
        w_uk = add_derived_param(graph, base + ".w_uk", TensorType((m.H, m.nope, m.r), wt.dtype), "mla_w_uk",
                                 [wkey], rec)
        w_uv = add_derived_param(graph, base + ".w_uv", TensorType((m.H, m.vd, m.r), wt.dtype), "mla_w_uv",
                                 [wkey], rec)
        qn = m.q_nope if m.q_nope.type.dtype == wt.dtype else graph.add("cast", m.q_nope, to=wt.dtype, meta=mk)
        q_lat = graph.add("einsum", qn, w_uk, equation="bthd,hdr->bthr", name_hint=f"{tag}.q_lat", meta=mk)
        qp = m.q_pe if m.q_pe.type.dtype == wt.dtype else graph.add("cast", m.q_pe, to=wt.dtype, meta=mk)
        q_abs = graph.add("cat", q_lat, qp, dim=-1, name_hint=f"{tag}.q_abs", meta=mk)
        o_lat = graph.add_node("mla_attention", [q_abs, m.kv, *extra], {"absorbed": True, "scale": m.scale,
                               "v_dim": m.r}, name_hint=f"{tag}.attn", meta=mk)[0]
        out = graph.add("einsum", o_lat, w_uv, equation="bthr,hvr->bthv", name_hint=f"{tag}.o", meta=mk)
    else:
        B, S = m.kv.type.shape[0], m.kv.type.shape[1]
        kpe = graph.add("unsqueeze", m.k_pe, dim=2, meta=mk)
        kpe = graph.add("expand", kpe, shape=_dims(TensorType((B, S, m.H, m.rope), kpe.type.dtype)), meta=mk)
        kn = m.k_nope if m.k_nope.type.dtype == kpe.type.dtype else graph.add("cast", m.k_nope, to=kpe.type.dtype)
        k = graph.add("cat", kn, kpe, dim=-1, name_hint=f"{tag}.k", meta=mk)
        q = m.q if m.q.type.dtype == k.type.dtype else graph.add("cast", m.q, to=k.type.dtype, meta=mk)
        out = graph.add_node("mla_attention", [q, k, m.v, *extra], {"absorbed": False, "scale": m.scale},
                             name_hint=f"{tag}.attn", meta=mk)[0]
    if out.type.dtype != m.out.type.dtype:
        out = graph.add("cast", out, to=m.out.type.dtype, meta=mk)
    return out


def lower_mla_layers(graph: Graph, bounds: dict[str, int], *, form: str = "auto", pass_name: str = "absorb_mla",
                     only_sparse: bool = False) -> int:
    """Rewrite every matched MLA attention core of `graph` in place (see the module docstring).

    bounds: the compile bounds {"B", "T", "L"} (`CompileContext.bounds`) the prefill choice is made at.
    form: "auto" (decode absorbed; prefill by FLOPs at `bounds`), "absorbed" or "naive". Returns the number of
    layers rewritten. `only_sparse`: only the DSA layers (used by `place_dsa` when this pass did not run).
    """
    if form not in ("auto", "absorbed", "naive"):
        raise ValueError(f"form must be auto, absorbed or naive, not {form!r}")
    b = bounds
    key_of = {v: k for k, v in graph.params.items()}
    matches = [m for n in graph.nodes if n.op == "softmax" for m in [match_mla(graph, n, key_of)] if m is not None]
    if only_sparse:
        matches = [m for m in matches if m.idx is not None]
    if not matches:
        return 0
    before: dict[int, list[Node]] = {}
    n0 = len(graph.nodes)
    used = set()
    for m in matches:
        T = m.q.type.shape[1]
        decode = isinstance(T, int) and T == 1
        tb = 1 if decode else (T if isinstance(T, int) else evaluate(dim(T), {"T": b["T"]}))
        flops = mla_flops(m, tb, b["L"])
        kv_bytes = naive_kv_bytes(m, b["B"], tb, b["L"])
        too_big = kv_bytes > NAIVE_KV_BUDGET_BYTES
        absorbed = form == "absorbed" or (form == "auto" and (decode or too_big or flops["absorbed"] <= flops["naive"]))
        why = "decode" if decode else "forced" if form != "auto" else \
            "naive K/V over budget" if too_big and flops["absorbed"] > flops["naive"] else "fewer FLOPs"
        meta = {"pass": pass_name, "layer": m.anchor.meta.get("layer"), "source": m.anchor.meta.get("source")}
        out = build_mla(graph, m, absorbed, key_of, meta)
        att = next(n for n in reversed(graph.nodes) if n.op == "mla_attention")
        att.meta["mla_form"] = {"chosen": "absorbed" if absorbed else "naive", "why": why, "T": tb, "L": b["L"],
                                "naive_kv_bytes": kv_bytes, **{f"{k}_flops": v for k, v in flops.items()}}
        for n in graph.nodes[n0:]:
            n.meta.setdefault("pass", pass_name)
            if meta["layer"] is not None:
                n.meta.setdefault("layer", meta["layer"])
        before.setdefault(id(m.anchor), []).extend(graph.nodes[n0:])
        n0 = len(graph.nodes)
        graph.replace_all_uses(m.out, out)
        used.add(key_of[m.w_kv_b])
    reorder(graph, before, set())
    dce_in_place(graph)
    prune_unused_params(graph, sorted(used))
    return len(matches)
