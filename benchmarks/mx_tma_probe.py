"""Probe (H200) of the MXFP4 decode kernels' knobs (k3c.codegen.triton.moe_mxfp4_gluon), beyond the mx_configs
`bench_moe_mxfp4.py` sweeps: the word stream (num_stages 1: the next K tile's words prefetched in registers; ≥ 2:
a TMA ring of that many shared-memory stages), how each kernel gets its activations (`ACT_AHEAD` 0: at use, 1:
one tile ahead in registers carried across the loop, 2: one tile ahead, the loop unrolled by two; the launcher
sets it by `gl_act_ahead`), a register cap
per kernel and the K tile. Every variant's output is first compared with the launcher's default.

    python3 benchmarks/mx_tma_probe.py --out DIR [--experts 32,896] [--batches 1,16]
        [--variants "BM,BR,STAGES,ACT_UP,ACT_DOWN,CAP_UP,CAP_DOWN[,BK][,t|,tb];..."] [--workers 16] [--launch-only]
        [--tiled]
A variant ending in ",t" reads the words in the runtime's `mxfp4_tiles` layout, one ending in ",tb" (or every
variant, with --tiled) in `mxfp4_tiles_bits`, as a session of a K3 / K3.1 Pro artifact holds them (the tiles with
each word's bits placed for the decoding; k3c.runtime.layouts).
Writes DIR/mx_tma_probe.json: per (E, N, variant) the max |difference| from the default's output and the time of
up, down and the whole op (permutation, up, down, slot sum; do_bench_cudagraph), with the expert bytes read over
that time as a fraction of the measured 4.2 TB/s. Variants compile in --workers processes first; --launch-only
launches each variant once and times nothing (a profiler's target: run it under ncu with --workers 0). A variant
of another K tile (BK) sums each output over K in another order, so it differs from the default by rounding
(`ref_max_abs`, the default output's largest magnitude, gives the scale); any other variant is bitwise equal.

Raw results: benchmarks/results_mx_tma_probe_run*.json. Run 1 (BENCHMARKS.md "MXFP4 round (mx27)") was measured
with this script's first version, whose own copies of the TMA kernels became the library's; its variant names
map onto --variants as "lib,BM,BR,S" = "BM,BR,S,1,1,0,0" (S 1; S 2 was mx26's cp.async ring, since removed) and
"tma,BM,BR,S[,A[,CAP]]" = "BM,BR,S,A,A,CAP,CAP" (A 0 when left out).
"""

import argparse
import json
import multiprocessing
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton.moe import launch_moe_experts, moe_schedule, moe_sum_kernel  # noqa: E402
from k3c.runtime.layouts import mx_tile_bits, mx_tile_words  # noqa: E402
from k3c.codegen.triton.gl_ring import gl_word_descs  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_gluon import (gl_permute, moe_down_mx_gluon_kernel,  # noqa: E402
                                               moe_up_mx_gluon_kernel)

HBM = 4.2e12
D, I, K = 3584, 3072, 16
ACT = dict(act="situ", situ_beta=4.0, situ_linear_beta=25.0)


class ExpertsOp:
    """The library's Gluon kernels (k3c.codegen.triton.moe_mxfp4_gluon) with every knob explicit, each kernel's
    own: weight rows (16 a warp), num_stages (1: words prefetched in registers; ≥ 2: a TMA ring), activation
    prefetch mode (`gl_act_ahead`), register cap and K tile; block_r, stages and block_k are (up, down) pairs."""

    def __init__(self, w1, w3, w2, s1, s3, s2, block_m, block_r, stages, act_up, act_down, cap_up, cap_down,
                 block_k=(256, 256), tiled=0):
        self.E, self.s = w1.shape[0], (s1, s3, s2)
        self.bm, self.br, self.stages, self.bk, self.tiled = block_m, block_r, stages, block_k, tiled
        relay = {0: lambda w: w, 1: mx_tile_words, 2: mx_tile_bits}[tiled]      # the loader's layouts
        words = [relay(w) for w in (w1, w3, w2)]
        self.w = tuple(gl_word_descs(w, self.br[j], self.bk[j], tiled) if self.stages[j] > 1 else w.view(torch.int32)
                       for w, j in zip(words, (0, 0, 1)))
        self.words = words
        self.up_opts, self.down_opts = (dict(ACT_AHEAD=int(act), num_warps=br // 16,
                                             **({"maxnreg": cap} if cap else {}))
                                        for act, cap, br in ((act_up, cap_up, block_r[0]),
                                                             (act_down, cap_down, block_r[1])))

    def up(self, zp, sched, h):
        moe_up_mx_gluon_kernel[(sched[1].shape[0], I // self.br[0])](
            zp.view(torch.int32), self.w[0], self.w[1], self.s[0], self.s[1], *sched, h,
            ACT["situ_beta"], ACT["situ_linear_beta"], E=self.E, K=K, D=D, I=I, ACT_SITU=True, TWO_MULS=False,
            BLOCK_M=self.bm, BLOCK_R=self.br[0], BLOCK_D=self.bk[0], BLOCK_K2=self.bk[1], STAGES=self.stages[0],
            TILED=self.tiled, **self.up_opts)

    def down(self, h, sched, weights, y_slot):
        moe_down_mx_gluon_kernel[(sched[1].shape[0], D // self.br[1])](
            h.view(torch.int32), self.w[2], self.s[2], weights, *sched, y_slot, E=self.E, D=D, I=I, TWO_MULS=False,
            BLOCK_M=self.bm, BLOCK_R=self.br[1], BLOCK_K2=self.bk[1], STAGES=self.stages[1], TILED=self.tiled,
            **self.down_opts)


#: the fields of a variant, in its text's order (the 8th, the K tile, optional: 256)
FIELDS = ("block_m", "block_r", "stages", "act_up", "act_down", "cap_up", "cap_down", "block_k")
#: the fields that may be 'UP/DOWN', one value per kernel (parsed as (up, down) pairs)
PAIRED = ("block_r", "stages", "block_k")


def parse_variant(spec):
    """'BM,BR,STAGES,ACT_UP,ACT_DOWN,CAP_UP,CAP_DOWN[,BK][,t|,tb]' (ACT 0..2; caps 0: none;
    BK, the K tile, 128 or 256, default 256; BR, STAGES and BK each one value for both kernels or 'UP/DOWN'; t: the
    words in the tiled layout, `mx_tile_words`; tb: tiled with their bits placed, `mx_tile_bits`) -> (spec,
    ExpertsOp keyword arguments, every field given: BR, STAGES and BK as (up, down) pairs; tiled the layout code
    0..2). Raises ValueError naming the text otherwise."""
    fields = spec.split(",")
    tiled = {"t": 1, "tb": 2}.get(fields[-1], 0)
    try:
        f = [tuple(int(x) for x in field.split("/")) for field in fields[:len(fields) - bool(tiled)]]
    except ValueError:
        f = []
    f += [(256,)] * (len(f) == 7)
    kw = dict(zip(FIELDS, f))
    if len(f) != 8 or not all(len(v) == 1 or k in PAIRED and len(v) == 2 for k, v in kw.items()) or \
            not set(kw["act_up"]) <= {0, 1, 2} or not set(kw["act_down"]) <= {0, 1, 2} or \
            not set(kw["block_k"]) <= {128, 256}:
        raise ValueError(f"variant {spec!r}: expected 7 or 8 fields BM,BR,STAGES,ACT_UP,ACT_DOWN,CAP_UP,CAP_DOWN[,BK] "
                         "(integers; BR, STAGES and BK may be UP/DOWN; ACT_UP, ACT_DOWN: 0, 1 or 2; BK: 128 or 256)")
    kw = {**{k: (v * (3 - len(v)) if k in PAIRED else v[0]) for k, v in kw.items()}, "tiled": tiled}
    return spec, kw


def warm_one(job):
    """Compile one variant for E experts (all tiles skipped: one stand-in expert), so timed runs hit the cache."""
    E, spec = job
    _, kw = parse_variant(spec)
    dev = "cuda"
    w1 = torch.zeros(1, I, D // 2, dtype=torch.uint8, device=dev)
    w2 = torch.zeros(1, D, I // 2, dtype=torch.uint8, device=dev)
    s1 = torch.zeros(1, I, D // 32, dtype=torch.uint8, device=dev)
    s2 = torch.zeros(1, D, I // 32, dtype=torch.uint8, device=dev)
    op = ExpertsOp(w1, w1, w2, s1, s1, s2, **kw)
    op.E = E
    sched = (torch.zeros(16, dtype=torch.int64, device=dev), torch.full((1,), E, dtype=torch.int64, device=dev),
             torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev))
    zp = torch.zeros(1, D, dtype=torch.bfloat16, device=dev)
    h = torch.zeros(16, I, dtype=torch.bfloat16, device=dev)
    try:
        op.up(zp, sched, h)
        op.down(h, sched, torch.zeros(1, 16, device=dev), torch.zeros(16, D, device=dev))
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001  (reported again by the timed run)
        print(f"warm {E} {spec}: {type(err).__name__}: {str(err)[:200]}", flush=True)


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e-3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--experts", default="32,896")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--variants", default="8,32,1,1,1,0,0;8,32,2,1,0,0,80;8,32,2,1,1,0,0;8,16,2,1,0,0,0;"
                    "8,32,3,1,0,0,80;16,32,2,0,0,0,0",
                    help="';'-separated 'BM,BR,STAGES,ACT_UP,ACT_DOWN,CAP_UP,CAP_DOWN[,BK]' (ACT 0..2, caps 0: "
                         "none, BK 128 or 256, default 256; BR, STAGES, BK may be UP/DOWN; BM 16: N > 1 only)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--launch-only", action="store_true", help="one launch per variant, nothing timed (for ncu)")
    ap.add_argument("--tiled", action="store_true", help="every variant over the words in mxfp4_tiles_bits")
    a = ap.parse_args()
    specs = a.variants.split(";")
    for spec in specs:
        try:
            parse_variant(spec)
        except ValueError as err:
            ap.error(f"--variants: {err}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Gluon kernels have no interpreter)")
    dev = "cuda"
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    os.makedirs(a.out, exist_ok=True)
    jobs = [(E, v) for E in map(int, a.experts.split(",")) for v in specs]
    if a.workers > 0:          # 0: compile in the timed process (a profiler then sees only the real launches)
        with multiprocessing.get_context("spawn").Pool(min(a.workers, len(jobs))) as pool:
            pool.map(warm_one, jobs)
    for E in map(int, a.experts.split(",")):
        gen = torch.Generator(device=dev).manual_seed(0)
        mats = []
        for R, C in ((I, D), (I, D), (D, I)):
            mats.append((torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, device=dev, generator=gen),
                         torch.randint(119, 123, (E, R, C // 32), dtype=torch.uint8, device=dev, generator=gen)))
        (w1, s1), (w3, s3), (w2, s2) = mats
        per_expert = sum(w.numel() + s.numel() for w, s in ((w1, s1), (w3, s3), (w2, s2))) // E
        for N in map(int, a.batches.split(",")):
            z = (torch.randn(N, D, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
            ids = torch.rand(N, E, device=dev, generator=gen).argsort(-1)[:, :K].contiguous()
            wt = torch.rand(N, K, device=dev, generator=gen)
            touched = int(torch.unique(ids).numel())
            nbytes = touched * per_expert
            y_ref = torch.empty_like(z)
            launch_moe_experts(z, wt, ids, w1, w3, w2, s1, s3, s2, y=y_ref, scale_max=122, **ACT)
            for name, kw in map(parse_variant, specs):
                kw = {**kw, "tiled": kw["tiled"] or 2 * a.tiled}
                if kw["block_m"] > 8 and N == 1:
                    continue
                try:
                    op = ExpertsOp(w1, w3, w2, s1, s3, s2, **kw)
                    sched = moe_schedule(ids, E, kw["block_m"])
                    zp = gl_permute(z, kw["block_k"][0])
                    h = torch.empty(N * K, I, dtype=torch.bfloat16, device=dev)
                    y_slot = torch.empty(N * K, D, dtype=torch.float32, device=dev)
                    y = torch.empty_like(z)

                    def whole():
                        gl_permute(z, op.bk[0], out=zp)
                        op.up(zp, sched, h)
                        op.down(h, sched, wt, y_slot)
                        moe_sum_kernel[(N, triton.cdiv(D, 256))](y_slot, ids, y, K=K, D=D, BLOCK_N=256)
                    whole()
                    torch.cuda.synchronize()
                    if a.launch_only:
                        continue
                    diff = (y.float() - y_ref.float()).abs().max().item()
                    t_up = bench(lambda: op.up(zp, sched, h))
                    t_down = bench(lambda: op.down(h, sched, wt, y_slot))
                    t_all = bench(whole)
                except Exception as err:  # noqa: BLE001  (a variant that fails to compile or run is reported)
                    print(f"E {E} N {N} {name}: failed {type(err).__name__}: {str(err)[:300]}", flush=True)
                    res["rows"].append({"E": E, "N": N, "variant": name, "error": str(err)[:500]})
                    continue
                up_b = touched * (w1[0].numel() + s1[0].numel()) * 2
                row = {"E": E, "N": N, "variant": name, "touched": touched, "max_abs_diff": diff,
                       "ref_max_abs": y_ref.float().abs().max().item(),
                       "up_us": t_up * 1e6, "down_us": t_down * 1e6, "op_us": t_all * 1e6,
                       "kernels_frac": nbytes / (t_up + t_down) / HBM, "up_frac": up_b / t_up / HBM,
                       "down_frac": (nbytes - up_b) / t_down / HBM, "op_frac": nbytes / t_all / HBM}
                res["rows"].append(row)
                print(f"E {E:4d} N {N:3d} {name:18s} diff {diff:.1e} up {t_up * 1e6:7.1f} ({row['up_frac']:.0%}) "
                      f"down {t_down * 1e6:7.1f} ({row['down_frac']:.0%}) kernels {row['kernels_frac']:.0%} "
                      f"op {t_all * 1e6:7.1f} us ({row['op_frac']:.0%})", flush=True)
                with open(os.path.join(a.out, "mx_tma_probe.json"), "w") as f:
                    json.dump(res, f, indent=1)
        del w1, w3, w2, s1, s3, s2, mats
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
