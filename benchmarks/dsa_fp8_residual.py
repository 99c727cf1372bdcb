"""FP8 index keys with a 4-bit low residual (`--dsa-index-keys fp8-rerank`, `fp8_split_ref` in
k3c/ir/ops/model_attn.py): what the residual restores exactly, and how many extra candidates E the exact re-rank
needs (CPU, torch).

1. `exactness`: every finite bf16 value y with |y| < 256 (a row whose largest value is in [128, 256): scale 1, so
   y is the scaled element itself) split into (e4m3, residual) and joined again (`fp8_join_ref`): per class
   (normal, e4m3 rounding carried into the next binade, e4m3 subnormal |y| < 2^-6, zero) the values, how many come
   back exactly and the largest error in ulps of y's bf16 binade; beside it two simpler codes: torch's
   ties-to-even e4m3 cast (the residual's range [-8, 7] then misses the ties rounded down), and the unit always
   ulp(x8) / 16 (a carry's residual then has half the resolution: 1 bf16 ulp off for half of them).
2. `candidates`: on the bench's Gaussian inputs (`dsa_checks.make`'s distributions: q_i, k_i bf16, w / sqrt(J)),
   the rank in the option's fp8 order (e4m3 keys with the power-of-two scale, e4m3 q; `dsa_index_topk_ref`'s
   first stage) of each key of the exact top-k (fp32 scores of the bf16 keys): the worst per row, and the top-k
   overlap with the exact set after the exact re-rank of topk + E candidates for several E (= the share of the
   exact top-k ranked below topk + E: the joined keys are the bf16 keys); the `fp8` option's overlap beside it; and
   `dsa_index_topk_ref` itself (E = the chosen one) on the first row.

Run: PYTHONPATH=$PWD python benchmarks/dsa_fp8_residual.py [--cases 4x131072,2x1048576] [--extra 0,128,...]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.ir.ops.model_attn import (_e4m3_unit, _fp8_query, dsa_index_topk_ref, fp8_join_ref,  # noqa: E402
                                   fp8_quantize_ref, fp8_split_ref)

J, DI, TOPK = 32, 128, 2048


def exactness():
    """Part 1 of the module docstring: {class: {values, exact, max_err_ulps}} for ties upward and ties to even."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    y = bits.float()
    y = y[torch.isfinite(y) & (y.abs() < 256)]
    rows = torch.stack([y, torch.full_like(y, 255.0)], -1)          # amax 255: scale 2^0
    x8, scale, lo = fp8_split_ref({}, rows)
    assert bool((scale == 1).all())
    back = fp8_join_ref(x8, scale, lo)[:, 0]
    x8 = x8[:, 0].float()
    even = rows[:, 0].to(torch.float8_e4m3fn).float()               # torch's cast: ties to even
    r = y - even
    unit = _e4m3_unit(even, (r != 0) & ((r < 0) != (even < 0)))
    back_even = even + torch.round(r / unit).clamp(-8, 7) * unit
    plain = torch.round((y - x8) / _e4m3_unit(x8)).clamp(-8, 7)       # one unit per x8, ulp(x8) / 16
    back_plain = x8 + plain * _e4m3_unit(x8)
    ulp = torch.ldexp(torch.ones_like(y), torch.frexp(y).exponent - 8)   # y's bf16 ulp (8 significant bits)
    carry = (x8.abs() > 0) & (torch.frexp(x8).exponent > torch.frexp(y).exponent) & (y.abs() >= 2 ** -6)
    classes = {"normal (|y| >= 2^-6, no carry)": (y.abs() >= 2 ** -6) & ~carry,
               "e4m3 rounding carried into the next binade": carry,
               "e4m3 subnormal (0 < |y| < 2^-6)": (y.abs() < 2 ** -6) & (y != 0), "zero": y == 0}
    out = {}
    for name, m in classes.items():
        for tie, b in (("the option", back), ("ties to even (torch's cast)", back_even),
                       ("unit ulp(x8) / 16 throughout", back_plain)):
            err = ((b - y).abs() / ulp)[m]
            out[f"{name} | {tie}"] = dict(values=int(m.sum()), exact=int((err == 0).sum()),
                                          max_err_bf16_ulps=float(err.max()) if m.any() else 0.0,
                                          max_abs_err=float((b - y).abs()[m].max()) if m.any() else 0.0)
    return out


def scores(q, w, k):
    """I[s] = sum_j w[j] ReLU(q[j] . k[s]) in f32: q [J, D], w [J], k [L, D]."""
    return torch.einsum("j,js->s", w, torch.einsum("jd,sd->js", q, k).relu())


def candidates(B, L, extras, seed):
    """Part 2 of the module docstring for B rows of L keys: per row the worst fp8 rank of an exact top-k key and the
    overlap per E; the fp8 option's overlap; the reference's overlap at E = max(extras) on row 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(B):
        k_i = torch.randn(L, DI, generator=g).to(torch.bfloat16)
        q_i = torch.randn(J, DI, generator=g).to(torch.bfloat16)
        w = torch.randn(J, generator=g) * J ** -0.5
        exact = scores(q_i.float(), w, k_i.float())
        want = exact.topk(TOPK).indices
        q8, w8 = _fp8_query(q_i, w)
        x8, scale, _ = fp8_split_ref({}, k_i)
        s8 = scores(q8, w8, x8.float()) * scale
        order = torch.sort(s8, descending=True, stable=True).indices
        rank = torch.empty(L, dtype=torch.int64)
        rank[order] = torch.arange(L)
        r = rank[want]
        k8o, kso = fp8_quantize_ref({}, k_i)
        opt = scores(q8, w8, k8o.float()) * kso
        row = dict(worst_rank=int(r.max()), overlap_by_extra={e: float((r < TOPK + e).float().mean()) for e in extras},
                   fp8_option_overlap=len(set(opt.topk(TOPK).indices.tolist()) & set(want.tolist())) / TOPK,
                   fp8_pow2_scale_overlap=float((r < TOPK).float().mean()))
        print(f"B={B} L={L} row {b}: {row}", flush=True)
        out.append(row)
    return out


def reference_row(L, extra, seed):
    """`dsa_index_topk_ref` with k_lo on one row of L keys (T = 1): its overlap with the exact top-k."""
    g = torch.Generator().manual_seed(seed)
    k_i = torch.randn(1, L, DI, generator=g).to(torch.bfloat16)
    q_i = torch.randn(1, 1, J, DI, generator=g).to(torch.bfloat16)
    w = torch.randn(1, 1, J, generator=g) * J ** -0.5
    want = scores(q_i[0, 0].float(), w[0, 0], k_i[0].float()).topk(TOPK).indices
    (idx,) = dsa_index_topk_ref({"topk": TOPK, "rerank": extra}, q_i, w, *fp8_split_ref({}, k_i))
    return len(set(idx[0, 0].tolist()) & set(want.tolist())) / TOPK


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="4x131072,2x1048576")
    ap.add_argument("--extra", default="0,64,128,256,512,1024,2048")
    ap.add_argument("--chosen", type=int, default=512, help="E for the reference's own run")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    res = dict(exactness=exactness())
    for k, v in res["exactness"].items():
        print(f"{k}: {v}", flush=True)
    extras = [int(e) for e in args.extra.split(",")]
    for case in args.cases.split(","):
        B, L = (int(v) for v in case.split("x"))
        rows = candidates(B, L, extras, seed=B + L)
        res[case] = dict(rows=rows, worst_rank=max(r["worst_rank"] for r in rows),
                         overlap_min_by_extra={e: min(r["overlap_by_extra"][e] for r in rows) for e in extras},
                         fp8_option_overlap_min=min(r["fp8_option_overlap"] for r in rows),
                         reference_overlap_at_chosen=reference_row(L, args.chosen, seed=7))
        print(case, {k: v for k, v in res[case].items() if k != "rows"}, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
