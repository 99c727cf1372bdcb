"""Benchmark and GPU check of the `moe_experts` kernels (k3c.codegen.triton.moe): MXFP4 experts (packed E2M1 +
E8M0 scales, decoded in registers) side by side with bf16 experts, at K3.1 Pro's expert shapes (latent
D = 3584, expert inner I = 3072, top-16), bf16 activations.

Run on a CUDA machine:
    python benchmarks/bench_moe_mxfp4.py [--experts 32,896] [--out DIR] [--quick] [--no-prefill] [--no-bf16] [--gluon]
        [--tiled]
Rows: decode at batch 1 and 16 (a few rows per expert: the kernels stream the weights) and, for the first E,
prefill at 16 × 2048 tokens (grouped GEMM). Decode reports the expert-weight bytes the step must read (every
touched expert's w1, w3, w2, scales included) over the time of the two GEMM kernels plus the slot sum ("kernels":
schedule precomputed) and of the whole op ("op": schedule and the activations' K permutation included), as GB/s
and as a fraction of the measured 4.2 TB/s HBM rate (KINDS.md); prefill reports 6·N·k·D·I FLOP over the op's time
as TFLOP/s (vs 790 bf16). Timing: triton.testing.do_bench_cudagraph (mean of CUDA-graph replays), falling back to
do_bench. Formats: "bf16" (the dense kernels on the dequantized weights), "mxfp4" (the Triton kernels
`moe_up_mx_kernel` / `moe_down_mx_kernel`, `gluon=False`: a sweep of `mx_config`, the launcher's default for the
weights' largest scale byte first) and, with --gluon at decode, "mxfp4-gluon" (the Gluon decode kernels a compiled
artifact runs for the decode default, `GLUON_SWEEP`; compared bitwise with the Triton default's output) and, with
--tiled, "mxfp4-tiled": the launcher's default (Gluon at decode, Triton at prefill) over the words re-laid as an
artifact's session holds them (the runtime's `mxfp4_tiles_bits`, k3c.runtime.layouts; `tiled=2`). Each MXFP4
row's output is compared with the bf16 kernels fed the dequantized weights (max relative difference) and, at a
small shape, with `moe_experts_ref` (the default and an `mma.sync` configuration), while the MXFP4 variants compile
in --compile-workers processes. Results:
OUT/moe_mxfp4_bench.json, rewritten after every row (a run cut short keeps what it measured).
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
from k3c.codegen.triton.moe import launch_moe_experts, moe_schedule  # noqa: E402
from k3c.codegen.triton.moe_mxfp4 import mx_config_from_text, mx_default_config  # noqa: E402
from k3c.ir.formats import mxfp4_dequantize  # noqa: E402
from k3c.ir.ops.model_moe import moe_experts_ref  # noqa: E402
from k3c.runtime.layouts import mx_tile_bits  # noqa: E402

HBM_BYTES_PER_S = 4.2e12       # measured device copy bandwidth (KINDS.md)
BF16_FLOP_PER_S = 790e12
D, I, K = 3584, 3072, 16       # K3.1 Pro: routed_expert_hidden_size, moe_intermediate_size, experts per token
ACT = dict(act="situ", situ_beta=4.0, situ_linear_beta=25.0)
SCALES = (119, 122)            # E8M0 bytes of the random weights: 2^-8 .. 2^-5; the largest is the node's scale_max


def mx_weights(E, R, C, dev, gen):
    """Random MXFP4 weights [E, R, C]: uniform codes, scales 2^-8 .. 2^-5 (K3-like magnitudes, `SCALES`)."""
    packed = torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, device=dev, generator=gen)
    scale = torch.randint(SCALES[0], SCALES[1] + 1, (E, R, C // 32), dtype=torch.uint8, device=dev, generator=gen)
    return packed, scale


def routing(N, E, dev, gen):
    """ids [N, K]: K distinct experts per token (uniform), weights f32 [N, K]."""
    ids = torch.rand(N, E, device=dev, generator=gen).argsort(-1)[:, :K].contiguous()
    return ids, torch.rand(N, K, device=dev, generator=gen)


def bench(fn):
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e-3, "graph"
    except Exception:  # noqa: BLE001  (capture can fail; plain timing then)
        return triton.testing.do_bench(fn, rep=100) * 1e-3, "eager"


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def check_small(dev):
    """MXFP4 kernels vs the IR reference at a small shape (N = 9, E = 6, D = 256, I = 192): fp32 (portable
    decoding) and bf16 (PTX word decoding), with the launcher's default (`wgmma` K order at decode) and an
    `mma.sync` configuration. Returns {case: max rel error}."""
    gen = torch.Generator(device=dev).manual_seed(1)
    N, E, d, i = 9, 6, 256, 192
    w1, s1 = mx_weights(E, i, d, dev, gen)
    w3, s3 = mx_weights(E, i, d, dev, gen)
    w2, s2 = mx_weights(E, d, i, dev, gen)
    z = torch.randn(N, d, device=dev, generator=gen)
    ids = torch.rand(N, E, device=dev, generator=gen).argsort(-1)[:, :4].contiguous()
    wt = torch.rand(N, 4, device=dev, generator=gen)
    out = {}
    f32, bf16 = ("f32", torch.float32), ("bf16", torch.bfloat16)
    for cname, cfg, dts in (("default", None, (f32, bf16)), ("mma_v2", (8, 64, 256, 2, 3, False, None), (f32, bf16)),
                            ("rows32", (8, 32, 256, 2, 2, False, None), (bf16,))):
        for name, dt in dts:
            zz = z.to(dt)
            y = torch.full_like(zz, float("nan"))
            launch_moe_experts(zz, wt, ids, w1, w3, w2, s1, s3, s2, y=y, mx_config=cfg, **ACT)
            ref = moe_experts_ref({**ACT, "weight_format": "mxfp4"},
                                  *(t.cpu() for t in (zz.float(), wt, ids, w1, w3, w2, s1, s3, s2)))
            out[f"{cname}_{name}"] = rel(y.cpu(), ref[0])
    return out


def dequantized(w, s, chunk=32):
    """bf16 [E, R, C] of MXFP4 weights, a few experts at a time (the fp32 intermediate of all E can be large)."""
    return torch.cat([mxfp4_dequantize(w[e:e + chunk], s[e:e + chunk]).to(torch.bfloat16)
                      for e in range(0, w.shape[0], chunk)])


# mx_config sweeps (BLOCK_M, BLOCK_R, largest BLOCK_K, num_warps, num_stages, two_muls, maxnreg); None: the
# launcher's default (k3c.codegen.triton.moe_mxfp4.mx_default_config) for the weights' largest scale byte, as a
# compiled artifact of this checkpoint runs it; 1 or 2 warps: `mma.sync` (mx_mma_v2), 4 or 8: `wgmma`
MX_SWEEP = {"decode": [None, (8, 64, 256, 2, 2, False, None), (8, 32, 256, 2, 2, False, 80),
                       (8, 32, 256, 2, 3, False, None)],
            "prefill": [None, (128, 128, 128, 8, 3, False, None), (64, 128, 128, 4, 3, False, None)],
            # decode at 16+ rows per expert (batch 64 of 32 experts: the prefill tiles are 3/4 empty there)
            "decode_mid": [None, (16, 64, 256, 4, 3, True, None), (32, 64, 256, 4, 3, True, None),
                           (64, 64, 256, 4, 3, True, None), (64, 128, 128, 4, 3, True, None),
                           (64, 128, 128, 8, 3, True, None)]}


def resolved_sweep(phase, rows, E, scale_max, quick):
    """The distinct MXFP4 configurations of one case: the launcher's default for `scale_max` first (None), then
    the sweep's explicit ones that differ from it."""
    mid = phase == "decode" and rows >= 16 * E
    sweep = MX_SWEEP["decode_mid" if mid else phase][:1 if quick else None]
    default = mx_default_config(rows, E, scale_max)
    return [c for c in sweep if c is None or tuple(c) != default]


# Gluon decode kernels (k3c.codegen.triton.moe_mxfp4_gluon, next K tile prefetched in registers): None = the
# launcher's default configuration; with --gluon each runs beside the Triton kernels (gluon=False) of the sweep
GLUON_SWEEP = [None, (8, 32, 256, 2, 1, False, None)]


def warm_one(job):
    """Compile (by one launch on stand-in weights: every expert's view is the same small block, and every slot
    chooses expert 0, the one the kernels then read, so any E costs a few MB) the MXFP4 kernels of one
    (E, mx_config), so the timed launches find them in Triton's on-disk cache: a binary depends on dtypes,
    pointer alignment and constexprs, never on the tensors' sizes."""
    E, cfg, gluon = job
    dev = "cuda"

    def experts(R, C):
        w = torch.zeros(R * C // 2, dtype=torch.uint8, device=dev).as_strided((E, R, C // 2), (0, C // 2, 1))
        sc = torch.full((R * C // 32,), 127, dtype=torch.uint8, device=dev).as_strided((E, R, C // 32),
                                                                                        (0, C // 32, 1))
        return w, sc

    (w1, s1), (w3, s3), (w2, s2) = experts(I, D), experts(I, D), experts(D, I)
    z = torch.zeros(1, D, dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(1, K, dtype=torch.int64, device=dev)
    try:
        launch_moe_experts(z, torch.ones(1, K, device=dev), ids, w1, w3, w2, s1, s3, s2, y=torch.empty_like(z),
                           mx_config=cfg, gluon=gluon, **ACT)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (reported again, per row, by the timed launch)
        print(f"  compile {E} {cfg}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)


def warm(jobs, workers, dev, check=True):
    """`warm_one` for every job and (check) `check_small` beside them, in `workers` spawned processes (compilation
    is CPU-bound and serial per process); returns check_small's result ({} without)."""
    if workers > 1 and jobs:
        try:
            with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs) + 1)) as pool:
                res = pool.apply_async(check_small, (dev,)) if check else None
                pool.map(warm_one, jobs)
                return res.get() if check else {}
        except Exception as e:  # noqa: BLE001  (the timed launches then compile in this process)
            print(f"  parallel compile failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
    return check_small(dev) if check else {}


def run_case(results, out_path, phase, N, E, dense, mx, bytes_per_expert, args, gen, dev, scale_max):
    """Time every format / configuration of one (phase, N) case and append the rows to results. dense None
    (--no-bf16): no bf16 row, each MXFP4 output is compared with the launcher's default's; args.launch_only: one
    launch of each configuration, nothing timed (a profiler's target)."""
    z = (torch.randn(N, D, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    ids, wt = routing(N, E, dev, gen)
    touched = int(torch.unique(ids).numel())
    y_ref = None
    if dense is not None:
        y_ref = torch.empty_like(z)
        launch_moe_experts(z, wt, ids, *dense, y=y_ref, **ACT)
    rows = N * K
    sweep = resolved_sweep(phase, rows, E, scale_max, args.quick)
    variants = [("mxfp4", mx, {"mx_config": c, "scale_max": scale_max, "gluon": False}) for c in sweep]
    if args.gluon and phase == "decode":
        variants += [("mxfp4-gluon", mx, {"mx_config": c, "scale_max": scale_max, "gluon": None}) for c in GLUON_SWEEP]
    if args.tiled:
        tiled = tuple(mx_tile_bits(w) for w in mx[:3]) + tuple(mx[3:])
        variants += [("mxfp4-tiled", tiled, {"scale_max": scale_max, "tiled": 2})]
    variants = ([("bf16", dense, {})] if dense is not None else []) + variants
    y_triton = None
    for fmt, ws, kw in variants:
        cfg = kw.get("mx_config")                 # the launcher's BLOCK_M choices (moe.launch_moe_experts)
        bm = (cfg or mx_default_config(rows, E, scale_max))[0] if fmt != "bf16" else 16 if rows < 16 * E else 64
        sched = moe_schedule(ids, E, bm)
        y = torch.empty_like(z)
        try:
            launch_moe_experts(z, wt, ids, *ws, y=y, **kw, **ACT)
            if args.launch_only:
                torch.cuda.synchronize()
                continue
            diff = None if fmt == "bf16" or y_ref is None else rel(y, y_ref)
            y_ref = y.clone() if y_ref is None else y_ref
            if fmt == "mxfp4" and cfg is None:
                y_triton = y.clone()          # the Triton kernels' default: gluon rows compare bitwise with it
            same = None if fmt != "mxfp4-gluon" or y_triton is None or (cfg is not None and tuple(cfg) != tuple(
                mx_default_config(rows, E, scale_max))) else (y - y_triton).abs().max().item()
            t_k, how = bench(lambda: launch_moe_experts(z, wt, ids, *ws, y=y, schedule=sched, **kw, **ACT))
            t_op, _ = bench(lambda: launch_moe_experts(z, wt, ids, *ws, y=y, **kw, **ACT))
        except Exception as e:  # noqa: BLE001  (a configuration the compiler rejects)
            print(f"  {fmt} {cfg}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
            continue
        row = {"phase": phase, "E": E, "N": N, "format": fmt, "mx_config": cfg, "touched": touched, "timing": how,
               "resolved_config": list(cfg or mx_default_config(rows, E, scale_max)) if fmt != "bf16" else None,
               "kernels_s": t_k, "op_s": t_op, "max_rel_vs_bf16": diff, "max_abs_vs_triton_default": same}
        if phase == "decode":
            nbytes = touched * bytes_per_expert[fmt != "bf16"]
            row.update(weight_bytes=nbytes, kernels_GBps=nbytes / t_k / 1e9, op_GBps=nbytes / t_op / 1e9,
                       kernels_hbm_frac=nbytes / t_k / HBM_BYTES_PER_S, op_hbm_frac=nbytes / t_op / HBM_BYTES_PER_S)
            print(f"  E {E} N {N} {fmt:10s} {str(cfg):28s} kernels {t_k * 1e6:7.1f} us ({row['kernels_GBps']:5.0f} "
                  f"GB/s, {row['kernels_hbm_frac']:4.0%} HBM)  op {t_op * 1e6:7.1f} us ({row['op_hbm_frac']:4.0%})  "
                  f"{nbytes / 1e6:.0f} MB  diff {diff if diff is None else f'{diff:.1e}'} vs triton {same}", flush=True)
        else:
            flop = 6 * N * K * D * I
            row.update(flop=flop, TFLOPs=flop / t_op / 1e12, bf16_peak_frac=flop / t_op / BF16_FLOP_PER_S)
            print(f"  E {E} N {N} {fmt:10s} {str(cfg):28s} op {t_op * 1e3:7.2f} ms ({row['TFLOPs']:.0f} TFLOP/s, "
                  f"{row['bf16_peak_frac']:.0%} of bf16 peak), kernels {t_k * 1e3:.2f} ms  diff "
                  f"{diff if diff is None else f'{diff:.1e}'}", flush=True)
        results["rows"].append(row)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", default="32", help="comma-separated expert counts, e.g. 32,896")
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="the default configuration only")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--decode-batches", default="1,16", help="comma-separated decode token counts")
    ap.add_argument("--prefill-tokens", type=int, default=16 * 2048)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (times meaningless)")
    ap.add_argument("--no-bf16", action="store_true", help="no bf16 rows (nor their dequantized weights)")
    ap.add_argument("--launch-only", action="store_true", help="one launch per configuration, for a profiler")
    ap.add_argument("--configs", default=None, help="comma-separated indices into the decode sweep to keep")
    ap.add_argument("--no-check", action="store_true", help="skip the small-shape check against the reference")
    ap.add_argument("--gluon", action="store_true", help="decode: the Gluon kernels (GLUON_SWEEP) beside")
    ap.add_argument("--gluon-configs", default=None,
                    help="';'-separated Gluon mx_configs replacing GLUON_SWEEP, each 'BLOCK_M,BLOCK_R,BLOCK_K,warps,"
                         "stages,two_muls,maxnreg' (two_muls 0/1, maxnreg 0: none or UP/DOWN; 'default': the "
                         "launcher's)")
    ap.add_argument("--compile-workers", type=int, default=8, help="processes compiling the MXFP4 variants first")
    ap.add_argument("--tiled", action="store_true",
                    help="the default over the words re-laid in mxfp4_tiles_bits beside")
    args = ap.parse_args()
    if args.configs:
        MX_SWEEP["decode"][:] = [MX_SWEEP["decode"][int(i)] for i in args.configs.split(",")]
    if args.gluon_configs:
        try:
            GLUON_SWEEP[:] = [None if c == "default" else mx_config_from_text(c) for c in args.gluon_configs.split(";")]
        except ValueError as e:
            ap.error(f"--gluon-configs: {e}")
    dev = args.device
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    results = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
               "shape": {"k": K, "D": D, "I": I}, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "moe_mxfp4_bench.json")
    experts = [int(e) for e in args.experts.split(",")]
    cases = [(E, "decode", int(n)) for E in experts for n in args.decode_batches.split(",")]
    cases += [] if args.no_prefill else [(experts[0], "prefill", args.prefill_tokens)]
    scale_max = SCALES[1]          # the weights' largest scale byte, as `k3c compile` records it
    jobs = sorted({(E, tuple(c or mx_default_config(N * K, E, scale_max)), False) for E, phase, N in cases
                   for c in resolved_sweep(phase, N * K, E, scale_max, args.quick)}, key=str) if dev == "cuda" else []
    jobs += [(E, tuple(c or mx_default_config(N * K, E, scale_max)), None) for E, phase, N in cases
             for c in GLUON_SWEEP if args.gluon and phase == "decode" and dev == "cuda"]
    results["diff_vs"] = "the launcher's default MXFP4 output" if args.no_bf16 else "the bf16 experts' output"
    results["check_small_rel"] = {} if args.launch_only else warm(jobs, args.compile_workers, dev, not args.no_check)
    print(f"MXFP4 kernels vs moe_experts_ref (small shape), max rel: {results['check_small_rel']}", flush=True)
    loaded = None
    for E, phase, N in cases:
        if loaded is None or loaded[0] != E:
            loaded = None
            torch.cuda.empty_cache()
            gen = torch.Generator(device=dev).manual_seed(0)
            mx = [mx_weights(E, R, C, dev, gen) for R, C in ((I, D), (I, D), (D, I))]
            dense = None if args.no_bf16 or args.launch_only else [dequantized(w, s) for w, s in mx]
            per_expert = (2 * 3 * D * I, sum(w.numel() + s.numel() for w, s in mx) // E)
            mx = tuple(w for w, _ in mx) + tuple(s for _, s in mx)
            loaded = (E, dense, mx, per_expert)
        run_case(results, out_path, phase, N, E, loaded[1], loaded[2], loaded[3], args, gen, dev, scale_max)
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
