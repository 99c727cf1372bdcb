"""The TMA ring of k3c's Gluon MXFP4 decode kernels (k3c.codegen.triton.moe_mxfp4_gluon, "Word stream"): the
descriptors of the packed words (`gl_word_descs`), the ring's mbarriers, its fills and refills (`gl_ring_fill`,
`gl_ring_refill`) and the read of a stage back into the kernels' register layout (`gl_stage_words`). Pasted with
the kernels into the emitted modules.
sm_90+: `cp.async.bulk.tensor` copies, issued by one thread, completing on a stage's mbarrier."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3c.codegen.triton.gl_common import gl_tma_load


@gluon.constexpr_function
def gl_words2d_layout(W, BLOCK_K):
    """[16W, BLOCK_K/8] i32 (a TMA stage: weight row, word): the words `gl_layouts`' [W, 2, 8, 4, CH, 4] layout
    gives each thread (row 16w + 8h + g, word 4·CH·t + 4·ch + c), as a 2-D layout a shared stage loads into (4
    consecutive words per thread: `LDS.128`)."""
    CH = BLOCK_K // 128
    reg = [[0, 1], [0, 2]] + [[0, 4 << i] for i in range(CH.bit_length() - 1)] + [[8, 0]]
    lane = [[0, 4 * CH], [0, 8 * CH], [1, 0], [2, 0], [4, 0]]
    warp = [[16 << i, 0] for i in range(W.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[16 * W, BLOCK_K // 8])


def gl_word_descs(w: torch.Tensor, block_r: int, block_k: int, tiled: int = 0):
    """TMA descriptor of MXFP4 words w u8 [E, R, C/2] (contiguous, 16-byte aligned) as i32 [E·R, C/8], or
    (tiled 1 or 2: the runtime's `mxfp4_tiles` or `mxfp4_tiles_bits` layout, k3c.runtime.layouts, which place
    the words alike) as i32 [E·R·C/256, 32], the rows of its
    [32 rows, 32 words] tiles one after another, with [block_r, block_k/8]-word boxes stored with a
    block_k/2-byte swizzle (`gl_words2d_layout` reads them free of bank conflicts; `gl_ring_fill` gives the
    coordinates). Raises ValueError for a w TMA cannot address, or tiled boxes of more than 32 rows or 256 values
    (a box would span two tiles)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, R, half = w.shape
    if tiled and (block_r > 32 or R % 32 or block_k > 256):
        raise ValueError(f"moe_experts: tiled MXFP4 words {list(w.shape)} take boxes of at most 32 rows and 256 "
                         f"values of 32-row blocks, got {block_r} rows of {block_k}")
    if not w.is_contiguous() or w.data_ptr() % 16 or half % (128 if tiled else 16):
        raise ValueError(f"moe_experts: MXFP4 words {list(w.shape)} must be contiguous, 16-byte aligned rows of a "
                         f"multiple of {128 if tiled else 16} bytes for the TMA ring (mx_config num_stages ≥ 2)")
    layout = gl.NVMMASharedLayout(swizzle_byte_width=block_k // 2, element_bitwidth=32, rank=2)
    words = w.view(torch.int32).view(E * R * half // 128, 32) if tiled else w.view(torch.int32).view(E * R, half // 4)
    return TensorDescriptor.from_tensor(words, [block_r, block_k // 8], layout)


@gluon.jit
def gl_stage_words(stage, W: gl.constexpr, CH: gl.constexpr, WL: gl.constexpr):
    """The words [W, 2, 8, 4, CH, 4] (WL) of one TMA stage [16W, 16·CH] i32 (BLOCK_K = 128·CH values a row)."""
    words = stage.load(gl_words2d_layout(W, 128 * CH))
    return gl.convert_layout(gl.reshape(words, [W, 2, 8, 4, CH, 4]), WL, assert_trivial=True)


@gluon.jit
def gl_ring_fill(d1, d3, r1, r3, bar, row, t, NT: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr,
                 TILED: gl.constexpr):
    """TMA K tile t (< NT, else nothing) of weight rows row.. (global: e·R + r) of d1 (and, PAIR, d3) into stage
    t % STAGES of ring r1 (r3), completing on that stage's mbarrier of `bar`; TILED: the descriptors are
    `gl_word_descs`' tiled view, where the box of a K tile of words k .. (within one 32-word piece) of rows
    row.. (within one 32-row block) starts at row (⌊row/32⌋·KW/32 + ⌊k/32⌋)·32 + row mod 32, word k mod 32."""
    stage = t % STAGES
    ok = t < NT
    BW: gl.constexpr = d1.block_type.shape[1]
    BYTES: gl.constexpr = (2 if PAIR else 1) * d1.block_type.nbytes
    if TILED:
        k = t * BW
        at = [((row // 32) * (NT * BW // 32) + k // 32) * 32 + row % 32, k % 32]
    else:
        at = [row, t * BW]
    gl.nvidia.hopper.mbarrier.expect(bar.index(stage), BYTES, ok)
    gl_tma_load(d1, at, bar.index(stage), r1.index(stage), ok)
    if PAIR:
        gl_tma_load(d3, at, bar.index(stage), r3.index(stage), ok)


@gluon.jit
def gl_ring_refill(d1, d3, r1, r3, bar, row, it, NT: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr,
                   TILED: gl.constexpr):
    """The TMA ring's refill at the top of K tile `it`'s iteration, after tile 0 was issued before the loop
    (`gl_ring_fill`'s arguments): every STAGES − 1 tiles, the STAGES − 1 stages the tiles before `it` freed are
    refilled together with tiles it + 1 .. it + STAGES − 1 (2 stages: tile it + 1 every tile). So each weight
    row's next STAGES − 1 pieces (BLOCK_K/2 bytes each) are asked of DRAM back to back, as one run, rather than
    one piece a tile (BENCHMARKS.md "MXFP4 round, run N")."""
    if STAGES == 2:
        gl_ring_fill(d1, d3, r1, r3, bar, row, it + 1, NT, STAGES, PAIR, TILED)
    else:
        if it % (STAGES - 1) == 0:
            for g in gl.static_range(STAGES - 1):
                gl_ring_fill(d1, d3, r1, r3, bar, row, it + 1 + g, NT, STAGES, PAIR, TILED)


@gluon.jit
def gl_ring_init(STAGES: gl.constexpr):
    """STAGES mbarriers (one arrival: the expect), initialised and fenced for the TMA."""
    bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], gl.nvidia.hopper.mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        gl.nvidia.hopper.mbarrier.init(bar.index(b), count=1)
    gl.nvidia.hopper.fence_async_shared()
    return bar
