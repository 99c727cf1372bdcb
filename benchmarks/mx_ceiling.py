"""Where the MXFP4 decode kernels' time goes (H200): how fast can the up kernel's own grid and TMA ring stream its
words with nothing decoded, with the words decoded and multiplied (the `mma.sync`s) but no activation or scale
loads, and how fast can the device read the same bytes at all (BENCHMARKS.md "MXFP4 round, run M")? The probe
kernels are benchmarks/mx_ceiling_kernels.py's; this script builds the inputs, launches and times them.

- `linear`: one plain Triton kernel reads a contiguous buffer of the up kernel's word bytes (and a 4 GB one) in
  16 KB blocks, XOR-folding them (the best read rate of this device for those bytes);
- `copy`: a torch device-to-device copy of 4 GB, counting bytes read + written;
- `stream,BR,BK,STAGES,MODE[,CTAS][,lin][,grp][,pfN|plN][,bm16][,dec1|dec2|dec3|dec4][,noload]`: `stream_kernel`, the up
  kernel's grid (tiles × I/BR CTAs of BR weight rows, BR/16 warps) and its TMA ring of STAGES stages over w1 and w3,
  with MODE 0: wait for each stage and refill it (the copies alone); 1: also read each thread's words back from
  shared memory (`gl_stage_words`, the decode kernels' `LDS.128`) and XOR-fold them; 2: as 1 with a CTA barrier
  before each refill; 3: the up kernel's decoding and `mma.sync`s of those words (`gl_decoded_tile`, gate and up)
  with constant scale bytes and activations (the up kernel without its activation and scale loads, its GLU and its
  store; BK > 256: each 256-wide box of a stage in turn); 4: as 3 with the activations read from shared memory every
  K tile (`gl_act_operand` of an `LDS` in the kernels' activation layout, 16-byte vectors swizzled by token so that
  an `LDS.128` is free of bank conflicts: what a ring staging them beside the words would cost in instructions and
  registers; run N's mode 4 had 8-way conflicts). CTAS: shared memory padded so that at most CTAS CTAs fit an SM
  (the library's up kernel has 8 by its registers), 0 or absent: none. `lin`: each CTA reads the same bytes in
  address order (boxes of BR·128 contiguous bytes) instead of the decode kernels' [BR weight rows, 32 words] boxes,
  whose rows lie D/2 bytes apart (the `mxfp4_tiles` layout gives the kernels that order). `grp`: the ring refills
  its STAGES − 1 free stages together every STAGES − 1 K tiles (each row's next pieces asked of DRAM back to back:
  (STAGES − 1)·128-byte runs), as the library's ring does (`gl_ring_refill`), instead of one stage every tile.
  `pfN`: every N K tiles each weight row's bytes of the next N tiles are asked of L2 as one run
  (`cp.async.bulk.prefetch.L2`), so DRAM sees N·128-byte runs of a row; `plN`: the same lines, one
  `prefetch.global.L2` each. `bm16`: modes 3 and 4 multiply 16 token columns (two n8 `mma.sync`s a k16 step) instead
  of 8, over the 16-token tile schedule. BK > 256 (a multiple of 256 dividing D): a K tile is BK/256 boxes side by
  side a matrix, each weight row read in runs of BK/2 bytes;
- `wgmma,BM,KSPLIT[,dec1|dec2|dec3][,noload]`: `wgmma_kernel`, mode 3 on `wgmma` (4 warps, 64 weight rows a CTA, BM = 8
  or 16 token columns over that tile schedule, each matrix's K tile in KSPLIT `wgmma`s of 256/KSPLIT); compiled
  offline for sm_90a (Triton 3.6): KSPLIT 1 162 / 170 registers (BM 8 / 16), 3 / 2 CTAs an SM; KSPLIT 2 98 / 106, 4
  CTAs; 616-620 instructions a K tile with 32 `HGMMA`s, against mode 3's 584 with 32 `HMMA`s at 8 tokens and 616
  with 64 at 16 (measured on an H100: BENCHMARKS.md "MXFP4 round, run P");
- `,dec1` / `,dec2` (stream modes 3-4, wgmma, persist): the decoding replaced by a cost probe of the same operands
  (`probe_word_bf16`; values not MXFP4's): dec1 the floor of any decoding into the bf16 pattern, one `and` and one
  `mul.bf16x2` a bf16 pair (4 integer instructions a word against the library's 12); dec2 one shift and one mask
  a pair but the first (7), what a bit order of the words with no `lop3` pre-pass would cost. Neither is a
  decoding k3c can use as it is: no bit order of a 32-bit word gives each of its four bf16 pairs by one shift
  and one mask (translates of the pair's 8 bit positions {6, 7, 8, 15, 22, 23, 24, 31} do not tile 32 bits);
  `,dec3`: the library's decoding of words in the `mxfp4_tiles_bits` layout's bit order (9 integer instructions
  a word: three pairs one shift or rotate and one mask, the fourth from two; k3c.runtime.layouts.MX_BIT_PLACE);
- `,dec4` (stream mode 3 only): the placed bits' decoding without its multiplies, each 32-value group multiplied
  into its own fp32 partial and scaled once (`group_scaled_tile`; BENCHMARKS.md "MXFP4 round, run R"): a cost
  probe of the scale applied once a group;
- `,noload` (stream, wgmma): compute alone, each stage filled once before the K loop and decoded over and over
  (no DRAM traffic after the first tiles): the decoding's and MMAs' time on this SM count and clock, which an
  H100 and an H200 share;
- `persist,BR,STAGES,CTAS_PER_SM[,bm16][,dec1|dec2|dec3]`: `persist_kernel`, mode 3 on a persistent grid of
  CTAS_PER_SM CTAs an SM, each streaming all K tiles of its (tile, row block) units through one TMA ring, the
  next unit's first tiles in flight under this unit's last;
- `mixed[,dec1|dec2|dec3][,noload]`: mode 3 over a schedule that mixes tile sizes by expert load (`mixed_tiles`): one
  8-token launch over the experts with at most 8 rows, one 16-token launch over the rest, timed together;
- `lib`: the library's decode default at that batch (`mx_round.default_variant`), its up and down kernels timed
  apart, its output first compared with `launch_moe_experts`.

Batch 1 and 16 of 32 experts (bench_e2e's), top-16 routing, seed 0, 8-token tiles; times by do_bench_cudagraph,
fractions of 4.2 TB/s (the word bytes; `lib` counts the scale bytes too).

    python3 benchmarks/mx_ceiling.py --out DIR [--variants "stream,32,256,2,0,8;..."] [--batches 1,16]
        [--launch-only]
    PYTHONPATH=/tmp/t36 python3 benchmarks/mx_ceiling.py --static --out DIR --variants "stream,32,256,2,3;wgmma,16,2"
(--static: no GPU; the stream and wgmma variants compiled for sm_90a, `static_rows`; the device's Triton 3.6 for
figures that match it: `pip install --target /tmp/t36 triton==3.6.0`)
Writes DIR/mx_ceiling.json (per batch and variant: us, bytes, the fraction of 4.2 TB/s). --launch-only launches
each variant once and times nothing (a profiler's target: `ncu -k regex:"moe_up_mx_gluon|stream_kernel"`).
Raw results: benchmarks/results_mx_ceiling_run_*.json (BENCHMARKS.md "MXFP4 round", runs M-P).
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton.gl_ring import gl_word_descs  # noqa: E402
from k3c.codegen.triton.moe import launch_moe_experts, moe_schedule, moe_sum_kernel  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_gluon import gl_permute  # noqa: E402
from mx_ceiling_kernels import linear_kernel, persist_kernel, stream_kernel, wgmma_kernel  # noqa: E402
from mx_round import default_variant  # noqa: E402
from mx_tma_probe import ExpertsOp, parse_variant  # noqa: E402

HBM = 4.2e12
SM_SHARED = 228 * 1024          # shared memory an SM (sm_90), 1 KB of it reserved per CTA
D, I, K, E = 3584, 3072, 16, 32
DEFAULT = ("linear;copy;lib;stream,32,256,2,0,8;stream,32,256,2,1,8;stream,32,256,2,3,8;stream,32,256,2,3;"
           "stream,16,256,2,3;stream,32,256,2,1,8,lin;stream,32,512,2,1")


LAUNCH_ONLY = []      # set by --launch-only: each variant launched once, nothing timed (a profiler's target)


def bench(fn):
    if LAUNCH_ONLY:
        fn()
        torch.cuda.synchronize()
        return float("nan")
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e-3


def linear(nbytes, dev):
    BLOCK, ITERS = 4096, 8
    n = triton.cdiv(nbytes, 4 * BLOCK * ITERS)
    x = torch.randint(-2**31, 2**31 - 1, (n * BLOCK * ITERS,), dtype=torch.int32, device=dev)
    out = torch.empty(n, dtype=torch.int32, device=dev)
    t = bench(lambda: linear_kernel[(n,)](x, out, ITERS=ITERS, BLOCK=BLOCK, num_warps=8))
    return t, x.numel() * 4


def lib(N, ids, touched, record, gen, mats):
    """Time the library's decode default at batch N (`mx_round.default_variant`: the kernels of
    `moe_mxfp4_gluon`), its up and down kernels apart, after checking its output against `launch_moe_experts`."""
    w1, w3, w2, s1, s3, s2 = mats
    dev = "cuda"
    z = (torch.randn(N, D, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    wt = torch.rand(N, K, device=dev, generator=gen)
    y_ref = torch.empty_like(z)
    launch_moe_experts(z, wt, ids, w1, w3, w2, s1, s3, s2, y=y_ref, scale_max=122, act="situ", situ_beta=4.0,
                       situ_linear_beta=25.0)
    spec = default_variant(N, torch.cuda.get_device_name())
    kw = parse_variant(spec)[1]
    op = ExpertsOp(w1, w3, w2, s1, s3, s2, **kw)
    sched = moe_schedule(ids, E, kw["block_m"])
    zp = gl_permute(z, op.bk[0])
    h = torch.empty(N * K, I, dtype=torch.bfloat16, device=dev)
    y_slot = torch.empty(N * K, D, dtype=torch.float32, device=dev)
    y = torch.empty_like(z)
    op.up(zp, sched, h)
    op.down(h, sched, wt, y_slot)
    moe_sum_kernel[(N, triton.cdiv(D, 256))](y_slot, ids, y, K=K, D=D, BLOCK_N=256)
    torch.cuda.synchronize()
    diff = (y.float() - y_ref.float()).abs().max().item()
    up_b = touched * 2 * (I * D // 2 + I * D // 32)
    down_b = touched * (D * I // 2 + D * I // 32)
    t_up, t_down = bench(lambda: op.up(zp, sched, h)), bench(lambda: op.down(h, sched, wt, y_slot))
    for part, t, nb in (("up", t_up, up_b), ("down", t_down, down_b), ("up+down", t_up + t_down, up_b + down_b)):
        record(N, f"lib {spec} {part}", t, nb, max_abs_diff=diff)


def mixed_tiles(ids):
    """The `mixed` variant's two tile lists (i64 experts, one per tile) for routing ids [N, K]: an 8-token tile for
    each expert with 1..8 rows, and ⌈rows/16⌉ 16-token tiles for each expert with more, so every touched expert's
    words are decoded once and only the busier experts pay the 16-token tile's second `mma.sync`."""
    rows = torch.bincount(ids.flatten(), minlength=E)
    small = torch.nonzero((rows >= 1) & (rows <= 8)).flatten()
    busy = torch.nonzero(rows > 8).flatten()
    large = torch.repeat_interleave(busy, (rows[busy] + 15) // 16)
    return small, large


def probe_flags(fields):
    """(DEC, NOLOAD) of a variant's fields: `dec1` / `dec2` (`probe_word_bf16`), `dec3` (placed bits), `noload`."""
    dec = 1 if "dec1" in fields else 2 if "dec2" in fields else 3 if "dec3" in fields else \
        4 if "dec4" in fields else 0
    return dec, "noload" in fields


def static_rows(variants):
    """--static: the `stream,BR,256,STAGES,MODE[,bm16]` and `wgmma,BM,KSPLIT` variants compiled for sm_90a without a
    GPU (k3c.codegen.triton.offline, the installed Triton): registers, shared memory, CTAs an SM
    (mx_static_cost.py's occupancy rule) and the K loop's instructions and tensor instructions per K tile."""
    from k3c.codegen.triton.offline import compile_for, resources, sass
    from mx_static_cost import ctas_per_sm, loop_stats, word_descriptor_type

    rows = []
    for spec in variants.split(";"):
        f = spec.split(",")
        dec, noload = probe_flags(f)
        f = [x for x in f if x not in ("dec1", "dec2", "dec3", "dec4", "noload")]
        if f[0] == "wgmma":
            bm, ksplit = map(int, f[1:3])
            kernel, br, warps = wgmma_kernel, 64, 4
            consts = dict(E=E, D=D, I=I, BM=bm, KSPLIT=ksplit, DEC=dec, NOLOAD=noload)
            sig = {"tile_expert_ptr": "*i64", "out_ptr": "*i32"}
        elif f[0] == "stream" and f[2] == "256" and set(f[5:]) <= {"bm16"}:
            br, stages, mode = int(f[1]), int(f[3]), int(f[4])
            kernel, warps = stream_kernel, br // 16
            consts = dict(E=E, D=D, I=I, BLOCK_R=br, BLOCK_D=256, STAGES=stages, MODE=mode, PAD_A=0, PAD_B=0,
                          LIN=False, PF=0, LINES=False, GROUP=1, BM=16 if "bm16" in f else 8, DEC=dec, NOLOAD=noload)
            sig = {"w1p": "*u8", "w3p": "*u8", "tile_expert_ptr": "*i64", "out_ptr": "*i32"}
        else:
            raise SystemExit(f"--static: {spec!r}: expected stream,BR,256,STAGES,MODE[,bm16] or wgmma,BM,KSPLIT")
        sig.update({w: word_descriptor_type(br, 256) for w in ("w1", "w3")})
        c = compile_for(kernel, sig, consts, num_warps=warps)
        code = sass(c.asm["cubin"])
        regs, shared = resources(c.asm["cubin"])["REG"], c.metadata.shared
        loop = loop_stats(code, 16 * 512 // 32)          # a thread's weights a K tile: 16 rows of 2 matrices / 32
        row = {"variant": spec, "registers": regs, "shared": shared, "ctas_per_sm": ctas_per_sm(regs, shared, warps),
               "instructions": loop["instructions"], "HMMA": loop["HMMA"],
               "HGMMA": sum(ins.split()[0].startswith("HGMMA") for _, ins in code)}
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--launch-only", action="store_true", help="launch each variant once, time nothing (for ncu)")
    ap.add_argument("--static", action="store_true", help="no GPU: compile the variants for sm_90a, print their cost")
    a = ap.parse_args()
    if a.static:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "mx_ceiling_static.json"), "w") as f:
            json.dump({"triton": triton.__version__, "target": "sm_90a", "rows": static_rows(a.variants)}, f, indent=1)
        return
    LAUNCH_ONLY[:] = [True] * a.launch_only
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Gluon kernels have no interpreter)")
    dev = "cuda"
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    w1 = torch.randint(0, 256, (E, I, D // 2), dtype=torch.uint8, device=dev, generator=gen)
    w3 = torch.randint(0, 256, (E, I, D // 2), dtype=torch.uint8, device=dev, generator=gen)
    s1 = torch.randint(119, 123, (E, I, D // 32), dtype=torch.uint8, device=dev, generator=gen)
    s3 = torch.randint(119, 123, (E, I, D // 32), dtype=torch.uint8, device=dev, generator=gen)
    w2 = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev, generator=gen)
    s2 = torch.randint(119, 123, (E, D, I // 32), dtype=torch.uint8, device=dev, generator=gen)

    def record(N, name, t, nbytes, **extra):
        row = {"N": N, "variant": name, "us": t * 1e6, "bytes": nbytes, "frac": nbytes / t / HBM, **extra}
        res["rows"].append(row)
        print(f"N {N:3d} {name:24s} {t * 1e6:8.1f} us {nbytes / 1e6:8.1f} MB {row['frac']:6.1%}", flush=True)
        with open(os.path.join(a.out, "mx_ceiling.json"), "w") as f:
            json.dump(res, f, indent=1)

    for N in map(int, a.batches.split(",")):
        ids = torch.rand(N, E, device=dev, generator=gen).argsort(-1)[:, :K].contiguous()
        touched = int(torch.unique(ids).numel())
        word_bytes = touched * 2 * I * D // 2
        sched = moe_schedule(ids, E, 8)
        for spec in a.variants.split(";"):
            f = spec.split(",")
            try:
                if f[0] == "linear":
                    t, nb = linear(word_bytes, dev)
                    record(N, spec, t, nb)
                    t, nb = linear(4 << 30, dev)
                    record(N, "linear 4 GB", t, nb)
                elif f[0] == "copy":
                    x = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
                    y = torch.empty_like(x)
                    record(N, spec, bench(lambda: y.copy_(x)), 2 * x.numel())
                    del x, y
                elif f[0] == "lib":
                    lib(N, ids, touched, record, gen, (w1, w3, w2, s1, s3, s2))
                elif f[0] == "persist":      # persist,BR,STAGES,CTAS_PER_SM[,bm16][,dec1|dec2|dec3]
                    br, stages, per_sm = map(int, f[1:4])
                    bm = 16 if "bm16" in f else 8
                    dec = probe_flags(f)[0]
                    sched_p = sched if bm == 8 else moe_schedule(ids, E, bm)
                    n_units = int((sched_p[1] < E).sum().item()) * (I // br)
                    d1, d3 = (gl_word_descs(w, br, 256) for w in (w1, w3))
                    grid = torch.cuda.get_device_properties(0).multi_processor_count * per_sm
                    out = torch.empty(grid, dtype=torch.int32, device=dev)
                    t = bench(lambda: persist_kernel[(grid,)](d1, d3, sched_p[1], out, n_units, E=E, D=D, I=I,
                                                              BLOCK_R=br, STAGES=stages, BM=bm, DEC=dec,
                                                              num_warps=br // 16))
                    record(N, spec, t, word_bytes)
                elif f[0] == "mixed":        # mixed[,dec1|dec2|dec3][,noload]
                    dec, noload = probe_flags(f)
                    small, large = mixed_tiles(ids)
                    d1, d3 = (gl_word_descs(w, 32, 256) for w in (w1, w3))
                    out = torch.empty((small.numel() + large.numel()) * (I // 32), dtype=torch.int32, device=dev)
                    kw = dict(E=E, D=D, I=I, BLOCK_R=32, BLOCK_D=256, STAGES=2, MODE=3, PAD_A=0, PAD_B=0, LIN=False,
                              PF=0, LINES=False, GROUP=1, DEC=dec, NOLOAD=noload, num_warps=2)

                    def both():
                        for tiles, bm in ((small, 8), (large, 16)):
                            if tiles.numel():
                                stream_kernel[(tiles.numel(), I // 32)](d1, d3, w1, w3, tiles, out, BM=bm, **kw)
                    t = bench(both)
                    record(N, spec, t, word_bytes, tiles_8=small.numel(), tiles_16=large.numel())
                elif f[0] == "wgmma":
                    bm, ksplit = map(int, f[1:3])
                    dec, noload = probe_flags(f)
                    d1, d3 = (gl_word_descs(w, 64, 256) for w in (w1, w3))
                    tile_expert = (sched if bm == 8 else moe_schedule(ids, E, bm))[1]
                    out = torch.empty(tile_expert.shape[0] * (I // 64), dtype=torch.int32, device=dev)
                    t = bench(lambda: wgmma_kernel[(tile_expert.shape[0], I // 64)](
                        d1, d3, tile_expert, out, E=E, D=D, I=I, BM=bm, KSPLIT=ksplit, DEC=dec, NOLOAD=noload,
                        num_warps=4))
                    record(N, spec, t, word_bytes)
                else:
                    pf = [int(x[2:]) for x in f if x[:2] in ("pf", "pl")]
                    lines = any(x.startswith("pl") for x in f)
                    grp = "grp" in f
                    bm = 16 if "bm16" in f else 8
                    dec, noload = probe_flags(f)
                    f = [x for x in f if x[:2] not in ("pf", "pl") and
                         x not in ("grp", "bm16", "dec1", "dec2", "dec3", "dec4", "noload")]
                    lin = f[-1] == "lin"
                    br, bk, stages, mode, *ctas = map(int, f[1:len(f) - lin])
                    ctas = [c for c in ctas if c]
                    if lin and bk != 256 or 3584 % bk or bk % 256:
                        raise ValueError(f"{spec}: BK must be 256 with lin, else a multiple of 256 dividing 3584")
                    ring = 2 * stages * br * bk // 2 + 8 * stages
                    room = (SM_SHARED // ctas[0] - 1024 - ring) // 1024 if ctas else 0
                    pad_a = 1 << (room.bit_length() - 1) if room > 0 else 0
                    pad_b = 1 << ((room - pad_a).bit_length() - 1) if room > pad_a else 0
                    fit = min(32, SM_SHARED // (ring + (pad_a + pad_b) * 1024 + 1024))
                    d1, d3 = (gl_word_descs(w.view(E, -1, 128) if lin else w, br, 256) for w in (w1, w3))
                    tile_expert = (sched if bm == 8 else moe_schedule(ids, E, bm))[1]
                    out = torch.empty(tile_expert.shape[0] * (I // br), dtype=torch.int32, device=dev)
                    consts = dict(E=E, D=D, I=I, BLOCK_R=br, BLOCK_D=bk, STAGES=stages, MODE=mode, PAD_A=pad_a,
                                  PAD_B=pad_b, LIN=lin, PF=pf[0] if pf else 0, LINES=lines,
                                  GROUP=stages - 1 if grp else 1, BM=bm, DEC=dec, NOLOAD=noload, num_warps=br // 16)
                    t = bench(lambda: stream_kernel[(tile_expert.shape[0], I // br)](d1, d3, w1, w3, tile_expert, out,
                                                                                      **consts))
                    record(N, spec, t, word_bytes, ctas_by_shared=fit)
            except Exception as err:  # noqa: BLE001  (a variant that fails is reported, the rest still run)
                print(f"N {N} {spec}: failed {type(err).__name__}: {str(err)[:300]}", flush=True)
                res["rows"].append({"N": N, "variant": spec, "error": str(err)[:500]})


if __name__ == "__main__":
    main()
