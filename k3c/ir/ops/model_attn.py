"""Model-level ops of the global layers and of Attention Residuals: mla_attention, dsa_index_topk, fp8_quantize,
fp8_split, attn_res_inter, attn_res_merge, cache_append.

Formulas: /work/shared/K3-SPEC.md "Gated MLA", "Gated DSA" and "Block Attention Residuals". Positions are
causal with the new tokens last: of S (or L) keys, query t sits at absolute position S − T + t and sees keys
s ≤ S − T + t. Softmaxes run in fp32.
"""

from __future__ import annotations

import sympy
import torch

from k3c.errors import IRError
from k3c.ir.ops.registry import Attr, need_dtype, need_eq, need_rank, op
from k3c.ir.types import TensorType, dim, numel

_F = {"f32", "bf16", "f16"}


def causal_visible(T: int, S: int) -> torch.Tensor:
    """bool [T, S]: key s is visible to query t (s ≤ S − T + t)."""
    return torch.arange(S)[None, :] <= (torch.arange(T) + (S - T))[:, None]


def _index_mask(idx: torch.Tensor, S: int) -> torch.Tensor:
    """bool [B, T, S] from selected positions idx [B, T, k] (−1 = none)."""
    B, T, _ = idx.shape
    m = torch.zeros(B, T, S + 1, dtype=torch.bool)
    m.scatter_(-1, torch.where(idx < 0, torch.full_like(idx, S), idx), True)
    return m[..., :S]


def mla_attention_ref(attrs, q, k_or_kv, v=None, idx=None):
    """Softmax attention of MLA (K3-SPEC.md "Gated MLA"), fp32 inside, q.dtype out.

    absorbed=False: q [B,T,H,D], k [B,S,H,D], v [B,S,H,Dv] -> [B,T,H,Dv]
    absorbed=True:  q [B,T,H,D], kv [B,S,D] (latent | k_pe, shared by all heads) -> [B,T,H,v_dim] using
                    kv[..., :v_dim] as values (MQA over the latent, FlashMLA layout)
    scores = q·k · scale; causal mask if `causal`; restricted to `idx` [B,T,k] (−1 unused) when given (DSA),
    unless the guard `dense_max_keys` is set and S ≤ dense_max_keys: then idx is ignored (dense path; exactly equal
    when idx is the causal top-`dense_max_keys`, which then selects every visible key).
    """
    qf = q.float()
    if attrs["absorbed"]:
        kv = k_or_kv.float()
        scores = torch.einsum("bthd,bsd->bhts", qf, kv)
        vals = kv[..., :attrs["v_dim"]]
    else:
        scores = torch.einsum("bthd,bshd->bhts", qf, k_or_kv.float())
        vals = v.float()
    scores = scores * attrs["scale"]
    T, S = q.shape[1], scores.shape[-1]
    allow = torch.ones(q.shape[0], T, S, dtype=torch.bool)
    if attrs["causal"]:
        allow = allow & causal_visible(T, S)
    guard = attrs.get("dense_max_keys")
    if idx is not None and (guard is None or S > guard):
        allow = allow & _index_mask(idx, S)
    p = torch.softmax(scores.masked_fill(~allow[:, None], float("-inf")), -1)
    if attrs["absorbed"]:
        o = torch.einsum("bhts,bsv->bthv", p, vals)
    else:
        o = torch.einsum("bhts,bshv->bthv", p, vals)
    return [o.to(q.dtype)]


def _keys_per_query(ins):
    """Keys each query attends to: all S, or the top-k of the DSA indexer when `idx` [B,T,topk] is given."""
    S = ins[1].shape[1]
    idx = ins[-1] if len(ins) > 2 and ins[-1].dtype == "i64" else None
    return S if idx is None else sympy.Min(S, idx.shape[2]), idx


def _mla_flops(a, ins, outs):
    q, o = ins[0], outs[0]
    keys, _ = _keys_per_query(ins)
    return numel(q) * keys * 2 + numel(o) * keys * 2


def _mla_bytes(a, ins, outs):
    """q, output and idx, plus the cache rows read: all of k (and v), or with idx at most min(S, T·topk) rows."""
    from k3c.ir.types import itemsize

    keys, idx = _keys_per_query(ins)
    nb = sum(numel(t) * itemsize(t.dtype) for t in (ins[0], outs[0]) + ((idx,) if idx is not None else ()))
    for t in ins[1:len(ins) - (idx is not None)]:
        rows = t.shape[1] if idx is None else sympy.Min(t.shape[1], idx.shape[1] * idx.shape[2])
        nb = nb + sympy.sympify(numel(t)) / t.shape[1] * rows * itemsize(t.dtype)
    return dim(sympy.ceiling(nb))


@op("mla_attention", inputs=["q", "k", "v?", "idx?"],
    attrs={"absorbed": Attr("bool", False), "causal": Attr("bool", True), "scale": Attr("float"),
           "v_dim": Attr("int", None), "dense_max_keys": Attr("int", None)},
    kind="model", ref=lambda a, *t: mla_attention_ref(a, *t) if not a["absorbed"] else mla_attention_ref(
        a, t[0], t[1], None, t[2] if len(t) > 2 else None), flops=_mla_flops, bytes=_mla_bytes)
def _mla_attention(attrs, q, k, v=None, idx=None):
    """mla_attention {absorbed, causal=True, scale, v_dim, dense_max_keys=None}: see `mla_attention_ref`.

    Inputs: unabsorbed (q, k, v[, idx]); absorbed (q, kv[, idx]) with v_dim set. idx: i64 [B,T,topk] from
    `dsa_index_topk`. dense_max_keys (DSA guard, set by place_dsa to topk; needs idx): while the key count
    S ≤ dense_max_keys the dense causal path runs and idx is not read. Output q.dtype.
    """
    n = "mla_attention"
    need_rank(n, q, 4, "q")
    need_dtype(n, q, _F, "q")
    B, T, H, D = q.shape
    if attrs["absorbed"]:
        if attrs["v_dim"] is None:
            raise IRError(f"{n}: absorbed form needs v_dim")
        kv, idx = k, v
        if idx is not None and idx.dtype != "i64":
            raise IRError(f"{n}: absorbed form takes (q, kv[, idx]); got a third input {idx}")
        need_rank(n, kv, 3, "kv")
        need_eq(n, kv.shape[0], B, "kv batch")
        need_eq(n, kv.shape[2], D, "kv width vs q head dim")
        if isinstance(D, int) and attrs["v_dim"] > D:
            raise IRError(f"{n}: v_dim {attrs['v_dim']} > latent width {D}")
        out = TensorType((B, T, H, attrs["v_dim"]), q.dtype)
    else:
        if v is None:
            raise IRError(f"{n}: unabsorbed form takes (q, k, v[, idx])")
        need_rank(n, k, 4, "k")
        need_rank(n, v, 4, "v")
        for i, d in ((0, B), (2, H), (3, D)):
            need_eq(n, k.shape[i], d, f"k dim {i}")
        for i in range(3):
            need_eq(n, v.shape[i], k.shape[i], f"v dim {i} vs k")
        out = TensorType((B, T, H, v.shape[3]), q.dtype)
    if attrs["dense_max_keys"] is not None and (idx is None or attrs["dense_max_keys"] < 1):
        raise IRError(f"{n}: dense_max_keys needs an idx input and must be >= 1")
    if idx is not None:
        need_dtype(n, idx, {"i64"}, "idx")
        need_rank(n, idx, 3, "idx")
        need_eq(n, idx.shape[0], B, "idx batch")
        need_eq(n, idx.shape[1], T, "idx tokens")
    return [out]


# ---- DSA lightning indexer ------------------------------------------------------------------------------------
FP8_MAX = 448.0   # largest float8_e4m3fn value


def fp8_quantize_ref(attrs, x):
    """x [..., D] float -> (x8 f8e4m3 [..., D], scale f32 [...]) with x ~= scale * x8: one scale per row of the last
    dim, scale = max|x| / 448 (1 for an all-zero row), x8 = e4m3(x / scale), rounded to nearest even (torch's cast).
    The per-key scaling of DeepSeek-V3.2's FP8 indexer cache (K3-SPEC.md "Gated DSA"). Both divisions are correctly
    rounded on every device: the divisor is a tensor (torch on CUDA computes `t / 448.0` as t * fp32(1 / 448), up to
    an ulp off, which moves x / scale across e4m3 rounding midpoints: BENCHMARKS.md DSA round 7)."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    return [(xf / scale[..., None]).to(torch.float8_e4m3fn), scale]


def _e4m3_unit(x8, toward_zero=None):
    """The residual unit of e4m3 values x8 (as f32): ulp / 16, 2^(e - 7) for |x8| in [2^e, 2^(e+1)), e >= -6, and
    2^-13 below 2^-6 (the subnormals' ulp 2^-9 / 16); halved where `toward_zero` (bool) and x8 is a power of two of
    at least 2^-5: the values just inside it lie in the binade below, whose ulp is half. Exact (exponent bits)."""
    bits = x8.float().view(torch.int32)
    e = (bits >> 23) & 255
    sh = e.clamp(min=121) - 7
    if toward_zero is not None:
        sh = sh - (((bits & 0x7FFFFF) == 0) & (e >= 122) & toward_zero).to(torch.int32)
    return (sh << 23).view(torch.float32)


def fp8_split_ref(attrs, x):
    """x [..., D] float (D even) -> (x8 f8e4m3 [..., D], scale f32 [...], lo u8 [..., D / 2]): FP8 index keys with a
    4-bit low residual (`--dsa-index-keys fp8-rerank`). scale = 2^(floor(log2 max|x|) - 7) per row (1 for a zero
    row), so max|x| / scale is in [128, 256): a power of two, y = x / scale exact; x8 = e4m3(y) rounded to nearest,
    ties upward (toward +inf: torch's ties-to-even cast, moved one e4m3 step up where y lies half a step above it);
    lo = (y - x8) in units u (`_e4m3_unit`: y's own binade's ulp / 16, also where x8 rounded up to a power of two),
    rounded to nearest even and clamped to [-8, 7], stored + 8 as nibbles (element 2i in the low 4 bits of byte i,
    2i + 1 in the high 4). `fp8_join_ref` inverts it: exactly for every bf16 row element with |y| >= 2^-6; e4m3
    subnormals (|y| < 2^-6) come back within 2^-13 (BENCHMARKS.md "FP8 index keys + 4-bit residual")."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    e = torch.frexp(amax).exponent                                  # amax = m 2^e, m in [0.5, 1)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e - 8), torch.ones_like(amax))
    y = xf / scale[..., None]                                       # exact: a power of two
    x8 = y.to(torch.float8_e4m3fn)
    step = _e4m3_unit(x8, x8.float() < 0) * 16                      # to the next e4m3 value up
    x8 = torch.where(y - x8.float() == step / 2, (x8.float() + step).to(torch.float8_e4m3fn), x8)   # ties upward
    r = y - x8.float()
    unit = _e4m3_unit(x8, (r != 0) & ((r < 0) != (x8.float() < 0)))
    lo = torch.round(r / unit).clamp(-8, 7).to(torch.int32) + 8
    lo = lo[..., 0::2] | (lo[..., 1::2] << 4)
    return [x8, scale, lo.to(torch.uint8)]


def fp8_join_ref(x8, scale, lo):
    """The keys `fp8_split_ref` stored, as f32: scale * (x8 + (nibble - 8) * u), u = `_e4m3_unit` (halved where the
    nibble points from a power of two toward zero)."""
    nib = torch.stack([lo.to(torch.int32) & 15, lo.to(torch.int32) >> 4], -1).flatten(-2) - 8
    unit = _e4m3_unit(x8, (nib != 0) & ((nib < 0) != (x8.float() < 0)))
    return (x8.float() + nib.float() * unit) * scale.float()[..., None]


def _fp8_query(q_i, w):
    """The e4m3 query of the FP8 scan: q rounded to bf16, then e4m3 per head (`fp8_quantize_ref`), its scale folded
    into w (scale > 0, so w_j ReLU(q_j . k) = (w_j s_j) ReLU(q8_j . k)). Returns (q8 as f32, w f32)."""
    q8, sq = fp8_quantize_ref({}, q_i.to(torch.bfloat16))
    return q8.float(), w.float() * sq


def dsa_index_topk_ref(attrs, q_i, w, k_i, k_scale=None, k_lo=None):
    """I[t,s] = Σ_j w[t,j] · ReLU(q_I[t,j] · k_I[s]) (DeepSeek-V3.2 eq. 1; K3-SPEC.md "Gated DSA"), fp32, causal.

    FP8 keys (k_i f8e4m3 with k_scale f32 [B,L], from `fp8_quantize`): I[t,s] = k_scale[s] · Σ_j w'[t,j] ·
    ReLU(q8[t,j] · k8[s]) with the e4m3 query of `_fp8_query` (one e4m3 x e4m3 product, as the kernels' scan).
    FP8 keys with their 4-bit residuals (k_lo u8 [B,L,D/2] from `fp8_split`, attr rerank = E): the topk + E best
    by that FP8 score are candidates, re-ranked by the exact score of their joined keys (`fp8_join_ref`, with q_I
    and w as given, fp32, as bf16 keys are scored); the result is their topk best.
    Returns i64 [B,T,topk]: visible positions by decreasing score, ties to the lowest position (stable sort),
    −1 in the slots beyond the visible count.
    """
    if k_lo is not None:
        (cand,) = dsa_index_topk_ref({"topk": attrs["topk"] + attrs["rerank"]}, q_i, w, k_i, k_scale)
        keys = fp8_join_ref(k_i, k_scale, k_lo)
        exact = torch.einsum("btjd,bsd->btjs", q_i.float(), keys).relu()
        score = torch.einsum("btj,btjs->bts", w.float(), exact)
        ok = cand >= 0
        s = torch.where(ok, torch.gather(score, -1, cand.clamp(min=0)), torch.full(cand.shape, float("-inf")))
        key = torch.where(ok, cand, torch.full_like(cand, score.shape[-1]))   # ties by position, then the empty
        order = torch.sort(key, dim=-1, stable=True).indices                    # slots last
        s, cand, ok = (torch.gather(a, -1, order) for a in (s, cand, ok))
        top = torch.sort(s.masked_fill(~ok, float("-inf")), dim=-1, descending=True, stable=True).indices
        top = top[..., :attrs["topk"]]
        return [torch.where(torch.gather(ok, -1, top), torch.gather(cand, -1, top), torch.full_like(top, -1))]
    topk = attrs["topk"]
    B, T = q_i.shape[:2]
    L = k_i.shape[1]
    q, w = _fp8_query(q_i, w) if k_scale is not None else (q_i.float(), w.float())
    s = torch.einsum("btjd,bsd->btjs", q, k_i.float()).relu()
    score = torch.einsum("btj,btjs->bts", w, s)
    if k_scale is not None:
        score = score * k_scale.float()[:, None, :]
    vis = causal_visible(T, L).expand(B, T, L)
    score = score.masked_fill(~vis, float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :topk]
    ok = torch.gather(vis, -1, order)
    idx = torch.where(ok, order, torch.full_like(order, -1))
    if L < topk:
        idx = torch.cat([idx, torch.full((B, T, topk - L), -1, dtype=torch.int64)], -1)
    return [idx]


@op("dsa_index_topk", inputs=["q_i", "w", "k_i", "k_scale?", "k_lo?"], attrs={"topk": Attr("int"),
                                                                          "rerank": Attr("int", 0)}, kind="model",
    ref=dsa_index_topk_ref,
    flops=lambda a, ins, outs: numel(ins[0]) * ins[2].shape[1] * 2 + numel(ins[1]) * ins[2].shape[1] * 2)
def _dsa_index_topk(attrs, q_i, w, k_i, k_scale=None, k_lo=None):
    """dsa_index_topk(q_I [B,T,J,D], w [B,T,J], k_I [B,L,D][, k_scale f32 [B,L][, k_lo u8 [B,L,D/2]]]) {topk,
    rerank=0} -> idx i64 [B,T,topk] (−1 = invalid).

    Matches `k3::dsa_topk` of models/ops.py. See `dsa_index_topk_ref`. Contract: row (b, t) is a SET — the topk
    best visible positions (exact ties to the lowest position) in its first min(visible, topk) slots, −1 after —
    in an order kernels may choose (its consumer, `mla_attention` with idx, is a softmax over the set); the
    reference returns them by decreasing score. FP8 keys (`--dsa-index-keys fp8`): k_I f8e4m3 with k_scale, and
    only then; `fp8-rerank` adds their 4-bit residuals k_lo and rerank = E >= 1 extra candidates (and only then).
    """
    n = "dsa_index_topk"
    need_rank(n, q_i, 4, "q_i")
    need_rank(n, w, 3, "w")
    need_rank(n, k_i, 3, "k_i")
    B, T, J, D = q_i.shape
    for i, d in enumerate((B, T, J)):
        need_eq(n, w.shape[i], d, f"w dim {i}")
    need_eq(n, k_i.shape[0], B, "k_i batch")
    need_eq(n, k_i.shape[2], D, "k_i width")
    if (k_i.dtype == "f8e4m3") != (k_scale is not None):
        raise IRError(f"{n}: k_scale goes with f8e4m3 keys and only then (k_i {k_i.dtype}, k_scale "
                      f"{'given' if k_scale is not None else 'missing'})")
    if k_scale is not None:
        need_dtype(n, k_scale, {"f32"}, "k_scale")
        need_rank(n, k_scale, 2, "k_scale")
        need_eq(n, k_scale.shape[0], B, "k_scale batch")
        need_eq(n, k_scale.shape[1], k_i.shape[1], "k_scale keys")
    if (k_lo is not None) != (attrs["rerank"] > 0) or (k_lo is not None and k_scale is None) or attrs["rerank"] < 0:
        raise IRError(f"{n}: k_lo goes with f8e4m3 keys and rerank >= 1, and only then (k_lo "
                      f"{'given' if k_lo is not None else 'missing'}, rerank {attrs['rerank']})")
    if k_lo is not None:
        need_dtype(n, k_lo, {"u8"}, "k_lo")
        need_rank(n, k_lo, 3, "k_lo")
        need_eq(n, k_lo.shape[0], B, "k_lo batch")
        need_eq(n, k_lo.shape[1], k_i.shape[1], "k_lo keys")
        need_eq(n, k_lo.shape[2] * 2, D, "k_lo width (two residuals a byte)")
    if attrs["topk"] < 1:
        raise IRError(f"{n}: topk must be >= 1")
    return [TensorType((B, T, attrs["topk"]), "i64")]


@op("fp8_quantize", inputs=["x"], kind="model", ref=fp8_quantize_ref,
    flops=lambda a, ins, outs: numel(ins[0]) * 3,
    bytes=lambda a, ins, outs: dim(numel(ins[0]) * (_isz(ins[0]) + 1) + numel(outs[1]) * 4))
def _fp8_quantize(attrs, x):
    """fp8_quantize(x [..., D] float) -> (x8 f8e4m3 [..., D], scale f32 [...]): see `fp8_quantize_ref` (the DSA
    index keys' append with `--dsa-index-keys fp8`)."""
    need_dtype("fp8_quantize", x, _F, "x")
    if x.rank < 1:
        raise IRError("fp8_quantize: x needs a last (quantized) dim")
    return [x.with_dtype("f8e4m3"), TensorType(tuple(x.shape[:-1]), "f32")]


@op("fp8_split", inputs=["x"], kind="model", ref=fp8_split_ref,
    flops=lambda a, ins, outs: numel(ins[0]) * 8,
    bytes=lambda a, ins, outs: dim(numel(ins[0]) * _isz(ins[0]) + numel(outs[0]) + numel(outs[1]) * 4
                                   + numel(outs[2])))
def _fp8_split(attrs, x):
    """fp8_split(x [..., D] float, D even) -> (x8 f8e4m3 [..., D], scale f32 [...], lo u8 [..., D/2]): see
    `fp8_split_ref` (the DSA index keys' append with `--dsa-index-keys fp8-rerank`)."""
    need_dtype("fp8_split", x, _F, "x")
    if x.rank < 1 or (isinstance(x.shape[-1], int) and x.shape[-1] % 2):
        raise IRError(f"fp8_split: x needs an even last (quantized) dim, got {x}")
    lo = x.with_shape((*x.shape[:-1], dim(x.shape[-1] // 2))).with_dtype("u8")
    return [x.with_dtype("f8e4m3"), TensorType(tuple(x.shape[:-1]), "f32"), lo]


# ---- Block Attention Residuals (two-phase inference form) -------------------------------------------------------
def _res_keys(v, eps):
    """K = V · rsqrt(mean(V², −1) + eps): RMSNorm without weight (K3-SPEC.md "Block Attention Residuals")."""
    vf = v.float()
    return vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)


def attn_res_inter_ref(attrs, queries, *blocks):
    """Phase 1 (AttnRes paper, Algorithm 1): all pseudo-queries of a block over the sealed blocks b_0..b_{n-1}.

    queries [Q,D] (row i = norm.weight ⊙ proj.weight[0] of sublayer i); blocks n × [B,T,D].
    logits[i,n] = K(b_n)·queries[i]; returns (o [Q,B,T,D] f32 = Σ_n softmax_n · b_n, lse [Q,B,T] f32).
    """
    V = torch.stack([b.float() for b in blocks], 0)  # [n,B,T,D]
    logits = torch.einsum("nbtd,qd->qnbt", _res_keys(V, attrs["eps"]), queries.float())
    lse = torch.logsumexp(logits, 1)
    p = torch.exp(logits - lse[:, None])
    return [torch.einsum("qnbt,nbtd->qbtd", p, V), lse]


@op("attn_res_inter", inputs=["queries", "*blocks"], attrs={"eps": Attr("float")}, kind="model",
    ref=attn_res_inter_ref,
    flops=lambda a, ins, outs: numel(ins[1]) * (len(ins) - 1) * (4 + ins[0].shape[0] * 4))
def _attn_res_inter(attrs, queries, *blocks):
    """attn_res_inter(queries [Q,D], b_0 .. b_{n-1} [B,T,D]) {eps} -> (o [Q,B,T,D] f32, lse [Q,B,T] f32)."""
    n = "attn_res_inter"
    if not blocks:
        raise IRError(f"{n}: needs at least one sealed block (a single source needs no AttnRes)")
    need_rank(n, queries, 2, "queries")
    for b in blocks:
        if b != blocks[0]:
            raise IRError(f"{n}: blocks differ: {blocks[0]} vs {b}")
    need_rank(n, blocks[0], 3, "block")
    B, T, D = blocks[0].shape
    need_eq(n, queries.shape[1], D, "query width")
    Q = queries.shape[0]
    return [TensorType((Q, B, T, D), "f32"), TensorType((Q, B, T), "f32")]


def attn_res_merge_ref(attrs, o, lse, partial, queries):
    """Phase 2: online-softmax merge of the inter-block result with the partial sum of the current block.

    l_p = K(partial)·queries[index]; m = logaddexp(lse[index], l_p);
    h = exp(lse − m) · o[index] + exp(l_p − m) · partial   (exactly softmax over [b_0..b_{n-1}, partial]).
    """
    i = attrs["index"]
    lp = torch.einsum("btd,d->bt", _res_keys(partial, attrs["eps"]), queries[i].float())
    m = torch.logaddexp(lse[i].float(), lp)
    h = torch.exp(lse[i] - m)[..., None] * o[i].float() + torch.exp(lp - m)[..., None] * partial.float()
    return [h.to(partial.dtype)]


@op("attn_res_merge", inputs=["o", "lse", "partial", "queries"], attrs={"index": Attr("int"), "eps": Attr("float")},
    kind="model", ref=attn_res_merge_ref, flops=lambda a, ins, outs: numel(ins[2]) * 10)
def _attn_res_merge(attrs, o, lse, partial, queries):
    """attn_res_merge(o [Q,B,T,D] f32, lse [Q,B,T] f32, partial [B,T,D], queries [Q,D]) {index, eps} -> [B,T,D]."""
    n = "attn_res_merge"
    need_rank(n, o, 4, "o")
    need_rank(n, lse, 3, "lse")
    need_rank(n, partial, 3, "partial")
    need_rank(n, queries, 2, "queries")
    need_dtype(n, o, {"f32"}, "o")
    need_dtype(n, lse, {"f32"}, "lse")
    for i in range(3):
        need_eq(n, o.shape[i + 1], partial.shape[i], f"o dim {i + 1} vs partial")
        need_eq(n, lse.shape[i], o.shape[i], f"lse dim {i} vs o")
    need_eq(n, queries.shape[0], o.shape[0], "query count")
    need_eq(n, queries.shape[1], partial.shape[2], "query width")
    Q = o.shape[0]
    if isinstance(Q, int) and not 0 <= attrs["index"] < Q:
        raise IRError(f"{n}: index {attrs['index']} out of range for {Q} queries")
    return [partial]


# ---- persistent caches ------------------------------------------------------------------------------------------
def cache_append_ref(attrs, cache, new):
    """cache' = cat(cache, new) along `dim` (functional here; the runtime appends in place into the persistent pool
    that backs `cache`, so only the new rows are written)."""
    return [torch.cat([cache, new], attrs["dim"])]


@op("cache_append", inputs=["cache", "new"], attrs={"dim": Attr("int", 1)}, kind="model", effects=True,
    ref=cache_append_ref, flops=lambda a, ins, outs: 0,
    bytes=lambda a, ins, outs: dim(numel(ins[1]) * 2 * _isz(ins[1])))
def _cache_append(attrs, cache, new):
    """cache_append(cache [B, L, ...], new [B, n, ...]) {dim=1} -> [B, L+n, ...]: the KV / index-key cache write.

    Bytes count only the appended rows (read + write of `new`): the pool behind the cache is written in place.
    """
    n = "cache_append"
    if cache.rank != new.rank or cache.dtype != new.dtype:
        raise IRError(f"{n}: new {new} does not match cache {cache}")
    d = attrs["dim"] % cache.rank
    for i in range(cache.rank):
        if i != d:
            need_eq(n, new.shape[i], cache.shape[i], f"dim {i}")
    return [cache.with_shape(tuple(dim(cache.shape[i] + new.shape[i]) if i == d else cache.shape[i]
                                   for i in range(cache.rank)))]


def _isz(t: TensorType) -> int:
    from k3c.ir.types import itemsize

    return itemsize(t.dtype)
