"""The `wgmma` MXFP4 decode kernels (k3c.codegen.triton.moe_mxfp4_wgmma) beside the `mma.sync` ones, at K3.1 Pro's
expert shapes (latent D 3584, inner I 3072, top-16), on one GPU; then, optionally, the end-to-end benchmark twice in
the same call: the checkout's defaults, and a copy whose decode default from 4 rows per expert is another config.

    python3 benchmarks/bench_mx_wgmma.py --out DIR [--experts 32,896] [--batches 1,16]
        [--variants "16,64,256,4,2,0,0,3/3;..."] [--resident] [--launch-only] [--e2e MX_CONFIG] [--e2e-seconds 280]
        [--scratch /tmp]

Kernels: random MXFP4 experts (uniform codes, scale bytes 119..122, as benchmarks/mx_tma_probe.py) in the
runtime's `mxfp4_tiles_bits` layout, as an artifact's session holds them. Variants: 'mma.sync' (the launcher's
default without the `wgmma` kernels: `mx_default_config(..., wgmma=False)`), 'default' (the launcher's own) and
--variants. Per (E, N, variant): the largest |difference| of the output from 'mma.sync''s, and times
(`do_bench_cudagraph`, mean) of the whole op (`launch_moe_experts` with the schedule precomputed) and of its
kernels: for a `wgmma` config the gather of z, the up and the down kernel (`mx_wgmma_launches`; with activation
modes 4/4 both phases are one launch, reported as "up" with down 0 and the whole bytes: the gather and it timed
together, less the gather's own time), for any other up
and down as mx_tma_probe's '8,32,2,2,0,0,80,tb' (the H200's `mma.sync` decode default; a card with its own entry,
`MX_DECODE_BY_DEVICE`, differs at batch 1). Fractions are of 4.2 TB/s (the H200's measured HBM rate; on another
card they only rank variants): the touched experts' bytes over up + down (+ gather). --resident: every (token,
slot) routed to expert 0, so its bytes (17.6 MB) stay in L2 and the times are the decoding's and the MMAs' at
the batch's tile count (16 tokens a tile: N tiles of 16); its fractions mean nothing. --launch-only: nothing
timed or compared; each `wgmma` variant's gather, up and down kernels launched three times, for a profiler
(BENCHMARKS.md "MXFP4 round, run U": `ncu --clock-control base --metrics gpu__time_duration.sum`).

--e2e: benchmarks/bench_e2e.py --experts mxfp4 (decode phases) twice, the checkout as it is, then a copy whose
`mx_default_config` returns MX_CONFIG from 4 rows per expert (benchmarks/mx_round.py's `prepare_copy`, under
--scratch; batch 16 of the benchmark's 32 experts is 8 rows an expert; e.g. the `mma.sync` default
'8,32,256,2,2,0,0/80,2/0' against the checkout's `wgmma` kernels); each writes its expert read rates.
Writes DIR/bench_mx_wgmma.json.
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.testing

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from k3c.codegen.triton.moe import launch_moe_experts, moe_schedule  # noqa: E402
from k3c.codegen.triton.moe_mxfp4 import mx_config_from_text, mx_default_config  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_gluon import gl_permute  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_fused import mx_wgmma_launches  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_wgmma import wg_tile_rows, wgmma_decode_ok  # noqa: E402
from mx_tma_probe import ACT, D, HBM, I, K, ExpertsOp, parse_variant  # noqa: E402

DEFAULT_KERNELS = "8,32,2,2,0,0,80,tb"


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e-3


def case(E, gen, dev="cuda"):
    """The default's `mma.sync` kernels over E random experts drawn as mx_tma_probe draws them (an `ExpertsOp`,
    whose .words are w1, w3, w2 in `mxfp4_tiles_bits`, .s their scale bytes) and the bytes of an expert."""
    mats = [(torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, device=dev, generator=gen),
             torch.randint(119, 123, (E, R, C // 32), dtype=torch.uint8, device=dev, generator=gen))
            for R, C in ((I, D), (I, D), (D, I))]
    per_expert = sum(w.numel() + s.numel() for w, s in mats) // E
    (w1, s1), (w3, s3), (w2, s2) = mats
    return ExpertsOp(w1, w3, w2, s1, s3, s2, **parse_variant(DEFAULT_KERNELS)[1]), per_expert


def kernel_rows(a, res, save):
    dev = "cuda"
    specs = ["mma.sync", "default"] + [v for v in a.variants.split(";") if v]
    for E in map(int, a.experts.split(",")):
        gen = torch.Generator(device=dev).manual_seed(0)
        kop, per_expert = case(E, gen)
        w1, w3, w2 = kop.words
        s1, s3, s2 = kop.s
        for N in map(int, a.batches.split(",")):
            z = (torch.randn(N, D, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
            ids = torch.rand(N, E, device=dev, generator=gen).argsort(-1)[:, :K].contiguous()
            if a.resident:
                ids = torch.zeros_like(ids)
            wt = torch.rand(N, K, device=dev, generator=gen)
            nbytes = int(torch.unique(ids).numel()) * per_expert
            up_bytes = nbytes * 2 // 3
            y_ref = torch.empty_like(z)
            card = torch.cuda.get_device_name()
            launch_moe_experts(z, wt, ids, w1, w3, w2, s1, s3, s2, y=y_ref, scale_max=122, tiled=2,
                               mx_config=mx_default_config(N * K, E, 122, card, wgmma=False), **ACT)
            for spec in specs:
                cfg = {"mma.sync": lambda: mx_default_config(N * K, E, 122, card, wgmma=False),
                       "default": lambda: mx_default_config(N * K, E, 122, card)}.get(
                           spec, lambda: mx_config_from_text(spec))()
                sched = moe_schedule(ids, E, cfg[0])
                tile_rows = wg_tile_rows(N * K, E, cfg[0])          # zs and h of the `wgmma` kernels: tile rows
                h = torch.empty(max(N * K, tile_rows), I, dtype=torch.bfloat16, device=dev)
                y_slot = torch.empty(N * K, D, dtype=torch.float32, device=dev)
                y = torch.empty_like(z)

                def op():
                    launch_moe_experts(z, wt, ids, w1, w3, w2, s1, s3, s2, y=y, mx_config=cfg, schedule=sched,
                                       tiled=2, **ACT)
                row = {"E": E, "N": N, "variant": spec, "mx_config": repr(cfg), "resident": a.resident}
                if a.launch_only:
                    if wgmma_decode_ok(cfg, D, I):
                        zs = torch.empty(tile_rows, D, dtype=torch.bfloat16, device=dev)
                        parts = mx_wgmma_launches(z, zs, sched, w1, w3, w2, (s1, s3, s2), h, y_slot, wt,
                                                  mx_config=cfg, K=K, tiled=2, **ACT)
                        for _ in range(3):
                            for launch in parts:
                                launch()
                        torch.cuda.synchronize()
                        print(f"E {E:4d} N {N:3d} {spec}: launched 3 times", flush=True)
                    continue
                try:
                    op()
                    torch.cuda.synchronize()
                    row["max_abs_diff"] = (y.float() - y_ref.float()).abs().max().item()
                    row["ref_max_abs"] = y_ref.float().abs().max().item()
                    row["op_us"] = bench(op) * 1e6
                    if wgmma_decode_ok(cfg, D, I):
                        zs = torch.empty(tile_rows, D, dtype=torch.bfloat16, device=dev)
                        parts = mx_wgmma_launches(z, zs, sched, w1, w3, w2, (s1, s3, s2), h, y_slot, wt,
                                                  mx_config=cfg, K=K, tiled=2, **ACT)
                        times = [bench(p) for p in parts]
                        if len(parts) == 2:         # one launch for both phases (modes 4/4): its time is "up",
                            gather, both = parts    # timed after the gather that zeroes its counters
                            times = [times[0], bench(lambda: (gather(), both())) - times[0], 0.0]
                    else:
                        ks = moe_schedule(ids, E, kop.bm)
                        zp = gl_permute(z, 256)
                        times = [0.0, bench(lambda: kop.up(zp, ks, h)), bench(lambda: kop.down(h, ks, wt, y_slot))]
                except Exception as err:  # noqa: BLE001  (a variant that fails is reported, the rest still run)
                    row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
                    print(f"E {E} N {N} {spec}: {row['error']}", flush=True)
                    res["kernels"].append(row)
                    save()
                    continue
                one = times[2] == 0.0
                row.update(gather_us=times[0] * 1e6, up_us=times[1] * 1e6, down_us=times[2] * 1e6,
                           up_frac=(nbytes if one else up_bytes) / times[1] / HBM,
                           down_frac=0.0 if one else (nbytes - up_bytes) / times[2] / HBM,
                           kernels_frac=nbytes / sum(times) / HBM, op_frac=nbytes / (row["op_us"] * 1e-6) / HBM)
                res["kernels"].append(row)
                print(f"E {E:4d} N {N:3d} {spec:24s} diff {row['max_abs_diff']:.1e} gather {row['gather_us']:5.1f} "
                      f"up {row['up_us']:7.1f} ({row['up_frac']:.0%}) down {row['down_us']:7.1f} "
                      f"({row['down_frac']:.0%}) kernels {row['kernels_frac']:.1%} op {row['op_us']:7.1f} us "
                      f"({row['op_frac']:.1%})", flush=True)
                save()
        kop = w1 = w3 = w2 = s1 = s3 = s2 = None          # freed before the next E's experts are drawn
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", default="32,896")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--variants", default="16,64,256,4,2,0,0,3/3;8,64,256,4,2,0,0,3/3;16,64,256,4,3,0,0,3/3")
    ap.add_argument("--resident", action="store_true",
                    help="every (token, slot) routed to expert 0: its bytes stay in L2, the times are the decoding's")
    ap.add_argument("--launch-only", action="store_true",
                    help="no timing: each `wgmma` variant's gather, up and down kernels launched 3 times (for ncu)")
    ap.add_argument("--e2e", default=None, metavar="MX_CONFIG", help="the decode default from 4 rows an expert")
    ap.add_argument("--e2e-seconds", type=float, default=280)
    ap.add_argument("--scratch", default="/tmp", help="where --e2e's patched copy of the checkout goes")
    a = ap.parse_args()
    try:
        for v in [v for v in a.variants.split(";") if v] + ([a.e2e] if a.e2e else []):
            mx_config_from_text(v)
    except ValueError as err:
        ap.error(str(err))
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Gluon kernels have no interpreter)")
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "kernels": [], "e2e": {}}

    def save():
        with open(os.path.join(a.out, "bench_mx_wgmma.json"), "w") as f:
            json.dump(res, f, indent=1)
    kernel_rows(a, res, save)
    if a.e2e:
        from mx_round import prepare_copy, run_e2e

        small = mx_default_config(K, 32, 122)
        copy = os.path.join(a.scratch, "k3c_wgmma_default")
        for name, (cwd, env) in (("checkout", (ROOT, dict(os.environ))),
                                 ("wgmma", prepare_copy(copy, small, mx_config_from_text(a.e2e)))):
            os.makedirs(os.path.join(a.out, f"e2e_{name}"), exist_ok=True)
            phase, rates = run_e2e(os.path.join(a.out, f"e2e_{name}"), a.e2e_seconds, cwd, env)
            res["e2e"][name] = {"phase": phase, "expert_read_frac": rates}
            print(f"e2e {name}: {phase} {rates}", flush=True)
            save()


if __name__ == "__main__":
    main()
