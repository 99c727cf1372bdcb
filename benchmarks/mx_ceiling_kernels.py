"""The probe kernels of benchmarks/mx_ceiling.py (its docstring names the variants that launch them): the MXFP4 up
kernel's grid and TMA ring with its decoding and MMAs switched on piece by piece (`stream_kernel`), on `wgmma`
(`wgmma_kernel`) and on a persistent grid (`persist_kernel`), the decoding's cost probes (`probe_word_bf16`,
`probe_tile`) and a plain read of the same bytes (`linear_kernel`). Constant scales and activations: their
outputs are sums that keep every read live, not MXFP4 products."""

import os
import sys

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton.gl_common import gl_thread_barrier, gl_tma_load  # noqa: E402
from k3c.codegen.triton.gl_ring import gl_ring_init, gl_stage_words  # noqa: E402
from k3c.codegen.triton.moe_mxfp4 import mxfp4_scale_bf16, mxfp4_word_bf16  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_gluon import (gl_act_operand, gl_decoded_tile, gl_layouts,  # noqa: E402
                                               gl_word_values_operand)
from mx_e4m3_kernels import e4_split8  # noqa: E402


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
    DEC (modes 3, 4): the decoding's instructions, `probe_tile` (0 / 3: the library's, checkpoint / placed bits);
    4 (mode 3): `group_scaled_tile`, the scale applied once a 32-value group to an fp32 partial.
    NOLOAD: compute alone, every
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
    if DEC == 4:        # one 32-column chunk's constant activations (`group_scaled_tile`)
        x32 = gl.convert_layout((gl.arange(0, 32, gl.SliceLayout(1, XL))[:, None] +
                                 gl.arange(0, BM, gl.SliceLayout(0, XL))[None, :]).to(gl.bfloat16),
                                gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8))
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
                    if DEC == 4:
                        gate = group_scaled_tile(c1, tile_expert_ptr + tile, x32, gate, BLOCK_R, MMA)
                        up = group_scaled_tile(c3, tile_expert_ptr + tile, x32, up, BLOCK_R, MMA)
                    else:
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
def word_bits_bf16(w):
    """`mxfp4_word_bf16` over placed bits (BITS) without its `mul.bf16x2`s: i32 words -> 8 bf16 tensors, the
    patterns code · 2^-126 (codes 0, 4, 1, 5, 2, 6, 3, 7): 9 integer instructions a word."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, u;
        and.b32 t, $8, 0x81c081c0; mov.b32 {$0, $1}, t;
        shf.r.wrap.b32 t, $8, $8, 4; and.b32 t, t, 0x81c081c0; mov.b32 {$2, $3}, t;
        shl.b32 t, $8, 6; and.b32 t, t, 0x81c081c0; mov.b32 {$4, $5}, t;
        shl.b32 t, $8, 2; shr.b32 u, $8, 6; and.b32 u, u, 0x01000100; lop3.b32 t, t, u, 0x80c080c0, 0xec;
        mov.b32 {$6, $7}, t;
        }""",
        "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@gluon.jit
def group_scaled_chunk(wc, s, SHIFT: gl.constexpr, x, acc, BLOCK_R: gl.constexpr, AL: gl.constexpr):
    """One 32-column chunk of `group_scaled_tile`: words [W, 2, 8, 4] (one a thread and row) -> the chunk's A
    operand [BLOCK_R, 32] (`gl_word_values_operand`'s column order, no data moved), multiplied by x [32, BM] into a
    fresh fp32 partial, which is scaled by its rows' factor 2^(byte − 127) (byte SHIFT/8 of s, i32 [BLOCK_R]) and
    added to acc [BLOCK_R, BM]."""
    v0, v4, v1, v5, v2, v6, v3, v7 = word_bits_bf16(wc)
    v = gl.join(gl.join(gl.join(v0, v4), gl.join(v1, v5)), gl.join(gl.join(v2, v6), gl.join(v3, v7)))
    a = gl.convert_layout(gl.reshape(gl.permute(v, (0, 1, 2, 3, 6, 5, 4)), [BLOCK_R, 32]), AL, assert_trivial=True)
    p = gl.nvidia.ampere.mma_v2(a, x, gl.zeros_like(acc))
    f = (((s >> SHIFT) & 255) << 23).to(gl.float32, bitcast=True)
    return acc + p * gl.expand_dims(f, 1)


@gluon.jit
def group_scaled_tile(words, s_ptr, x, acc, BLOCK_R: gl.constexpr, MMA: gl.constexpr):
    """Mode 3's K tile of 256 with DEC 4 (BENCHMARKS.md "MXFP4 round, run R"): each 32-value group's chunk
    multiplied into its own fp32 partial from the placed bits as they are (code · 2^-126, bf16 subnormals
    included, which the tensor cores keep), and the group's scale applied once to that partial (an `FFMA` per
    accumulator) instead of a `mul.bf16x2` per weight pair. A cost probe: it takes chunk cc of the tile as word cc
    of each thread of a quad, the group only where the words' load-time order makes it one (run R's E4M3 words);
    the activations would also need a power-of-two pre-scale so that the products stay normal in fp32. The 8
    scale bytes of a row are two 32-bit words loaded from s_ptr, the same for every row: runtime values, so
    nothing folds, but uniform, so their factors run on the uniform datapath (a kernel's per-row bytes would
    cost vector instructions)."""
    W: gl.constexpr = BLOCK_R // 16
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    rows = gl.arange(0, BLOCK_R, gl.SliceLayout(1, MMA))
    s_lo = gl.load(s_ptr + rows * 0).to(gl.int32) + 0x78787878
    s_hi = gl.load(s_ptr + rows * 0 + 1).to(gl.int32) + 0x77777777
    a0, a1, a2, a3, a4, a5, a6, a7 = e4_split8(gl.reshape(words, [W, 2, 8, 4, 8]))    # word 4·ch + c a thread
    acc = group_scaled_chunk(a0, s_lo, 0, x, acc, BLOCK_R, AL)
    acc = group_scaled_chunk(a1, s_lo, 8, x, acc, BLOCK_R, AL)
    acc = group_scaled_chunk(a2, s_lo, 16, x, acc, BLOCK_R, AL)
    acc = group_scaled_chunk(a3, s_lo, 24, x, acc, BLOCK_R, AL)
    acc = group_scaled_chunk(a4, s_hi, 0, x, acc, BLOCK_R, AL)
    acc = group_scaled_chunk(a5, s_hi, 8, x, acc, BLOCK_R, AL)
    acc = group_scaled_chunk(a6, s_hi, 16, x, acc, BLOCK_R, AL)
    return group_scaled_chunk(a7, s_hi, 24, x, acc, BLOCK_R, AL)


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
    """`gl_decoded_tile` (one multiply) with DEC 0 (the checkpoint's bit order) or 3 (the `mxfp4_tiles_bits`
    layout's), else with `probe_word_bf16`'s decoding DEC."""
    if DEC == 0 or DEC == 3:
        return gl_decoded_tile(words, s, False, BLOCK_R, BLOCK_K, AL, DEC == 3)
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
    (CH = BK/128; DEC: as `probe_tile`'s) -> the bf16 A operand [16W, BK] whose column
    32·cc + 16a + 8p + 2t + e is code 4a + 2p + e of word cc of thread t."""
    mult = gl.expand_dims(mxfp4_scale_bf16(s, False), 5)
    mult, words = gl.broadcast(mult, words)
    if DEC == 0 or DEC == 3:
        v0, v4, v1, v5, v2, v6, v3, v7 = mxfp4_word_bf16(words, mult, False, DEC == 3)
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
