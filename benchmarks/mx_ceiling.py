"""Where the MXFP4 decode kernels' time goes (H200): how fast can the up kernel's own grid and TMA ring stream its
words with nothing decoded, with the words decoded and multiplied (the `mma.sync`s) but no activation or scale
loads, and how fast can the device read the same bytes at all (BENCHMARKS.md "MXFP4 round, run M")?

- `linear`: one plain Triton kernel reads a contiguous buffer of the up kernel's word bytes (and a 4 GB one) in
  16 KB blocks, XOR-folding them (the best read rate of this device for those bytes);
- `copy`: a torch device-to-device copy of 4 GB, counting bytes read + written;
- `stream,BR,BK,STAGES,MODE[,CTAS][,lin][,grp][,pfN|plN][,bm16][,dec1|dec2][,noload]`: `stream_kernel`, the up
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
- `wgmma,BM,KSPLIT[,dec1|dec2][,noload]`: `wgmma_kernel`, mode 3 on `wgmma` (4 warps, 64 weight rows a CTA, BM = 8
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
- `,noload` (stream, wgmma): compute alone, each stage filled once before the K loop and decoded over and over
  (no DRAM traffic after the first tiles): the decoding's and MMAs' time on this SM count and clock, which an
  H100 and an H200 share;
- `persist,BR,STAGES,CTAS_PER_SM[,bm16][,dec1|dec2]`: `persist_kernel`, mode 3 on a persistent grid of
  CTAS_PER_SM CTAs an SM, each streaming all K tiles of its (tile, row block) units through one TMA ring, the
  next unit's first tiles in flight under this unit's last;
- `mixed[,dec1|dec2][,noload]`: mode 3 over a schedule that mixes tile sizes by expert load (`mixed_tiles`): one
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
import triton.language as tl
import triton.testing
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton.gl_common import gl_thread_barrier, gl_tma_load  # noqa: E402
from k3c.codegen.triton.moe import launch_moe_experts, moe_schedule, moe_sum_kernel  # noqa: E402
from k3c.codegen.triton.moe_mxfp4 import mxfp4_scale_bf16, mxfp4_word_bf16  # noqa: E402
from k3c.codegen.triton.gl_ring import gl_ring_init, gl_stage_words, gl_word_descs  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_gluon import (gl_act_operand, gl_decoded_tile, gl_layouts, gl_permute,  # noqa: E402
                                               gl_word_values_operand)
from mx_round import default_variant  # noqa: E402
from mx_tma_probe import ExpertsOp, parse_variant  # noqa: E402

HBM = 4.2e12
SM_SHARED = 228 * 1024          # shared memory an SM (sm_90), 1 KB of it reserved per CTA
D, I, K, E = 3584, 3072, 16, 32
DEFAULT = ("linear;copy;lib;stream,32,256,2,0,8;stream,32,256,2,1,8;stream,32,256,2,3,8;stream,32,256,2,3;"
           "stream,16,256,2,3;stream,32,256,2,1,8,lin;stream,32,512,2,1")


@gluon.jit
def stream_kernel(w1, w3, w1p, w3p, tile_expert_ptr, out_ptr, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr,
                  BLOCK_R: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
                  PAD_A: gl.constexpr, PAD_B: gl.constexpr, LIN: gl.constexpr, PF: gl.constexpr,
                  LINES: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr, DEC: gl.constexpr = 0,
                  NOLOAD: gl.constexpr = False):
    """The up kernel's word stream without its decoding (module docstring); out i32 [tiles, I/BLOCK_R] gets each
    CTA's wrapping sum of its XOR-folded words (MODE ≥ 1), so nothing read is dead. A K tile of BLOCK_D is
    BLOCK_D/256 boxes [BLOCK_R, 32 words] a matrix (the decode kernels' box at 256 of K; more boxes: longer runs of
    each weight row a tile). PAD_A, PAD_B > 0: that many more KB (each a power of two) of shared memory a CTA,
    zeroed and read back at the end (they only hold the CTAs an SM to the decode kernel's). LIN: w1 / w3 are
    descriptors of the words as rows of 32 words, read in address order. PF > 0: every PF K tiles each thread asks
    L2 for one weight row's bytes of the next PF tiles as one run (`l2_prefetch_rows`; w1p / w3p: the words' u8
    pointers), so DRAM sees PF·BLOCK_D/2-byte runs of each row while the TMA ring still copies 128-byte pieces.
    GROUP: the ring refills GROUP stages at once every GROUP K tiles (1: one stage a tile; STAGES − 1: all the
    free stages together). BM: the token columns of modes 3 and 4 (8, or 16: two n8 `mma.sync`s a k16 step).
    DEC (modes 3, 4): the decoding's instructions, `probe_tile` (0: the library's). NOLOAD: compute alone, every
    stage filled once before the loop and decoded over and over, nothing more read from DRAM."""
    W: gl.constexpr = BLOCK_R // 16
    BOXES: gl.constexpr = BLOCK_D // 256
    NT: gl.constexpr = D // BLOCK_D
    WL: gl.constexpr = gl_layouts(W, 256, BM)[0]
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    acc = gl.zeros([W, 2, 8, 4, 2, 4], gl.int32, WL)
    MMA: gl.constexpr = gl_layouts(W, 256, BM)[1]
    AL: gl.constexpr = gl_layouts(W, 256, BM)[2]
    BL: gl.constexpr = gl_layouts(W, 256, BM)[3]
    gate = gl.zeros([BLOCK_R, BM], gl.float32, MMA)
    up = gl.zeros([BLOCK_R, BM], gl.float32, MMA)
    XL: gl.constexpr = gl.BlockedLayout([1, BM], [32, 1], [W, 1], [1, 0])
    x = gl.convert_layout((gl.arange(0, 256, gl.SliceLayout(1, XL))[:, None] +
                           gl.arange(0, BM, gl.SliceLayout(0, XL))[None, :]).to(gl.bfloat16), BL)
    sc = gl.full([W, 2, 8, 4, 2], 120, gl.uint8, gl.SliceLayout(5, WL))
    if MODE == 4:       # constant activation pairs in shared memory, [128 pairs, BM tokens] token-major, the
        # 16-byte vectors of a token's row XOR-swizzled by the token (vec 4, 8 phases): the 8 lanes of an LDS.128
        # phase (tokens g, g + 1 at pairs 8t..) then hit 8 distinct vectors of the 32 banks (run N's unswizzled
        # layout put all 8 tokens' pairs in the same banks: 8-way conflicts)
        AP: gl.constexpr = gl_layouts(W, 256, BM)[4]
        act = gl.allocate_shared_memory(gl.int32, [128, BM], gl.SwizzledSharedLayout(4, 1, 8, [0, 1]))
        act.store(gl.convert_layout(gl.full([128, BM], 0x3F803F80, gl.int32, XL), AP))
    PL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if PAD_A > 0:
        pa = gl.allocate_shared_memory(gl.int32, [256 * PAD_A], SL)
        pa.store(gl.zeros([256 * PAD_A], gl.int32, PL))
    if PAD_B > 0:
        pb = gl.allocate_shared_memory(gl.int32, [256 * PAD_B], SL)
        pb.store(gl.zeros([256 * PAD_B], gl.int32, PL))
    if e < E:
        row = (e * I + gl.program_id(1) * BLOCK_R).to(gl.int32)
        r1 = gl.allocate_shared_memory(gl.int32, [STAGES * BOXES, BLOCK_R, 32], w1.layout)
        r3 = gl.allocate_shared_memory(gl.int32, [STAGES * BOXES, BLOCK_R, 32], w3.layout)
        bar = gl_ring_init(STAGES)
        if PF > 0:
            l2_prefetch_rows(w1p, w3p, row, 0, D, BLOCK_R, BLOCK_D, PF, NT, LINES)
        if NOLOAD:
            for p in gl.static_range(STAGES):
                box_fill(w1, w3, r1, r3, bar, row, p, NT, STAGES, BOXES, LIN)
                gl.nvidia.hopper.mbarrier.wait(bar.index(p), 0)
        else:
            for p in gl.static_range(STAGES - GROUP):
                box_fill(w1, w3, r1, r3, bar, row, p, NT, STAGES, BOXES, LIN)
        for it in range(NT):
            if PF > 0:
                if it % PF == 0:
                    l2_prefetch_rows(w1p, w3p, row, it + PF, D, BLOCK_R, BLOCK_D, PF, NT, LINES)
            if MODE == 2:
                gl_thread_barrier()
            if not NOLOAD:
                if it % GROUP == 0:     # the stages of tiles it − GROUP .. it − 1 are free: refill them together
                    for g in gl.static_range(GROUP):
                        box_fill(w1, w3, r1, r3, bar, row, it + STAGES - GROUP + g, NT, STAGES, BOXES, LIN)
                gl.nvidia.hopper.mbarrier.wait(bar.index(it % STAGES), (it // STAGES) & 1)
            if MODE >= 3:       # the up kernel's decoding and MMAs, constant scale bytes and activations
                if MODE == 4:   # ... the activations read from shared memory each K tile, as a ring would
                    x = gl_act_operand(act.load(AP), 256, BL)
                for b in gl.static_range(BOXES):
                    c1 = gl_stage_words(r1.index((it % STAGES) * BOXES + b), W, 2, WL)
                    c3 = gl_stage_words(r3.index((it % STAGES) * BOXES + b), W, 2, WL)
                    gate = gl.nvidia.ampere.mma_v2(probe_tile(c1, sc, DEC, BLOCK_R, 256, AL), x, gate)
                    up = gl.nvidia.ampere.mma_v2(probe_tile(c3, sc, DEC, BLOCK_R, 256, AL), x, up)
            elif MODE >= 1:
                for b in gl.static_range(BOXES):
                    acc = acc ^ gl_stage_words(r1.index((it % STAGES) * BOXES + b), W, 2, WL) ^ \
                        gl_stage_words(r3.index((it % STAGES) * BOXES + b), W, 2, WL)
    total = gl.sum(gl.sum(gl.sum(gl.sum(gl.sum(gl.sum(acc, 5), 4), 3), 2), 1), 0)
    total += gl.sum(gl.sum(gate + up, 1), 0).to(gl.int32)
    if PAD_A > 0:
        total += gl.sum(pa.load(PL), 0)
    if PAD_B > 0:
        total += gl.sum(pb.load(PL), 0)
    gl.store(out_ptr + tile * gl.num_programs(1) + gl.program_id(1), total)


@gluon.jit
def l2_prefetch_rows(w1p, w3p, row, t0, D: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_D: gl.constexpr,
                     PF: gl.constexpr, NT: gl.constexpr, LINES: gl.constexpr):
    """`cp.async.bulk.prefetch.L2` (sm_90; LINES: a `prefetch.global.L2` per 128-byte line) of K tiles
    t0 .. t0 + PF − 1 (those < NT) of weight rows row.. of w1 and w3 (u8 [.., D/2]): one contiguous run a row,
    thread i of the CTA's 2·BLOCK_R rows (w1's, then w3's)."""
    if t0 < NT:
        L: gl.constexpr = gl.BlockedLayout([1], [32], [BLOCK_R // 16], [0])
        r = gl.arange(0, 2 * BLOCK_R, L)
        off = (row + r % BLOCK_R).to(gl.int64) * (D // 2) + t0 * (BLOCK_D // 2)
        ptrs = gl.where(r < BLOCK_R, w1p + off, w3p + off)
        if LINES:       # one `prefetch.global.L2` a 128-byte line, the row's lines back to back
            for j in gl.static_range(PF * BLOCK_D // 256):
                gl.inline_asm_elementwise("@$2 prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l,b",
                                          [ptrs + 128 * j, (t0 * (BLOCK_D // 256) + j) < NT * (BLOCK_D // 256)],
                                          dtype=gl.int32, is_pure=False, pack=1)
        else:
            n = gl.minimum(PF, NT - t0) * (BLOCK_D // 2)
            gl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                      [ptrs, gl.full([2 * BLOCK_R], n, gl.int32, L)], dtype=gl.int32,
                                      is_pure=False, pack=1)


@triton.jit
def probe_word_bf16(w, mult, DEC: tl.constexpr):
    """Cost probes of `mxfp4_word_bf16` (same operands and outputs; the values are not MXFP4's): DEC 1, the
    floor of any decoding into the bf16 pattern (one `and` a bf16 pair and the scale's `mul.bf16x2`: 4 integer
    instructions a word); DEC 2, one shift and one mask a pair but the first (7 integer instructions: what a
    load-time bit order of the words that needs no `lop3` pre-pass would cost)."""
    if DEC == 1:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, m;
            mov.b32 m, {$9, $9};
            and.b32 t, $8, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$0, $1}, t;
            and.b32 t, $8, 0x40e040e0; mul.bf16x2 t, t, m; mov.b32 {$2, $3}, t;
            and.b32 t, $8, 0x20702070; mul.bf16x2 t, t, m; mov.b32 {$4, $5}, t;
            and.b32 t, $8, 0x10381038; mul.bf16x2 t, t, m; mov.b32 {$6, $7}, t;
            }""",
            "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, mult], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, m;
        mov.b32 m, {$9, $9};
        and.b32 t, $8, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$0, $1}, t;
        shl.b32 t, $8, 3; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$2, $3}, t;
        shl.b32 t, $8, 6; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$4, $5}, t;
        shr.b32 t, $8, 7; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$6, $7}, t;
        }""",
        "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, mult], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@gluon.jit
def probe_tile(words, s, DEC: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_K: gl.constexpr, AL: gl.constexpr):
    """`gl_decoded_tile` (one multiply) with DEC 0, else with `probe_word_bf16`'s decoding DEC."""
    if DEC == 0:
        return gl_decoded_tile(words, s, False, BLOCK_R, BLOCK_K, AL)
    mult = gl.expand_dims(mxfp4_scale_bf16(s, False), 5)
    mult, words = gl.broadcast(mult, words)
    v0, v4, v1, v5, v2, v6, v3, v7 = probe_word_bf16(words, mult, DEC)
    return gl_word_values_operand(v0, v4, v1, v5, v2, v6, v3, v7, BLOCK_R, BLOCK_K, AL)


@gluon.jit
def box_fill(d1, d3, r1, r3, bar, row, t, NT: gl.constexpr, STAGES: gl.constexpr, BOXES: gl.constexpr,
             LIN: gl.constexpr):
    """K tile t (< NT, else nothing) of weight rows row.. of d1 and d3 into stage t % STAGES: BOXES boxes a matrix
    at consecutive 32-word columns, or (LIN) the tile's box of lines row·NT + t·BLOCK_R .. in address order."""
    stage = t % STAGES
    ok = t < NT
    gl.nvidia.hopper.mbarrier.expect(bar.index(stage), 2 * BOXES * d1.block_type.nbytes, ok)
    for b in gl.static_range(BOXES):
        if LIN:
            at = [row * NT + t * d1.block_type.shape[0], 0]
        else:
            at = [row, (t * BOXES + b) * 32]
        gl_tma_load(d1, at, bar.index(stage), r1.index(stage * BOXES + b), ok)
        gl_tma_load(d3, at, bar.index(stage), r3.index(stage * BOXES + b), ok)


@gluon.jit
def wgmma_kernel(w1, w3, tile_expert_ptr, out_ptr, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr,
                 BM: gl.constexpr, KSPLIT: gl.constexpr, DEC: gl.constexpr = 0, NOLOAD: gl.constexpr = False):
    """Mode 3 on `wgmma` (the batch-16 candidate of BENCHMARKS.md "MXFP4 round, run O", measured in run P): a
    warpgroup of 4 warps decodes 64 weight rows a CTA (16 a warp) from the up kernel's 2-stage TMA ring of
    256-wide K tiles straight into `wgmma`'s register A operand (`DotOperandLayout` of k_width 2: no data moved),
    and multiplies it with constant activations [BM tokens, 256] bf16 in shared memory (`wgmma`'s B operand,
    read from there), gate and up each K tile. Each matrix's K tile goes in KSPLIT pieces (1: [64, 256] a
    `wgmma`; 2: [64, 128]), each `wgmma` asynchronous, one left in flight while the next piece is decoded, so
    the decoded pieces of two `wgmma`s are live at a time. Constant scale bytes; out i32 [tiles, I/64] as
    `stream_kernel`'s. DEC, NOLOAD: as `stream_kernel`'s."""
    W: gl.constexpr = 4
    NT: gl.constexpr = D // 256
    BK: gl.constexpr = 256 // KSPLIT
    WL: gl.constexpr = gl_layouts(W, BK, BM)[0]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BM, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [BM, 32 // BM], [W, 1], [1, 0])
    act = gl.allocate_shared_memory(gl.bfloat16, [BM, 256], gl.NVMMASharedLayout.get_default_for([BM, 256],
                                                                                                 gl.bfloat16))
    act.store(gl.full([BM, 256], 1.0, gl.bfloat16, XL))
    gl.nvidia.hopper.fence_async_shared()
    sc = gl.full([W, 2, 8, 4, BK // 128], 120, gl.uint8, gl.SliceLayout(5, WL))
    gate = gl.zeros([16 * W, BM], gl.float32, ACC)
    up = gl.zeros([16 * W, BM], gl.float32, ACC)
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    if e < E:
        row = (e * I + gl.program_id(1) * 16 * W).to(gl.int32)
        r1 = gl.allocate_shared_memory(gl.int32, [2, 16 * W, 32], w1.layout)
        r3 = gl.allocate_shared_memory(gl.int32, [2, 16 * W, 32], w3.layout)
        bar = gl_ring_init(2)
        box_fill(w1, w3, r1, r3, bar, row, 0, NT, 2, 1, False)
        if NOLOAD:
            box_fill(w1, w3, r1, r3, bar, row, 1, NT, 2, 1, False)
            gl.nvidia.hopper.mbarrier.wait(bar.index(0), 0)
            gl.nvidia.hopper.mbarrier.wait(bar.index(1), 0)
        a = gl.zeros([16 * W, BK], gl.bfloat16, AL)        # the piece in flight (none yet)
        for it in range(NT):
            if not NOLOAD:
                box_fill(w1, w3, r1, r3, bar, row, it + 1, NT, 2, 1, False)
                gl.nvidia.hopper.mbarrier.wait(bar.index(it % 2), (it // 2) & 1)
            for m in gl.static_range(2):
                ring = r1 if m == 0 else r3
                for h in gl.static_range(KSPLIT):
                    words = ring.index(it % 2).slice(h * (BK // 8), BK // 8, dim=1)
                    nxt = wgmma_operand(gl_stage_words(words, W, BK // 128, WL), sc, BK, AL, DEC)
                    b = act.slice(h * BK, BK, dim=1).permute((1, 0))
                    if m == 0:
                        gate = gl.nvidia.hopper.warpgroup_mma(nxt, b, gate, is_async=True)
                    else:
                        up = gl.nvidia.hopper.warpgroup_mma(nxt, b, up, is_async=True)
                    gate, up, a, nxt = gl.nvidia.hopper.warpgroup_mma_wait(1, deps=(gate, up, a, nxt))
                    a = nxt
        gate, up = gl.nvidia.hopper.warpgroup_mma_wait(0, deps=(gate, up))
    total = gl.sum(gl.sum(gate + up, 1), 0).to(gl.int32)
    gl.store(out_ptr + tile * gl.num_programs(1) + gl.program_id(1), total)


@gluon.jit
def wgmma_operand(words, s, BK: gl.constexpr, AL: gl.constexpr, DEC: gl.constexpr = 0):
    """`gl_decoded_tile` in `wgmma`'s K order (`wgmma_kernel`): words [W, 2, 8, 4, CH, 4] of a BK-wide K tile
    (CH = BK/128; DEC: `probe_word_bf16`'s cost probe) -> the bf16 A operand [16W, BK] whose column
    32·cc + 16a + 8p + 2t + e is code 4a + 2p + e of word cc of thread t."""
    mult = gl.expand_dims(mxfp4_scale_bf16(s, False), 5)
    mult, words = gl.broadcast(mult, words)
    if DEC == 0:
        v0, v4, v1, v5, v2, v6, v3, v7 = mxfp4_word_bf16(words, mult, False)
    else:
        v0, v4, v1, v5, v2, v6, v3, v7 = probe_word_bf16(words, mult, DEC)
    # [W, 2, 8, 4(t), CH, 4(c), e, p, a] -> [W, 2, 8, CH, 4(c), a, p, 4(t), e]
    v = gl.join(gl.join(gl.join(v0, v4), gl.join(v1, v5)), gl.join(gl.join(v2, v6), gl.join(v3, v7)))
    tile = gl.reshape(gl.permute(v, (0, 1, 2, 4, 5, 8, 7, 3, 6)), [words.shape[0] * 16, BK])
    return gl.convert_layout(tile, AL, assert_trivial=True)


@gluon.jit
def persist_kernel(w1, w3, tile_expert_ptr, out_ptr, n_units, E: gl.constexpr, D: gl.constexpr,
                   I: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr,
                   DEC: gl.constexpr):
    """Mode 3 of `stream_kernel` on a persistent grid: program p takes the (tile, row block) units p, p + G, ..
    (G programs, n_units = the schedule's tiles × I/BLOCK_R) and streams all their K tiles through one TMA ring
    of STAGES stages as one sequence, so the next unit's first words are in flight while this unit's last are
    decoded (no pipeline fill per unit, no partial last wave). out i32 [G]: each program's wrapping sum."""
    W: gl.constexpr = BLOCK_R // 16
    NT: gl.constexpr = D // 256
    RB: gl.constexpr = I // BLOCK_R
    WL: gl.constexpr = gl_layouts(W, 256, BM)[0]
    MMA: gl.constexpr = gl_layouts(W, 256, BM)[1]
    AL: gl.constexpr = gl_layouts(W, 256, BM)[2]
    BL: gl.constexpr = gl_layouts(W, 256, BM)[3]
    XL: gl.constexpr = gl.BlockedLayout([1, BM], [32, 1], [W, 1], [1, 0])
    x = gl.convert_layout((gl.arange(0, 256, gl.SliceLayout(1, XL))[:, None] +
                           gl.arange(0, BM, gl.SliceLayout(0, XL))[None, :]).to(gl.bfloat16), BL)
    sc = gl.full([W, 2, 8, 4, 2], 120, gl.uint8, gl.SliceLayout(5, WL))
    G = gl.num_programs(0)
    pid = gl.program_id(0)
    steps = (n_units - pid + G - 1) // G * NT
    r1 = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_R, 32], w1.layout)
    r3 = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_R, 32], w3.layout)
    bar = gl_ring_init(STAGES)
    for p in gl.static_range(STAGES - 1):
        unit_fill(w1, w3, r1, r3, bar, tile_expert_ptr, pid, G, p, steps, I, NT, RB, BLOCK_R, STAGES)
    gate = gl.zeros([BLOCK_R, BM], gl.float32, MMA)
    up = gl.zeros([BLOCK_R, BM], gl.float32, MMA)
    total = gl.zeros([BLOCK_R, BM], gl.float32, MMA)
    for j in range(steps):
        unit_fill(w1, w3, r1, r3, bar, tile_expert_ptr, pid, G, j + STAGES - 1, steps, I, NT, RB, BLOCK_R, STAGES)
        gl.nvidia.hopper.mbarrier.wait(bar.index(j % STAGES), (j // STAGES) & 1)
        c1 = gl_stage_words(r1.index(j % STAGES), W, 2, WL)
        c3 = gl_stage_words(r3.index(j % STAGES), W, 2, WL)
        gate = gl.nvidia.ampere.mma_v2(probe_tile(c1, sc, DEC, BLOCK_R, 256, AL), x, gate)
        up = gl.nvidia.ampere.mma_v2(probe_tile(c3, sc, DEC, BLOCK_R, 256, AL), x, up)
        if j % NT == NT - 1:        # the unit's epilogue: fold its sums, start the next unit's
            total += gate + up
            gate = gl.zeros([BLOCK_R, BM], gl.float32, MMA)
            up = gl.zeros([BLOCK_R, BM], gl.float32, MMA)
    gl.store(out_ptr + pid, gl.sum(gl.sum(total, 1), 0).to(gl.int32))


@gluon.jit
def unit_fill(d1, d3, r1, r3, bar, tile_expert_ptr, pid, G, s, steps, I: gl.constexpr, NT: gl.constexpr,
              RB: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    """`persist_kernel`'s step s (< steps, else nothing): K tile s mod NT of its program's unit s // NT, into
    stage s % STAGES."""
    ok = s < steps
    unit = pid + (s // NT) * G
    kt = s % NT
    e = gl.load(tile_expert_ptr + gl.where(ok, unit // RB, 0))
    row = (e * I + (unit % RB) * BLOCK_R).to(gl.int32)
    stage = s % STAGES
    gl.nvidia.hopper.mbarrier.expect(bar.index(stage), 2 * d1.block_type.nbytes, ok)
    gl_tma_load(d1, [row, kt * 32], bar.index(stage), r1.index(stage), ok)
    gl_tma_load(d3, [row, kt * 32], bar.index(stage), r3.index(stage), ok)


@triton.jit
def linear_kernel(x_ptr, out_ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    """XOR-fold ITERS blocks of BLOCK i32 words (program p: blocks p·ITERS ..) into out[p]."""
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        acc ^= tl.load(x_ptr + (p * ITERS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + p, tl.sum(acc))


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
    """(DEC, NOLOAD) of a variant's fields: `dec1` / `dec2` (`probe_word_bf16`), `noload`."""
    return (1 if "dec1" in fields else 2 if "dec2" in fields else 0), "noload" in fields


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
        f = [x for x in f if x not in ("dec1", "dec2", "noload")]
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
        tiles = sched[1].shape[0]
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
                elif f[0] == "persist":      # persist,BR,STAGES,CTAS_PER_SM[,bm16][,dec1|dec2]
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
                elif f[0] == "mixed":        # mixed[,dec1|dec2][,noload]
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
                         x not in ("grp", "bm16", "dec1", "dec2", "noload")]
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
