"""Gluon decode kernels of MXFP4 `moe_experts` (k3c.codegen.triton.moe_mxfp4's `mma.sync` decode path): each
thread decodes exactly the packed words it is given, and the words stream ahead of the decoding either in registers
or through a TMA ring in shared memory.

Why Gluon: the Triton decode kernels stream each K tile's packed words through shared memory laid out for
Triton's own conversion (cp.async, one buffer: 2 stages), so every tile waits for its own load behind the
barrier that frees the buffer (BENCHMARKS.md, "MXFP4 round (mx20)"). Here each thread owns the 32-bit words it
decodes, in the layout the `mma.sync` A operand wants after decoding (`mx_permute(..., v2=True)` K order:
thread t of a quad holds words t·CC .. t·CC + CC − 1 of rows g and g + 8 of its warp's 16, CC = BLOCK_K/32, two
16-byte loads per row), so the decoded tile is the MMA operand as it is (`convert_layout(...,
assert_trivial=True)` compiles only if no data moves). Plain Triton cannot state this: a loop-carried load there
is converted through shared memory.

Word stream (num_stages of the launch's mx_config, the kernels' STAGES): 1 loads the next K tile's words and
scale bytes (and, by `gl_act_ahead`'s rule, activations) into registers at the top of each iteration
(loop-carried: no shared memory, no barrier; but ptxas issues those loads where the current tile's registers free
up, about three quarters through the tile, so they are in flight for a quarter of it). STAGES ≥ 2 streams
the words through a ring of STAGES shared-memory stages filled by TMA: one thread issues a [BLOCK_R,
BLOCK_K/8]-word box per matrix and tile (`w1` / `w3` / `w2` are then TMA descriptors, `gl_word_descs`),
completing on the stage's mbarrier; the box is stored with a BLOCK_K/2-byte swizzle, so a warp's 16-byte reads of
its words (`gl_words2d_layout`: the same words per thread as registers) are free of bank conflicts. The copies
cost no registers and no per-thread instructions. The ring refills its STAGES − 1 free stages together every
STAGES − 1 tiles (`gl_ring_refill`; 2 stages: one tile ahead, every tile), so DRAM is asked for each weight
row's next (STAGES − 1)·BLOCK_K/2 bytes back to back: under the decoding's load, a row read in 128-byte pieces
a tile apart costs the H200 up to 8 points of its read rate against address order (BENCHMARKS.md "MXFP4 round,
run N"). With TILED words (the runtime's `mxfp4_tiles` load-time layout, k3c.runtime.layouts: [32 rows, 32 words]
tiles along K, then row block by row block) a box of 32 rows is one contiguous 4 KB run, and a CTA reads its rows'
bytes in address order; the descriptor is then over the tiles' rows (`gl_word_descs`) and `gl_ring_fill` maps a
(row, K tile) to the box's place; the register word stream addresses the words by `mx_word_offset`. TILED 2
(`mxfp4_tiles_bits`): the same tiles with each word's bits placed so that it decodes in 9 integer instructions
instead of 11 (`mxfp4_word_bf16`'s BITS).
The scale bytes stay one tile ahead in registers; the activations load at use or one tile ahead, as
`gl_act_ahead` says (mode 2 unrolls the K loop by two so that the prefetched activations and scale bytes need
no copies; the register word stream's words are still carried). Staging the down kernel's activations in the
ring beside its words (its h rows are sorted by expert, so each K tile's are one TMA box) was measured slower on
the H100 and the H200, its extra copies and CTA barriers costing more than the loads they replace (BENCHMARKS.md
"MXFP4 round, run Q"). The ring's descriptors, fills and stage reads are k3c.codegen.triton.gl_ring's.
Measured on the H200 (BENCHMARKS.md "MXFP4 round (mx27)"), the TMA ring beats the register prefetch at batch 1
and 16, bitwise equal; the per-thread cp.async ring it replaces was 55-70 % slower (mx26).

Layouts (W = num_warps, BLOCK_R = 16·W weight rows, BLOCK_M = 8 or 16 token rows, `mma.sync` m16n8k16 with
kWidth 8: one or two instructions per k16 step): the words are a [W, 2, 8, 4, CH, 4] tensor (weight row 16w +
8h + g, thread-in-quad t, word t·CC + 4·ch + c, CH = CC/4) in a BlockedLayout whose lanes are (g, t) and warps
w; each word decodes (`mxfp4_word_bf16`, the same PTX as the Triton kernels, so bitwise the same values) to 4
bf16 pairs, which joined, permuted and reshaped are the [BLOCK_R, BLOCK_K] A operand, decoded once for all
BLOCK_M tokens. The activations are the B operand [BLOCK_K, BLOCK_M] (thread (g, t) holds token columns g and,
at 16, g + 8), loaded straight from z / h in `gl_permute` order (the v2 order with each thread's pairs of two
32-column chunks interleaved, as Triton's `mma.sync` lowering pairs them: 16 bytes per thread = two
instructions' B registers, no moves) as 32-bit pairs (carried bf16 values cost a PRMT per pair); rows past the
tile read a valid row instead of being masked (no zero fill; their columns of the product are never stored).
The E8M0 scale bytes of a word's 32-value group, (t·CC + 4·ch + c) // 4 = t·CH + ch, are CH consecutive bytes
per thread and row.

Scope: bf16 activations on a GPU, 1 or 2 warps, decode tiles of 8 or 16 token rows, K tiles of 128..512 (CC a
multiple of 4; the TMA ring ≤ 256: a swizzled box row is at most 128 bytes), weight rows a multiple of BLOCK_R
(`gluon_decode_ok`); the Triton kernels cover the rest (and the interpreter: Gluon has none). Public API:
`GLUON_BLOCK_MS`, `gluon_decode_ok`, `gl_act_ahead`, the jit helpers (pasted into the emitted modules) and
`moe_up_mx_gluon_kernel`, `moe_down_mx_gluon_kernel`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3c.codegen.triton.gl_ring import gl_ring_fill, gl_ring_init, gl_ring_refill, gl_stage_words
from k3c.codegen.triton.moe_act import glu
from k3c.codegen.triton.moe_mxfp4 import mx_kernels, mx_word_offset, mxfp4_scale_bf16, mxfp4_word_bf16

#: token rows per tile the kernels take (the `mma.sync` N: one or two n8 instructions per k16 step)
GLUON_BLOCK_MS = (8, 16)


def gluon_decode_ok(mx_config: tuple, D: int, I: int, bk1: int, bk2: int) -> bool:
    """Whether the Gluon kernels take a bf16 MXFP4 launch on a GPU with `mx_config` (BLOCK_M, BLOCK_R, largest
    BLOCK_K, num_warps, num_stages, ...: `mx_default_config`; per-kernel fields as `mx_kernels` splits them) over
    latent D and expert inner I with K tiles bk1 (over D: the up kernel) and bk2 (over I: the down kernel): 8- or
    16-row token tiles and, for each kernel, 1 or 2 warps (the `mma.sync` path, `mx_mma_v2`), 16 weight rows per
    warp, every weight-row block full (up: I rows, down: D), K tiles of 128..512 (≤ 256 for the TMA ring), an
    even number of K tiles where its activation prefetch mode (`gl_act_ahead`) is 2; not the modes (3, 3) or
    (4, 4), which name the `wgmma` kernels (k3c.codegen.triton.moe_mxfp4_wgmma; in one launch, moe_mxfp4_fused).
    For these kernels num_stages is the word stream's depth (module docstring): 1 prefetches the next K tile in
    registers, ≥ 2 streams the words through a TMA ring of that many stages, refilled num_stages − 1 at a time.
    Raises ValueError for prefetch modes `gl_act_ahead` refuses or a per-kernel field that is not a pair."""
    def ok(kernel, rows, k, bk, mode):
        block_r, _, warps, stages, _ = kernel
        return warps in (1, 2) and block_r == 16 * warps and rows % block_r == 0 and \
            bk in ((128, 256, 512) if stages == 1 else (128, 256)) and (mode != 2 or (k // bk) % 2 == 0)

    if len(mx_config) > 7 and mx_config[7] is not None and tuple(mx_config[7]) in ((3, 3), (4, 4)):
        return False            # the activations staged by the ring: the `wgmma` kernels (moe_mxfp4_wgmma)
    up, down = mx_kernels(mx_config)
    mode_up, mode_down = gl_act_ahead(mx_config)
    return mx_config[0] in GLUON_BLOCK_MS and ok(up, I, D, bk1, mode_up) and ok(down, D, I, bk2, mode_down)


def gl_act_ahead(mx_config: tuple) -> tuple[int, int]:
    """(up, down): how each Gluon kernel of `mx_config` gets a K tile's activations and scale bytes. 0: the
    activations at the top of the tile's iteration, the scale bytes one tile ahead. 1: both one tile ahead in
    registers carried across the loop, which ptxas copies into fresh registers at the back edge (83 moves a tile
    in the up kernel against 16 with 2; benchmarks/mx_static_cost.py). 2: both one tile ahead, the K loop unrolled
    by two so that two register sets take turns, each reloaded after its last use: no copies of them; an even
    number of K tiles (`gluon_decode_ok`). The config's optional 8th field is the pair; else the rule measured on
    the H200 (BENCHMARKS.md "MXFP4 round (mx27)"), per kernel by its own num_stages (`mx_kernels`): with the
    register word stream (num_stages 1) 1; with the TMA ring the up kernel 1 at 8-token tiles (batch 1: 60.2
    against 65.5 us for 0; at 16 tokens its registers would double) and the down kernel 0 (mode 1 cost it 29
    registers and 5-10 % of its time); `mx_default_config` gives the pair explicitly (run Q: (2, 0) at decode but
    on a card with its own entry; `mx_even_unroll` makes 2 into 1 over an odd count of K tiles). Raises ValueError
    for a mode outside 0..2."""
    if len(mx_config) > 7 and mx_config[7] is not None:
        modes = mx_config[7]
    else:
        up, down = mx_kernels(mx_config)
        modes = (int(up[3] == 1 or mx_config[0] == 8), int(down[3] == 1))
    if len(modes) != 2 or modes[0] not in (0, 1, 2) or modes[1] not in (0, 1, 2):
        raise ValueError(f"mx_config {tuple(mx_config)}: activation prefetch modes (up, down) must be 0, 1 or 2")
    return int(modes[0]), int(modes[1])


@gluon.constexpr_function
def gl_layouts(W, BLOCK_K, BM):
    """(words [W, 2, 8, 4, CH, 4] layout, MMA accumulator, A operand, B operand, activation pairs) for W warps,
    K tiles of BLOCK_K = 128·CH and BM = 8 or 16 token columns (module docstring); the pairs: i32 [BLOCK_K/2, BM]
    in `gl_permute` memory order, thread t of a quad holding pairs 8t .. 8t + 7 of every 32 (two 16-byte loads)
    of token columns g (and g + 8), so the prefetched activations are carried across the loop as 32-bit words
    (carried bf16 values cost a PRMT per pair)."""
    CH = BLOCK_K // 128
    words = gl.BlockedLayout([1, 2, 1, 1, CH, 4], [1, 1, 8, 4, 1, 1], [W, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    pairs = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0]] + [[32 << i, 0] for i in range((BLOCK_K // 64).bit_length() - 1)] +
        [[0, 8 << i] for i in range((BM // 8).bit_length() - 1)],
        lane_bases=[[8, 0], [16, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[[0, 0]] * (W.bit_length() - 1),
        block_bases=[], shape=[BLOCK_K // 2, BM])
    return (words, mma, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8),
            gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8), pairs)


def gl_permute(x: torch.Tensor, block_k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] -> the same values [N, K] in the Gluon kernels' activation order: `mx_permute`'s `mma.sync` (v2)
    order with, in every 64 columns (its 32-column chunks 2b and 2b + 1), thread t's 8 columns of both chunks
    interleaved by pairs: column 64b + 16t + 4q + 2s + e holds the v2 column 32·(2b + s) + 8t + 2q + e, i.e.
    in-tile k = 8·(t·CC + 2b + s) + 4e + q. Triton's `mma.sync` lowering (kWidth 8) feeds one instruction the
    same pair of both chunks, so each 16-byte load gives two instructions' B registers in place (no moves). A
    contiguous copy (into `out`, contiguous [N, K] of x's dtype, when given)."""
    N, K = x.shape
    src = x.reshape(N, K // block_k, 4, block_k // 64, 2, 2, 4).permute(0, 1, 3, 2, 6, 4, 5)
    if out is None:
        return src.reshape(N, K)
    out.view(src.shape).copy_(src)
    return out


@triton.jit
def gl_permuted_col(k, BLOCK_K: tl.constexpr):
    """`gl_permute`'s column of natural column k (int tensor)."""
    r = k % BLOCK_K
    CC: tl.constexpr = BLOCK_K // 32
    t = r // (8 * CC)
    cc = (r // 8) % CC
    return k - r + 64 * (cc // 2) + 16 * t + 4 * (r % 4) + 2 * (cc % 2) + (r // 4) % 2


@gluon.constexpr_function
def gl_axis_layout(layout, rank, d):
    """The 1-D layout of dim d of a rank-`rank` layout (every other dim sliced off, the last first)."""
    for k in reversed(range(rank)):
        if k != d:
            layout = gl.SliceLayout(k, layout)
    return layout


@gluon.jit
def gl_word_offsets(row0, KDIM: gl.constexpr, W: gl.constexpr, CH: gl.constexpr, WL: gl.constexpr,
                    TILED: gl.constexpr):
    """(word offsets [W, 2, 8, 4, CH, 4] (WL) of K tile 0 of weight rows row0 + 16w + 8h + g in i32 words
    [.., KDIM/8] (row-major or TILED: `mx_word_offset`), their scale-byte offsets [W, 2, 8, 4, CH]
    (SliceLayout(5, WL)) in bytes [.., KDIM/32])."""
    w = gl.expand_dims(gl.arange(0, W, gl_axis_layout(WL, 6, 0)), (1, 2, 3, 4, 5))
    h = gl.expand_dims(gl.arange(0, 2, gl_axis_layout(WL, 6, 1)), (0, 2, 3, 4, 5))
    g = gl.expand_dims(gl.arange(0, 8, gl_axis_layout(WL, 6, 2)), (0, 1, 3, 4, 5))
    t = gl.expand_dims(gl.arange(0, 4, gl_axis_layout(WL, 6, 3)), (0, 1, 2, 4, 5))
    ch = gl.expand_dims(gl.arange(0, CH, gl_axis_layout(WL, 6, 4)), (0, 1, 2, 3, 5))
    c = gl.expand_dims(gl.arange(0, 4, gl_axis_layout(WL, 6, 5)), (0, 1, 2, 3, 4))
    woff = mx_word_offset(row0 + 16 * w + 8 * h + g, t * (4 * CH) + ch * 4, KDIM // 8, TILED) + c   # c: one piece
    SL: gl.constexpr = gl.SliceLayout(5, WL)
    w = gl.expand_dims(gl.arange(0, W, gl_axis_layout(SL, 5, 0)), (1, 2, 3, 4))
    h = gl.expand_dims(gl.arange(0, 2, gl_axis_layout(SL, 5, 1)), (0, 2, 3, 4))
    g = gl.expand_dims(gl.arange(0, 8, gl_axis_layout(SL, 5, 2)), (0, 1, 3, 4))
    t = gl.expand_dims(gl.arange(0, 4, gl_axis_layout(SL, 5, 3)), (0, 1, 2, 4))
    ch = gl.expand_dims(gl.arange(0, CH, gl_axis_layout(SL, 5, 4)), (0, 1, 2, 3))
    soff = (row0 + 16 * w + 8 * h + g) * (KDIM // 32) + t * CH + ch
    return woff, soff


@gluon.jit
def gl_act_offsets(rows_m, KDIM: gl.constexpr, BLOCK_K: gl.constexpr, PL: gl.constexpr):
    """Offsets [BLOCK_K/2, BM] (PL: `gl_layouts`' pairs) of K tile 0 of activation rows rows_m [BM]
    (SliceLayout(0, PL)) in bf16 pairs (i32) [.., KDIM/2]."""
    k = gl.arange(0, BLOCK_K // 2, gl.SliceLayout(1, PL))
    return gl.expand_dims(rows_m.to(gl.int64) * (KDIM // 2), 0) + gl.expand_dims(k, 1)


@gluon.jit
def gl_act_operand(pairs, BLOCK_K: gl.constexpr, BL: gl.constexpr):
    """The bf16 B operand [BLOCK_K, BM] (BL) of activation pairs i32 [BLOCK_K/2, BM] in `gl_permute` order
    (`gl_layouts`' pairs): pair 32b + 8t + 2q + s of the memory is pair 4t + q of 32-column chunk 2b + s."""
    BM: gl.constexpr = pairs.shape[1]
    p = gl.reshape(gl.permute(gl.reshape(pairs, [BLOCK_K // 64, 4, 4, 2, BM]), (0, 3, 1, 2, 4)), [BLOCK_K // 2, BM])
    lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    x = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [BLOCK_K, BM])
    return gl.convert_layout(x, BL, assert_trivial=True)


@gluon.jit
def gl_decoded_tile(words, s, TWO_MULS: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_K: gl.constexpr, AL: gl.constexpr,
                    BITS: gl.constexpr):
    """The bf16 A operand [BLOCK_R, BLOCK_K] (`mma.sync` K order) of packed words [W, 2, 8, 4, CH, 4] (i32) with
    their groups' E8M0 bytes s [W, 2, 8, 4, CH] (u8): `mxfp4_word_bf16` per word (BITS: the words' bits placed by
    the `mxfp4_tiles_bits` layout), joined into each thread's 8 consecutive columns 32·cc + 8t + j (j = 2q + e:
    code q + 4e of word cc)."""
    mult = gl.expand_dims(mxfp4_scale_bf16(s, TWO_MULS), 5)
    mult, words = gl.broadcast(mult, words)
    v0, v4, v1, v5, v2, v6, v3, v7 = mxfp4_word_bf16(words, mult, TWO_MULS, BITS)
    return gl_word_values_operand(v0, v4, v1, v5, v2, v6, v3, v7, BLOCK_R, BLOCK_K, AL)


@gluon.jit
def gl_word_values_operand(v0, v4, v1, v5, v2, v6, v3, v7, BLOCK_R: gl.constexpr, BLOCK_K: gl.constexpr,
                           AL: gl.constexpr):
    """The bf16 A operand [BLOCK_R, BLOCK_K] (AL, `mma.sync` K order) of each word's 8 decoded values, bf16
    [W, 2, 8, 4, CH, 4] each (v_q: code q; `mxfp4_word_bf16`'s outputs in its order 0, 4, 1, 5, 2, 6, 3, 7):
    joined into each thread's 8 consecutive columns 32·cc + 8t + j (j = 2q + e: code q + 4e of word cc), with no
    data moved (`convert_layout(..., assert_trivial=True)`)."""
    # [W, 2, 8, 4(t), CH, 4, e, p, a]: each join appends the last dim; column j = 4a + 2p + e
    v = gl.join(gl.join(gl.join(v0, v4), gl.join(v1, v5)), gl.join(gl.join(v2, v6), gl.join(v3, v7)))
    tile = gl.reshape(gl.permute(v, (0, 1, 2, 4, 5, 3, 8, 7, 6)), [BLOCK_R, BLOCK_K])
    return gl.convert_layout(tile, AL, assert_trivial=True)


@gluon.jit
def gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BM: gl.constexpr, layout: gl.constexpr):
    """The sorted-row offsets [BM] of schedule tile `tile` in `layout` and their mask."""
    offs_m = gl.load(tile_row0_ptr + tile) + gl.arange(0, BM, layout)
    return offs_m, offs_m < gl.load(tile_row_end_ptr + tile)


@gluon.jit
def moe_up_mx_gluon_kernel(zp_ptr, w1, w3, s1_ptr, s3_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                           tile_row_end_ptr, hp_ptr, SITU_BETA, SITU_LINEAR_BETA, E: gl.constexpr, K: gl.constexpr,
                           D: gl.constexpr, I: gl.constexpr, ACT_SITU: gl.constexpr, TWO_MULS: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_D: gl.constexpr,
                           BLOCK_K2: gl.constexpr, STAGES: gl.constexpr, ACT_AHEAD: gl.constexpr,
                           TILED: gl.constexpr):
    """`moe_up_mx_kernel` (bf16, V2) for one BLOCK_M-row tile (8 or 16) and BLOCK_R intermediate columns:
    h = act(z W1[e]ᵀ, z W3[e]ᵀ) into hp [N·k, I] in `gl_permute` order of BLOCK_K2. zp: z [N, D] (bf16 read as
    i32 pairs) `gl_permute`d by BLOCK_D; s1/s3 u8 [E, I, D/32]; w1/w3: STAGES 1, pointers to i32 words
    [E, I, D/8], loaded one K tile ahead into registers; STAGES ≥ 2, their TMA descriptors (`gl_word_descs`,
    boxes [BLOCK_R, BLOCK_D/8]) streaming through a shared ring of STAGES stages (module docstring, "Word
    stream"); TILED: the words' layout, 0 row-major, 1 `mxfp4_tiles`, 2 `mxfp4_tiles_bits` (module docstring).
    ACT_AHEAD 0, 1 or 2: where the activations and scale bytes of a K tile come from (`gl_act_ahead`); a prefetch
    of the tile past the last wraps to tile 0 (unused)."""
    W: gl.constexpr = BLOCK_R // 16
    CH: gl.constexpr = BLOCK_D // 128
    NT: gl.constexpr = D // BLOCK_D
    WL: gl.constexpr = gl_layouts(W, BLOCK_D, BLOCK_M)[0]
    MMA: gl.constexpr = gl_layouts(W, BLOCK_D, BLOCK_M)[1]
    AL: gl.constexpr = gl_layouts(W, BLOCK_D, BLOCK_M)[2]
    BL: gl.constexpr = gl_layouts(W, BLOCK_D, BLOCK_M)[3]
    PL: gl.constexpr = gl_layouts(W, BLOCK_D, BLOCK_M)[4]
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    if e < E:
        offs_m, m_ok = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BLOCK_M, gl.SliceLayout(0, PL))
        token = gl.load(order_ptr + offs_m, mask=m_ok, other=0) // K
        zptrs = zp_ptr + gl_act_offsets(token, D, BLOCK_D, PL)     # rows past the tile read token 0, never stored
        i0 = gl.program_id(1) * BLOCK_R
        woff, soff = gl_word_offsets(e.to(gl.int64) * I + i0, D, W, CH, WL, TILED)
        s1p, s3p = s1_ptr + soff, s3_ptr + soff
        s1, s3 = gl.load(s1p), gl.load(s3p)
        if STAGES > 1:
            row = (e * I + i0).to(gl.int32)
            r1 = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_R, BLOCK_D // 8], w1.layout)
            r3 = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_R, BLOCK_D // 8], w3.layout)
            bar = gl_ring_init(STAGES)
            gl_ring_fill(w1, w3, r1, r3, bar, row, 0, NT, STAGES, True, TILED)
        else:
            w1p, w3p = w1 + woff, w3 + woff
            c1_n, c3_n = gl.load(w1p), gl.load(w3p)
        if ACT_AHEAD:
            z = gl.load(zptrs)
        gate = gl.zeros([BLOCK_R, BLOCK_M], gl.float32, MMA)
        up = gl.zeros([BLOCK_R, BLOCK_M], gl.float32, MMA)
        UNROLL: gl.constexpr = 2 if ACT_AHEAD == 2 else 1
        gl.static_assert(NT % UNROLL == 0, "ACT_AHEAD 2 takes an even number of K tiles")
        for j in range(NT // UNROLL):
            for u in gl.static_range(UNROLL):
                it = j * UNROLL + u
                d0 = it * BLOCK_D
                dn = gl.where(d0 + BLOCK_D < D, d0 + BLOCK_D, 0)
                if STAGES > 1:
                    gl_ring_refill(w1, w3, r1, r3, bar, row, it, NT, STAGES, True, TILED)
                else:
                    c1, c3 = c1_n, c3_n
                    nxt = mx_word_offset(0, dn // 8, D // 8, TILED)
                    c1_n, c3_n = gl.load(w1p + nxt), gl.load(w3p + nxt)   # the last wraps to tile 0: unused
                if ACT_AHEAD == 2:      # two register sets, a (z, s1, s3) and b, each loaded after its last use
                    if u == 0:
                        x, t1, t3 = gl_act_operand(z, BLOCK_D, BL), s1, s3
                        zb, s1b, s3b = gl.load(zptrs + dn // 2), gl.load(s1p + dn // 32), gl.load(s3p + dn // 32)
                    else:
                        x, t1, t3 = gl_act_operand(zb, BLOCK_D, BL), s1b, s3b
                        z, s1, s3 = gl.load(zptrs + dn // 2), gl.load(s1p + dn // 32), gl.load(s3p + dn // 32)
                else:
                    if ACT_AHEAD:
                        x = gl_act_operand(z, BLOCK_D, BL)
                        z = gl.load(zptrs + dn // 2)
                    else:
                        x = gl_act_operand(gl.load(zptrs + d0 // 2), BLOCK_D, BL)
                    t1, t3 = s1, s3
                    s1, s3 = gl.load(s1p + dn // 32), gl.load(s3p + dn // 32)
                if STAGES > 1:
                    gl.nvidia.hopper.mbarrier.wait(bar.index(it % STAGES), (it // STAGES) & 1)
                    c1 = gl_stage_words(r1.index(it % STAGES), W, CH, WL)
                    c3 = gl_stage_words(r3.index(it % STAGES), W, CH, WL)
                a1 = gl_decoded_tile(c1, t1, TWO_MULS, BLOCK_R, BLOCK_D, AL, TILED == 2)
                gate = gl.nvidia.ampere.mma_v2(a1, x, gate)
                a3 = gl_decoded_tile(c3, t3, TWO_MULS, BLOCK_R, BLOCK_D, AL, TILED == 2)
                up = gl.nvidia.ampere.mma_v2(a3, x, up)
        h = glu(gate, up, SITU_BETA, SITU_LINEAR_BETA, ACT_SITU)
        col = gl_permuted_col(i0 + gl.arange(0, BLOCK_R, gl.SliceLayout(1, MMA)), BLOCK_K2)
        offs_mo, m_ok_o = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BLOCK_M, gl.SliceLayout(0, MMA))
        gl.store(hp_ptr + gl.expand_dims(offs_mo.to(gl.int64) * I, 0) + gl.expand_dims(col, 1),
                 h.to(hp_ptr.dtype.element_ty), mask=gl.expand_dims(m_ok_o, 0) & gl.expand_dims(col < I, 1))


@gluon.jit
def moe_down_mx_gluon_kernel(hp_ptr, w2, s2_ptr, weights_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                             tile_row_end_ptr, y_slot_ptr, E: gl.constexpr, D: gl.constexpr, I: gl.constexpr,
                             TWO_MULS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_R: gl.constexpr,
                             BLOCK_K2: gl.constexpr, STAGES: gl.constexpr, ACT_AHEAD: gl.constexpr,
                             TILED: gl.constexpr):
    """`moe_down_mx_kernel` (bf16, V2) for one BLOCK_M-row tile and BLOCK_R output columns: y_slot[(token, slot)]
    = (h W2[e]ᵀ) · weight; hp [N·k, I] (bf16 read as i32 pairs) in `gl_permute` order of BLOCK_K2, s2 u8
    [E, D, I/32]; w2 as the up kernel's w1: i32 words [E, D, I/8] with STAGES 1, else their TMA descriptor;
    ACT_AHEAD and TILED as in the up kernel."""
    W: gl.constexpr = BLOCK_R // 16
    CH: gl.constexpr = BLOCK_K2 // 128
    NT: gl.constexpr = I // BLOCK_K2
    WL: gl.constexpr = gl_layouts(W, BLOCK_K2, BLOCK_M)[0]
    MMA: gl.constexpr = gl_layouts(W, BLOCK_K2, BLOCK_M)[1]
    AL: gl.constexpr = gl_layouts(W, BLOCK_K2, BLOCK_M)[2]
    BL: gl.constexpr = gl_layouts(W, BLOCK_K2, BLOCK_M)[3]
    PL: gl.constexpr = gl_layouts(W, BLOCK_K2, BLOCK_M)[4]
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    if e < E:
        offs_m, m_ok = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BLOCK_M, gl.SliceLayout(0, PL))
        hptrs = hp_ptr + gl_act_offsets(gl.where(m_ok, offs_m, 0), I, BLOCK_K2, PL)   # rows past the tile: row 0
        n0 = gl.program_id(1) * BLOCK_R
        woff, soff = gl_word_offsets(e.to(gl.int64) * D + n0, I, W, CH, WL, TILED)
        s2p = s2_ptr + soff
        s2 = gl.load(s2p)
        if STAGES > 1:
            row = (e * D + n0).to(gl.int32)
            r2 = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_R, BLOCK_K2 // 8], w2.layout)
            bar = gl_ring_init(STAGES)
            gl_ring_fill(w2, w2, r2, r2, bar, row, 0, NT, STAGES, False, TILED)
        else:
            w2p = w2 + woff
            c2_n = gl.load(w2p)
        if ACT_AHEAD:
            h = gl.load(hptrs)
        acc = gl.zeros([BLOCK_R, BLOCK_M], gl.float32, MMA)
        UNROLL: gl.constexpr = 2 if ACT_AHEAD == 2 else 1
        gl.static_assert(NT % UNROLL == 0, "ACT_AHEAD 2 takes an even number of K tiles")
        for j in range(NT // UNROLL):
            for u in gl.static_range(UNROLL):
                it = j * UNROLL + u
                i0 = it * BLOCK_K2
                nx = gl.where(i0 + BLOCK_K2 < I, i0 + BLOCK_K2, 0)
                if STAGES > 1:
                    gl_ring_refill(w2, w2, r2, r2, bar, row, it, NT, STAGES, False, TILED)
                else:
                    c2 = c2_n
                    c2_n = gl.load(w2p + mx_word_offset(0, nx // 8, I // 8, TILED))   # the last wraps to tile 0
                if ACT_AHEAD == 2:      # as in the up kernel: register sets a (h, s2) and b
                    if u == 0:
                        x, t2 = gl_act_operand(h, BLOCK_K2, BL), s2
                        hb, s2b = gl.load(hptrs + nx // 2), gl.load(s2p + nx // 32)
                    else:
                        x, t2 = gl_act_operand(hb, BLOCK_K2, BL), s2b
                        h, s2 = gl.load(hptrs + nx // 2), gl.load(s2p + nx // 32)
                else:
                    if ACT_AHEAD == 1:
                        x = gl_act_operand(h, BLOCK_K2, BL)
                        h = gl.load(hptrs + nx // 2)
                    else:
                        x = gl_act_operand(gl.load(hptrs + i0 // 2), BLOCK_K2, BL)
                    t2 = s2
                    s2 = gl.load(s2p + nx // 32)
                if STAGES > 1:
                    gl.nvidia.hopper.mbarrier.wait(bar.index(it % STAGES), (it // STAGES) & 1)
                    c2 = gl_stage_words(r2.index(it % STAGES), W, CH, WL)
                a2 = gl_decoded_tile(c2, t2, TWO_MULS, BLOCK_R, BLOCK_K2, AL, TILED == 2)
                acc = gl.nvidia.ampere.mma_v2(a2, x, acc)
        offs_mo, m_ok_o = gl_tile_rows(tile_row0_ptr, tile_row_end_ptr, tile, BLOCK_M, gl.SliceLayout(0, MMA))
        slot = gl.load(order_ptr + offs_mo, mask=m_ok_o, other=0)
        weight = gl.load(weights_ptr + slot, mask=m_ok_o, other=0.0)
        offs_n = n0 + gl.arange(0, BLOCK_R, gl.SliceLayout(1, MMA))
        gl.store(y_slot_ptr + gl.expand_dims(slot * D, 0) + gl.expand_dims(offs_n, 1), acc * gl.expand_dims(weight, 0),
                 mask=gl.expand_dims(m_ok_o, 0) & gl.expand_dims(offs_n < D, 1))
