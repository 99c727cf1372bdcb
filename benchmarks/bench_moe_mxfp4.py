"""Benchmark and GPU check of the `moe_experts` kernels (k3c.codegen.triton.moe): MXFP4 experts (packed E2M1 +
E8M0 scales, dequantized in registers) side by side with bf16 experts, at K3.1 Pro's expert shapes (latent
D = 3584, expert inner I = 3072, top-16), bf16 activations.

Run on a CUDA machine:
    python benchmarks/bench_moe_mxfp4.py [--experts 32] [--out DIR] [--quick]
Rows: decode at batch 1 and 16 (BLOCK_M = 16: a few rows per expert, the kernels stream the weights) and prefill
at 16 × 2048 tokens (grouped GEMM). Decode reports the expert-weight bytes the step must read (every touched
expert's w1, w3, w2, scales included) over the time of the two GEMM kernels plus the slot sum ("kernels": schedule
precomputed) and of the whole op ("op": schedule included), as GB/s and as a fraction of the measured 4.2 TB/s HBM
rate (KINDS.md); prefill reports 6·N·k·D·I FLOP over the op's time as TFLOP/s (vs 790 bf16). Timing:
triton.testing.do_bench_cudagraph (mean of CUDA-graph replays), falling back to do_bench. A block-size sweep
is run (the defaults first; --quick: the defaults only). MXFP4 runs both ways of dequantizing: "mxfp4" (Triton's
`dot_scaled`) and "mxfp4-regs" (`mxfp4_tile`: k3c's own register decoding + tl.dot, the default). Each
MXFP4 case's output is compared with the bf16 kernels fed the dequantized weights (same math in bf16: the max
relative difference is printed) and, at a small shape, with `moe_experts_ref` (fp32 and bf16).
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton.moe import launch_moe_experts, moe_schedule  # noqa: E402
from k3c.ir.formats import mxfp4_dequantize  # noqa: E402
from k3c.ir.ops.model_moe import moe_experts_ref  # noqa: E402

HBM_BYTES_PER_S = 4.2e12       # measured device copy bandwidth (KINDS.md)
BF16_FLOP_PER_S = 790e12
D, I, K = 3584, 3072, 16       # K3.1 Pro: routed_expert_hidden_size, moe_intermediate_size, experts per token
ACT = dict(act="situ", situ_beta=4.0, situ_linear_beta=25.0)


def mx_weights(E, R, C, dev, gen):
    """Random MXFP4 weights [E, R, C]: uniform codes, scales 2^-8 .. 2^-5 (K3-like magnitudes)."""
    packed = torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, device=dev, generator=gen)
    scale = torch.randint(119, 123, (E, R, C // 32), dtype=torch.uint8, device=dev, generator=gen)
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
    """MXFP4 kernels vs the IR reference at a small shape (N = 9, E = 6, D = 256, I = 192): fp32 (register
    decoding), bf16 with dot_scaled and with register decoding. Returns {case: max rel error}."""
    gen = torch.Generator(device=dev).manual_seed(1)
    N, E, d, i = 9, 6, 256, 192
    w1, s1 = mx_weights(E, i, d, dev, gen)
    w3, s3 = mx_weights(E, i, d, dev, gen)
    w2, s2 = mx_weights(E, d, i, dev, gen)
    z = torch.randn(N, d, device=dev, generator=gen)
    ids = torch.rand(N, E, device=dev, generator=gen).argsort(-1)[:, :4].contiguous()
    wt = torch.rand(N, 4, device=dev, generator=gen)
    out = {}
    for name, dt, scaled in (("f32", torch.float32, False), ("bf16-dot_scaled", torch.bfloat16, True),
                             ("bf16-regs", torch.bfloat16, False)):
        zz = z.to(dt)
        y = torch.full_like(zz, float("nan"))
        launch_moe_experts(zz, wt, ids, w1, w3, w2, s1, s3, s2, y=y, dot_scaled=scaled, **ACT)
        ref = moe_experts_ref({**ACT, "weight_format": "mxfp4"},
                              *(t.cpu() for t in (zz.float(), wt, ids, w1, w3, w2, s1, s3, s2)))
        out[name] = rel(y.cpu(), ref[0])
    return out


def dequantized(w, s, chunk=32):
    """bf16 [E, R, C] of MXFP4 weights, a few experts at a time (the fp32 intermediate of all E can be large)."""
    return torch.cat([mxfp4_dequantize(w[e:e + chunk], s[e:e + chunk]).to(torch.bfloat16)
                      for e in range(0, w.shape[0], chunk)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="default block sizes only, no prefill")
    ap.add_argument("--prefill-tokens", type=int, default=16 * 2048)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (times meaningless)")
    args = ap.parse_args()
    dev = args.device
    E = args.experts
    gen = torch.Generator(device=dev).manual_seed(0)
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    results = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
               "shape": {"E": E, "k": K, "D": D, "I": I}, "rows": []}
    results["check_small_rel"] = check_small(dev)
    print(f"MXFP4 kernels vs moe_experts_ref (small shape), max rel: {results['check_small_rel']}")
    w1, s1 = mx_weights(E, I, D, dev, gen)
    w3, s3 = mx_weights(E, I, D, dev, gen)
    w2, s2 = mx_weights(E, D, I, dev, gen)
    dense = [dequantized(w, s) for w, s in ((w1, s1), (w3, s3), (w2, s2))]
    mx_bytes = sum(t.numel() for t in (w1, w3, w2, s1, s3, s2)) // E
    bf_bytes = 2 * sum(t.numel() for t in dense) // E
    # block sizes (BLOCK_M, BLOCK_I, BLOCK_D, BLOCK_N); None: the launcher's defaults
    sweeps = {"decode": [None, (16, 64, 128, 64), (16, 32, 256, 32), (16, 128, 128, 128)],
              "prefill": [None, (64, 128, 64, 128), (128, 64, 64, 64)]}
    cases = [("decode", 1), ("decode", 16)] + ([] if args.quick else [("prefill", args.prefill_tokens)])
    for phase, N in cases:
        z = (torch.randn(N, D, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        ids, wt = routing(N, E, dev, gen)
        touched = int(torch.unique(ids).numel())
        y_bf = torch.empty_like(z)
        launch_moe_experts(z, wt, ids, *dense, y=y_bf, **ACT)
        mx = (w1, w3, w2, s1, s3, s2)
        for fmt, ws, per_expert, scaled in (("mxfp4", mx, mx_bytes, True), ("mxfp4-regs", mx, mx_bytes, False),
                                            ("bf16", dense, bf_bytes, False)):
            diff = None
            if fmt != "bf16":
                y_mx = torch.empty_like(z)
                launch_moe_experts(z, wt, ids, *ws, y=y_mx, dot_scaled=scaled, **ACT)
                diff = rel(y_mx, y_bf)
                print(f"{phase} N={N}: {fmt} vs bf16 kernels on the dequantized weights: max rel diff {diff:.2e}")
            sweep = sweeps[phase]
            blocks_list = sweep[:1] if args.quick else sweep if (phase == "prefill" or fmt != "bf16") else sweep[:2]
            for blocks in blocks_list:
                bm = blocks[0] if blocks else (16 if N * K < 16 * E else 64)
                sched = moe_schedule(ids, E, bm)
                y = torch.empty_like(z)
                try:
                    t_k, how = bench(lambda: launch_moe_experts(z, wt, ids, *ws, y=y, blocks=blocks, schedule=sched,
                                                                dot_scaled=scaled, **ACT))
                    t_op, _ = bench(lambda: launch_moe_experts(z, wt, ids, *ws, y=y, blocks=blocks, dot_scaled=scaled,
                                                               **ACT))
                except Exception as e:  # noqa: BLE001  (a block configuration the compiler rejects)
                    print(f"  {fmt} blocks {blocks}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                    continue
                row = {"phase": phase, "N": N, "format": fmt, "blocks": blocks, "touched": touched, "timing": how,
                       "kernels_s": t_k, "op_s": t_op, "max_rel_vs_bf16": diff}
                if phase == "decode":
                    nbytes = touched * per_expert
                    row.update(weight_bytes=nbytes, kernels_GBps=nbytes / t_k / 1e9, op_GBps=nbytes / t_op / 1e9,
                               kernels_hbm_frac=nbytes / t_k / HBM_BYTES_PER_S)
                    print(f"  {fmt:10s} blocks {blocks}: kernels {t_k * 1e6:8.1f} us ({row['kernels_GBps']:6.0f} GB/s, "
                          f"{row['kernels_hbm_frac']:.0%} HBM), op {t_op * 1e6:8.1f} us; {touched} experts "
                          f"{nbytes / 1e6:.0f} MB")
                else:
                    flop = 6 * N * K * D * I
                    row.update(flop=flop, TFLOPs=flop / t_op / 1e12, bf16_peak_frac=flop / t_op / BF16_FLOP_PER_S)
                    print(f"  {fmt:10s} blocks {blocks}: op {t_op * 1e3:8.2f} ms ({row['TFLOPs']:.0f} TFLOP/s, "
                          f"{row['bf16_peak_frac']:.0%} of bf16 peak), kernels {t_k * 1e3:.2f} ms")
                results["rows"].append(row)
        del z, y_bf
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"moe_mxfp4_bench_E{E}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
