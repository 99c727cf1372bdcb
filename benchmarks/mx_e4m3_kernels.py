"""The kernels and host helpers of benchmarks/mx_e4m3_probe.py (its docstring explains the E4M3 decoding, the
split activations and the per-group scales): the words' load-time order (`E4M3_PLACE`, `e4m3_words`), the
activations' split (`e4m3_split`), and the Gluon up and down kernels on FP8 `wgmma` (`e4wg_up_kernel`,
`e4wg_down_kernel`) with their helpers."""

import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton.gl_common import gl_thread_barrier, gl_tma_load  # noqa: E402
from k3c.codegen.triton.gl_ring import gl_ring_fill, gl_ring_init, gl_ring_refill, gl_stage_words  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_gluon import gl_axis_layout, gl_layouts  # noqa: E402


def _e4m3_place():
    """Bit 4c + b of a checkpoint word (code c, b = 3 its sign) -> its place for the E4M3 decoding."""
    place = []
    for c in range(8):
        j = c % 4
        for b in range(4):
            place.append(8 * j + ((2, 3, 4, 7) if c < 4 else (0, 1, 6, 5))[b])
    assert sorted(place) == list(range(32))
    return tuple(place)


E4M3_PLACE = _e4m3_place()


def e4m3_words(w):
    """Checkpoint words u8 [E, R, C/2] -> i32 [E, R, C/8]: each 256-value K tile's words reordered (position 8t +
    g holds word 4g + t) and each word's bits placed by E4M3_PLACE."""
    E, R, half = w.shape
    words = w.view(torch.int32).view(E, R, half // 128, 8, 4).transpose(3, 4).contiguous().view(E, R, half // 4)
    out = torch.zeros_like(words)
    for src, dst in enumerate(E4M3_PLACE):
        bit = (words >> src) & 1
        out |= bit << dst
    return out


def e4m3_split(x):
    """x [R, C] (fp32 values of bf16) -> (u8 [R, 2C] in the kernel's order, rinv f32 [R] = 2^-r). Per 256-value
    tile: 8 groups × (hi, lo) × 32 bytes, byte c of a group's part holding value 8·((c % 16) // 4) + 4·(c // 16) +
    c % 4 of the group."""
    R, C = x.shape
    m = x.abs().amax(1)
    e = torch.floor(torch.log2(torch.where(m > 0, m, torch.ones_like(m))))
    r = torch.where(m > 0, 7 - e, torch.zeros_like(e)).clamp(-120, 120)
    xs = x * torch.exp2(r)[:, None]
    hi = xs.to(torch.float8_e4m3fn)
    lo = (xs - hi.float()).to(torch.float8_e4m3fn)
    c = torch.arange(32, device=x.device)
    f = 8 * ((c % 16) // 4) + 4 * (c // 16) + c % 4
    parts = torch.stack([hi.view(torch.uint8), lo.view(torch.uint8)], 1).view(R, 2, C // 256, 8, 32)
    parts = parts[..., f].permute(0, 2, 3, 1, 4).contiguous()           # [R, tile, group, part, 32]
    return parts.view(R, 2 * C), torch.exp2(-r).float()


@gluon.constexpr_function
def e4_layouts(W, BM):
    """(per-thread [W, 8, 4, 8], scale bytes [W, 2, 8, 4, 8], bytes [W, 8, 4, 8, 2(r), 2(h), 4], wgmma acc of BM
    token columns, its A operand)."""
    c4 = gl.BlockedLayout([1, 1, 1, 8], [1, 8, 4, 1], [W, 1, 1, 1], [3, 2, 1, 0])
    s5 = gl.BlockedLayout([1, 2, 1, 1, 8], [1, 1, 8, 4, 1], [W, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    p7 = gl.BlockedLayout([1, 1, 1, 8, 2, 2, 4], [1, 8, 4, 1, 1, 1, 1], [W, 1, 1, 1, 1, 1, 1], [6, 5, 4, 3, 2, 1, 0])
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BM, 32])
    return c4, s5, p7, acc, gl.DotOperandLayout(operand_index=0, parent=acc, k_width=4)


@gluon.jit
def e4_axis(n: gl.constexpr, d: gl.constexpr, rank: gl.constexpr, L: gl.constexpr):
    """arange(n) along dim d of a rank-`rank` tensor in layout L, every other dim of size 1."""
    v = gl.arange(0, n, gl_axis_layout(L, rank, d))
    for k in gl.static_range(rank):
        if k != d:
            v = gl.expand_dims(v, k)
    return v


@gluon.constexpr_function
def e4_bits3(shape):
    """shape [..., 8] -> [..., 2, 2, 2]."""
    return [int(getattr(d, "value", d)) for d in shape[:-1]] + [2, 2, 2]


@gluon.jit
def e4_split8(x):
    """x [..., 8] (last dim per thread) -> its 8 slices along the last dim, in order; no data moved."""
    y = gl.reshape(x, e4_bits3(x.shape))
    e, o = gl.split(y)
    ee, eo = gl.split(e)
    oe, oo = gl.split(o)
    x0, x4 = gl.split(ee)
    x2, x6 = gl.split(eo)
    x1, x5 = gl.split(oe)
    x3, x7 = gl.split(oo)
    return x0, x1, x2, x3, x4, x5, x6, x7


@gluon.jit
def e4_word(w):
    """i32 words in the E4M3_PLACE bit order -> (codes 0..3, codes 4..7), 4 E4M3 bytes each: 5 instructions."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 a, t, u;
        and.b32 a, $2, 0x9c9c9c9c;
        shl.b32 t, $2, 2; shr.b32 u, $2, 2; and.b32 u, u, 0x10101010;
        lop3.b32 $1, t, 0x8c8c8c8c, u, 0xea;
        mov.b32 $0, a;
        }""", "=r,=r,r", [w], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def e4_operands(words, C4: gl.constexpr, P7: gl.constexpr, AL: gl.constexpr):
    """A stage's words [W, 2, 8, 4, 2, 4] i32 (rows 16w + 8h + g, position 8t + group) -> the 8 groups' `wgmma` A
    operands, E4M3 [16W, 32] each in AL (row 16w + 8h + g, k 16r + 4t + b: byte b of half r of the decoding)."""
    W: gl.constexpr = words.shape[0]
    wh = gl.split(gl.permute(gl.reshape(words, [W, 2, 8, 4, 8]), (0, 2, 3, 4, 1)))
    g_lo, g_hi = e4_word(gl.convert_layout(wh[0], C4, assert_trivial=True))
    r_lo, r_hi = e4_word(gl.convert_layout(wh[1], C4, assert_trivial=True))
    x = gl.join(gl.join(g_lo, g_hi), gl.join(r_lo, r_hi))                 # [W, 8, 4, 8, 2(r), 2(h)]
    x = gl.convert_layout(x, gl.SliceLayout(6, P7), assert_trivial=True)
    xb = gl.broadcast(gl.expand_dims(x, 6), gl.full([W, 8, 4, 8, 2, 2, 4], 0, gl.int32, P7))[0]
    y = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [xb], dtype=gl.float8e4nv, is_pure=True, pack=4)
    y = gl.reshape(gl.permute(y, (0, 5, 1, 4, 2, 6, 3)), [16 * W, 32, 8])      # (w, h, g), (r, t, b), group
    a0, a1, a2, a3, a4, a5, a6, a7 = e4_split8(y)
    return (gl.convert_layout(a0, AL, assert_trivial=True), gl.convert_layout(a1, AL, assert_trivial=True),
            gl.convert_layout(a2, AL, assert_trivial=True), gl.convert_layout(a3, AL, assert_trivial=True),
            gl.convert_layout(a4, AL, assert_trivial=True), gl.convert_layout(a5, AL, assert_trivial=True),
            gl.convert_layout(a6, AL, assert_trivial=True), gl.convert_layout(a7, AL, assert_trivial=True))


@gluon.jit
def e4_factors(s, C4: gl.constexpr, ACC: gl.constexpr):
    """Scale bytes [W, 2, 8, 4, 8] u8 (rows 16w + 8h + g, group) -> the 8 groups' factors 2^(s − 121), f32
    [16W, BM] each in ACC (every token column of a row alike)."""
    f = ((s.to(gl.int32) + 6) << 23).to(gl.float32, bitcast=True)
    fh = gl.split(gl.permute(f, (0, 2, 3, 4, 1)))
    fg = e4_split8(gl.convert_layout(fh[0], C4, assert_trivial=True))
    fr = e4_split8(gl.convert_layout(fh[1], C4, assert_trivial=True))
    return (e4_factor_tile(fg[0], fr[0], ACC), e4_factor_tile(fg[1], fr[1], ACC),
            e4_factor_tile(fg[2], fr[2], ACC), e4_factor_tile(fg[3], fr[3], ACC),
            e4_factor_tile(fg[4], fr[4], ACC), e4_factor_tile(fg[5], fr[5], ACC),
            e4_factor_tile(fg[6], fr[6], ACC), e4_factor_tile(fg[7], fr[7], ACC))


@gluon.jit
def e4_factor_tile(fg, fr, ACC: gl.constexpr):
    """Factors of rows g and g + 8, [W, 8, 4] each -> [16W, BM] in ACC (row 16w + 8h + g, token 8·c8 + 2t + c)."""
    W: gl.constexpr = fg.shape[0]
    BM: gl.constexpr = ACC.instr_shape[1]
    x = gl.join(gl.join(fg, fg), gl.join(fr, fr))                         # [W, 8, 4, 2(c), 2(h)]
    if BM == 8:
        return gl.convert_layout(gl.reshape(gl.permute(x, (0, 4, 1, 2, 3)), [16 * W, 8]), ACC, assert_trivial=True)
    else:
        y = gl.permute(gl.join(x, x), (0, 4, 1, 5, 2, 3))                 # (w, h, g, c8, t, c)
        return gl.convert_layout(gl.reshape(y, [16 * W, 16]), ACC, assert_trivial=True)


@gluon.jit
def e4_group(a, act, k: gl.constexpr, zero):
    """One MX group: p = A·hi + A·lo (two asynchronous `wgmma` m64nBMk32 E4M3, fp32)."""
    BM: gl.constexpr = zero.shape[1]
    hi = act.slice(2 * k * BM, BM, dim=0).permute((1, 0))
    lo = act.slice((2 * k + 1) * BM, BM, dim=0).permute((1, 0))
    p = gl.nvidia.hopper.warpgroup_mma(a, hi, zero, use_acc=False, is_async=True)
    return gl.nvidia.hopper.warpgroup_mma(a, lo, p, use_acc=True, is_async=True)


@gluon.jit
def e4_tile(acc, words, s, act, C4: gl.constexpr, P7: gl.constexpr, ACC: gl.constexpr, AL: gl.constexpr,
            HALF: gl.constexpr = False):
    """acc [16W, BM] f32 += one K tile of 256: 8 groups, each its two `wgmma`s, then the group factors; HALF: the
    groups in two halves of 4, each waited for before the next is issued (half the live partials)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = e4_operands(words, C4, P7, AL)
    f0, f1, f2, f3, f4, f5, f6, f7 = e4_factors(s, C4, ACC)
    zero = gl.zeros(acc.shape, gl.float32, ACC)
    p0 = e4_group(a0, act, 0, zero)
    p1 = e4_group(a1, act, 1, zero)
    p2 = e4_group(a2, act, 2, zero)
    p3 = e4_group(a3, act, 3, zero)
    if HALF:
        p0, p1, p2, p3 = gl.nvidia.hopper.warpgroup_mma_wait(0, deps=(p0, p1, p2, p3))
        acc = acc + p0 * f0 + p1 * f1 + p2 * f2 + p3 * f3
    p4 = e4_group(a4, act, 4, zero)
    p5 = e4_group(a5, act, 5, zero)
    p6 = e4_group(a6, act, 6, zero)
    p7 = e4_group(a7, act, 7, zero)
    if HALF:
        p4, p5, p6, p7 = gl.nvidia.hopper.warpgroup_mma_wait(0, deps=(p4, p5, p6, p7))
        return acc + p4 * f4 + p5 * f5 + p6 * f6 + p7 * f7
    else:
        p0, p1, p2, p3, p4, p5, p6, p7 = gl.nvidia.hopper.warpgroup_mma_wait(
            0, deps=(p0, p1, p2, p3, p4, p5, p6, p7))
        return acc + p0 * f0 + p1 * f1 + p2 * f2 + p3 * f3 + p4 * f4 + p5 * f5 + p6 * f6 + p7 * f7


@gluon.jit
def e4_fill(d1, d3, dx, r1, r3, act, bar, row, xrow, t, NT: gl.constexpr, BM: gl.constexpr):
    """K tile t (< NT, else nothing) into stage t % 2: the words of weight rows row.. of d1 and d3 ([64, 32]
    boxes) and the 16 (group, part) × BM × 32 activation bytes of sorted rows xrow.. (dx: 3-D descriptor, box
    [16, BM, 32]), all on the stage's mbarrier."""
    stage = t % 2
    ok = t < NT
    gl.nvidia.hopper.mbarrier.expect(bar.index(stage), 2 * d1.block_type.nbytes + dx.block_type.nbytes, ok)
    gl_tma_load(d1, [row, t * 32], bar.index(stage), r1.index(stage), ok)
    gl_tma_load(d3, [row, t * 32], bar.index(stage), r3.index(stage), ok)
    dst = act.index(stage)._reinterpret(gl.float8e4nv, [16, BM, 32], gl.NVMMASharedLayout(32, 8, rank=3))
    gl_tma_load(dx, [t * 16, xrow, 0], bar.index(stage), dst, ok)


@gluon.jit
def e4_scale_offsets(r0, KDIM: gl.constexpr, W: gl.constexpr, S5: gl.constexpr):
    """Offsets [W, 2, 8, 4, 8] (S5) of K tile 0's scale bytes of global weight rows r0 + 16w + 8h + g (i64) in u8
    [.., KDIM/32] (the thread's 8 groups of each of its two rows; t broadcast)."""
    srow = r0 + 16 * e4_axis(W, 0, 5, S5) + 8 * e4_axis(2, 1, 5, S5) + e4_axis(8, 2, 5, S5)
    return srow * (KDIM // 32) + e4_axis(8, 4, 5, S5) + 0 * e4_axis(4, 3, 5, S5)


@gluon.jit
def e4_act_pointers(x_ptr, row0, row_end, KDIM: gl.constexpr, BM: gl.constexpr, XL: gl.constexpr):
    """i32 pointers [16 (group, part), BM, 8] (XL) of K tile 0 of the split activation rows row0 .. row0 + BM − 1
    (i32 [.., KDIM/2] a row; rows past row_end read row0)."""
    m = row0 + e4_axis(BM, 1, 3, XL)
    m = gl.where(m < row_end, m, row0)
    return x_ptr + m * (KDIM // 2) + e4_axis(16, 0, 3, XL) * 8 + e4_axis(8, 2, 3, XL)


@gluon.jit
def e4wg_up_kernel(zq_ptr, dx, zrinv_ptr, w1, w3, s1_ptr, s3_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                   g_ptr, u_ptr, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr, BM: gl.constexpr,
                   NOLOAD: gl.constexpr, ACT_TMA: gl.constexpr = False, HALF: gl.constexpr = False):
    """Module docstring. zq u8 [rows, 2D] and zrinv f32 [rows]: `e4m3_split` of the sorted rows' z; w1 / w3: TMA
    descriptors of `e4m3_words` i32 [E·I, D/8], boxes [64, 32]; s1 / s3 u8 [E, I, D/32]; g / u f32 [rows, I]."""
    W: gl.constexpr = 4
    NT: gl.constexpr = D // 256
    C4: gl.constexpr = e4_layouts(W, BM)[0]
    S5: gl.constexpr = e4_layouts(W, BM)[1]
    P7: gl.constexpr = e4_layouts(W, BM)[2]
    ACC: gl.constexpr = e4_layouts(W, BM)[3]
    AL: gl.constexpr = e4_layouts(W, BM)[4]
    WL: gl.constexpr = gl_layouts(W, 256, 8)[0]
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [2, 8, 2], [4, 1, 1], [2, 1, 0])
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    if e < E:
        row0 = gl.load(tile_row0_ptr + tile)
        row_end = gl.load(tile_row_end_ptr + tile)
        i0 = gl.program_id(1) * 64
        soff = e4_scale_offsets(e.to(gl.int64) * I + i0, D, W, S5)
        row = (e * I + i0).to(gl.int32)
        r1 = gl.allocate_shared_memory(gl.int32, [2, 64, 32], w1.layout)
        r3 = gl.allocate_shared_memory(gl.int32, [2, 64, 32], w3.layout)
        bar = gl_ring_init(2)
        gacc = gl.zeros([64, BM], gl.float32, ACC)
        uacc = gl.zeros([64, BM], gl.float32, ACC)
        if ACT_TMA:
            act = gl.allocate_shared_memory(gl.float8e4nv, [2, 16 * BM, 32], gl.NVMMASharedLayout(32, 8, rank=2))
            xrow = row0.to(gl.int32)
            e4_fill(w1, w3, dx, r1, r3, act, bar, row, xrow, 0, NT, BM)
            for it in range(NT):
                e4_fill(w1, w3, dx, r1, r3, act, bar, row, xrow, it + 1, NT, BM)
                q1, q3 = gl.load(s1_ptr + soff + it * 8), gl.load(s3_ptr + soff + it * 8)
                gl.nvidia.hopper.mbarrier.wait(bar.index(it % 2), (it // 2) & 1)
                a = act.index(it % 2)
                gacc = e4_tile(gacc, gl_stage_words(r1.index(it % 2), W, 2, WL), q1, a, C4, P7, ACC, AL, HALF)
                uacc = e4_tile(uacc, gl_stage_words(r3.index(it % 2), W, 2, WL), q3, a, C4, P7, ACC, AL, HALF)
        else:
            act32 = gl.allocate_shared_memory(gl.int32, [16 * BM, 8], gl.NVMMASharedLayout(32, 32, rank=2))
            act = act32._reinterpret(gl.float8e4nv, [16 * BM, 32], gl.NVMMASharedLayout(32, 8, rank=2))
            xp = e4_act_pointers(zq_ptr, row0, row_end, D, BM, XL)
            gl_ring_fill(w1, w3, r1, r3, bar, row, 0, NT, 2, True, 0)
            if NOLOAD:
                gl_ring_fill(w1, w3, r1, r3, bar, row, 1, NT, 2, True, 0)
                gl.nvidia.hopper.mbarrier.wait(bar.index(0), 0)
                gl.nvidia.hopper.mbarrier.wait(bar.index(1), 0)
            x = gl.load(xp)
            for it in range(NT):
                nx = gl.where(it + 1 < NT, it + 1, 0)
                if not NOLOAD:
                    gl_ring_refill(w1, w3, r1, r3, bar, row, it, NT, 2, True, 0)
                gl_thread_barrier()
                act32.store(gl.reshape(x, [16 * BM, 8]))
                gl.nvidia.hopper.fence_async_shared()
                gl_thread_barrier()
                x = gl.load(xp + nx * 128)
                q1, q3 = gl.load(s1_ptr + soff + it * 8), gl.load(s3_ptr + soff + it * 8)
                if not NOLOAD:
                    gl.nvidia.hopper.mbarrier.wait(bar.index(it % 2), (it // 2) & 1)
                gacc = e4_tile(gacc, gl_stage_words(r1.index(it % 2), W, 2, WL), q1, act, C4, P7, ACC, AL, HALF)
                uacc = e4_tile(uacc, gl_stage_words(r3.index(it % 2), W, 2, WL), q3, act, C4, P7, ACC, AL, HALF)
        tok = row0 + gl.arange(0, BM, gl.SliceLayout(0, ACC))
        ok = tok < row_end
        rinv = gl.load(zrinv_ptr + tok, mask=ok, other=0.0)
        out = gl.expand_dims(tok.to(gl.int64) * I, 0) + gl.expand_dims(i0 + gl.arange(0, 64, gl.SliceLayout(1, ACC)), 1)
        gl.store(g_ptr + out, gacc * gl.expand_dims(rinv, 0), mask=gl.expand_dims(ok, 0))
        gl.store(u_ptr + out, uacc * gl.expand_dims(rinv, 0), mask=gl.expand_dims(ok, 0))



@gluon.jit
def e4_fill1(d2, dx, r2, act, bar, row, xrow, t, NT: gl.constexpr, BM: gl.constexpr):
    """`e4_fill` of the down kernel: one matrix."""
    stage = t % 2
    ok = t < NT
    gl.nvidia.hopper.mbarrier.expect(bar.index(stage), d2.block_type.nbytes + dx.block_type.nbytes, ok)
    gl_tma_load(d2, [row, t * 32], bar.index(stage), r2.index(stage), ok)
    dst = act.index(stage)._reinterpret(gl.float8e4nv, [16, BM, 32], gl.NVMMASharedLayout(32, 8, rank=3))
    gl_tma_load(dx, [t * 16, xrow, 0], bar.index(stage), dst, ok)


@gluon.jit
def e4wg_down_kernel(hq_ptr, dx, hrinv_ptr, w2, s2_ptr, weights_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                     tile_row_end_ptr, y_slot_ptr, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr,
                     BM: gl.constexpr, ACT_TMA: gl.constexpr = False, HALF: gl.constexpr = False):
    """The down kernel on the same path: y_slot[(token, slot)] = (h W2[e]ᵀ) · weight for one BM-row tile and 64
    output columns; hq u8 [rows, 2I] / hrinv f32 [rows]: `e4m3_split` of h's sorted rows (dx: hq's 3-D
    descriptor when ACT_TMA); w2: TMA descriptor of `e4m3_words` i32 [E·D, I/8]; s2 u8 [E, D, I/32]."""
    W: gl.constexpr = 4
    NT: gl.constexpr = I // 256
    C4: gl.constexpr = e4_layouts(W, BM)[0]
    S5: gl.constexpr = e4_layouts(W, BM)[1]
    P7: gl.constexpr = e4_layouts(W, BM)[2]
    ACC: gl.constexpr = e4_layouts(W, BM)[3]
    AL: gl.constexpr = e4_layouts(W, BM)[4]
    WL: gl.constexpr = gl_layouts(W, 256, 8)[0]
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [2, 8, 2], [4, 1, 1], [2, 1, 0])
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    if e < E:
        row0 = gl.load(tile_row0_ptr + tile)
        row_end = gl.load(tile_row_end_ptr + tile)
        n0 = gl.program_id(1) * 64
        soff = e4_scale_offsets(e.to(gl.int64) * D + n0, I, W, S5)
        row = (e * D + n0).to(gl.int32)
        r2 = gl.allocate_shared_memory(gl.int32, [2, 64, 32], w2.layout)
        bar = gl_ring_init(2)
        acc = gl.zeros([64, BM], gl.float32, ACC)
        if ACT_TMA:
            act = gl.allocate_shared_memory(gl.float8e4nv, [2, 16 * BM, 32], gl.NVMMASharedLayout(32, 8, rank=2))
            xrow = row0.to(gl.int32)
            e4_fill1(w2, dx, r2, act, bar, row, xrow, 0, NT, BM)
            for it in range(NT):
                e4_fill1(w2, dx, r2, act, bar, row, xrow, it + 1, NT, BM)
                q2 = gl.load(s2_ptr + soff + it * 8)
                gl.nvidia.hopper.mbarrier.wait(bar.index(it % 2), (it // 2) & 1)
                acc = e4_tile(acc, gl_stage_words(r2.index(it % 2), W, 2, WL), q2, act.index(it % 2), C4, P7, ACC,
                              AL, HALF)
        else:
            xp = e4_act_pointers(hq_ptr, row0, row_end, I, BM, XL)
            act32 = gl.allocate_shared_memory(gl.int32, [16 * BM, 8], gl.NVMMASharedLayout(32, 32, rank=2))
            act = act32._reinterpret(gl.float8e4nv, [16 * BM, 32], gl.NVMMASharedLayout(32, 8, rank=2))
            gl_ring_fill(w2, w2, r2, r2, bar, row, 0, NT, 2, False, 0)
            x = gl.load(xp)
            for it in range(NT):
                nx = gl.where(it + 1 < NT, it + 1, 0)
                gl_ring_refill(w2, w2, r2, r2, bar, row, it, NT, 2, False, 0)
                gl_thread_barrier()
                act32.store(gl.reshape(x, [16 * BM, 8]))
                gl.nvidia.hopper.fence_async_shared()
                gl_thread_barrier()
                x = gl.load(xp + nx * 128)
                q2 = gl.load(s2_ptr + soff + it * 8)
                gl.nvidia.hopper.mbarrier.wait(bar.index(it % 2), (it // 2) & 1)
                acc = e4_tile(acc, gl_stage_words(r2.index(it % 2), W, 2, WL), q2, act, C4, P7, ACC, AL, HALF)
        rows = row0 + gl.arange(0, BM, gl.SliceLayout(0, ACC))
        ok = rows < row_end
        slot = gl.load(order_ptr + rows, mask=ok, other=0)
        f = gl.load(hrinv_ptr + rows, mask=ok, other=0.0) * gl.load(weights_ptr + slot, mask=ok, other=0.0)
        out = gl.expand_dims(slot * D, 0) + gl.expand_dims(n0 + gl.arange(0, 64, gl.SliceLayout(1, ACC)), 1)
        gl.store(y_slot_ptr + out, acc * gl.expand_dims(f, 0), mask=gl.expand_dims(ok, 0))
