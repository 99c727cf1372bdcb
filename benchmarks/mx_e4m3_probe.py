"""Probe (H200): the MXFP4 up kernel on FP8 `wgmma` (BENCHMARKS.md "MXFP4 round, run R").

The E2M1 codes become E4M3 bytes in 5 integer instructions a word (the words' bits placed at load for it,
`E4M3_PLACE`): a code's em bits at E4M3 bits 2..4 and its sign at bit 7 make the E4M3 number code · 2^-6 for
every code, subnormals included, as bf16 bits 6..8 give code · 2^-126 (k3c.codegen.triton.moe_mxfp4). Codes 0..3 of
a placed word are `w & 0x9c9c9c9c`, codes 4..7 `((w << 2) & 0x8c8c8c8c) | ((w >> 2) & 0x10101010)`. The
activations are split into two E4M3 parts per row (x·2^r = hi + lo, exact where x·2^r ≥ 2^-2 with the row's
largest magnitude in [128, 256)), the tensor cores multiply the decoded weights by both (`wgmma` m64nBMk32 E4M3,
the A operand from registers, the parts from shared memory), each 32-value MX group into its own fp32 partial,
and the group's scale is applied once to that partial: acc += p · 2^(s − 121) (s ≤ 248), instead of a
`mul.bf16x2` per weight pair. `mma.sync` E4M3 is no option on sm_90: ptxas emulates it (F2FP conversions and f16
HMMAs: 426 instructions a K tile of the down kernel against 306 for bf16, offline).

The words of a row are also reordered within each 256-value K tile: position 8t + g holds word 4g + t, so that
thread t of a quad holds word t of every group g and each `wgmma` k32 step sums exactly one MX group.

Kernel `e4wg_up_kernel`: 4 warps (one warpgroup), 64 weight rows a CTA, 8- or 16-token tiles (BM) of the
`moe_schedule`, the
words of w1 and w3 through a 2-stage TMA ring (row-major boxes [64, 32 words]), the activations' two parts of a K
tile staged in shared memory each tile ([16 = group × part, 8 tokens, 32 bytes]); gate and up written as fp32
(no GLU) for the check. NOLOAD: each ring stage filled once and decoded over and over (compute alone).

    python3 benchmarks/mx_e4m3_probe.py --out DIR [--experts 32] [--batches 1,16]
        [--variants "BM,ACT_TMA,HALF[,CAP];..."]
    python3 benchmarks/mx_e4m3_probe.py --cpu-check          # the host side's checks on CPU
    PYTHONPATH=/tmp/t36 python3 benchmarks/mx_e4m3_probe.py --static    # offline sm_90a counts (Triton 3.6)
Writes DIR/mx_e4m3_probe.json: per batch the probe's error against dequantize-then-GEMM (fp32) and its time,
beside the library's default up kernel (bf16 decoding, `mx_tma_probe.ExpertsOp`) in the same process.
"""

import argparse
import json
import os
import sys

import torch
import triton
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mx_e4m3_kernels import e4m3_split, e4m3_words, e4wg_down_kernel, e4wg_up_kernel  # noqa: E402

HBM = 4.2e12
D, I, K = 3584, 3072, 16
#: the largest E8M0 scale byte the kernels take: their group factor 2^(s − 121) is a finite fp32 for s ≤ 248
E4M3_MAX_SCALE = 248
#: a variant whose largest error against dequantize-then-GEMM (fp32) exceeds this share of the reference's largest
#: magnitude is reported as failed (the split alone stays under 2^-17; the rest is the FP8 tensor cores' summation)
TOLERANCE = 1e-3


def _e4m3_bytes(reg):
    """int64 tensor of 32-bit patterns -> their 4 E4M3 bytes' values, float64 [..., 4] (byte 0 first)."""
    b = torch.stack([(reg >> (8 * j)) & 255 for j in range(4)], -1).to(torch.uint8)
    return b.view(torch.float8_e4m3fn).double()


def cpu_check():
    """The host side and the kernels' index arithmetic, on CPU in float64 (no GPU): one expert's 64 weight rows by
    two K tiles, multiplied as `e4wg_up_kernel` does (the 5-instruction decoding emulated, A[row, 16r + 4t + b] =
    byte b of half r of the word at position 8t + g; the activations staged [16·BM, 32] from `e4m3_split`'s bytes
    at the kernels' offsets; the group factor ((s + 6) << 23) as fp32; the row's 2^-r at the end), must equal
    dequantize-then-GEMM of the same activations as the split holds them, to float64 rounding; and the split must
    rebuild bf16 rows within 2^-17 of a row's largest value (exactly where x·2^r ≥ 2^-2). Returns the split's largest
    relative error; raises AssertionError otherwise."""
    from k3c.ir.formats import mxfp4_dequantize

    gen = torch.Generator().manual_seed(0)
    E, R, C, BM = 2, 64, 512, 8
    w = torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(110, 135, (E, R, C // 32), dtype=torch.uint8, generator=gen)
    x = torch.randn(BM, C, generator=gen).to(torch.bfloat16).float()
    x[1] = (x[1] * 1e-3).to(torch.bfloat16).float()
    x[2, :7] = 0
    words = e4m3_words(w).to(torch.int64) & 0xFFFFFFFF
    q, rinv = e4m3_split(x)
    q32 = q.view(torch.int32)
    e = 1                                                  # the second expert: its rows start at e·R
    acc = torch.zeros(R, BM, dtype=torch.float64)
    for it in range(C // 256):
        stage = torch.stack([q32[:, it * 128 + j * 8:it * 128 + j * 8 + 8] for j in range(16)], 0)
        stage = stage.reshape(16 * BM, 8).contiguous().view(torch.uint8).view(torch.float8_e4m3fn).double()
        for g in range(8):
            wd = words[e, :, it * 32 + 8 * torch.arange(4) + g]                       # [R, t]
            halves = (wd & 0x9C9C9C9C, (((wd << 2) & 0xFFFFFFFF) & 0x8C8C8C8C) | ((wd >> 2) & 0x10101010))
            a = torch.cat([_e4m3_bytes(h).reshape(R, 16) for h in halves], 1)        # k = 16r + 4t + b
            p = a @ stage[2 * g * BM:(2 * g + 1) * BM].T + a @ stage[(2 * g + 1) * BM:(2 * g + 2) * BM].T
            sb = s.flatten()[(e * R + torch.arange(R)) * (C // 32) + it * 8 + g].to(torch.int32)
            acc += p * ((sb + 6) << 23).view(torch.float32).double()[:, None]
    out = acc * rinv.double()[None, :]
    c = torch.arange(32)
    f = 8 * ((c % 16) // 4) + 4 * (c // 16) + c % 4
    parts = q.view(BM, C // 256, 8, 2, 32).view(torch.float8_e4m3fn).double()
    held = torch.zeros(BM, C, dtype=torch.float64)
    for tile in range(C // 256):
        for g in range(8):
            held[:, 256 * tile + 32 * g + f] = (parts[:, tile, g, 0] + parts[:, tile, g, 1]) * rinv.double()[:, None]
    ref = mxfp4_dequantize(w[e], s[e]).double() @ held.T
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-12, "the kernels' index arithmetic"
    err = ((held - x.double()).abs().amax(1) / x.double().abs().amax(1)).max().item()
    assert err <= 2.0 ** -17, f"split error {err}"
    return err


def variant_fields(spec):
    """'BM,ACT_TMA,HALF[,CAP]' -> (BM, the kernels' keyword arguments: ACT_TMA, HALF, num_warps and maxnreg)."""
    bm, tma, half, cap = ([int(v) for v in spec.split(",")] + [0])[:4]
    return bm, {"ACT_TMA": bool(tma), "HALF": bool(half), "num_warps": 4, **({"maxnreg": cap} if cap else {})}


def split_desc(q, C, BM):
    """The 3-D TMA descriptor of split rows q u8 [rows, 2C]: (K tile · 16 + group · 2 + part, row, byte), boxes
    [16, BM, 32] (the kernels' ACT_TMA staging)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(q.view(torch.float8_e4m3fn), [C // 256 * 16, q.shape[0], 32], [32, 2 * C, 1],
                            [16, BM, 32], gl.NVMMASharedLayout(32, 8, rank=3))


def expert_error(ex, touched, pairs):
    """Largest |out − ref| and largest |ref| over the touched experts; pairs(e, rows) -> [(out rows, ref rows)] for
    expert e's sorted rows (ex: each sorted row's expert)."""
    err, ref_max = 0.0, 0.0
    for e in touched.tolist():
        for out, ref in pairs(e, (ex == e).nonzero().flatten()):
            err = max(err, (out - ref).abs().max().item())
            ref_max = max(ref_max, ref.abs().max().item())
    return err, ref_max


def loop_opcodes(code):
    """The opcodes (first word, predicate dropped) of the SASS body of the kernel's longest backward branch, most
    frequent first, as {opcode: count}."""
    import collections
    import re

    branch = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")
    loops = [(int(m.group(1), 16), a) for a, ins in code
             if ins.startswith("@") and (m := branch.search(ins)) and int(m.group(1), 16) <= a]
    top, end = max(loops, key=lambda t: t[1] - t[0])
    ops = [(ins.split()[1] if ins.startswith("@") else ins.split()[0]).split(".")[0]
           for a, ins in code if top <= a <= end]
    return dict(collections.Counter(ops).most_common(14))


def static_counts():
    """The offline rows of BENCHMARKS.md "run R": each variant's up and down kernel compiled for sm_90a (no GPU;
    Triton 3.6 for the device's figures) at K3.1 Pro's shapes, its registers, shared memory and K loop (per K tile:
    `mx_static_cost.loop_stats`)."""
    from triton.runtime.jit import mangle_type

    from k3c.codegen.triton.gl_ring import gl_word_descs
    from k3c.codegen.triton.offline import compile_for, resources, sass
    from mx_static_cost import loop_stats

    words = mangle_type(gl_word_descs(torch.zeros(1, 64, 256, dtype=torch.uint8), 64, 256))
    ptrs = {"zq_ptr": "*i32", "hq_ptr": "*i32", "zrinv_ptr": "*fp32", "hrinv_ptr": "*fp32", "s1_ptr": "*u8",
            "s3_ptr": "*u8", "s2_ptr": "*u8", "order_ptr": "*i64", "tile_expert_ptr": "*i64", "tile_row0_ptr": "*i64",
            "tile_row_end_ptr": "*i64", "g_ptr": "*fp32", "u_ptr": "*fp32", "weights_ptr": "*fp32",
            "y_slot_ptr": "*fp32"}
    for spec in ("8,0,0", "8,0,1", "16,0,0", "16,0,1", "16,0,1,168", "16,1,1", "8,1,0", "noload 8,0,0"):
        bm, kw = variant_fields(spec.split()[-1])
        for name, kernel, C, extra in (("up", e4wg_up_kernel, D, {"NOLOAD": spec.startswith("noload")}),
                                       ("down", e4wg_down_kernel, I, {}))[:1 if spec.startswith("noload") else 2]:
            dx = mangle_type(split_desc(torch.zeros(64, 2 * C, dtype=torch.uint8), C, bm))
            sig = {n: ptrs.get(n, dx if n == "dx" else words) for n in kernel.arg_names}
            ck = compile_for(kernel, sig, dict(E=32, D=D, I=I, BM=bm, ACT_TMA=kw["ACT_TMA"], HALF=kw["HALF"], **extra),
                             num_warps=4, maxnreg=kw.get("maxnreg"),
                             divisible=[n for n, t in sig.items() if t.startswith("*")])
            res, loop = resources(ck.asm["cubin"]), loop_stats(sass(ck.asm["cubin"]), 256 if name == "up" else 128)
            print(f"{spec:14s} {name:4s} {loop['instructions']:6.1f} instructions a K tile, {res['REG']} registers "
                  f"(stack {res['STACK']} B), {ck.metadata.shared} B shared", flush=True)
            if spec.startswith("noload"):       # compute alone: what the K loop's instructions are
                print("  K loop by opcode:", loop_opcodes(sass(ck.asm["cubin"])), flush=True)


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e-3


def main():
    from k3c.codegen.triton.gl_ring import gl_word_descs
    from k3c.codegen.triton.moe import moe_schedule
    from k3c.ir.formats import mxfp4_dequantize
    from mx_tma_probe import ExpertsOp, parse_variant

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--experts", default="32")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--variants", default="16,0,1,168;16,0,1;8,0,0;16,1,1;8,1,0",
                    help="';'-separated 'BM,ACT_TMA,HALF[,CAP]' (BM 8 or 16 token columns; ACT_TMA 1: the "
                         "activations by "
                         "TMA on the words' mbarrier, 0: staged through registers; HALF 1: groups waited 4 at a time; "
                         "CAP: a register cap, maxnreg, for both kernels)")
    ap.add_argument("--cpu-check", action="store_true", help="only the host-side checks (`cpu_check`), no GPU")
    ap.add_argument("--static", action="store_true", help="only the offline sm_90a counts (`static_counts`), no GPU")
    a = ap.parse_args()
    if a.static:
        static_counts()
        return
    if a.cpu_check:
        print(f"the kernels' arithmetic equals dequantize-then-GEMM of the split activations; split: largest error "
              f"{cpu_check():.2g} of a row's largest value")
        return
    for spec in a.variants.split(";"):
        f = spec.split(",")
        if not 3 <= len(f) <= 4 or not all(v.isdigit() for v in f) or f[0] not in ("8", "16") or \
                not set(f[1:3]) <= {"0", "1"}:
            ap.error(f"--variants: {spec!r}: expected BM,ACT_TMA,HALF[,CAP] (BM 8 or 16, ACT_TMA and HALF 0 or 1, "
                     "CAP a register count or 0)")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (sm_90)")
    dev = "cuda"
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    os.makedirs(a.out, exist_ok=True)
    for E in map(int, a.experts.split(",")):
        gen = torch.Generator(device=dev).manual_seed(0)
        w1, w3 = (torch.randint(0, 256, (E, I, D // 2), dtype=torch.uint8, device=dev, generator=gen) for _ in "ab")
        s1, s3 = (torch.randint(119, 123, (E, I, D // 32), dtype=torch.uint8, device=dev, generator=gen)
                  for _ in "ab")
        w2 = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev, generator=gen)
        s2 = torch.randint(119, 123, (E, D, I // 32), dtype=torch.uint8, device=dev, generator=gen)
        if max(int(x.max()) for x in (s1, s3, s2)) > E4M3_MAX_SCALE:
            raise SystemExit(f"scale bytes above {E4M3_MAX_SCALE}: the E4M3 kernels' group factor would overflow")
        e1, e3 = e4m3_words(w1), e4m3_words(w3)
        d1, d3 = (gl_word_descs(x.view(torch.uint8).view(E, I, D // 2), 64, 256, 0) for x in (e1, e3))
        d2 = gl_word_descs(e4m3_words(w2).view(torch.uint8).view(E, D, I // 2), 64, 256, 0)
        lib = ExpertsOp(w1, w3, w2, s1, s3, s2, **parse_variant("8,32,2,2,0,0,80,tb")[1])
        for N in map(int, a.batches.split(",")):
            z = (torch.randn(N, D, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
            ids = torch.rand(N, E, device=dev, generator=gen).argsort(-1)[:, :K].contiguous()
            touched = torch.unique(ids)
            up_bytes = touched.numel() * (w1[0].numel() + s1[0].numel()) * 2
            sched8 = moe_schedule(ids, E, 8)
            hp = torch.empty(N * K, I, dtype=torch.bfloat16, device=dev)
            from k3c.codegen.triton.moe_mxfp4_gluon import gl_permute
            zp = gl_permute(z, 256)
            t_lib = bench(lambda: lib.up(zp, sched8, hp))
            row = {"E": E, "N": N, "lib_up_us": t_lib * 1e6, "lib_up_frac": up_bytes / t_lib / HBM}
            print(f"E {E} N {N}: library up {t_lib * 1e6:.1f} us ({row['lib_up_frac']:.0%})", flush=True)
            for spec in a.variants.split(";"):
                BM, kw = variant_fields(spec)
                if BM > 8 and N == 1:
                    continue
                order, tile_expert, tile_row0, tile_row_end = moe_schedule(ids, E, BM)
                tok = order // K
                zq, zrinv = e4m3_split(z.float()[tok])
                dx = split_desc(zq, D, BM)
                zq = zq.view(torch.int32)
                g = torch.zeros(N * K, I, device=dev)
                u = torch.zeros(N * K, I, device=dev)
                grid = (tile_expert.shape[0], I // 64)

                def run(noload=False):
                    e4wg_up_kernel[grid](zq, dx, zrinv, d1, d3, s1, s3, tile_expert, tile_row0, tile_row_end, g, u,
                                         E=E, D=D, I=I, BM=BM, NOLOAD=noload, **kw)
                try:
                    run()
                    torch.cuda.synchronize()
                    # reference: dequantize-then-GEMM in fp32, per expert over its sorted rows
                    err, ref_max = expert_error(ids.flatten()[order], touched, lambda e, rows: [
                        (out[rows], z.float()[tok[rows]] @ mxfp4_dequantize(w[e], sc[e]).float().T)
                        for out, w, sc in ((g, w1, s1), (u, w3, s3))])
                    t = bench(run)
                    t0 = bench(lambda: run(True)) if not kw["ACT_TMA"] else float("nan")
                except Exception as exc:  # noqa: BLE001
                    print(f"E {E} N {N} {spec}: failed {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                    row[f"{spec}_error"] = str(exc)[:500]
                    continue
                row[spec] = {"us": t * 1e6, "frac": up_bytes / t / HBM, "noload_us": t0 * 1e6, "max_err": err,
                             "ok": err <= TOLERANCE * ref_max,
                             "ref_max": ref_max, "tiles": int((tile_expert < E).sum())}
                verdict = "ok" if err <= TOLERANCE * ref_max else "FAILED"
                print(f"E {E} N {N} {spec}: {verdict} e4m3 wgmma up {t * 1e6:.1f} us ({up_bytes / t / HBM:.0%}), "
                      f"compute alone {t0 * 1e6:.1f} us; max error {err:.3g} of {ref_max:.3g}", flush=True)
            down_bytes = touched.numel() * (w2[0].numel() + s2[0].numel())
            wt = torch.rand(N, K, device=dev, generator=gen)
            y_lib = torch.empty(N * K, D, device=dev)
            t_lib = bench(lambda: lib.down(hp, sched8, wt, y_lib))
            row.update({"lib_down_us": t_lib * 1e6, "lib_down_frac": down_bytes / t_lib / HBM})
            print(f"E {E} N {N}: library down {t_lib * 1e6:.1f} us ({row['lib_down_frac']:.0%})", flush=True)
            hrows = (torch.randn(N * K, I, device=dev, generator=gen) * 0.3).to(torch.bfloat16).float()
            for spec in a.variants.split(";"):
                BM, kw = variant_fields(spec)
                if BM > 8 and N == 1:
                    continue
                order, tile_expert, tile_row0, tile_row_end = moe_schedule(ids, E, BM)
                hq, hrinv = e4m3_split(hrows)
                dx = split_desc(hq, I, BM)
                hq = hq.view(torch.int32)
                y_slot = torch.zeros(N * K, D, device=dev)
                grid = (tile_expert.shape[0], D // 64)

                def run_down():
                    e4wg_down_kernel[grid](hq, dx, hrinv, d2, s2, wt, order, tile_expert, tile_row0, tile_row_end,
                                           y_slot, E=E, D=D, I=I, BM=BM, **kw)
                try:
                    run_down()
                    torch.cuda.synchronize()
                    err, ref_max = expert_error(ids.flatten()[order], touched, lambda e, rows: [
                        (y_slot[order[rows]], hrows[rows] @ mxfp4_dequantize(w2[e], s2[e]).float().T
                         * wt.flatten()[order[rows]][:, None])])
                    t = bench(run_down)
                except Exception as exc:  # noqa: BLE001
                    print(f"E {E} N {N} down {spec}: failed {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                    row[f"down {spec}_error"] = str(exc)[:500]
                    continue
                row["down " + spec] = {"us": t * 1e6, "frac": down_bytes / t / HBM, "max_err": err, "ref_max": ref_max,
                                       "ok": err <= TOLERANCE * ref_max}
                verdict = "ok" if err <= TOLERANCE * ref_max else "FAILED"
                print(f"E {E} N {N} down {spec}: {verdict} e4m3 wgmma down {t * 1e6:.1f} us "
                      f"({down_bytes / t / HBM:.0%}); max "
                      f"error {err:.3g} of {ref_max:.3g}", flush=True)
            res["rows"].append(row)
            with open(os.path.join(a.out, "mx_e4m3_probe.json"), "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
