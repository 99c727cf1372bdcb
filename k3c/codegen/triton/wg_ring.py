"""The TMA ring of k3c's `wgmma` MXFP4 decode kernels (k3c.codegen.triton.moe_mxfp4_wgmma): the descriptors of
their operands (`wg_word_desc`, `wg_pair_desc`, `wg_act_desc`), a stage's shared-memory layouts and its fill
(`wg_ring_fill`). Pasted with the kernels into the emitted modules.

A stage holds one K tile of 256 values for the CTA's 64 weight rows: the packed words of each matrix the kernel
reads, [64 rows, 32 words] (i32) each, and the tile's activations, [BLOCK_M, 256] bf16; every copy completes on the
stage's mbarrier. The words are one copy for both of the up phase's matrices (`wg_pair_desc`: a descriptor whose
leading dimension steps from one tensor to the other, 2 × 8 KB a copy), one for w2; the activations one. A copy
is a CTA barrier and an elected thread's `cp.async.bulk.tensor` in Triton 3.6's lowering, plus the predication
and descriptor moves around it, so one copy fewer a K tile of the up phase is 43 instructions fewer in its
two-tile loop body (1228 -> 1185, SASS of the one-launch kernel, Triton 3.6) and 2 of its 11 `BAR.SYNC`.
sm_90+. Public API: `WG_ROWS`, `WG_BLOCK_K`, `wg_act_desc`, `wg_word_desc`, `wg_pair_desc`, `wg_stage_layouts`,
`wg_ring_fill`."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3c.codegen.triton.gl_common import gl_reinterpret, gl_tma_load
from k3c.codegen.triton.gl_ring import gl_word_descs

#: weight rows of a CTA (one warpgroup: 4 warps of 16 rows)
WG_ROWS = 64
#: values of a K tile (a ring stage), decoded in two `wgmma` pieces of 128
WG_BLOCK_K = 256


def wg_act_desc(x: torch.Tensor, block_m: int):
    """TMA descriptor of activation rows x bf16 [R, K] (contiguous, K a multiple of 64) viewed as [K/64, R, 64]
    (a 64-column block, a row, a column), with [WG_BLOCK_K/64, block_m, 64] boxes: one copy a stage, each
    128-byte row swizzled as `wgmma` reads its B operand, the column blocks one after another, which is how the
    [block_m, WG_BLOCK_K] stage's 128-byte swizzled layout places them (`wg_ring_fill`). Rows past R read as
    zeros."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    R, K = x.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    return TensorDescriptor(x, [K // 64, R, 64], [64, K, 1], [WG_BLOCK_K // 64, block_m, 64], layout)


def wg_word_desc(w: torch.Tensor, tiled: int):
    """TMA descriptor of MXFP4 words w u8 [E, R, C/2] for a K tile of WG_ROWS rows a copy: row-major (tiled 0),
    `gl_word_descs`' [WG_ROWS, 32]-word boxes; in a tiled layout (1, 2: [32 rows, 32 words] tiles along K, then
    row block by row block) the i32 words viewed as [E·R/32, C/8, 32] (a 32-row block, a tile's row
    32·(K tile) + row, a word) with [2, 32, 32] boxes: two row blocks' tiles of one K tile, one copy, the same
    bytes in shared memory as a [64, 32] stage. Raises ValueError as `gl_word_descs`."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if not tiled:
        return gl_word_descs(w, WG_ROWS, WG_BLOCK_K)
    gl_word_descs(w, 32, WG_BLOCK_K, tiled)                 # its checks of w
    E, R, half = w.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)
    return TensorDescriptor(w.view(torch.int32), [E * R // 32, half // 4, 32], [half * 8, 32, 1], [2, 32, 32],
                            layout)


def wg_pair_desc(w1: torch.Tensor, w3: torch.Tensor, tiled: int):
    """One TMA descriptor of the up phase's two word tensors w1, w3 u8 [E, I, D/2] (one shape, one layout
    `tiled`): `wg_word_desc`'s view of the one at the lower address with a leading dimension of 2 whose stride is
    the distance to the other (TMA takes any stride that is a multiple of 16 bytes below 2^40), and boxes of both,
    so that one copy brings a K tile of both matrices ([2, 64, 32] words) where two did. Returns (descriptor,
    swap): swap 1 where w3 lies first (index 0 of the stage is then w3's), else 0. Raises ValueError as
    `wg_word_desc`, for tensors of two shapes, or for the same tensor twice."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    wg_word_desc(w1, tiled)
    wg_word_desc(w3, tiled)
    gap = w3.data_ptr() - w1.data_ptr()
    if w1.shape != w3.shape or gap == 0 or abs(gap) >= 1 << 40:
        raise ValueError(f"moe_experts: w1 {list(w1.shape)} and w3 {list(w3.shape)} must be two tensors of one shape "
                         f"less than 2^40 bytes apart for one TMA copy of both (wgmma decode kernels)")
    base = w1 if gap > 0 else w3
    E, R, half = w1.shape
    if tiled:
        shape, strides, box = [2, E * R // 32, half // 4, 32], [abs(gap) // 4, half * 8, 32, 1], [2, 2, 32, 32]
    else:
        shape, strides, box = [2, E * R, half // 4], [abs(gap) // 4, half // 4, 1], [2, WG_ROWS, WG_BLOCK_K // 8]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=len(shape))
    return TensorDescriptor(base.view(torch.int32), shape, strides, box, layout), int(gap < 0)


@gluon.constexpr_function
def wg_stage_layouts():
    """(words, activations): the rank-2 128-byte swizzled layouts of a [64, 32] i32 word stage and a
    [BM, 256] bf16 activation stage."""
    return (gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2),
            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


@gluon.jit
def wg_ring_fill(dw, da, rw, ra, bar, row, arow, t, stage, NT: gl.constexpr, PAIR: gl.constexpr,
                 TILED: gl.constexpr):
    """TMA K tile t (< NT, else nothing) into ring stage `stage`: the words of the 64 weight rows row.. (global:
    e·R + r) of dw into rw's [64, 32] stage (one copy, `wg_word_desc`; with PAIR both matrices of `wg_pair_desc`
    into its [128, 32] stage, one after the other, one copy), and the 256 activation columns of rows arow.. of da
    (`wg_act_desc`) into ra, one copy; all completing on the stage's mbarrier of `bar`."""
    ok = t < NT
    BYTES: gl.constexpr = dw.block_type.nbytes + da.block_type.nbytes
    gl.nvidia.hopper.mbarrier.expect(bar.index(stage), BYTES, ok)
    ABOX: gl.constexpr = da.layout
    BM: gl.constexpr = da.block_type.shape[1]
    WBOX: gl.constexpr = dw.block_type.shape
    WL: gl.constexpr = dw.layout
    dst = gl_reinterpret(rw.index(stage), gl.int32, WBOX, WL)
    if TILED and PAIR:
        gl_tma_load(dw, [0, row // 32, t * 32, 0], bar.index(stage), dst, ok)
    elif TILED:
        gl_tma_load(dw, [row // 32, t * 32, 0], bar.index(stage), dst, ok)
    elif PAIR:
        gl_tma_load(dw, [0, row, t * 32], bar.index(stage), dst, ok)
    else:
        gl_tma_load(dw, [row, t * 32], bar.index(stage), dst, ok)
    gl_tma_load(da, [t * 4, arow, 0], bar.index(stage), gl_reinterpret(ra.index(stage), gl.bfloat16, [4, BM, 64],
                                                                        ABOX), ok)
