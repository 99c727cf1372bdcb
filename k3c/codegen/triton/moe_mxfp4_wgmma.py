"""Gluon `wgmma` decode kernels of MXFP4 `moe_experts` (sm_90): a warpgroup decodes 64 weight rows a CTA straight
into `wgmma`'s register A operand, and both operands stream through one TMA ring.

Why: with 8 tokens an expert (batch 16 of 32 experts choosing 16) the `mma.sync` kernels
(k3c.codegen.triton.moe_mxfp4_gluon) are bound by the decoding's compute, not by HBM: their 8-token tiles decode
the experts with more than 8 tokens twice (43 tiles for 32 experts), and a 16-token `mma.sync` tile holds its
activations in registers, which costs it its occupancy (BENCHMARKS.md "MXFP4 round, run Q": compute alone 97 us
for 43 `mma.sync` tiles against 82 us for 32 `wgmma` tiles of 16 tokens, probes with constant activations). Here
the activations are `wgmma`'s B operand, read from shared memory, so a 16-token tile costs no more registers than
an 8-token one. Measured in "MXFP4 round, run S": the expert kernels 6 % faster end to end at batch 16 of 32
experts (H200); 4-9 % slower at one token an expert (H100), where the `mma.sync` kernels stay the default
(`mx_default_config`: these from 8 rows per expert).

A CTA (4 warps, one warpgroup) takes one tile of BLOCK_M ≤ 16 token rows of one expert (the launch's tile schedule,
`moe_schedule`) and 64 weight rows. Each K tile of 256 values is one stage of a TMA ring
(k3c.codegen.triton.wg_ring): one copy of the tile's packed words ([64 rows, 32 words] of w2; of w1 and w3 both in
one copy, `wg_pair_desc`) and one of its activations, [BLOCK_M, 256] bf16. The activations are in tile rows:
schedule tile t's token rows at rows BLOCK_M·t .. of zs and h, the rows past the tile's tokens zeros
(`wg_tile_rows`). The up kernel's are z gathered so first
(`wg_gather_kernel`, one launch); it writes h so. Zero padding rows cost the gather their writes (1.5 us at batch 16
of 32 experts), and the kernels spend less energy on them than on another expert's rows (the `wgmma`s' operands and
the bytes moved to them): under the H200's 700 W cap the SM clock, which paces these kernels there, rises with it
(BENCHMARKS.md "MXFP4 round, run V": at 8 tokens a 16-row tile, sustained, an H100's clock 1.56 → 1.63-1.69 GHz
under the up kernel). A stage is decoded in two pieces of 128 values a matrix (`wg_decoded_tile`, the `mma.sync`
kernels' `mxfp4_word_bf16`: bitwise the same values), each piece one asynchronous `wgmma` with one left in flight
while the next piece is decoded (`wg_mma_piece`; run P: 89 us compute alone against 96 for one [64, 256] `wgmma` a
matrix). A stage is refilled once the `wgmma`s that read it are done: after the first `wgmma` of the next K tile
retires the last of the previous one. The K loop is unrolled by the ring's stages (`wg_up_step`, `wg_down_step`),
and the stage index reaches the unrolled body through a `mov` LLVM cannot see through (`wg_opaque`): with constant
indices LLVM hoists all 32 `wgmma` descriptors of two K tiles out of the loop, and ptxas keeps them in registers and
copies one into each `HGMMA` (`UMOV`, `R2UR`); formed in the loop from one base they save the up kernel 26
instructions a K tile and leave it 125 registers instead of 141 (Triton 3.6; 127 instead of 211 under 3.9), 2-3 % of
its time on an H200 (run V). The next tile's scale bytes (one-byte global loads) are issued after the refill: the
refill's async-proxy fence (`MEMBAR.ALL.CTA`, which Triton places before the copies) waits until the warp's earlier
memory accesses are performed (PTX `membar`), so scale loads issued before it would hold every K tile for their
latency (BENCHMARKS.md "MXFP4 round, run T").

Narrow tiles: a 16-row tile of at most 8 tokens (`wg_narrow`; at batch 16 of 32 experts choosing 16, 60 % of them)
runs the same K loop instantiated for 8 token columns (`wg_up_tile`, `wg_down_tile`: `m64n8k16` `wgmma`s over the
[8, 256] boxes of a second descriptor, its rows 8 .. 15 neither gathered, read nor written). That halves the
tensor work and the activation bytes such a tile moves, so the card spends less energy under its cap (run W).
The two loops share the CTA's shared memory.

K order: a thread's 32-bit word w (8 codes, natural columns 8w .. 8w + 7) is decoded into the A fragment's
columns of `wgmma`'s register layout; a piece's column 32·cc + 16a + 8p + 2t + e holds code 2a + p + 4e of word
4t + cc of the thread t of a quad, natural column 32t + 8cc + 4e + 2a + p of the piece (`wg_permuted_col`: the
inverse; each 32-bit register of the fragment holds codes c and c + 4, as `mxfp4_word_bf16` pairs them). The
activations are stored in that order (`wg_permute`, `wg_gather_kernel`; the up kernel writes h in it), so a
stage is the B operand as it is.

Scope: bf16 activations on sm_90 (`wgmma` is Hopper's; the launcher checks the GPU), token tiles of 8 or 16 rows,
4 warps and 64 weight rows a CTA, K tiles of 256, a ring of 2 to 4 stages, D and I multiples of 256
(`wgmma_decode_ok`); an mx_config's activation modes (3, 3) name this path (the activations staged by the ring),
(4, 4) the same kernels' work in one launch.
Launches: k3c.codegen.triton.moe_mxfp4_fused's `mx_wgmma_launches` (the two kernels, or both phases in one launch
there, whose work items are these kernels' `wg_up_item` / `wg_down_item`).
Public API: `wgmma_decode_ok`, `WG_ACT_MODES`, `WG_FUSED_MODES`, `WG_BLOCK_MS`, `wg_tile_rows`, `wg_permute`,
the jit helpers (pasted into the emitted modules), `wg_gather_kernel`, `moe_up_mx_wgmma_kernel`,
`moe_down_mx_wgmma_kernel`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3c.codegen.triton.gl_ring import gl_ring_init, gl_stage_words
from k3c.codegen.triton.moe_act import glu
from k3c.codegen.triton.moe_mxfp4 import mx_kernels, mxfp4_scale_bf16, mxfp4_word_bf16
from k3c.codegen.triton.moe_mxfp4_gluon import gl_axis_layout, gl_layouts, gl_tile_rows
from k3c.codegen.triton.moe_schedule import schedule_tiles
from k3c.codegen.triton.wg_ring import WG_BLOCK_K, WG_ROWS, wg_ring_fill, wg_stage_layouts

#: the activation prefetch modes (`gl_act_ahead`, an mx_config's 8th field) that select these kernels
WG_ACT_MODES = (3, 3)
#: the modes that select them in one launch (k3c.codegen.triton.moe_mxfp4_fused; the ring stages the activations)
WG_FUSED_MODES = (4, 4)
#: the token rows of a tile these kernels take (an mx_config's BLOCK_M)
WG_BLOCK_MS = (8, 16)


def wgmma_decode_ok(mx_config: tuple, D: int, I: int) -> bool:
    """Whether these kernels take a bf16 MXFP4 launch with `mx_config` (`mx_default_config`'s fields; the 8th, the
    activation prefetch modes, (3, 3) or, in one launch, (4, 4)) over latent D and expert inner I: 8- or 16-token
    tiles and, for each kernel, 64 weight rows on 4 warps, K tiles of 256 (the configured largest K tile 256), a
    ring of 2 to 4 stages (the tested ones; 4 take 96 KB of shared memory in the up kernel), D and I multiples of
    256. The GPU (sm_90) is the launcher's to check."""
    if len(mx_config) < 8 or mx_config[7] is None or tuple(mx_config[7]) not in (WG_ACT_MODES, WG_FUSED_MODES):
        return False
    return mx_config[0] in WG_BLOCK_MS and D % WG_BLOCK_K == 0 and I % WG_BLOCK_K == 0 and all(
        block_r == WG_ROWS and most == WG_BLOCK_K and warps == 4 and 2 <= stages <= 4
        for block_r, most, warps, stages, _ in mx_kernels(mx_config))


def wg_tile_rows(rows: int, E: int, block_m: int) -> int:
    """Rows of zs and h in tile rows (module docstring) for `rows` (token, slot) pairs over E experts in tiles of
    block_m rows: block_m per tile of `moe_schedule`, block_m · min(rows, ⌈rows / block_m⌉ + E)
    (`schedule_tiles`). A schedule of 8-row tiles never needs more rows than one of 16-row tiles."""
    return block_m * schedule_tiles(rows, E, block_m)


def wg_permute(x: torch.Tensor) -> torch.Tensor:
    """x [N, K] (K a multiple of 128) -> the same values [N, K] in these kernels' K order (module docstring):
    column 128b + 32cc + 16a + 8p + 2t + e holds column 128b + 32t + 8cc + 4e + 2a + p. A contiguous copy."""
    N, K = x.shape
    # source column 128b + 32t + 8cc + 4e + 2a + p: dims (b, t, cc, e, a, p) -> (b, cc, a, p, t, e)
    return x.reshape(N, K // 128, 4, 4, 2, 2, 2).permute(0, 1, 3, 5, 6, 2, 4).reshape(N, K)


@triton.jit
def wg_permuted_col(k):
    """`wg_permute`'s column of natural column k (int tensor)."""
    r = k % 128
    t = r // 32
    cc = (r // 8) % 4
    return k - r + 32 * cc + 16 * ((r // 2) % 2) + 8 * (r % 2) + 2 * t + (r // 4) % 2


@triton.jit
def wg_gather_kernel(z_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, zs_ptr, flags_ptr, z_stride,
                     E, K: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                     FLAGS: tl.constexpr = False):
    """The up kernel's activations in tile rows (module docstring), `wg_permute` order: for row r = program 0 of
    zs (tile t = r // BLOCK_M, its row j = r % BLOCK_M), zs[r] = z[order[row0[t] + j] // K] where row0[t] + j <
    row_end[t], else zeros, BLOCK columns at a time; nothing for a tile past the schedule (expert E), nor for rows
    8 .. of a tile of at most 8 tokens (`wg_narrow`: the kernels read its first 8). z rows z_stride apart, unit
    stride; D a multiple of BLOCK. FLAGS: also zero i32 flags_ptr[0 .. tiles] (tiles = programs / BLOCK_M ≥ 1,
    BLOCK_M ≥ 2), the work counters of the one-launch kernel that follows (k3c.codegen.triton.moe_mxfp4_fused)."""
    r = tl.program_id(0)
    t = r // BLOCK_M
    if FLAGS:
        if r <= tl.num_programs(0) // BLOCK_M:
            tl.store(flags_ptr + r, 0)
    row0 = tl.load(tile_row0_ptr + t)
    row_end = tl.load(tile_row_end_ptr + t)
    if (tl.load(tile_expert_ptr + t) < E) & ((r % BLOCK_M < 8) | (row_end - row0 > 8)):
        row = row0 + r % BLOCK_M
        ok = row < row_end
        token = tl.load(order_ptr + tl.where(ok, row, row0)) // K
        end = tl.where(ok, D, 0)                                    # a padding row reads nothing: zeros
        for c in tl.static_range(D // BLOCK):
            k = c * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(z_ptr + token * z_stride + k, mask=k < end, other=0.0)
            tl.store(zs_ptr + r.to(tl.int64) * D + wg_permuted_col(k), x)


@gluon.jit
def wg_decoded_tile(words, s, TWO_MULS: gl.constexpr, AL: gl.constexpr, BITS: gl.constexpr):
    """The bf16 A operand [64, 128] (AL: `wgmma`'s register operand) of one piece's packed words [4, 2, 8, 4, 1, 4]
    (i32, `gl_layouts`' word layout) with their groups' E8M0 bytes s [4, 2, 8, 4, 1] (u8): `mxfp4_word_bf16` per
    word, code 2a + p + 4e of word cc of thread t at column 32·cc + 16a + 8p + 2t + e, no data moved."""
    mult = gl.expand_dims(mxfp4_scale_bf16(s, TWO_MULS), 5)
    mult, words = gl.broadcast(mult, words)
    v0, v4, v1, v5, v2, v6, v3, v7 = mxfp4_word_bf16(words, mult, TWO_MULS, BITS)
    # [W, 2, 8, 4(t), 1, 4(cc), e, p, a] -> [W, 2, 8, 1, 4(cc), a, p, 4(t), e]
    v = gl.join(gl.join(gl.join(v0, v4), gl.join(v1, v5)), gl.join(gl.join(v2, v6), gl.join(v3, v7)))
    tile = gl.reshape(gl.permute(v, (0, 1, 2, 4, 5, 8, 7, 3, 6)), [64, 128])
    return gl.convert_layout(tile, AL, assert_trivial=True)


@gluon.jit
def wg_scale_offsets(row0, KDIM: gl.constexpr, SL: gl.constexpr):
    """Offsets [4, 2, 8, 4, 1] (SL) in E8M0 bytes [.., KDIM/32] of K tile 0, piece 0's scale byte of each
    thread's words: row row0 + 16w + 8h + g, group t (a piece's thread t holds words 4t .. 4t + 3)."""
    w = gl.expand_dims(gl.arange(0, 4, gl_axis_layout(SL, 5, 0)), (1, 2, 3, 4))
    h = gl.expand_dims(gl.arange(0, 2, gl_axis_layout(SL, 5, 1)), (0, 2, 3, 4))
    g = gl.expand_dims(gl.arange(0, 8, gl_axis_layout(SL, 5, 2)), (0, 1, 3, 4))
    t = gl.expand_dims(gl.arange(0, 4, gl_axis_layout(SL, 5, 3)), (0, 1, 2, 4))
    c = gl.expand_dims(gl.arange(0, 1, gl_axis_layout(SL, 5, 4)), (0, 1, 2, 3))
    return (row0 + 16 * w + 8 * h + g) * (KDIM // 32) + t + c


@gluon.jit
def wg_stage_piece(words, piece, WL: gl.constexpr):
    """Words [4, 2, 8, 4, 1, 4] (WL) of piece `piece` (16 words a row) of one matrix's stage `words` [64, 32]
    i32."""
    return gl_stage_words(words.slice(piece * 16, 16, dim=1), 4, 1, WL)


@gluon.constexpr_function
def wg_layouts(BM):
    """(words, scale bytes, accumulator, A operand) layouts of a 4-warp CTA over 128-value pieces and BM tokens."""
    words = gl_layouts(4, 128, BM)[0]
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    return words, gl.SliceLayout(5, words), acc, gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)


@gluon.jit
def wg_mma_piece(words, acts, p: gl.constexpr, sc, acc, other, a, TWO_MULS: gl.constexpr,
                 TILED: gl.constexpr, WL: gl.constexpr, AL: gl.constexpr, PAIR: gl.constexpr = True):
    """Piece p of one matrix's K tile in a ring stage (its words [64, 32], the stage's activations acts [BM,
    256]): decoded (scale bytes sc) into the A operand, one asynchronous `wgmma` into acc with the activations,
    then wait until one `wgmma` is in flight (this one): the previous piece's A registers `a` (and, PAIR,
    `other`: the other matrix's accumulator) are then free. Returns (acc, other, this piece's A operand, kept
    alive while its `wgmma` runs)."""
    nxt = wg_decoded_tile(wg_stage_piece(words, p, WL), sc, TWO_MULS, AL, TILED == 2)
    x = acts.slice(p * 128, 128, dim=1).permute((1, 0))
    acc = gl.nvidia.hopper.warpgroup_mma(nxt, x, acc, is_async=True)
    if not PAIR:
        acc, a, nxt = gl.nvidia.hopper.warpgroup_mma_wait(1, deps=(acc, a, nxt))
    else:
        acc, other, a, nxt = gl.nvidia.hopper.warpgroup_mma_wait(1, deps=(acc, other, a, nxt))
    return acc, other, nxt


@gluon.jit
def wg_scale_pair(s_ptr, soff, t, NT: gl.constexpr):
    """The scale bytes of K tile t's two pieces (tile 0 past the last: a prefetch never used)."""
    nx = gl.where(t < NT, t, 0) * 8
    return gl.load(s_ptr + soff + nx), gl.load(s_ptr + soff + nx + 4)


@gluon.jit
def wg_opaque(x):
    """x (an i32 scalar) through a `mov` marked not pure: the same value, which LLVM can neither fold into the
    addresses built from it nor hoist out of the loop (module docstring)."""
    return gl.inline_asm_elementwise("mov.u32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def wg_up_step(w13, zs, rw, ra, bar, sa_ptr, sb_ptr, soff, row, arow, it, stage, phase, acc0, acc1, a, n0, n1,
               NT: gl.constexpr, STAGES: gl.constexpr, TWO_MULS: gl.constexpr, TILED: gl.constexpr,
               WL: gl.constexpr, AL: gl.constexpr):
    """The up kernel's K tile `it` from ring stage `stage` (the unrolled loop's u, through `wg_opaque`): piece 0 of
    the stage's matrix 0 into acc0, of matrix 1 into acc1, then piece 1 of each (`wg_mma_piece`; the matrices in
    `wg_pair_desc`'s order, scale bytes sa, sb); once the first piece has retired the previous tile's `wgmma`s,
    tile it + STAGES − 1 into the stage they read, then the next tile's scale bytes loaded (n0, n1: this tile's
    on entry). Returns (acc0, acc1, a, n0, n1).
    Why the pieces alternate between the matrices: consecutive `wgmma`s then accumulate into different registers,
    and the two matrices' `wgmma`s of a piece read the same activations, whose 8 shared-memory descriptors are
    formed once and used twice in a row (Triton 3.6, sm_90a, the one-launch kernel: 1185 -> 1138 instructions a
    two-tile loop body, `UMOV`s 50 -> 17, 123 registers; matrix by matrix, ptxas saved and restored descriptors
    between a matrix's pieces)."""
    gl.nvidia.hopper.mbarrier.wait(bar.index(stage), phase)
    w0 = rw.index(stage).slice(0, 64, dim=0)
    w1 = rw.index(stage).slice(64, 64, dim=0)
    acts = ra.index(stage)
    acc0, acc1, a = wg_mma_piece(w0, acts, 0, n0[0], acc0, acc1, a, TWO_MULS, TILED, WL, AL)
    wg_ring_fill(w13, zs, rw, ra, bar, row, arow, it + STAGES - 1, (stage + STAGES - 1) % STAGES, NT, True, TILED)
    c0, c1 = n0, n1                 # the next tile's scale bytes, loaded behind the refill's fence
    n0, n1 = wg_scale_pair(sa_ptr, soff, it + 1, NT), wg_scale_pair(sb_ptr, soff, it + 1, NT)
    acc1, acc0, a = wg_mma_piece(w1, acts, 0, c1[0], acc1, acc0, a, TWO_MULS, TILED, WL, AL)
    acc0, acc1, a = wg_mma_piece(w0, acts, 1, c0[1], acc0, acc1, a, TWO_MULS, TILED, WL, AL)
    acc1, acc0, a = wg_mma_piece(w1, acts, 1, c1[1], acc1, acc0, a, TWO_MULS, TILED, WL, AL)
    return acc0, acc1, a, n0, n1


@gluon.jit
def wg_cta_rows(e, tile, rb, R: gl.constexpr, KDIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """A CTA's rows, for expert e of schedule tile `tile` and 64-row block rb: (the tile's first activation row,
    BLOCK_M·tile in tile rows; the CTA's first global weight row e·R + 64·rb of a matrix of R rows; its rows'
    scale-byte offsets over KDIM columns, `wg_scale_offsets`)."""
    SL: gl.constexpr = wg_layouts(BLOCK_M)[1]
    r0 = rb * 64
    return tile * BLOCK_M, (e * R + r0).to(gl.int32), wg_scale_offsets(e.to(gl.int64) * R + r0, KDIM, SL)


@gluon.jit
def wg_narrow(tile_row0_ptr, tile_row_end_ptr, tile):
    """Whether schedule tile `tile` holds at most 8 tokens (its `m64n8k16` path)."""
    return gl.load(tile_row_end_ptr + tile) - gl.load(tile_row0_ptr + tile) <= 8


@gluon.jit
def wg_up_tile(zs, w13, sa_ptr, sb_ptr, swap, tile_row0_ptr, tile_row_end_ptr, hp_ptr, SITU_BETA, SITU_LINEAR_BETA, e,
               tile, rb, D: gl.constexpr, I: gl.constexpr, ACT_SITU: gl.constexpr, TWO_MULS: gl.constexpr,
               BLOCK_M: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, TILED: gl.constexpr):
    """`moe_up_mx_wgmma_kernel`'s work for expert e's schedule tile `tile` (rows BLOCK_M apart) and 64-row block
    rb over the tile's first BM ≤ BLOCK_M rows: `m64nBMk16` `wgmma`s over zs's [BM, 256] boxes; h's rows of the
    tile past BM untouched."""
    NT: gl.constexpr = D // 256
    WL: gl.constexpr = wg_layouts(BM)[0]
    ACC: gl.constexpr = wg_layouts(BM)[2]
    AL: gl.constexpr = wg_layouts(BM)[3]
    arow, row, soff = wg_cta_rows(e, tile, rb, I, D, BLOCK_M)
    rw = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 32], wg_stage_layouts()[0])   # two matrices a stage
    ra = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 256], wg_stage_layouts()[1])
    bar = gl_ring_init(STAGES)
    for t in gl.static_range(STAGES - 1):
        wg_ring_fill(w13, zs, rw, ra, bar, row, arow, t, t, NT, True, TILED)
    n0, n1 = wg_scale_pair(sa_ptr, soff, 0, NT), wg_scale_pair(sb_ptr, soff, 0, NT)
    acc0 = gl.zeros([64, BM], gl.float32, ACC)
    acc1 = gl.zeros([64, BM], gl.float32, ACC)
    a = gl.zeros([64, 128], gl.bfloat16, AL)          # the piece in flight (none yet)
    for j in range(NT // STAGES):
        for u in gl.static_range(STAGES):
            acc0, acc1, a, n0, n1 = wg_up_step(w13, zs, rw, ra, bar, sa_ptr, sb_ptr, soff, row, arow,
                                               j * STAGES + u, wg_opaque(j * 0 + u), j & 1, acc0, acc1, a, n0, n1,
                                               NT, STAGES, TWO_MULS, TILED, WL, AL)
    for u in gl.static_range(NT % STAGES):
        acc0, acc1, a, n0, n1 = wg_up_step(w13, zs, rw, ra, bar, sa_ptr, sb_ptr, soff, row, arow,
                                           NT - NT % STAGES + u, wg_opaque(arow * 0 + u), (NT // STAGES) & 1, acc0,
                                           acc1, a, n0, n1, NT, STAGES, TWO_MULS, TILED, WL, AL)
    acc0, acc1 = gl.nvidia.hopper.warpgroup_mma_wait(0, deps=(acc0, acc1))
    if swap != 0:                                      # w3's words first (`wg_pair_desc`)
        gate, up = acc1, acc0
    else:
        gate, up = acc0, acc1
    _, m_ok = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BM, gl.SliceLayout(0, ACC))
    h = gl.where(gl.expand_dims(m_ok, 0), glu(gate, up, SITU_BETA, SITU_LINEAR_BETA, ACT_SITU), 0.0)
    col = wg_permuted_col(rb * 64 + gl.arange(0, 64, gl.SliceLayout(1, ACC)))
    rows = arow.to(gl.int64) + gl.arange(0, BM, gl.SliceLayout(0, ACC))
    gl.store(hp_ptr + gl.expand_dims(rows * I, 0) + gl.expand_dims(col, 1), h.to(hp_ptr.dtype.element_ty))


@gluon.jit(do_not_specialize=["SWAP"])
def moe_up_mx_wgmma_kernel(zs, zs8, w13, sa_ptr, sb_ptr, SWAP, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                           hp_ptr, SITU_BETA, SITU_LINEAR_BETA, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr,
                           ACT_SITU: gl.constexpr, TWO_MULS: gl.constexpr, BLOCK_M: gl.constexpr,
                           STAGES: gl.constexpr, TILED: gl.constexpr):
    """h = act(z W1[e]ᵀ, z W3[e]ᵀ) for one BLOCK_M-row tile and 64 intermediate columns, into hp [tile rows, I]
    (bf16, `wg_tile_rows`) at the tile's rows, its padding rows zeros, in `wg_permute` order; a 16-row tile of at
    most 8 tokens (`wg_narrow`) as an 8-row one, its h rows 8 .. 15 untouched. zs / zs8: TMA descriptors
    (`wg_act_desc`, BLOCK_M- and 8-row boxes) of z's rows gathered in tile rows and `wg_permute`d
    (`wg_gather_kernel`); w13: the TMA descriptor of both matrices' i32 words [E, I, D/8] (`wg_pair_desc`), the
    one at the lower address first; sa / sb: the E8M0 scale bytes u8 [E, I, D/32] of its first and second
    matrix; SWAP (i32, not specialised: it follows the weights' addresses): 1 where the first is w3; TILED: the
    words' layout, 0 row-major, 1 `mxfp4_tiles`, 2 `mxfp4_tiles_bits`."""
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    if e < E:
        wg_up_item(zs, zs8, w13, sa_ptr, sb_ptr, SWAP, tile_row0_ptr, tile_row_end_ptr, hp_ptr, SITU_BETA,
                   SITU_LINEAR_BETA, e, tile, gl.program_id(1), D, I, ACT_SITU, TWO_MULS, BLOCK_M, STAGES, TILED)


@gluon.jit
def wg_up_item(zs, zs8, w13, sa_ptr, sb_ptr, swap, tile_row0_ptr, tile_row_end_ptr, hp_ptr, SITU_BETA,
               SITU_LINEAR_BETA, e, tile, rb, D: gl.constexpr, I: gl.constexpr, ACT_SITU: gl.constexpr,
               TWO_MULS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, TILED: gl.constexpr):
    """`wg_up_tile` for a live tile (expert e < E), a tile of at most 8 tokens (`wg_narrow`) over zs8's 8-row
    boxes."""
    if BLOCK_M == 8:
        wg_up_tile(zs, w13, sa_ptr, sb_ptr, swap, tile_row0_ptr, tile_row_end_ptr, hp_ptr, SITU_BETA,
                   SITU_LINEAR_BETA, e, tile, rb, D, I, ACT_SITU, TWO_MULS, BLOCK_M, 8, STAGES, TILED)
    elif wg_narrow(tile_row0_ptr, tile_row_end_ptr, tile):
        wg_up_tile(zs8, w13, sa_ptr, sb_ptr, swap, tile_row0_ptr, tile_row_end_ptr, hp_ptr, SITU_BETA,
                   SITU_LINEAR_BETA, e, tile, rb, D, I, ACT_SITU, TWO_MULS, BLOCK_M, 8, STAGES, TILED)
    else:
        wg_up_tile(zs, w13, sa_ptr, sb_ptr, swap, tile_row0_ptr, tile_row_end_ptr, hp_ptr, SITU_BETA,
                   SITU_LINEAR_BETA, e, tile, rb, D, I, ACT_SITU, TWO_MULS, BLOCK_M, BLOCK_M, STAGES, TILED)


@gluon.jit
def wg_down_step(w2, hs, r2, ra, bar, s2_ptr, soff, row, arow, it, stage, phase, acc, a, n2,
                 NT: gl.constexpr, STAGES: gl.constexpr, TWO_MULS: gl.constexpr, TILED: gl.constexpr,
                 WL: gl.constexpr, AL: gl.constexpr):
    """The down kernel's K tile `it`, as `wg_up_step` for one matrix. Returns (acc, a, n2)."""
    gl.nvidia.hopper.mbarrier.wait(bar.index(stage), phase)
    words = r2.index(stage)
    acts = ra.index(stage)
    acc, _, a = wg_mma_piece(words, acts, 0, n2[0], acc, a, a, TWO_MULS, TILED, WL, AL, False)
    wg_ring_fill(w2, hs, r2, ra, bar, row, arow, it + STAGES - 1, (stage + STAGES - 1) % STAGES, NT, False, TILED)
    c2 = n2
    n2 = wg_scale_pair(s2_ptr, soff, it + 1, NT)
    acc, _, a = wg_mma_piece(words, acts, 1, c2[1], acc, a, a, TWO_MULS, TILED, WL, AL, False)
    return acc, a, n2


@gluon.jit
def wg_down_tile(hs, w2, s2_ptr, weights_ptr, order_ptr, tile_row0_ptr, tile_row_end_ptr, y_slot_ptr, e, tile, rb,
                 D: gl.constexpr, I: gl.constexpr, TWO_MULS: gl.constexpr, BLOCK_M: gl.constexpr, BM: gl.constexpr,
                 STAGES: gl.constexpr, TILED: gl.constexpr):
    """`moe_down_mx_wgmma_kernel`'s work for expert e's tile `tile` and 64-row block rb over the tile's first BM ≤
    BLOCK_M rows, as `wg_up_tile`."""
    NT: gl.constexpr = I // 256
    WL: gl.constexpr = wg_layouts(BM)[0]
    ACC: gl.constexpr = wg_layouts(BM)[2]
    AL: gl.constexpr = wg_layouts(BM)[3]
    arow, row, soff = wg_cta_rows(e, tile, rb, D, I, BLOCK_M)
    r2 = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 32], wg_stage_layouts()[0])
    ra = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 256], wg_stage_layouts()[1])
    bar = gl_ring_init(STAGES)
    for t in gl.static_range(STAGES - 1):
        wg_ring_fill(w2, hs, r2, ra, bar, row, arow, t, t, NT, False, TILED)
    n2 = wg_scale_pair(s2_ptr, soff, 0, NT)
    acc = gl.zeros([64, BM], gl.float32, ACC)
    a = gl.zeros([64, 128], gl.bfloat16, AL)
    for j in range(NT // STAGES):
        for u in gl.static_range(STAGES):
            acc, a, n2 = wg_down_step(w2, hs, r2, ra, bar, s2_ptr, soff, row, arow, j * STAGES + u,
                                      wg_opaque(j * 0 + u), j & 1, acc, a, n2, NT, STAGES, TWO_MULS, TILED, WL, AL)
    for u in gl.static_range(NT % STAGES):
        acc, a, n2 = wg_down_step(w2, hs, r2, ra, bar, s2_ptr, soff, row, arow, NT - NT % STAGES + u,
                                  wg_opaque(arow * 0 + u), (NT // STAGES) & 1, acc, a, n2, NT, STAGES, TWO_MULS,
                                  TILED, WL, AL)
    acc = gl.nvidia.hopper.warpgroup_mma_wait(0, deps=(acc,))
    offs_m, m_ok = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BM, gl.SliceLayout(0, ACC))
    slot = gl.load(order_ptr + offs_m, mask=m_ok, other=0)
    weight = gl.load(weights_ptr + slot, mask=m_ok, other=0.0)
    offs_n = rb * 64 + gl.arange(0, 64, gl.SliceLayout(1, ACC))
    gl.store(y_slot_ptr + gl.expand_dims(slot * D, 0) + gl.expand_dims(offs_n, 1), acc * gl.expand_dims(weight, 0),
             mask=gl.expand_dims(m_ok, 0))


@gluon.jit
def moe_down_mx_wgmma_kernel(hs, hs8, w2, s2_ptr, weights_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                             tile_row_end_ptr, y_slot_ptr, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr,
                             TWO_MULS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                             TILED: gl.constexpr):
    """y_slot[(token, slot)] = (h W2[e]ᵀ) · weight for one BLOCK_M-row tile and 64 output columns (a tile of at most
    8 tokens as an 8-row one, `wg_narrow`); hs / hs8: TMA descriptors (`wg_act_desc`, BLOCK_M- and 8-row boxes) of
    h [tile rows, I] (bf16, `wg_tile_rows`, `wg_permute` order: the up kernel's output); w2: TMA descriptor of the
    i32 words [E, D, I/8] as the up kernel's w1; s2 u8 [E, D, I/32]."""
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    if e < E:
        wg_down_item(hs, hs8, w2, s2_ptr, weights_ptr, order_ptr, tile_row0_ptr, tile_row_end_ptr, y_slot_ptr, e,
                     tile, gl.program_id(1), D, I, TWO_MULS, BLOCK_M, STAGES, TILED)


@gluon.jit
def wg_down_item(hs, hs8, w2, s2_ptr, weights_ptr, order_ptr, tile_row0_ptr, tile_row_end_ptr, y_slot_ptr, e, tile,
                 rb, D: gl.constexpr, I: gl.constexpr, TWO_MULS: gl.constexpr, BLOCK_M: gl.constexpr,
                 STAGES: gl.constexpr, TILED: gl.constexpr):
    """`wg_down_tile` for a live tile, as `wg_up_item`."""
    if BLOCK_M == 8:
        wg_down_tile(hs, w2, s2_ptr, weights_ptr, order_ptr, tile_row0_ptr, tile_row_end_ptr, y_slot_ptr, e, tile,
                     rb, D, I, TWO_MULS, BLOCK_M, 8, STAGES, TILED)
    elif wg_narrow(tile_row0_ptr, tile_row_end_ptr, tile):
        wg_down_tile(hs8, w2, s2_ptr, weights_ptr, order_ptr, tile_row0_ptr, tile_row_end_ptr, y_slot_ptr, e, tile,
                     rb, D, I, TWO_MULS, BLOCK_M, 8, STAGES, TILED)
    else:
        wg_down_tile(hs, w2, s2_ptr, weights_ptr, order_ptr, tile_row0_ptr, tile_row_end_ptr, y_slot_ptr, e, tile,
                     rb, D, I, TWO_MULS, BLOCK_M, BLOCK_M, STAGES, TILED)
