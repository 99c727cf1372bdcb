"""K-split Gluon decode kernels of MXFP4 `moe_experts`: a CTA's warps share 16 weight rows and split each K step
between them, so the TMA ring reads every weight row in runs of W·128 bytes.

Why: the decode kernels of `moe_mxfp4_gluon` give each warp its own 16 rows and stream a [16·W, 256]-value box a
matrix per K tile, so each row is read in 128-byte pieces D/2 bytes apart, one piece a tile (BENCHMARKS.md "MXFP4
round, run M": the DRAM's side of that order). Here warp w of a step's W chunks of 256 values decodes chunk
it·W + w of the same 16 rows: the step's W boxes [16, 32 words] a matrix are issued back to back, so each row's
W·128 bytes are read together. The words, their decoding, the activations' order and the `mma.sync` instructions
are `moe_mxfp4_gluon`'s (its layouts with the warp dimension on the K chunks instead of the rows), run as a
batched MMA [W, 16, BM] (warp w: chunk w's partial sums); the W partial sums are added once, at the end
(`gl.sum` over the warps, through shared memory). Chunks past K (D = 3584 is 14 chunks: W = 4 leaves half the
last step empty) copy the last chunk again and load their activations as 0, so they add 0 (`ks_fill`).

Each warp's activations are its own chunk's: in the up kernel one step ahead in registers (`gl_act_ahead` modes
1 and 2), in the down kernel at use; the scale bytes one step ahead. Scope (`moe_mxfp4_gluon.gluon_decode_ok`,
`ksplit_kernel`): bf16 activations on a GPU, 8- or 16-token tiles, 2, 4 or 8 warps, chunks of 256 values (the
jit functions spell it 256 or derive it from their operands' shapes: an emitted module holds no constexpr
globals), K and the weight rows multiples of 256 and 16, a TMA ring of at least 2 steps. Public API: the jit
helpers (pasted into the emitted modules), `moe_up_mx_ksplit_kernel` and `moe_down_mx_ksplit_kernel` (their
words: `gl_word_descs(w, 16, 256)`)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3c.codegen.triton.gl_common import gl_tma_load
from k3c.codegen.triton.moe_act import glu
from k3c.codegen.triton.moe_mxfp4 import mxfp4_scale_bf16, mxfp4_word_bf16
from k3c.codegen.triton.moe_mxfp4_gluon import (gl_axis_layout, gl_permuted_col, gl_ring_init, gl_stage_words,
                                               gl_tile_rows)

@gluon.constexpr_function
def ks_layouts(W, BM):
    """(words [W, 2, 8, 4, 2, 4], batched MMA accumulator [W, 16, BM], A operand [W, 16, 256], B operand
    [W, 256, BM], activation pairs [W, 128, BM]) for W warps, warp w holding chunk w: `moe_mxfp4_gluon.gl_layouts`
    at BLOCK_K 256 with the MMA's and the activations' warp dimension leading (the words' already is: a ring
    stage [16·W, 32] i32, box w in rows 16w .., loads as in `gl_stage_words`)."""
    words = gl.BlockedLayout([1, 2, 1, 1, 2, 4], [1, 1, 8, 4, 1, 1], [W, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    warp = [[1 << i, 0, 0] for i in range(W.bit_length() - 1)]
    pairs = gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 32, 0], [0, 64, 0]] +
        [[0, 0, 8 << i] for i in range((BM // 8).bit_length() - 1)],
        lane_bases=[[0, 8, 0], [0, 16, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], warp_bases=warp,
        block_bases=[], shape=[W, 128, BM])
    return (words, mma, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8),
            gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8), pairs)


@gluon.jit
def ks_scale_offsets(row0, KDIM: gl.constexpr, W: gl.constexpr, WL: gl.constexpr):
    """(offsets [W, 2, 8, 4, 2] (SliceLayout(5, WL)) of step 0's scale bytes: row row0 + 8h + g, chunk w's group
    8w + 2t + ch in bytes [.., KDIM/32], the chunk index w [W, 1, 1, 1, 1] to mask chunks past KDIM)."""
    SL: gl.constexpr = gl.SliceLayout(5, WL)
    w = gl.expand_dims(gl.arange(0, W, gl_axis_layout(SL, 5, 0)), (1, 2, 3, 4))
    h = gl.expand_dims(gl.arange(0, 2, gl_axis_layout(SL, 5, 1)), (0, 2, 3, 4))
    g = gl.expand_dims(gl.arange(0, 8, gl_axis_layout(SL, 5, 2)), (0, 1, 3, 4))
    t = gl.expand_dims(gl.arange(0, 4, gl_axis_layout(SL, 5, 3)), (0, 1, 2, 4))
    ch = gl.expand_dims(gl.arange(0, 2, gl_axis_layout(SL, 5, 4)), (0, 1, 2, 3))
    return (row0 + 8 * h + g) * (KDIM // 32) + 8 * w + 2 * t + ch, w


@gluon.jit
def ks_act_offsets(rows_m, KDIM: gl.constexpr, W: gl.constexpr, PL: gl.constexpr):
    """(offsets [W, 128, BM] (PL) of step 0's activation pairs (i32) of rows rows_m [BM] in [.., KDIM/2] (chunk w:
    pairs 128w ..), the chunk index w [W, 1, 1])."""
    CHUNK: gl.constexpr = 256
    w = gl.expand_dims(gl.arange(0, W, gl_axis_layout(PL, 3, 0)), (1, 2))
    k = gl.expand_dims(gl.arange(0, CHUNK // 2, gl_axis_layout(PL, 3, 1)), (0, 2))
    m = gl.expand_dims(rows_m.to(gl.int64) * (KDIM // 2), (0, 1))
    return m + k + (CHUNK // 2) * w, w


@gluon.jit
def ks_load(ptr, chunk, NC: gl.constexpr):
    """gl.load of `ptr`, 0 where `chunk` (the K chunk each element lies in: warp w's of the step) is past the
    NC chunks of K; unmasked when the warps split NC evenly (chunk's dim 0 is the W warps)."""
    if NC % chunk.shape[0] == 0:
        return gl.load(ptr)
    else:
        return gl.load(ptr, mask=chunk < NC, other=0)


@gluon.jit
def ks_act_operand(pairs, BL: gl.constexpr):
    """`gl_act_operand` per warp: the bf16 B operand [W, 256, BM] (BL) of pairs i32 [W, 128, BM]."""
    W: gl.constexpr = pairs.shape[0]
    BM: gl.constexpr = pairs.shape[2]
    CHUNK: gl.constexpr = 2 * pairs.shape[1]
    p = gl.reshape(gl.permute(gl.reshape(pairs, [W, CHUNK // 64, 4, 4, 2, BM]), (0, 1, 4, 2, 3, 5)),
                   [W, CHUNK // 2, BM])
    lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    x = gl.reshape(gl.permute(gl.join(lo, hi), (0, 1, 3, 2)), [W, CHUNK, BM])
    return gl.convert_layout(x, BL, assert_trivial=True)


@gluon.jit
def ks_decoded_tile(words, s, TWO_MULS: gl.constexpr, AL: gl.constexpr):
    """`gl_decoded_tile` per warp: the bf16 A operand [W, 16, 256] of words [W, 2, 8, 4, 2, 4] (i32) with their
    E8M0 bytes s [W, 2, 8, 4, 2]."""
    W: gl.constexpr = words.shape[0]
    CHUNK: gl.constexpr = 128 * words.shape[4]
    mult = gl.expand_dims(mxfp4_scale_bf16(s, TWO_MULS), 5)
    mult, words = gl.broadcast(mult, words)
    v0, v4, v1, v5, v2, v6, v3, v7 = mxfp4_word_bf16(words, mult, TWO_MULS)
    v = gl.join(gl.join(gl.join(v0, v4), gl.join(v1, v5)), gl.join(gl.join(v2, v6), gl.join(v3, v7)))
    tile = gl.reshape(gl.permute(v, (0, 1, 2, 4, 5, 3, 8, 7, 6)), [W, 16, CHUNK])
    return gl.convert_layout(tile, AL, assert_trivial=True)


@gluon.jit
def ks_fill(d1, d3, r1, r3, bar, row, t, NT: gl.constexpr, NC: gl.constexpr, STAGES: gl.constexpr,
            W: gl.constexpr, PAIR: gl.constexpr):
    """Step t (< NT, else nothing) of weight rows row .. row + 15: the W boxes [16, 32 words] of chunks t·W .. of
    d1 (and, PAIR, d3), issued back to back into rows 16b .. of stage t % STAGES of ring r1 (r3) [STAGES, 16·W,
    32], completing on its mbarrier. A chunk past K (≥ NC) copies chunk NC − 1 again (in bounds, so the step's
    byte count is whole; from L2, the step has just asked for it): its activations load as 0, so it adds 0."""
    stage = t % STAGES
    ok = t < NT
    BOX: gl.constexpr = d1.block_type.shape[1]       # 32 words: a chunk of 256 values
    BYTES: gl.constexpr = (2 if PAIR else 1) * W * d1.block_type.nbytes
    gl.nvidia.hopper.mbarrier.expect(bar.index(stage), BYTES, ok)
    for b in gl.static_range(W):
        col = gl.minimum(gl.to_tensor(t * W + b), NC - 1) * BOX
        gl_tma_load(d1, [row, col], bar.index(stage), r1.index(stage).slice(16 * b, 16), ok)
        if PAIR:
            gl_tma_load(d3, [row, col], bar.index(stage), r3.index(stage).slice(16 * b, 16), ok)


@gluon.jit
def ks_up_step(r1, r3, bar, it, x, t1, t3, gate, up, STAGES: gl.constexpr, W: gl.constexpr, TWO_MULS: gl.constexpr,
               AL: gl.constexpr, WL: gl.constexpr):
    """One step of the up kernel: wait for step `it`'s stage, decode its words (scale bytes t1, t3) and add their
    products with the activations x to the gate and up partial sums."""
    gl.nvidia.hopper.mbarrier.wait(bar.index(it % STAGES), (it // STAGES) & 1)
    c1 = gl_stage_words(r1.index(it % STAGES), W, 2, WL)
    c3 = gl_stage_words(r3.index(it % STAGES), W, 2, WL)
    gate = gl.nvidia.ampere.mma_v2(ks_decoded_tile(c1, t1, TWO_MULS, AL), x, gate)
    up = gl.nvidia.ampere.mma_v2(ks_decoded_tile(c3, t3, TWO_MULS, AL), x, up)
    return gate, up


@gluon.jit
def moe_up_mx_ksplit_kernel(zp_ptr, w1, w3, s1_ptr, s3_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                            tile_row_end_ptr, hp_ptr, SITU_BETA, SITU_LINEAR_BETA, E: gl.constexpr, K: gl.constexpr,
                            D: gl.constexpr, I: gl.constexpr, ACT_SITU: gl.constexpr, TWO_MULS: gl.constexpr,
                            BLOCK_M: gl.constexpr, W: gl.constexpr, BLOCK_K2: gl.constexpr, STAGES: gl.constexpr,
                            ACT_AHEAD: gl.constexpr):
    """`moe_up_mx_gluon_kernel` with its K split over the CTA's W warps (module docstring), for one BLOCK_M-row
    tile and 16 intermediate columns: h = act(z W1[e]ᵀ, z W3[e]ᵀ) into hp [N·k, I] in `gl_permute` order of
    BLOCK_K2. zp: z [N, D] (bf16 read as i32 pairs) `gl_permute`d by 256; w1 / w3: `gl_word_descs(w, 16, 256)`; s1 / s3 u8
    [E, I, D/32]; a ring of STAGES ≥ 2 steps. ACT_AHEAD 1: the next step's activations and scale bytes are
    loaded into registers carried across the loop; 2: the loop is unrolled by two so that two register sets take
    turns (`gl_act_ahead` mode 2: no copies at the back edge; an odd last step is peeled)."""
    CHUNK: gl.constexpr = 256
    NC: gl.constexpr = D // CHUNK
    NT: gl.constexpr = (NC + W - 1) // W
    WL: gl.constexpr = ks_layouts(W, BLOCK_M)[0]
    MMA: gl.constexpr = ks_layouts(W, BLOCK_M)[1]
    AL: gl.constexpr = ks_layouts(W, BLOCK_M)[2]
    BL: gl.constexpr = ks_layouts(W, BLOCK_M)[3]
    PL: gl.constexpr = ks_layouts(W, BLOCK_M)[4]
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    if e < E:
        ML: gl.constexpr = gl_axis_layout(PL, 3, 2)
        offs_m, m_ok = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BLOCK_M, ML)
        token = gl.load(order_ptr + offs_m, mask=m_ok, other=0) // K
        zoff, zc = ks_act_offsets(token, D, W, PL)      # rows past the tile read token 0, never stored
        i0 = gl.program_id(1) * 16
        soff, sc = ks_scale_offsets(e.to(gl.int64) * I + i0, D, W, WL)
        row = (e * I + i0).to(gl.int32)
        r1 = gl.allocate_shared_memory(gl.int32, [STAGES, 16 * W, CHUNK // 8], w1.layout)
        r3 = gl.allocate_shared_memory(gl.int32, [STAGES, 16 * W, CHUNK // 8], w3.layout)
        bar = gl_ring_init(STAGES)
        for p in gl.static_range(STAGES - 1):
            ks_fill(w1, w3, r1, r3, bar, row, p, NT, NC, STAGES, W, True)
        z = gl.load(zp_ptr + zoff, mask=zc < NC, other=0)
        s1 = gl.load(s1_ptr + soff, mask=sc < NC, other=0)
        s3 = gl.load(s3_ptr + soff, mask=sc < NC, other=0)
        gate = gl.zeros([W, 16, BLOCK_M], gl.float32, MMA)
        up = gl.zeros([W, 16, BLOCK_M], gl.float32, MMA)
        if ACT_AHEAD == 2:      # two register sets, a (z, s1, s3) and b, each reloaded after its last use
            for j in range(NT // 2):
                for u in gl.static_range(2):
                    it = 2 * j + u
                    ks_fill(w1, w3, r1, r3, bar, row, it + STAGES - 1, NT, NC, STAGES, W, True)
                    nx = gl.where(it + 1 < NT, it + 1, 0)   # the last prefetch wraps to step 0: unused
                    if u == 0:
                        x, t1, t3 = ks_act_operand(z, BL), s1, s3
                        zb = ks_load(zp_ptr + zoff + nx * (W * CHUNK // 2), zc + nx * W, NC)
                        s1b = ks_load(s1_ptr + soff + nx * (W * CHUNK // 32), sc + nx * W, NC)
                        s3b = ks_load(s3_ptr + soff + nx * (W * CHUNK // 32), sc + nx * W, NC)
                    else:
                        x, t1, t3 = ks_act_operand(zb, BL), s1b, s3b
                        z = ks_load(zp_ptr + zoff + nx * (W * CHUNK // 2), zc + nx * W, NC)
                        s1 = ks_load(s1_ptr + soff + nx * (W * CHUNK // 32), sc + nx * W, NC)
                        s3 = ks_load(s3_ptr + soff + nx * (W * CHUNK // 32), sc + nx * W, NC)
                    gate, up = ks_up_step(r1, r3, bar, it, x, t1, t3, gate, up, STAGES, W, TWO_MULS, AL, WL)
            if NT % 2:          # the last step, its activations in set a
                gate, up = ks_up_step(r1, r3, bar, NT - 1, ks_act_operand(z, BL), s1, s3, gate, up, STAGES, W,
                                      TWO_MULS, AL, WL)
        else:
            for it in range(NT):
                ks_fill(w1, w3, r1, r3, bar, row, it + STAGES - 1, NT, NC, STAGES, W, True)
                x, t1, t3 = ks_act_operand(z, BL), s1, s3
                nx = gl.where(it + 1 < NT, it + 1, 0)       # the last prefetch wraps to step 0: unused
                z = ks_load(zp_ptr + zoff + nx * (W * CHUNK // 2), zc + nx * W, NC)
                s1 = ks_load(s1_ptr + soff + nx * (W * CHUNK // 32), sc + nx * W, NC)
                s3 = ks_load(s3_ptr + soff + nx * (W * CHUNK // 32), sc + nx * W, NC)
                gate, up = ks_up_step(r1, r3, bar, it, x, t1, t3, gate, up, STAGES, W, TWO_MULS, AL, WL)
        h = glu(gl.sum(gate, 0), gl.sum(up, 0), SITU_BETA, SITU_LINEAR_BETA, ACT_SITU)
        OL: gl.constexpr = gl.SliceLayout(0, MMA)
        col = gl_permuted_col(i0 + gl.arange(0, 16, gl.SliceLayout(1, OL)), BLOCK_K2)
        offs_mo, m_ok_o = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BLOCK_M, gl.SliceLayout(0, OL))
        gl.store(hp_ptr + gl.expand_dims(offs_mo.to(gl.int64) * I, 0) + gl.expand_dims(col, 1),
                 h.to(hp_ptr.dtype.element_ty), mask=gl.expand_dims(m_ok_o, 0) & gl.expand_dims(col < I, 1))


@gluon.jit
def moe_down_mx_ksplit_kernel(hp_ptr, w2, s2_ptr, weights_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                              tile_row_end_ptr, y_slot_ptr, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr,
                              TWO_MULS: gl.constexpr, BLOCK_M: gl.constexpr, W: gl.constexpr,
                              STAGES: gl.constexpr):
    """`moe_down_mx_gluon_kernel` with its K split over the CTA's W warps, for one BLOCK_M-row tile and 16 output
    columns: y_slot[(token, slot)] = (h W2[e]ᵀ) · weight; hp [N·k, I] (bf16 read as i32 pairs) in `gl_permute`
    order of 256; w2: `gl_word_descs(w2, 16, 256)`; s2 u8 [E, D, I/32]."""
    CHUNK: gl.constexpr = 256
    NC: gl.constexpr = I // CHUNK
    NT: gl.constexpr = (NC + W - 1) // W
    WL: gl.constexpr = ks_layouts(W, BLOCK_M)[0]
    MMA: gl.constexpr = ks_layouts(W, BLOCK_M)[1]
    AL: gl.constexpr = ks_layouts(W, BLOCK_M)[2]
    BL: gl.constexpr = ks_layouts(W, BLOCK_M)[3]
    PL: gl.constexpr = ks_layouts(W, BLOCK_M)[4]
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    if e < E:
        offs_m, m_ok = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BLOCK_M, gl_axis_layout(PL, 3, 2))
        hoff, hc = ks_act_offsets(gl.where(m_ok, offs_m, 0), I, W, PL)    # rows past the tile: row 0
        n0 = gl.program_id(1) * 16
        soff, sc = ks_scale_offsets(e.to(gl.int64) * D + n0, I, W, WL)
        row = (e * D + n0).to(gl.int32)
        r2 = gl.allocate_shared_memory(gl.int32, [STAGES, 16 * W, CHUNK // 8], w2.layout)
        bar = gl_ring_init(STAGES)
        for p in gl.static_range(STAGES - 1):
            ks_fill(w2, w2, r2, r2, bar, row, p, NT, NC, STAGES, W, False)
        s2 = gl.load(s2_ptr + soff, mask=sc < NC, other=0)
        acc = gl.zeros([W, 16, BLOCK_M], gl.float32, MMA)
        for it in range(NT):
            ks_fill(w2, w2, r2, r2, bar, row, it + STAGES - 1, NT, NC, STAGES, W, False)
            x = ks_act_operand(ks_load(hp_ptr + hoff + it * (W * CHUNK // 2), hc + it * W, NC), BL)
            t2 = s2
            nx = gl.where(it + 1 < NT, it + 1, 0)
            s2 = ks_load(s2_ptr + soff + nx * (W * CHUNK // 32), sc + nx * W, NC)
            gl.nvidia.hopper.mbarrier.wait(bar.index(it % STAGES), (it // STAGES) & 1)
            acc = gl.nvidia.ampere.mma_v2(ks_decoded_tile(gl_stage_words(r2.index(it % STAGES), W, 2, WL), t2, TWO_MULS, AL), x, acc)
        out = gl.sum(acc, 0)
        OL: gl.constexpr = gl.SliceLayout(0, MMA)
        offs_mo, m_ok_o = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BLOCK_M, gl.SliceLayout(0, OL))
        slot = gl.load(order_ptr + offs_mo, mask=m_ok_o, other=0)
        weight = gl.load(weights_ptr + slot, mask=m_ok_o, other=0.0)
        offs_n = n0 + gl.arange(0, 16, gl.SliceLayout(1, OL))
        gl.store(y_slot_ptr + gl.expand_dims(slot * D, 0) + gl.expand_dims(offs_n, 1), out * gl.expand_dims(weight, 0),
                 mask=gl.expand_dims(m_ok_o, 0) & gl.expand_dims(offs_n < D, 1))
