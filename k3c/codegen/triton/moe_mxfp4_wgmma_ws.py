"""Warp-specialized `wgmma` decode kernels of MXFP4 `moe_experts` (sm_90): k3c.codegen.triton.moe_mxfp4_wgmma's
kernels with the TMA ring driven by a loader warp.

Why: in the single-partition kernels every warp takes part in each ring refill: the copies are issued by one
thread behind CTA barriers (`bar.sync`) that Triton places around them (the stage's reads must be done before the
copy overwrites it), about 5.5 barriers and 30-40 bookkeeping instructions a K tile of the up kernel, on warps
whose issue slots the decoding already fills (634 instructions a K tile against 562 in the `mma.sync` kernels,
BENCHMARKS.md "MXFP4 round, run S"). Here a loader partition (one warp, 24 registers) waits on a stage's `empty`
mbarrier and issues its copies; the decoding warpgroup (the default partition) waits on the stage's `ready`
mbarrier, decodes and multiplies as before (`wg_mma_piece`), and releases the previous stage with one fenced
mbarrier arrival once the first `wgmma` of a tile has retired the previous tile's. No CTA barrier is left in the
K loop.

Registers: Hopper allocates registers by warpgroup, so the one-warp loader makes the CTA two warpgroups; the
launch's maxnreg (default `WS_MAXNREG`) sets the CTA's registers, the loader keeps 24 a thread (`setmaxnreg`)
and the decoding warpgroup gets the rest: (maxnreg·256 − 24·128)/128, 136 at maxnreg 80 (3 CTAs an SM).

The ring, the descriptors, the K order and the decoding are moe_mxfp4_wgmma's (its module docstring). Public API:
`WS_ACT_MODES`, `WS_MAXNREG`, the jit helpers and `moe_up_mx_wgmma_ws_kernel`, `moe_down_mx_wgmma_ws_kernel`
(the same arguments as the single-partition kernels)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3c.codegen.triton.gl_ring import gl_ring_init
from k3c.codegen.triton.moe_act import glu
from k3c.codegen.triton.moe_mxfp4_gluon import gl_tile_rows
from k3c.codegen.triton.moe_mxfp4 import mx_kernels
from k3c.codegen.triton.moe_mxfp4_wgmma import (WG_ROWS, moe_down_mx_wgmma_kernel, moe_up_mx_wgmma_kernel,
                                               wg_act_desc, wg_cta_rows, wg_gather_kernel, wg_layouts, wg_mma_piece,
                                               wg_permuted_col, wg_ring_fill, wg_scale_pair, wg_stage_layouts,
                                               wg_word_desc)

#: the activation modes (an mx_config's 8th field) that select these kernels
WS_ACT_MODES = (4, 4)
#: the launch's default maxnreg: 80 registers a thread for two warpgroups, 3 CTAs an SM
WS_MAXNREG = 80


@gluon.jit
def ws_loader(d1, d3, da, r1, r3, ra, ready, empty, row, arow, NT: gl.constexpr, STAGES: gl.constexpr,
              PAIR: gl.constexpr, TILED: gl.constexpr):
    """The loader partition: K tiles 0 .. NT − 1 into the ring, each into its stage once the decoding warpgroup
    has released it (`empty`; a fresh mbarrier passes the first round's wait on phase 1)."""
    for t in range(NT):
        stage = t % STAGES
        gl.nvidia.hopper.mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
        wg_ring_fill(d1, d3, da, r1, r3, ra, ready, row, arow, t, stage, NT, PAIR, TILED)


@gluon.jit
def ws_release(empty, it, stage: gl.constexpr, STAGES: gl.constexpr):
    """Release the stage of K tile it − 1 (none at tile 0): its words were read by the warps' shared loads
    (ordered before the loader's copy by the async-proxy fence) and its activations by `wgmma`s now retired."""
    gl.nvidia.hopper.fence_async_shared()
    gl.nvidia.hopper.mbarrier.arrive(empty.index((stage + STAGES - 1) % STAGES), count=1, pred=it > 0)


@gluon.jit
def ws_up_step(r1, r3, ra, ready, empty, s1_ptr, s3_ptr, soff, it, stage: gl.constexpr, phase, gate, up, a, n1,
               n3, NT: gl.constexpr, STAGES: gl.constexpr, TWO_MULS: gl.constexpr, TILED: gl.constexpr,
               WL: gl.constexpr, AL: gl.constexpr):
    """The up kernel's K tile `it` from ring stage `stage` (a constant: the loop is unrolled by the ring's
    stages): the next tile's scale bytes loaded, gate's and up's two pieces (`wg_mma_piece`), the previous
    tile's stage released after the first. Returns (gate, up, a, n1, n3)."""
    gl.nvidia.hopper.mbarrier.wait(ready.index(stage), phase)
    gate, up, a = wg_mma_piece(r1, stage, 0, n1[0], ra, gate, up, a, TWO_MULS, TILED, WL, AL)
    ws_release(empty, it, stage, STAGES)
    c1, c3 = n1, n3                 # the next tile's scale bytes, loaded behind the release's fence
    n1, n3 = wg_scale_pair(s1_ptr, soff, it + 1, NT), wg_scale_pair(s3_ptr, soff, it + 1, NT)
    gate, up, a = wg_mma_piece(r1, stage, 1, c1[1], ra, gate, up, a, TWO_MULS, TILED, WL, AL)
    up, gate, a = wg_mma_piece(r3, stage, 0, c3[0], ra, up, gate, a, TWO_MULS, TILED, WL, AL)
    up, gate, a = wg_mma_piece(r3, stage, 1, c3[1], ra, up, gate, a, TWO_MULS, TILED, WL, AL)
    return gate, up, a, n1, n3


@gluon.jit
def ws_up_decode(r1, r3, ra, ready, empty, s1_ptr, s3_ptr, soff, NT: gl.constexpr, STAGES: gl.constexpr,
                 TWO_MULS: gl.constexpr, TILED: gl.constexpr, BLOCK_M: gl.constexpr):
    """The up kernel's decoding partition: (gate, up) f32 [64, BLOCK_M] over all NT K tiles."""
    WL: gl.constexpr = wg_layouts(BLOCK_M)[0]
    ACC: gl.constexpr = wg_layouts(BLOCK_M)[2]
    AL: gl.constexpr = wg_layouts(BLOCK_M)[3]
    n1, n3 = wg_scale_pair(s1_ptr, soff, 0, NT), wg_scale_pair(s3_ptr, soff, 0, NT)
    gate = gl.zeros([64, BLOCK_M], gl.float32, ACC)
    up = gl.zeros([64, BLOCK_M], gl.float32, ACC)
    a = gl.zeros([64, 128], gl.bfloat16, AL)          # the piece in flight (none yet)
    for j in range(NT // STAGES):
        for u in gl.static_range(STAGES):
            gate, up, a, n1, n3 = ws_up_step(r1, r3, ra, ready, empty, s1_ptr, s3_ptr, soff, j * STAGES + u, u,
                                             j & 1, gate, up, a, n1, n3, NT, STAGES, TWO_MULS, TILED, WL, AL)
    for u in gl.static_range(NT % STAGES):
        gate, up, a, n1, n3 = ws_up_step(r1, r3, ra, ready, empty, s1_ptr, s3_ptr, soff, NT - NT % STAGES + u, u,
                                         (NT // STAGES) & 1, gate, up, a, n1, n3, NT, STAGES, TWO_MULS, TILED, WL,
                                         AL)
    return gl.nvidia.hopper.warpgroup_mma_wait(0, deps=(gate, up))


@gluon.jit
def moe_up_mx_wgmma_ws_kernel(zs, w1, w3, s1_ptr, s3_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, hp_ptr,
                              SITU_BETA, SITU_LINEAR_BETA, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr,
                              ACT_SITU: gl.constexpr, TWO_MULS: gl.constexpr, BLOCK_M: gl.constexpr,
                              STAGES: gl.constexpr, TILED: gl.constexpr):
    """`moe_up_mx_wgmma_kernel` (its arguments and result) with a loader partition (module docstring)."""
    NT: gl.constexpr = D // 256
    ACC: gl.constexpr = wg_layouts(BLOCK_M)[2]
    e = gl.load(tile_expert_ptr + gl.program_id(0))
    if e < E:
        arow, row, soff = wg_cta_rows(tile_row0_ptr, e, I, D, BLOCK_M)
        r1 = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 32], wg_stage_layouts()[0])
        r3 = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 32], wg_stage_layouts()[0])
        ra = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 256], wg_stage_layouts()[1])
        ready = gl_ring_init(STAGES)
        empty = gl_ring_init(STAGES)
        gate, up = gl.warp_specialize([
            (ws_up_decode, (r1, r3, ra, ready, empty, s1_ptr, s3_ptr, soff, NT, STAGES, TWO_MULS, TILED, BLOCK_M)),
            (ws_loader, (w1, w3, zs, r1, r3, ra, ready, empty, row, arow, NT, STAGES, True, TILED)),
        ], [1], [24])
        h = glu(gate, up, SITU_BETA, SITU_LINEAR_BETA, ACT_SITU)
        col = wg_permuted_col(gl.program_id(1) * 64 + gl.arange(0, 64, gl.SliceLayout(1, ACC)))
        offs_m, m_ok = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, gl.program_id(0), BLOCK_M,
                                    gl.SliceLayout(0, ACC))
        gl.store(hp_ptr + gl.expand_dims(offs_m.to(gl.int64) * I, 0) + gl.expand_dims(col, 1),
                 h.to(hp_ptr.dtype.element_ty), mask=gl.expand_dims(m_ok, 0))


@gluon.jit
def ws_down_step(r2, ra, ready, empty, s2_ptr, soff, it, stage: gl.constexpr, phase, acc, a, n2, NT: gl.constexpr,
                 STAGES: gl.constexpr, TWO_MULS: gl.constexpr, TILED: gl.constexpr, WL: gl.constexpr,
                 AL: gl.constexpr):
    """The down kernel's K tile `it`, as `ws_up_step` for one matrix. Returns (acc, a, n2)."""
    gl.nvidia.hopper.mbarrier.wait(ready.index(stage), phase)
    acc, _, a = wg_mma_piece(r2, stage, 0, n2[0], ra, acc, a, a, TWO_MULS, TILED, WL, AL, False)
    ws_release(empty, it, stage, STAGES)
    c2 = n2
    n2 = wg_scale_pair(s2_ptr, soff, it + 1, NT)
    acc, _, a = wg_mma_piece(r2, stage, 1, c2[1], ra, acc, a, a, TWO_MULS, TILED, WL, AL, False)
    return acc, a, n2


@gluon.jit
def ws_down_decode(r2, ra, ready, empty, s2_ptr, soff, NT: gl.constexpr, STAGES: gl.constexpr,
                   TWO_MULS: gl.constexpr, TILED: gl.constexpr, BLOCK_M: gl.constexpr):
    """The down kernel's decoding partition: (acc,) f32 [64, BLOCK_M] over all NT K tiles."""
    WL: gl.constexpr = wg_layouts(BLOCK_M)[0]
    ACC: gl.constexpr = wg_layouts(BLOCK_M)[2]
    AL: gl.constexpr = wg_layouts(BLOCK_M)[3]
    n2 = wg_scale_pair(s2_ptr, soff, 0, NT)
    acc = gl.zeros([64, BLOCK_M], gl.float32, ACC)
    a = gl.zeros([64, 128], gl.bfloat16, AL)
    for j in range(NT // STAGES):
        for u in gl.static_range(STAGES):
            acc, a, n2 = ws_down_step(r2, ra, ready, empty, s2_ptr, soff, j * STAGES + u, u, j & 1, acc, a, n2,
                                      NT, STAGES, TWO_MULS, TILED, WL, AL)
    for u in gl.static_range(NT % STAGES):
        acc, a, n2 = ws_down_step(r2, ra, ready, empty, s2_ptr, soff, NT - NT % STAGES + u, u, (NT // STAGES) & 1,
                                  acc, a, n2, NT, STAGES, TWO_MULS, TILED, WL, AL)
    return (gl.nvidia.hopper.warpgroup_mma_wait(0, deps=(acc,)),)


@gluon.jit
def moe_down_mx_wgmma_ws_kernel(hs, w2, s2_ptr, weights_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                                tile_row_end_ptr, y_slot_ptr, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr,
                                TWO_MULS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                                TILED: gl.constexpr):
    """`moe_down_mx_wgmma_kernel` (its arguments and result) with a loader partition (module docstring)."""
    NT: gl.constexpr = I // 256
    ACC: gl.constexpr = wg_layouts(BLOCK_M)[2]
    e = gl.load(tile_expert_ptr + gl.program_id(0))
    if e < E:
        arow, row, soff = wg_cta_rows(tile_row0_ptr, e, D, I, BLOCK_M)
        r2 = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 32], wg_stage_layouts()[0])
        ra = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 256], wg_stage_layouts()[1])
        ready = gl_ring_init(STAGES)
        empty = gl_ring_init(STAGES)
        acc, = gl.warp_specialize([
            (ws_down_decode, (r2, ra, ready, empty, s2_ptr, soff, NT, STAGES, TWO_MULS, TILED, BLOCK_M)),
            (ws_loader, (w2, w2, hs, r2, r2, ra, ready, empty, row, arow, NT, STAGES, False, TILED)),
        ], [1], [24])
        offs_m, m_ok = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, gl.program_id(0), BLOCK_M,
                                    gl.SliceLayout(0, ACC))
        slot = gl.load(order_ptr + offs_m, mask=m_ok, other=0)
        weight = gl.load(weights_ptr + slot, mask=m_ok, other=0.0)
        offs_n = gl.program_id(1) * 64 + gl.arange(0, 64, gl.SliceLayout(1, ACC))
        gl.store(y_slot_ptr + gl.expand_dims(slot * D, 0) + gl.expand_dims(offs_n, 1), acc * gl.expand_dims(weight, 0),
                 mask=gl.expand_dims(m_ok, 0))


def mx_wgmma_launches(z, zs, schedule, w1, w3, w2, scales, h, y_slot, weights, *, mx_config, K, act, situ_beta,
                      situ_linear_beta, tiled):
    """`launch_moe_experts`' launches on this path (`wgmma_decode_ok(mx_config, D, I)`), as three callables run in
    order (benchmarks time each): z bf16 [N, D] gathered into zs [N·k, D] (the schedule's row order,
    `wg_permute`d: `wg_gather_kernel`), `moe_up_mx_wgmma_kernel` into h [N·k, I], `moe_down_mx_wgmma_kernel` into
    y_slot f32 [N·k, D] (weighted); w1/w3/w2 u8 MXFP4 words ([E, I, D/2], [E, D, I/2]) in layout `tiled` (0
    row-major, 1 `mxfp4_tiles`, 2 `mxfp4_tiles_bits`), scales their E8M0 bytes, schedule `moe_schedule(ids, E,
    BLOCK_M)`. The slot sum is the caller's. Activation modes `WS_ACT_MODES` take this module's warp-specialized
    kernels (maxnreg `WS_MAXNREG` unless the config caps it), (3, 3) moe_mxfp4_wgmma's."""
    D, (E, I) = z.shape[1], w1.shape[:2]
    block_m, two_muls = mx_config[0], mx_config[5]
    (_, _, _, stages_up, cap_up), (_, _, _, stages_down, cap_down) = mx_kernels(mx_config)
    ws_up, ws_down = (m == WS_ACT_MODES[0] for m in mx_config[7])
    up_kernel = moe_up_mx_wgmma_ws_kernel if ws_up else moe_up_mx_wgmma_kernel
    down_kernel = moe_down_mx_wgmma_ws_kernel if ws_down else moe_down_mx_wgmma_kernel
    cap_up, cap_down = cap_up or (WS_MAXNREG if ws_up else None), cap_down or (WS_MAXNREG if ws_down else None)
    order, tile_expert, row0, row_end = schedule
    max_tiles = tile_expert.shape[0]
    w1d, w3d, w2d = (wg_word_desc(w, tiled) for w in (w1, w3, w2))
    zd, hd = wg_act_desc(zs, block_m), wg_act_desc(h, block_m)

    def gather():
        wg_gather_kernel[(order.shape[0], D // 256)](z, order, zs, z.stride(0), K=K, D=D, BLOCK=256)

    def up():
        up_kernel[(max_tiles, I // WG_ROWS)](
            zd, w1d, w3d, scales[0], scales[1], tile_expert, row0, row_end, h, float(situ_beta),
            float(situ_linear_beta), E=E, D=D, I=I, ACT_SITU=act == "situ", TWO_MULS=two_muls, BLOCK_M=block_m,
            STAGES=stages_up, TILED=tiled, num_warps=4, **({"maxnreg": cap_up} if cap_up else {}))

    def down():
        down_kernel[(max_tiles, D // WG_ROWS)](
            hd, w2d, scales[2], weights, order, tile_expert, row0, row_end, y_slot, E=E, D=D, I=I,
            TWO_MULS=two_muls, BLOCK_M=block_m, STAGES=stages_down, TILED=tiled, num_warps=4,
            **({"maxnreg": cap_down} if cap_down else {}))

    return gather, up, down
