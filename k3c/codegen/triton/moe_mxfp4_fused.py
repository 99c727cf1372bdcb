"""The launches of the `wgmma` MXFP4 decode path of `moe_experts` (k3c.codegen.triton.moe_mxfp4_wgmma), and its
one-launch form: the up and the down phase in one grid whose CTAs take their work in the order they start.

Why one launch: each of the two kernels ends in a tail, its last CTAs finishing while the SMs they leave have no
work, and the next one starts by filling every CTA's ring. Timed with the weights resident in L2 (BENCHMARKS.md
"MXFP4 round, run T", H100), each kernel's time is a fixed part plus one per tile: the up kernel 6.6 us + 2.96
us a tile, the down kernel 7.3 us + 1.46 (16 and 64 tiles of 16 tokens); at batch 16 of 32 experts (about 40
tiles) the fixed parts are about 7 % of the two kernels' time (13.9 of about 191 us by that fit). In one launch
the down work of the first tiles fills the up phase's tail, and the launch between them is gone.

The work items: every (tile, 64-row block) of the up phase, tile by tile (the block fastest), then every one of the
down phase, tile by tile: T·I/64 + T·D/64 CTAs for the schedule's T tiles (`moe_schedule`; tiles past it,
expert E, do nothing). A CTA takes the next item from a counter when it starts (`gl.atomic_add`), so items start
in order whatever order the hardware starts CTAs in. A down item of tile t waits until the I/64 up items of t have
written their h rows: it reads t's count of finished up items (acquire, GPU scope) until it is I/64. It cannot
wait forever: it started after every up item had been taken by a CTA already running, and an up item waits for
nothing. With tiles taken in order, the first down items are those of the first tiles, long finished, while the
last tiles' up items still run.

Memory order (PTX ISA, "Memory consistency model"): an up item stores its h rows, a CTA barrier orders every
thread's stores before thread 0's release add on the tile's count (cumulative, GPU scope); a down item's acquire
read of the count, then a CTA barrier, then `fence.proxy.async.global`, since its reads of h are the TMA's (the
async proxy) and the stores were the generic proxy's. The counters (flags i32 [1 + T]: the next item, then each
tile's count) are zeroed by the gather (`wg_gather_kernel`, FLAGS) that precedes the launch on the stream.

Shared memory and registers: the kernel holds both phases' code; their rings live in disjoint branches, so they
share one allocation (the larger: 49 KB at the decode default), and the kernel takes the larger phase's registers
(128 under Triton 3.6, as the up kernel alone).

Measured (BENCHMARKS.md "MXFP4 round, run Z", H100, both forms interleaved in one process): at 8 tokens an expert
the expert kernels' time 4.3 % shorter over 32 experts (217.7 -> 208.4 us), 6.3 % and 6.5 % over 16 and 64; the
whole `launch_moe_experts` 6.4-9.1 %. The decode default from 8 rows per expert (`mx_default_config`).

Public API: `mx_wgmma_launches`, `wg_proxy_fence`, `wg_wait_count`, `moe_mx_wgmma_fused_kernel`."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3c.codegen.triton.gl_common import gl_thread_barrier
from k3c.codegen.triton.moe_mxfp4 import mx_kernels
from k3c.codegen.triton.moe_mxfp4_wgmma import (WG_FUSED_MODES, moe_down_mx_wgmma_kernel, moe_up_mx_wgmma_kernel,
                                               wg_down_item, wg_gather_kernel, wg_up_item)
from k3c.codegen.triton.wg_ring import WG_ROWS, wg_act_desc, wg_pair_desc, wg_word_desc


@gluon.jit
def wg_proxy_fence(x):
    """`fence.proxy.async.global`: the generic-proxy accesses to global memory this thread has observed are
    ordered before its later async-proxy (TMA) accesses. Returns x (an i32 scalar), which keeps the fence in
    program order."""
    return gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def wg_wait_count(ptr, want):
    """Wait until the i32 counter at ptr is at least `want` (acquire reads, GPU scope), then order the CTA's
    threads and their TMA reads after it (a CTA barrier, `wg_proxy_fence`)."""
    n = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while n < want:
        n = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    gl_thread_barrier()
    wg_proxy_fence(n)


@gluon.jit(do_not_specialize=["SWAP"])
def moe_mx_wgmma_fused_kernel(zs, zs8, hs, hs8, w13, w2, sa_ptr, sb_ptr, SWAP, s2_ptr, weights_ptr, order_ptr,
                              tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, hp_ptr, y_slot_ptr, flags_ptr,
                              SITU_BETA, SITU_LINEAR_BETA, TILES, E: gl.constexpr, D: gl.constexpr,
                              I: gl.constexpr, ACT_SITU: gl.constexpr, TWO_MULS: gl.constexpr,
                              BLOCK_M: gl.constexpr, STAGES_UP: gl.constexpr, STAGES_DOWN: gl.constexpr,
                              TILED: gl.constexpr):
    """`moe_up_mx_wgmma_kernel` and `moe_down_mx_wgmma_kernel` in one grid of TILES·(I + D)/64 CTAs (module
    docstring): the arguments theirs, hp (h's pointer) and hs / hs8 (its descriptors) the same h bf16 [tile rows,
    I]; flags i32 [1 + TILES], zero on entry (the work counter, then each tile's finished up items). Launched
    again without the gather after a launch of the same grid, its items all lie past the grid and it does
    nothing; other stale counters are undefined behaviour (`launch_moe_experts` always gathers first)."""
    UP: gl.constexpr = I // 64                       # WG_ROWS
    DOWN: gl.constexpr = D // 64
    item = gl.atomic_add(flags_ptr, 1, sem="relaxed", scope="gpu")
    if item < TILES * UP:
        tile = item // UP
        e = gl.load(tile_expert_ptr + tile)
        if e < E:
            wg_up_item(zs, zs8, w13, sa_ptr, sb_ptr, SWAP, tile_row0_ptr, tile_row_end_ptr, hp_ptr, SITU_BETA,
                       SITU_LINEAR_BETA, e, tile, item % UP, D, I, ACT_SITU, TWO_MULS, BLOCK_M, STAGES_UP, TILED)
            gl_thread_barrier()                              # every thread's h stores before the release
            gl.atomic_add(flags_ptr + 1 + tile, 1, sem="release", scope="gpu")
    elif item < TILES * (UP + DOWN):                 # (past it: a relaunch without the gather, nothing to do)
        tile = (item - TILES * UP) // DOWN
        e = gl.load(tile_expert_ptr + tile)
        if e < E:
            wg_wait_count(flags_ptr + 1 + tile, UP)
            wg_down_item(hs, hs8, w2, s2_ptr, weights_ptr, order_ptr, tile_row0_ptr, tile_row_end_ptr, y_slot_ptr,
                         e, tile, (item - TILES * UP) % DOWN, D, I, TWO_MULS, BLOCK_M, STAGES_DOWN, TILED)


def mx_wgmma_launches(z, zs, schedule, w1, w3, w2, scales, h, y_slot, weights, *, mx_config, K, act, situ_beta,
                      situ_linear_beta, tiled, flags=None):
    """`launch_moe_experts`' launches on the `wgmma` path (`wgmma_decode_ok(mx_config, D, I)`), as callables run
    in order (benchmarks time each): z bf16 [N, D] gathered into zs bf16 [R, D] (tile rows, `wg_permute`d:
    `wg_gather_kernel`), then `moe_up_mx_wgmma_kernel` into h bf16 [R, I] and `moe_down_mx_wgmma_kernel` into
    y_slot f32 [N·k, D] (weighted), or, where mx_config's activation modes are WG_FUSED_MODES, both in one
    `moe_mx_wgmma_fused_kernel` launch whose counters are flags i32 [≥ 1 + tiles] (None: allocated here; the
    gather zeroes them). R ≥ BLOCK_M · the schedule's tiles (`wg_tile_rows`; only those rows are used); w1/w3/w2
    u8 MXFP4 words ([E, I, D/2], [E, D, I/2]) in layout `tiled` (0 row-major, 1 `mxfp4_tiles`, 2
    `mxfp4_tiles_bits`), scales their E8M0 bytes, schedule `moe_schedule(ids, E, BLOCK_M)`. The slot sum is the
    caller's. Raises ValueError when zs, h or flags has fewer rows than the schedule's tiles need."""
    D, (E, I) = z.shape[1], w1.shape[:2]
    block_m, two_muls = mx_config[0], mx_config[5]
    (_, _, _, stages_up, cap_up), (_, _, _, stages_down, cap_down) = mx_kernels(mx_config)
    order, tile_expert, row0, row_end = schedule
    max_tiles = tile_expert.shape[0]
    rows = max_tiles * block_m
    fused = tuple(mx_config[7]) == WG_FUSED_MODES
    if fused and flags is None:
        flags = torch.empty(1 + max_tiles, dtype=torch.int32, device=z.device)
    if zs.shape[0] < rows or h.shape[0] < rows or fused and flags.shape[0] < 1 + max_tiles:
        raise ValueError(f"moe_experts (wgmma): zs {list(zs.shape)}, h {list(h.shape)}"
                         f"{f' and flags {list(flags.shape)}' if fused else ''} need {rows} tile rows "
                         f"({max_tiles} tiles of {block_m}, wg_tile_rows){' and 1 + tiles flags' if fused else ''}")
    w13d, swap = wg_pair_desc(w1, w3, tiled)
    w2d = wg_word_desc(w2, tiled)
    sa, sb = (scales[1], scales[0]) if swap else (scales[0], scales[1])
    zd, hd = wg_act_desc(zs[:rows], block_m), wg_act_desc(h[:rows], block_m)
    zd8, hd8 = wg_act_desc(zs[:rows], 8), wg_act_desc(h[:rows], 8)
    opts_up = {"num_warps": 4, **({"maxnreg": cap_up} if cap_up else {})}
    opts_down = {"num_warps": 4, **({"maxnreg": cap_down} if cap_down else {})}
    opts_both = {"num_warps": 4, **({"maxnreg": max(cap_up, cap_down)} if cap_up and cap_down else {})}

    def gather():
        wg_gather_kernel[(rows,)](z, order, tile_expert, row0, row_end, zs, flags if fused else zs, z.stride(0), E,
                                  K=K, D=D, BLOCK_M=block_m, BLOCK=256, FLAGS=fused)

    def up():
        moe_up_mx_wgmma_kernel[(max_tiles, I // WG_ROWS)](
            zd, zd8, w13d, sa, sb, swap, tile_expert, row0, row_end, h, float(situ_beta),
            float(situ_linear_beta), E=E, D=D, I=I, ACT_SITU=act == "situ", TWO_MULS=two_muls, BLOCK_M=block_m,
            STAGES=stages_up, TILED=tiled, **opts_up)

    def down():
        moe_down_mx_wgmma_kernel[(max_tiles, D // WG_ROWS)](
            hd, hd8, w2d, scales[2], weights, order, tile_expert, row0, row_end, y_slot, E=E, D=D, I=I,
            TWO_MULS=two_muls, BLOCK_M=block_m, STAGES=stages_down, TILED=tiled, **opts_down)

    def both():
        moe_mx_wgmma_fused_kernel[(max_tiles * (I + D) // WG_ROWS,)](
            zd, zd8, hd, hd8, w13d, w2d, sa, sb, swap, scales[2], weights, order, tile_expert, row0,
            row_end, h, y_slot, flags, float(situ_beta), float(situ_linear_beta), max_tiles, E=E, D=D, I=I,
            ACT_SITU=act == "situ", TWO_MULS=two_muls, BLOCK_M=block_m, STAGES_UP=stages_up,
            STAGES_DOWN=stages_down, TILED=tiled, **opts_both)

    return (gather, both) if fused else (gather, up, down)
