"""Benchmark and GPU check of DSA decode at long context (k3c.codegen.triton.dsa_decode), K3.1 shapes: indexer
J = 32 heads x D = 128, top-2048, absorbed latent attention over H = 96 heads x 576 (values: the first 512).

Run on a CUDA machine:
    python benchmarks/bench_dsa.py [--out DIR] [--cases 1x1048576,16x131072,1x131072] [--baseline OLD_dsa_decode.py]
Per case (B x L), before timing: the top-k set against torch's fp32 scores + torch.topk (overlap), the same set in
every selection variant (SELECT_VARIANTS, --select: first-digit histogram, collect block, finishing program), through
the compiled path (`dsa_index.launch_dsa_index_topk` into `out` on planned scratch pre-filled with garbage) and in a
previous dsa_decode.py (--baseline, e.g. `git show <rev>:k3c/codegen/triton/dsa_decode.py`; its ordered output must
equal the current one's), the collect pass's candidate counts, FP8 index keys (e4m3 + one fp32 scale per key, fp8
q; alone, or as fp8-rerank: e4m3 + power-of-two scale + 4-bit residuals, topk + E candidates re-ranked by their
joined keys) against bf16 keys (top-k overlap, attention-output error), every attention variant's output against
a torch gather + softmax (ATTN_VARIANTS, --attention), and the set for a zeroed index-key cache (every score tied: the lowest
positions; also timed, with the baseline's). Then each is timed, the baseline as a set and as the previous compiled path
(ordered + out.copy_). Timing: triton.testing.do_bench_cudagraph median, rotating buffer sets past 3x the 60 MB L2.
Floor = bytes / 4.2 TB/s, bytes = index keys (+ scales, + the re-ranked candidates' bf16 keys) + the 2048 latent
rows read by the attention. The whole decode step as the compiled model launches it (`dsa_checks.compiled_decode`:
`launch_dsa_index_topk` + `launch_mla`, device lengths, planned scratch; bf16 keys, the FP8 option (e4m3 keys +
scale, e4m3 q) and fp8-rerank at each E of --extras) is checked (its set against torch.topk of the same scores, or
for fp8-rerank the option's semantics in torch, and against the bf16 keys' exact set; the attention against torch
on that set) and timed (with the default attention and each --attention variant), floor = index keys (+ scales, +
the re-ranked candidates' keys and residuals) + selected latent rows + q_i, w, q, o; and the FP8 option's top-k overlap is taken apart (`dsa_fp8_overlap.study`: score noise vs the
threshold, per-32-channel scales, a Hadamard rotation, int8). --quick: only the sets, the whole step, the 16-wide fp8
path and the variants (no re-ranking, overlap study or tied-keys timing). Inputs and torch references:
`dsa_checks.py`.
Writes dsa_bench.json / dsa_bench.md under --out after every case; per-kernel times (torch.profiler) as PROFILE
lines and in the json.
"""

import argparse
import json
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton import attention, dsa_index, dsa_rerank, dsa_decode as dd  # noqa: E402
from k3c.codegen.triton.attention import launch_mla  # noqa: E402
from k3c.codegen.triton.dsa_decode import dsa_decode_topk  # noqa: E402
from dsa_checks import (DI, DL, DV, H, SCALE, TOPK, compiled_decode, decode_buffers, decode_bytes,  # noqa: E402
                        dsa_decode, make, overlap, ref_attention, ref_topk, ref_topk_fp8, ref_topk_rerank, rel,
                        tiny_fp8_check)
from dsa_fp8_overlap import outlier_keys, study  # noqa: E402

HBM_BYTES_PER_S = 4.2e12
L2_BYTES = 60e6
DEV = "cuda"


REP_MS = 200      # do_bench_cudagraph's rep, ms (each row replays its graph 10 times); --rep
EXTRAS = (dsa_rerank.RERANK_EXTRA,)   # fp8-rerank's E values checked and timed in the whole step (the default first)
RANKS = {"radix select": 1, "all-pairs rank": 1 << 30}   # fp8-rerank's ranking: dsa_rerank.RANK_SELECT_MIN_ROWS
RANK_DEFAULT = dsa_rerank.RANK_SELECT_MIN_ROWS


def bench(fn, n_sets):
    def run_all():
        for i in range(n_sets):
            fn(i)
    run_all()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(run_all, rep=REP_MS, return_mode="median") / n_sets, "graph"
    except Exception:  # noqa: BLE001  capture not possible: plain launches
        return triton.testing.do_bench(run_all, warmup=10, rep=REP_MS, return_mode="median") / n_sets, "launch"


PROFILE = []     # per-kernel device times (torch.profiler), written with the rows


def profile(label, fn):
    from torch.profiler import ProfilerActivity, profile as prof_ctx
    fn()
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        us = ev.self_cuda_time_total if us is None else us
        if us > 0:
            PROFILE.append(dict(case=label, kernel=ev.key[:80], us=us))
            print(f"PROFILE {label} | {ev.key[:50]} | {us:.1f} us", flush=True)


ATTN_KNOBS = ("SPARSE_DECODE", ("SPARSE_HEAD_BLOCK", "SPARSE_HEAD_BLOCK_BATCHED"), "SPARSE_STAGES",
              "MIN_KEYS_PER_SPLIT", "SPARSE_BLOCK_S", "SPARSE_WARPS", "SPARSE_TARGET_PROGRAMS", "SPARSE_WGMMA",
              "WGMMA_BLOCK_S", "WGMMA_STAGES")
ATTN_DEFAULTS = {k: getattr(attention, k) for knob in ATTN_KNOBS for k in ((knob,) if isinstance(knob, str) else knob)}
ATTN_VARIANTS = {     # name -> attention knobs (ATTN_KNOBS, in order: a head block sets it for every batch; the ones
                      # left out keep their defaults; () = the module's policy); B = 16 x 96 heads at head block 32:
                      # 48 programs per key split, so target 96 / 240 / 264 / 528 / 1056 / 2112 -> 2 / 5 / 6 / 11 / 16 /
                      # 32 splits; head block 64: 32 per split, target 128 -> 4 splits, 264 -> 9
    "sparse (default policy)": (), "triton sparse (round 8 default)": (None,) * 7 + (False,),   # None: the default
    "wgmma bs32 s4": (None,) * 7 + (True, 32, 4),
    "wgmma bs32 s4 mk32": (None,) * 3 + (32, None, None, None, True, 32, 4),
    "wgmma bs64 s2 tp256": (None,) * 6 + (256, True, 64, 2),
    "generic kernel (previous)": (False, 32, 2, 64, 64, 8, 264), "sparse hb32 s2": (True, 32, 2, 64, 64, 8, 264),
    "sparse hb32 s3": (True, 32, 3, 64, 64, 8, 264), "sparse hb32 s1": (True, 32, 1, 64, 64, 8, 264),
    "sparse hb16 s2": (True, 16, 2, 64, 64, 8, 264), "sparse hb64 s2": (True, 64, 2, 64, 64, 8, 264),
    "sparse hb32 s2 mk128": (True, 32, 2, 128, 64, 8, 264), "sparse hb32 s2 bs32": (True, 32, 2, 64, 32, 8, 264),
    "sparse hb64 s2 bs32": (True, 64, 2, 64, 32, 8, 264), "sparse hb64 s2 w16": (True, 64, 2, 64, 64, 16, 264),
    "sparse hb32 s2 tp528": (True, 32, 2, 64, 64, 8, 528), "sparse hb32 s2 tp1056": (True, 32, 2, 64, 64, 8, 1056),
    "sparse hb32 s2 tp2112": (True, 32, 2, 64, 64, 8, 2112), "sparse hb64 s2 tp1056": (True, 64, 2, 64, 64, 8, 1056),
    "sparse hb32 s3 tp1056": (True, 32, 3, 64, 64, 8, 1056), "sparse hb32 s2 mk32": (True, 32, 2, 32, 32, 8, 264),
    "sparse hb32 s2 tp96": (True, 32, 2, 64, 64, 8, 96), "sparse hb32 s2 tp240": (True, 32, 2, 64, 64, 8, 240),
    "sparse hb32 s2 bs128 tp96": (True, 32, 2, 128, 128, 8, 96), "sparse hb64 s2 tp128": (True, 64, 2, 64, 64, 8, 128),
    "sparse hb64 s2 bs32 tp128": (True, 64, 2, 32, 32, 8, 128), "sparse hb64 s2 w16 tp128": (True, 64, 2, 64, 64, 16, 128),
    "sparse hb32 s1 w4 tp264": (True, 32, 1, 64, 64, 4, 264), "sparse hb32 s2 w4 tp264": (True, 32, 2, 64, 64, 4, 264)}
ATTN_VARIANTS = {k: v + (False,) if len(v) == 7 else v for k, v in ATTN_VARIANTS.items()}  # rounds 4-8: the Triton kernel


def set_attention(values):
    for k, v in ATTN_DEFAULTS.items():
        setattr(attention, k, v)
    for knob, v in zip(ATTN_KNOBS, values):
        for k in ((knob,) if isinstance(knob, str) else knob) if v is not None else ():
            setattr(attention, k, v)


SELECT_VARIANTS = {   # name -> dsa_decode attributes (the default first)
    "11-bit first digit in a 256-bin window": {}, "2048-bin first digit": dict(BINS=2048, BASE=0),
    "collect block 2048": dict(SELECT_BLOCK=2048), "finish 4 warps": dict(FINISH_WARPS=4),
    "finish 16 warps": dict(FINISH_WARPS=16), "finish chunk 2048": dict(FINISH_CHUNK=2048),
    "finish chunk 8192": dict(FINISH_CHUNK=8192, FINISH_LONG_KEYS=2 ** 62),
    "finish chunk 8192 16 warps": dict(FINISH_CHUNK=8192, FINISH_WARPS=16, FINISH_LONG_KEYS=2 ** 62),
    "finish 4096 x 8 warps at every L": dict(FINISH_LONG_KEYS=2 ** 62),
    "finish computes its first level (no collect next digit)": dict(COLLECT_NEXT=False),
    "collect next digit by block histograms only": dict(NEXT_DENSE=-1),
    "scan / collect programs 1056 (before round 6)": dict(SCAN_PROGRAMS=1056),
    "scan / collect programs 2112": dict(SCAN_PROGRAMS=2112), "scan 4 stages": dict(SCAN_STAGES=4),
    "finish 32 warps (long rows)": dict(FINISH_WARPS_LONG=32), "scan / collect programs 396": dict(SCAN_PROGRAMS=396),
    "collect block 2048, programs 396": dict(SELECT_BLOCK=2048, SCAN_PROGRAMS=396),
    "no refine (round 7 finish)": dict(REFINE=False),
    "refine with finish 2048 x 8 warps": dict(FINISH_CHUNK_REFINED=2048, FINISH_WARPS_REFINED=8)}
SELECT_KNOBS = ("BINS", "BASE", "SELECT_BLOCK", "FINISH_WARPS", "FINISH_CHUNK", "FINISH_LONG_KEYS", "SCAN_BLOCK",
                "SCAN_WARPS", "COLLECT_NEXT", "NEXT_DENSE", "SCAN_PROGRAMS", "SCAN_STAGES", "FINISH_WARPS_LONG",
                "REFINE", "REFINE_BLOCK", "REFINE_PROGRAMS", "FINISH_CHUNK_REFINED", "FINISH_WARPS_REFINED")


def load_baseline(path):
    """A previous `dsa_decode.py` (e.g. `git show <rev>:k3c/codegen/triton/dsa_decode.py`) as a module, timed in
    the same run as the current one."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("dsa_decode_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def candidate_stats(x):
    """(keys the collect pass selects, candidates in the threshold bin): min and max over the rows."""
    B, L = x["k_i"].shape[:2]
    buf = torch.empty(dd.radix_scratch_words(B, L), dtype=torch.int32, device=DEV)
    dd.radix_topk(x["q_i"], x["w"], x["k_i"], TOPK, None, False, scratch=buf)
    hist = buf[2 * B * L:].view(B, dd.HIST_STRIDE)
    above, cand = hist[:, -2], hist[:, -1]
    fine = hist[:, dd.BINS + 256:dd.BINS + 258]             # the refine pass's: keys taken, short list
    return dict(above_min=int(above.min()), above_max=int(above.max()), cand_min=int(cand.min()),
                cand_max=int(cand.max()), refine_taken_max=int(fine[:, 0].max()), refine_list_min=int(fine[:, 1].min()),
                refine_list_max=int(fine[:, 1].max()))


def run_case(B, L, rows, checks, attn_variants, select_variants, baseline, quick):
    x = make(B, L, seed=B + L, dev=DEV)
    defaults = ({k: getattr(dd, k) for k in SELECT_KNOBS}, ())

    def restore():
        for k, v in defaults[0].items():
            setattr(dd, k, v)
        set_attention(defaults[1])

    def select(name):
        restore()
        for k, v in SELECT_VARIANTS[name].items():
            setattr(dd, k, v)

    idx = dsa_decode_topk(x["q_i"], x["w"], x["k_i"], TOPK)
    want = ref_topk(x, x["k_i"].float())
    o = dsa_decode(x["q_i"], x["w"], x["k_i"], x["q"], x["kv"])
    o_ref = ref_attention(x, want)
    c = dict(case=f"B={B} L={L}", topk_overlap_bf16_vs_fp32_torch=overlap(idx, want),
             attn_rel_bf16_vs_torch=rel(o, o_ref),
             valid=bool(((idx >= 0).sum(-1) == TOPK).all()) and bool((idx.max() < L).item()))

    def check(name, fn):
        try:
            c[name] = fn()
        except Exception as e:  # noqa: BLE001  keep the other checks
            c[name] = f"failed: {e!r}"[:300]

    check("candidates (collect pass)", lambda: candidate_stats(x))
    idx8 = dsa_decode_topk(x["q_i"], x["w"], x["k8"], TOPK, k_scale=x["ks"])
    for name in select_variants:
        select(name)
        check(f"same set [{name}]", lambda: overlap(dsa_decode_topk(x["q_i"], x["w"], x["k_i"], TOPK), idx) == 1.0)
        check(f"same fp8 set [{name}]", lambda: overlap(dsa_decode_topk(x["q_i"], x["w"], x["k8"], TOPK,
                                                                        k_scale=x["ks"]), idx8) == 1.0)
    restore()
    check("ordered == ordered baseline" if baseline else "ordered: valid", lambda: bool(torch.equal(
        dsa_decode_topk(x["q_i"], x["w"], x["k_i"], TOPK, ordered=True),
        baseline.dsa_decode_topk(x["q_i"], x["w"], x["k_i"], TOPK, ordered=True) if baseline else
        dsa_decode_topk(x["q_i"], x["w"], x["k_i"], TOPK, ordered=True))))
    if baseline:
        check("same set as baseline", lambda: overlap(baseline.dsa_decode_topk(x["q_i"], x["w"], x["k_i"], TOPK),
                                                      idx) == 1.0)

    def compiled_path(s, out):
        dsa_index.launch_dsa_index_topk(s["q_i"][:, None], s["w"][:, None], s["k_i"], out, topk=TOPK,
                                        scratch={"keys": s["scratch"]})

    def compiled_check():
        out = torch.empty(B, 1, TOPK, dtype=torch.int64, device=DEV)
        x["scratch"] = torch.full((B * (L + dsa_index.RADIX_ROW_PAD),), -7, dtype=torch.int64, device=DEV)
        compiled_path(x, out)
        return overlap(out, idx) == 1.0

    check("compiled path (launch_dsa_index_topk, planned scratch) same set", compiled_check)
    zeroed = dict(q_i=x["q_i"], w=x["w"], k_i=torch.zeros_like(x["k_i"]))    # every score 0: all tied
    lowest = [set(range(TOPK))] * B

    def zeroed_sets(mod):
        got = mod.dsa_decode_topk(zeroed["q_i"], zeroed["w"], zeroed["k_i"], TOPK)
        return [set(r.tolist()) for r in got.reshape(B, -1)] == lowest

    check("zeroed index keys (all scores tied): the lowest positions", lambda: zeroed_sets(dd))
    if baseline:
        check("zeroed index keys: baseline the lowest positions", lambda: zeroed_sets(baseline))

    check("overlap fp8 keys (no rerank) vs bf16",
          lambda: overlap(dsa_decode_topk(x["q_i"], x["w"], x["k8"], TOPK, k_scale=x["ks"]), idx))
    if not quick:
        check("overlap fp8-rerank (dsa_decode_topk) vs fp32 torch", lambda: overlap(dsa_decode_topk(
            x["q_i"], x["w"], x["k8r"], TOPK, k_scale=x["ksr"], k_lo=x["lor"]), want))
        check("attn rel fp8-rerank vs bf16", lambda: rel(dsa_decode(
            x["q_i"], x["w"], x["k8r"], x["q"], x["kv"], k_scale=x["ksr"], k_lo=x["lor"]), o))

    def attn_rel():
        oo = torch.empty(B, 1, H, DV, dtype=torch.bfloat16, device=DEV)
        launch_mla(x["q"], x["kv"], None, want[:, None], oo, absorbed=True, causal=True, scale=SCALE, v_dim=DV,
                   dense_max_keys=None)
        return rel(oo, o_ref)

    for name in attn_variants:
        set_attention(ATTN_VARIANTS[name])
        check(f"attn rel [{name}] vs torch", attn_rel)
    restore()
    lengths = torch.full((B,), L - 1, dtype=torch.int32, device=DEV)     # device lengths: L keys per row
    want8 = ref_topk_fp8(x)

    same = dict(bf16=want, fp8=want8)

    def whole_check(keys, mod=None, extra=EXTRAS[0]):
        bufs = decode_buffers(B, L, DEV, extra)
        bufs["keys"].fill_(-7)                                              # garbage-filled planned scratch
        bufs["rerank"].fill_(-7)
        o_w = compiled_decode(x, keys, bufs, lengths, mod, extra).clone()
        got = bufs["idx"].clone()
        ref = same[keys] if keys in same else ref_topk_rerank(x, extra)
        r = dict(overlap_vs_torch_topk_same_scores=overlap(got, ref),
                 attn_rel_vs_torch_on_its_set=rel(o_w, ref_attention(x, got[:, 0])))
        if keys != "bf16":
            r.update(overlap_vs_bf16_exact_set=overlap(got, want), out_rel_vs_bf16_keys_decode=rel(o_w, o))
        return r

    for keys in ("bf16", "fp8"):
        check(f"whole decode, compiled kernels, {keys} keys", lambda: whole_check(keys))
        if baseline:
            check(f"whole decode, baseline kernels, {keys} keys", lambda: whole_check(keys, baseline))
    for e in EXTRAS:
        for rank, min_rows in RANKS.items():
            dsa_rerank.RANK_SELECT_MIN_ROWS = min_rows
            check(f"whole decode, compiled kernels, fp8-rerank keys E={e} [{rank}]",
                  lambda: whole_check("fp8-rerank", extra=e))
    dsa_rerank.RANK_SELECT_MIN_ROWS = RANK_DEFAULT
    for name in attn_variants:
        set_attention(ATTN_VARIANTS[name])
        check(f"whole decode, compiled kernels, fp8 keys [{name}]", lambda: whole_check("fp8"))
    restore()
    check("fp8 keys at D = 16 (FP8_RADIX_MIN_D: the score kernel), compiled path vs dsa_index_topk_ref",
          lambda: tiny_fp8_check(B, DEV))
    if not quick:
        check("fp8 overlap study, Gaussian keys (dsa_fp8_overlap.study)",
              lambda: study(x["q_i"], x["w"], x["k_i"], TOPK))
        check("fp8 overlap study, keys with 4 outlier channels x16",
              lambda: study(x["q_i"], x["w"], outlier_keys(x["k_i"]), TOPK))
    checks.append(c)
    print("CHECK", c, flush=True)

    idx_bytes = B * L * DI * 2
    idx8_bytes = B * L * (DI + 4)
    rerank_bytes = B * (TOPK + dsa_rerank.RERANK_EXTRA) * (DI * 3 // 2 + 4)
    attn_bytes = B * TOPK * DL * 2
    per_set = idx_bytes + idx8_bytes + B * L * (DI * 3 // 2 + 4) + B * L * DL * 2
    n_sets = max(1, math.ceil(3 * L2_BYTES / per_set))
    sets = [x] + [make(B, L, seed=100 + i, dev=DEV) for i in range(n_sets - 1)]
    for s in sets:
        s["scratch"] = torch.empty((B * (L + dsa_index.RADIX_ROW_PAD),), dtype=torch.int64, device=DEV)
    outs = [torch.empty(B, 1, TOPK, dtype=torch.int64, device=DEV) for _ in sets]

    def add(name, ms, how, nbytes):
        floor_ms = nbytes / HBM_BYTES_PER_S * 1e3
        rows.append(dict(B=B, L=L, impl=name, ms=ms, how=how, floor_ms=floor_ms, frac_floor=floor_ms / ms))
        print("ROW", rows[-1], flush=True)

    def timed(name, fn, nbytes, n=None):
        try:
            ms, how = bench(fn, n or n_sets)
            add(name, ms, how, nbytes)
        except Exception as e:  # noqa: BLE001
            print(f"# {name} failed: {e!r}", flush=True)

    def topk_bf16(i):
        s = sets[i]
        return dsa_decode_topk(s["q_i"], s["w"], s["k_i"], TOPK)

    def topk_fp8(i):
        s = sets[i]
        return dsa_decode_topk(s["q_i"], s["w"], s["k8"], TOPK, k_scale=s["ks"])

    def topk_fp8_rerank(i):
        s = sets[i]
        return dsa_decode_topk(s["q_i"], s["w"], s["k8r"], TOPK, k_scale=s["ksr"], k_lo=s["lor"])

    def full_bf16(i):
        s = sets[i]
        return dsa_decode(s["q_i"], s["w"], s["k_i"], s["q"], s["kv"])

    def full_fp8_rerank(i):
        s = sets[i]
        return dsa_decode(s["q_i"], s["w"], s["k8r"], s["q"], s["kv"], k_scale=s["ksr"], k_lo=s["lor"])

    out_attn = [torch.empty(B, 1, H, DV, dtype=torch.bfloat16, device=DEV) for _ in sets]
    idx_all = [topk_bf16(i) for i in range(n_sets)]

    def attn_only(i):
        s = sets[i]
        launch_mla(s["q"], s["kv"], None, idx_all[i], out_attn[i], absorbed=True, causal=True, scale=SCALE,
                   v_dim=DV, dense_max_keys=None)

    for name in select_variants:
        select(name)
        timed(f"k3c index scan + radix top-k, bf16 keys [{name}]", topk_bf16, idx_bytes)
        timed(f"k3c index scan + radix top-k, fp8 keys [{name}]", topk_fp8, idx8_bytes)
    restore()
    if not quick:
        timed("k3c compiled path: launch_dsa_index_topk into out, planned scratch, bf16 keys",
              lambda i: compiled_path(sets[i], outs[i]), idx_bytes)
        timed("k3c top-k set, zeroed index keys (all scores tied)",
              lambda i: dsa_decode_topk(zeroed["q_i"], zeroed["w"], zeroed["k_i"], TOPK), idx_bytes, n=1)
    if baseline and not quick:
        timed("baseline top-k set, zeroed index keys (all scores tied)",
              lambda i: baseline.dsa_decode_topk(zeroed["q_i"], zeroed["w"], zeroed["k_i"], TOPK), idx_bytes, n=1)
    if baseline:
        timed("baseline index scan + radix top-k, bf16 keys (set)",
              lambda i: baseline.dsa_decode_topk(sets[i]["q_i"], sets[i]["w"], sets[i]["k_i"], TOPK), idx_bytes)
        timed("baseline compiled path: ordered + out.copy_, bf16 keys",
              lambda i: outs[i].copy_(baseline.dsa_decode_topk(sets[i]["q_i"], sets[i]["w"], sets[i]["k_i"], TOPK,
                                                               ordered=True)), idx_bytes)
    timed("k3c index scan + radix top-k, fp8 keys [fp8 q], no rerank", topk_fp8, idx8_bytes)
    if not quick:
        timed("k3c index scan + radix top-k, fp8-rerank keys", topk_fp8_rerank, idx8_bytes + rerank_bytes)
    for name in attn_variants:
        set_attention(ATTN_VARIANTS[name])
        timed(f"k3c sparse latent attention (2048 rows) [{name}]", attn_only, attn_bytes)
    restore()
    wbufs = {e: [decode_buffers(B, L, DEV, e) for _ in sets] for e in EXTRAS}
    forms = [("bf16", "bf16 keys", EXTRAS[0], RANK_DEFAULT), ("fp8", "fp8 keys (e4m3 q)", EXTRAS[0], RANK_DEFAULT)]
    forms += [("fp8-rerank", f"fp8-rerank keys (E = {e}, {rank})", e, min_rows) for e in EXTRAS
              for rank, min_rows in RANKS.items()]
    for keys, label, e, min_rows in forms:
        dsa_rerank.RANK_SELECT_MIN_ROWS = min_rows
        nbytes = decode_bytes(B, L, keys, e)
        timed(f"k3c whole DSA decode, compiled kernels, {label}",
              lambda i: compiled_decode(sets[i], keys, wbufs[e][i], lengths, extra=e), nbytes)
        if baseline and keys != "fp8-rerank":
            timed(f"baseline whole DSA decode, compiled kernels, {label}",
                  lambda i: compiled_decode(sets[i], keys, wbufs[e][i], lengths, baseline), nbytes)
        profile(f"B={B} L={L} whole decode {label}", lambda: compiled_decode(x, keys, wbufs[e][0], lengths, extra=e))
    dsa_rerank.RANK_SELECT_MIN_ROWS = RANK_DEFAULT
    for name in attn_variants:
        set_attention(ATTN_VARIANTS[name])
        timed(f"k3c whole DSA decode, compiled kernels, fp8 keys (e4m3 q) [{name}]",
              lambda i: compiled_decode(sets[i], "fp8", wbufs[EXTRAS[0]][i], lengths), decode_bytes(B, L, "fp8"))
    restore()
    if quick:
        return
    for name, fn, nbytes in (("k3c DSA decode: top-k + attention, bf16 keys", full_bf16, idx_bytes + attn_bytes),
                             ("k3c DSA decode: top-k + attention, fp8-rerank keys", full_fp8_rerank,
                              idx8_bytes + rerank_bytes + attn_bytes)):
        timed(name, fn, nbytes)
    profile(f"B={B} L={L} bf16", lambda: full_bf16(0))
    profile(f"B={B} L={L} fp8-rerank", lambda: full_fp8_rerank(0))
    if baseline:
        profile(f"B={B} L={L} baseline compiled path", lambda: outs[0].copy_(baseline.dsa_decode_topk(
            x["q_i"], x["w"], x["k_i"], TOPK, ordered=True)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--cases", default="1x1048576,16x131072,1x131072")
    ap.add_argument("--attention", default="sparse (default policy),sparse hb32 s2,sparse hb64 s2 tp128",
                    help="attention variants to time (ATTN_VARIANTS; all: --attention all)")
    ap.add_argument("--select", default=",".join(SELECT_VARIANTS),
                    help="selection variants to check and time (SELECT_VARIANTS), the default first")
    ap.add_argument("--baseline", default="", help="a previous dsa_decode.py to time in the same run")
    ap.add_argument("--rep", type=int, default=200, help="ms per timing replay (do_bench_cudagraph's rep)")
    ap.add_argument("--quick", action="store_true", help="the sets, the whole step and the variants only")
    ap.add_argument("--extras", default=str(dsa_rerank.RERANK_EXTRA), help="fp8-rerank's E values (whole step)")
    args = ap.parse_args()
    global REP_MS, EXTRAS
    REP_MS = args.rep
    EXTRAS = tuple(int(e) for e in args.extras.split(","))
    attn_variants = list(ATTN_VARIANTS) if args.attention == "all" else [v for v in args.attention.split(",") if v]
    select_variants = [v for v in args.select.split(",") if v]
    unknown = [v for v in attn_variants if v not in ATTN_VARIANTS] + [v for v in select_variants
                                                                     if v not in SELECT_VARIANTS]
    if unknown:                     # before any GPU work (variant names are comma-separated: none holds a comma)
        ap.error(f"unknown variants {unknown}")
    baseline = load_baseline(args.baseline) if args.baseline else None
    rows, checks = [], []
    for case in args.cases.split(","):
        B, L = (int(v) for v in case.split("x"))
        try:
            run_case(B, L, rows, checks, attn_variants, select_variants, baseline, args.quick)
        except Exception as e:  # noqa: BLE001  keep the other cases
            import traceback
            traceback.print_exc()
            print(f"# case {case} failed: {e!r}", flush=True)
        torch.cuda.empty_cache()
        write(args.out, rows, checks)      # after every case: a run cut short keeps what it measured


def write(out, rows, checks):
    lines = ["| B | L | implementation | time (us) | floor (us) | % of floor | timing |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['B']} | {r['L']} | {r['impl']} | {r['ms'] * 1e3:.1f} | {r['floor_ms'] * 1e3:.1f} | "
              f"{100 * r['frac_floor']:.1f} | {r['how']} |" for r in rows]
    for c in checks:
        lines += ["", f"Checks {c['case']}:"] + [f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}"
                                                for k, v in c.items() if k != "case"]
    text = "\n".join(lines)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "dsa_bench.md"), "w") as fh:
            fh.write(text + "\n")
        with open(os.path.join(out, "dsa_bench.json"), "w") as fh:
            json.dump(dict(rows=rows, checks=checks, profile=PROFILE, device=torch.cuda.get_device_name(),
                           torch=torch.__version__, triton=triton.__version__), fh, indent=1)


if __name__ == "__main__":
    main()
