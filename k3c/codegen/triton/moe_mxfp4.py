"""MXFP4 expert GEMM kernels of `moe_experts` (k3c.codegen.triton.moe): packed E2M1 weights + E8M0 scales
(k3c.ir.formats) decoded in registers, 8 codes per 32-bit word, feeding bf16 (or fp32) tensor-core dots.

Orientation: the weight tile is the dot's left operand, out[r, m] = Σ_k W[r, k] · x[m, k] for BLOCK_R weight rows
and a tile of BLOCK_M token rows (a GEMV at decode: the MMA's M dimension is the weights', its N the tokens'), so
on Hopper the decoded tile goes from registers straight into `wgmma` (its A operand may live in registers).

K order. The dot sums over k in any order, so each K tile of BLOCK_K weights is fed to the dot in the order that
puts every decoded value where the MMA wants it: `wgmma`'s A fragment gives thread t (of a quad) the columns
16c + 8p + 2t + e (p, e ∈ {0, 1}) of its rows; the tile's column (cc, cl, p, t, e) ↦ 32·cc + 16·cl + 8p + 2t + e
holds the weight of in-tile k = 8·(t·CC + cc) + 4e + 2·cl + p (CC = BLOCK_K/32). So thread t reads the CC
consecutive words t·CC .. t·CC + CC − 1 of each of its rows (16-byte loads), and the pair (e = 0, 1) of one
register is the pair of codes (s, s + 4), s = 2·cl + p, of one word, which the decoding makes in one 32-bit
register. The activations are stored once in the same order (`mx_permute`; the up kernel writes h directly in
the down kernel's order, `mx_permuted_col`); the products are the same, summed in another order.
`mma.sync` (MMA v2: 1 or 2 warps, `mx_mma_v2`; the kernels' V2): Triton's operand layout for it (kWidth 8) gives
thread t the 8 consecutive columns 32·cc + 8t + j of each 32-column chunk, so there column 32·cc + 8t + 2q + e
holds in-tile k = 8·(t·CC + cc) + 4e + q: the same words per thread, one word's 8 codes per chunk. Either way
the decoded registers are the MMA's operand as they are (no shared-memory round trip, no shuffle: checked in
the SASS); a tile whose order does not match its MMA still computes the same sums, through shared memory.

Decoding a word (bf16 activations on the GPU: inline PTX, Hopper has no E2M1 convert): a code s·8 + em (em =
exponent and mantissa bits) moved to bf16 bits 15 (sign) and 8..6 (em) is the bf16 number code · 2^-126 (em < 2
lands on bf16 subnormals, which `mul.bf16x2` keeps); TWO_MULS (the default): `mul.bf16x2` by 2^126, then by the
scale, gives code · scale exactly for every E8M0 value; without, one `mul.bf16x2` by 2^(s_E8M0 − 1) = 2^126 · scale
does, for s_E8M0 ≤ 128 only (2^(s − 1) overflows bf16 above). In the word a code's sign lies 1 bit above its em, in
the pattern 7 bits: two bit-selects (`lop3`) make two words in which the 7-bit gap holds for 4 codes each (y: the em
of codes 0, 1, 4, 5 with their signs moved 6 bits up; z: the em of codes 2, 3, 6, 7 moved 6 bits down with their
signs in place), so each bf16 pair is one shift and one mask of y or z (11 integer PTX instructions). Per word
(SASS, sm_90): 12 integer instructions (6 `LOP3`, 5 shifts of which one right shift, the left ones mostly `IMAD.SHL`
on the FMA pipe) and 4 `HMUL2` (8 with TWO_MULS): 2 instructions per weight with one multiply. Words whose bits the
runtime placed at load (`mxfp4_tiles_bits`, k3c.runtime.layouts.MX_BIT_PLACE; the kernels' TILED 2) need no
bit-selects first: pair 0 is one mask of the word, pairs 1 and 2 a rotate or shift and a mask, pair 3 two shifts, a
mask and a bit-select, 9 integer instructions, in PTX and SASS alike (no order does better with whole pairs: four
translates of the pair's bits {6, 7, 8, 15, 22, 23, 24, 31} do not tile 32 bits, so one pair takes two pieces). The
up kernel's K loop at 8 tokens: 562 instructions a K tile against 622 (sm_90a, benchmarks/mx_static_cost.py). The
assembly is elementwise (one word in, its 8 values out), so it does not depend on Triton's register layout.
Elsewhere (fp32 activations; Triton's interpreter, which has no inline assembly): `mxfp4_tile_f32` gathers the same
tile's bytes and scales per element and decodes in fp32.

Scales: a K tile's scale bytes are one contiguous [R, BLOCK_K/32] block per matrix (`mxfp4_scales`), which
Triton's pipeliner streams through shared memory with the words (cp.async) and reads back in the layout the
decoder wants; reshaped (no data movement) to one byte per word. A byte gather per word or per thread group is
too narrow for cp.async: it became a synchronous global load plus a shared-memory layout conversion (two CTA
barriers per matrix) in every K iteration, 7-14 % of the decode time (BENCHMARKS.md).

Public API: `ONE_MUL_MAX_SCALE`, `MX_DECODE_BY_DEVICE`, `mx_default_config(rows, E, scale_max, device)`,
`mx_even_unroll(mx_config, k_tiles_up)`, `mx_config_from_text(text)`, `mx_kernels(mx_config)` (the up and down
kernels' own fields of an mx_config), `mx_mma_v2(num_warps)`, `mx_block_k(K)`, `mx_permute(x, block_k, out, v2)`,
the jit helpers (among them `mx_word_offset`, the words' address row-major or in the runtime's tiled layouts, and
`mx_word_code`, a code's bits in either bit order) and
`moe_up_mx_kernel`, `moe_down_mx_kernel` (launched by `launch_moe_experts`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3c.codegen.triton.moe_act import expert_tile, glu


#: the largest E8M0 scale byte the one-multiply decoding takes: 2^(s − 1) is a finite bf16 for s ≤ 128
ONE_MUL_MAX_SCALE = 128

#: decode configurations measured faster than `mx_default_config`'s own on a card, by its CUDA device name
#: (`torch.cuda.get_device_name`), for the one-multiply decoding below 4 rows per expert (batch 1 of 32 experts,
#: batch ≤ 223 of 896). An entry takes the shapes the card's default takes (`gluon_decode_ok`: no unrolled loop,
#: which needs an even number of K tiles). H100 SXM (BENCHMARKS.md "MXFP4 round, run N"): the up kernel on a
#: 4-stage TMA ring refilled 3 stages at a time, 78.2-78.5 us against 81.7-81.8 for the default at batch 1 of 32
#: experts (three calls, bitwise equal); with its K loop unrolled too (mode 2) 78.4-78.6 us, and end to end 2.37
#: against 2.30 TB/s of expert reads in the same call
MX_DECODE_BY_DEVICE = {"NVIDIA H100 80GB HBM3": (8, 32, 256, 2, (4, 2), False, (None, 80), (1, 0))}


def mx_default_config(rows: int, E: int, scale_max: int = 255, device: str | None = None,
                      wgmma: bool = True) -> tuple:
    """`launch_moe_experts`' MXFP4 configuration (BLOCK_M, BLOCK_R, largest BLOCK_K, num_warps, num_stages, two_muls,
    maxnreg; an optional 8th field, the Gluon kernels' activation modes, `gl_act_ahead`; BLOCK_R, BLOCK_K,
    num_warps, num_stages and maxnreg may be (up, down) pairs, `mx_kernels`) for `rows` (token, slot) pairs over E
    experts whose scale bytes are at most `scale_max` (the `moe_experts` node's checkpoint fact; 255: unknown) on
    the CUDA device named `device` (None: any); wgmma: whether the launch can take the `wgmma` decode kernels
    (k3c.codegen.triton.moe_mxfp4_wgmma: bf16 on an sm_90 GPU, D and I multiples of 256; the launcher says).
    One multiply, < 16 rows per expert on average (decode):
    - < 8 rows per expert (batch 1 of 32 or 896 experts, batch 16 of 896): the card's own entry of
      `MX_DECODE_BY_DEVICE` below 4 rows per expert where it has one, else 8-token tiles of 32 weight rows on 2
      warps (`mma.sync`, the Gluon kernels of k3c.codegen.triton.moe_mxfp4_gluon), the words streamed by a 2-stage
      TMA ring, the down kernel capped at 80 registers, the up kernel's K loop unrolled by two with its activations
      one tile ahead (`gl_act_ahead` mode 2; `mx_even_unroll` takes mode 1 over an odd count of K tiles). Measured
      on the H200: mx27's ring (BENCHMARKS.md "MXFP4 round (mx27)"), run Q's placed bits with the unrolled loop
      (batch 1 of 32 experts: up 51.4 against 56.3 us for mode 1; 155 registers, 6 CTAs an SM, faster so than
      capped at 128).
    - from 8 rows per expert (batch 16 of the end-to-end benchmark's 32 experts), where wgmma: the `wgmma` kernels,
      16-token tiles of 64 rows on 4 warps, activations staged by the TMA ring (modes (3, 3); (4, 4) below), which
      decode an expert's 9-16 tokens once where 8-token tiles decode it twice (BENCHMARKS.md "MXFP4 round, run S",
      H200, same call: the expert kernels of 3 layers 0.567 against 0.604 ms, the expert bytes read at 70.8
      against 66.4 % of 4.2 TB/s); the up kernel's ring 2 stages, the down kernel's 3 (run T, H100: the down
      kernel 5-6 % shorter than with 2, in each of four calls; the up kernel's 3-stage ring was slower). At one
      token an expert their kernels took 4-9 % longer (H100); between 1 and 8 rows per expert nothing was timed,
      so the `mma.sync` kernels keep that range. Both kernels' work in one launch (modes (4, 4),
      k3c.codegen.triton.moe_mxfp4_fused; BENCHMARKS.md "MXFP4 round, run Z", H100, in the same runs: up and
      down 4-6.5 % less time at 8 tokens an expert of 16, 32 and 64 experts, the whole op 6.5-9 %).
    Two multiplies: 8-row tiles, 64 rows, 3 stages below 4 rows per expert, then 16-row tiles of the Triton kernels
    (Triton's own `wgmma`; the `wgmma` kernels above were not timed with two multiplies). < 64 rows per expert
    (measured at 32, batch 64 of 32 experts: 476 us against 1040 us for the prefill tiles, 3/4 empty there):
    32-row tiles; prefill: 128 × 128 tiles. two_muls (exact for every E8M0 scale) unless scale_max ≤
    ONE_MUL_MAX_SCALE, where the one-multiply decoding is exact too (4-6 % less time with 16-row tiles)."""
    two = scale_max > ONE_MUL_MAX_SCALE
    tuned = MX_DECODE_BY_DEVICE.get(device) if not two and rows < 4 * E else None
    if tuned:
        return tuned
    if not two and rows < 16 * E:
        if rows < 8 * E or not wgmma:
            return (8, 32, 256, 2, 2, two, (None, 80), (2, 0))
        return (16, 64, 256, 4, (2, 3), two, None, (4, 4))
    if rows < 4 * E:
        return (8, 64, 256, 2, 3, two, None)
    if rows < 16 * E:
        return (16, 64, 256, 4, 3, two, None)
    return (32, 64, 256, 4, 3, two, None) if rows < 64 * E else (128, 128, 128, 8, 3, two, None)


def mx_even_unroll(mx_config: tuple, k_tiles_up: int) -> tuple:
    """`mx_config` as the Gluon kernels can take it for an up kernel of `k_tiles_up` K tiles: its activation
    prefetch mode 2 (the K loop unrolled by two, `gl_act_ahead`) becomes 1 where the count is odd (K3.1 Pro's
    latent: 14 tiles of 256; a latent of 2304: 9); anything else unchanged."""
    if len(mx_config) > 7 and mx_config[7] is not None and mx_config[7][0] == 2 and k_tiles_up % 2:
        return (*mx_config[:7], (1, mx_config[7][1]))
    return mx_config


def mx_config_from_text(text: str) -> tuple:
    """An mx_config from its benchmark-flag form 'BLOCK_M,BLOCK_R,BLOCK_K,warps,stages,two_muls,maxnreg[,act]'
    (two_muls 0/1; maxnreg 0: none; act, optional: the Gluon kernels' activation prefetch modes, 0..2 each,
    `gl_act_ahead`, or 3/3: the activations staged by the TMA ring, the `wgmma` kernels of moe_mxfp4_wgmma; 4/4:
    the same in one launch, moe_mxfp4_fused).
    BLOCK_R, BLOCK_K, warps, stages and maxnreg may each be 'UP/DOWN', one value per kernel (`mx_kernels`); act
    is always 'UP/DOWN'. E.g. '8,32,256,2,2,0,0/80' -> (8, 32, 256, 2, 2, False, (None, 80)),
    '8,32,256,2,2,0,0/80,2/0' -> (..., (None, 80), (2, 0)) and '8,32,128/256,2,1/2,0,80' -> (8, 32, (128, 256),
    2, (1, 2), False, 80). Raises ValueError naming the text otherwise."""
    f = text.split(",")
    try:
        if len(f) not in (7, 8):
            raise ValueError
        v = [tuple(int(x) for x in field.split("/")) for field in f]
        if any(len(x) not in (1, 2) for x in v) or len(v[0]) > 1 or len(v[5]) > 1 or \
                len(f) == 8 and (len(v[7]) != 2 or not (set(v[7]) <= {0, 1, 2} or v[7] in ((3, 3), (4, 4)))):
            raise ValueError
    except ValueError:
        raise ValueError(f"{text!r}: expected BLOCK_M,BLOCK_R,BLOCK_K,warps,stages,two_muls,maxnreg[,act] (7 "
                         "integers; BLOCK_R, BLOCK_K, warps, stages and maxnreg may be UP/DOWN; act: UP/DOWN, "
                         "each 0, 1 or 2, or 3/3 or 4/4)") from None

    def one(x):
        return x[0] if len(x) == 1 else x

    caps = tuple(c or None for c in v[6])
    return (*(one(x) for x in v[:5]), bool(v[5][0]), one(caps), *((v[7],) if len(f) == 8 else ()))


def mx_kernels(mx_config: tuple) -> tuple[tuple, tuple]:
    """(up, down): each expert kernel's (BLOCK_R, largest BLOCK_K, num_warps, num_stages, maxnreg) in `mx_config`,
    whose BLOCK_R, BLOCK_K, num_warps, num_stages and maxnreg fields are each one value for both kernels or an
    (up, down) pair. The two are separate launches; they share BLOCK_M (one tile schedule) and two_muls, and the
    up kernel writes h in the down kernel's K order (its K tile and MMA). Raises ValueError for a pair of another
    length."""
    def split(i):
        x = mx_config[i]
        if not isinstance(x, (tuple, list)):
            return x, x
        if len(x) != 2:
            raise ValueError(f"mx_config {tuple(mx_config)}: field {i} must be one value or an (up, down) pair")
        return tuple(x)

    up, down = zip(*(split(i) for i in (1, 2, 3, 4, 6)))
    return up, down


def mx_mma_v2(num_warps: int) -> bool:
    """Whether the MXFP4 kernels launched with `num_warps` warps take the `mma.sync` (MMA v2) K order (module
    docstring): Triton gives a dot `mma.sync` rather than `wgmma` on Hopper whenever num_warps is not a multiple
    of 4 (checked on sm_90a with Triton 3.6 and 3.9; with 4 or 8 warps the choice also depends on the tile and
    the version, e.g. an 8-token tile gets `mma.sync` from 3.6 but `wgmma` from 3.9)."""
    return num_warps % 4 != 0


def mx_block_k(K: int, most: int = 256) -> int:
    """The K tile for an MXFP4 reduction of length K (a multiple of 32): the largest power of two ≤ `most` that
    divides K (≥ 32), so tiles never straddle the end."""
    b = most
    while K % b:
        b //= 2
    return b


def mx_permute(x: torch.Tensor, block_k: int, out: torch.Tensor | None = None, v2: bool = False) -> torch.Tensor:
    """x [N, K] -> the same values [N, K] in the MXFP4 kernels' K order (module docstring): per tile of block_k,
    column 32·cc + 16·cl + 8p + 2t + e holds k = 8·(t·CC + cc) + 4e + 2·cl + p; v2 (the `mma.sync` order):
    column 32·cc + 8t + 2q + e holds k = 8·(t·CC + cc) + 4e + q. A contiguous copy (into `out`, a contiguous
    [N, K] of x's dtype, when given)."""
    N, K = x.shape
    if v2:
        src = x.reshape(N, K // block_k, 4, block_k // 32, 2, 4).permute(0, 1, 3, 2, 5, 4)
    else:
        src = x.reshape(N, K // block_k, 4, block_k // 32, 2, 2, 2).permute(0, 1, 3, 5, 6, 2, 4)
    if out is None:
        return src.reshape(N, K)
    out.view(src.shape).copy_(src)
    return out


@triton.jit
def mx_permuted_col(k, BLOCK_K: tl.constexpr, V2: tl.constexpr):
    """`mx_permute`'s column of natural column k (int tensor)."""
    r = k % BLOCK_K
    CC: tl.constexpr = BLOCK_K // 32
    t = r // (8 * CC)
    cc = (r // 8) % CC
    if V2:
        col = k - r + 32 * cc + 8 * t + 2 * (r % 4) + (r // 4) % 2
    else:
        col = k - r + 32 * cc + 16 * ((r // 2) % 2) + 8 * (r % 2) + 2 * t + (r // 4) % 2
    return col


@triton.jit
def mx_word_offset(rows, wk, KW: tl.constexpr, TILED: tl.constexpr):
    """The offset in i32 words of word wk (int tensor, < KW) of global weight rows `rows` (e·R + r; int tensor)
    of packed MXFP4 words with KW words a row: row-major (TILED 0), or TILED 1 or 2 (the runtime's `mxfp4_tiles`
    and `mxfp4_tiles_bits` load-time layouts, k3c.runtime.layouts: [32 rows, 32 words] tiles along K, then row
    block by row block; 2 also places each word's bits for the decoding, `mxfp4_word_bf16`'s BITS). Both are
    linear in a K tile's start: offset(r, k0/8 + wi) = offset(r, wi) + offset(0, k0/8) for a K tile of 128..512
    values at k0 (a multiple of it)."""
    if TILED:
        return ((rows // 32) * (KW // 32) + wk // 32) * 1024 + (rows % 32) * 32 + wk % 32
    else:
        return rows * KW + wk


@triton.jit
def mx_word_code(word, c, BITS: tl.constexpr):
    """Code c (int tensor, 0..7) of i32 words `word` (broadcast together), 4 bits: bits 4c .. 4c + 3 in the
    checkpoint's order; BITS: gathered from where the `mxfp4_tiles_bits` layout placed them
    (k3c.runtime.layouts.MX_BIT_PLACE: bit b of code c at p, p + 4 mod 32, p − 6 or p − 2 / p + 6 for pair
    c mod 4, p = (6, 7, 8, 15)[b] + 16·(c // 4))."""
    if BITS:
        code = tl.zeros_like(word + c)
        for b in tl.static_range(4):
            p = (6 + b + 6 * (b // 3)) + 16 * (c // 4)
            j = c % 4
            at = tl.where(j == 0, p, tl.where(j == 1, (p + 4) % 32, tl.where(j == 2, p - 6,
                                                                             p - 2 + 8 * (b // 2 - b // 3))))
            code |= ((word >> at) & 1) << b
        return code
    return (word >> (4 * c)) & 15


@triton.jit
def mxfp4_word_bf16(w, mult, TWO_MULS: tl.constexpr, BITS: tl.constexpr = False):
    """w u32 (8 codes), mult bf16 (the word's 2^(s − 1), or with TWO_MULS its scale 2^(s − 127)), same shape ->
    8 bf16 tensors: code (s, s + 4) · scale for s = 0..3, i.e. the word's codes 0, 4, 1, 5, 2, 6, 3, 7. PTX sm_90.
    The checkpoint's bit order: two bit-selects (`lop3`) build y (em of codes 0, 1, 4, 5 in place, their signs 6
    bits up) and z (em of codes 2, 3, 6, 7 6 bits down, their signs in place), in which each code's sign lies 7
    bits above its em's top bit, as in the bf16 pattern; then each pair is one left shift (none for codes 3, 7)
    and one mask of y or z: 11 integer instructions per word. BITS (the runtime's `mxfp4_tiles_bits` layout,
    k3c.runtime.layouts.MX_BIT_PLACE): pair 0 is one mask of w, pairs 1 and 2 a rotate or shift and a mask, pair
    3 two shifts, a mask and a bit-select: 9."""
    if BITS:
        if TWO_MULS:
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 t, u, m, b;
                mov.b32 m, {$9, $9};
                mov.b32 b, 0x7e807e80;
                and.b32 t, $8, 0x81c081c0; mul.bf16x2 t, t, b; mul.bf16x2 t, t, m; mov.b32 {$0, $1}, t;
                shf.r.wrap.b32 t, $8, $8, 4; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, b; mul.bf16x2 t, t, m;
                mov.b32 {$2, $3}, t;
                shl.b32 t, $8, 6; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, b; mul.bf16x2 t, t, m; mov.b32 {$4, $5}, t;
                shl.b32 t, $8, 2; shr.b32 u, $8, 6; and.b32 u, u, 0x01000100; lop3.b32 t, t, u, 0x80c080c0, 0xec;
                mul.bf16x2 t, t, b; mul.bf16x2 t, t, m; mov.b32 {$6, $7}, t;
                }""",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, mult], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, u, m;
            mov.b32 m, {$9, $9};
            and.b32 t, $8, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$0, $1}, t;
            shf.r.wrap.b32 t, $8, $8, 4; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$2, $3}, t;
            shl.b32 t, $8, 6; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$4, $5}, t;
            shl.b32 t, $8, 2; shr.b32 u, $8, 6; and.b32 u, u, 0x01000100; lop3.b32 t, t, u, 0x80c080c0, 0xec;
            mul.bf16x2 t, t, m; mov.b32 {$6, $7}, t;
            }""",
            "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, mult], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    if TWO_MULS:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, y, z, m, b;
            mov.b32 m, {$9, $9};
            mov.b32 b, 0x7e807e80;
            shl.b32 t, $8, 6; lop3.b32 y, $8, t, 0x00770077, 0xe4;
            shr.b32 t, $8, 6; lop3.b32 z, t, $8, 0x01dc01dc, 0xe4;
            shl.b32 t, y, 6; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, b; mul.bf16x2 t, t, m; mov.b32 {$0, $1}, t;
            shl.b32 t, y, 2; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, b; mul.bf16x2 t, t, m; mov.b32 {$2, $3}, t;
            shl.b32 t, z, 4; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, b; mul.bf16x2 t, t, m; mov.b32 {$4, $5}, t;
            and.b32 t, z, 0x81c081c0; mul.bf16x2 t, t, b; mul.bf16x2 t, t, m; mov.b32 {$6, $7}, t;
            }""",
            "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, mult], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, y, z, m;
        mov.b32 m, {$9, $9};
        shl.b32 t, $8, 6; lop3.b32 y, $8, t, 0x00770077, 0xe4;
        shr.b32 t, $8, 6; lop3.b32 z, t, $8, 0x01dc01dc, 0xe4;
        shl.b32 t, y, 6; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$0, $1}, t;
        shl.b32 t, y, 2; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$2, $3}, t;
        shl.b32 t, z, 4; and.b32 t, t, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$4, $5}, t;
        and.b32 t, z, 0x81c081c0; mul.bf16x2 t, t, m; mov.b32 {$6, $7}, t;
        }""",
        "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, mult], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def mxfp4_scales(s_ptr, rows, r_ok, k0, KDIM: tl.constexpr, BLOCK_K: tl.constexpr, FAST: tl.constexpr,
                 V2: tl.constexpr):
    """The E8M0 scale bytes (u8; rows masked off by r_ok: 127) of the tile `mxfp4_weight_tile` decodes (rows i64
    [R], in-row columns k0 : k0+BLOCK_K of scales u8 [.., KDIM/32]), in the shape its decoder takes them. FAST: one
    per packed word, [R, 4, CC] (CC = BLOCK_K/32; word (t, cc) of the module docstring lies in 32-value group
    (t·CC + cc) // 4), loaded as the contiguous [R, CC] block and reshaped, so Triton's pipeliner streams it with
    the words (module docstring, "Scales"); else one per element, [R, BLOCK_K] in the kernels' K order (V2: the
    `mma.sync` one)."""
    CC: tl.constexpr = BLOCK_K // 32
    base = rows * (KDIM // 32) + k0 // 32
    if FAST:
        R: tl.constexpr = rows.shape[0]
        s = tl.load(s_ptr + base[:, None] + tl.arange(0, CC)[None, :], mask=r_ok[:, None], other=127)
        if CC >= 4:     # thread t's words lie in its CC / 4 groups t·CC/4 + cc // 4
            s = tl.reshape(tl.broadcast_to(tl.reshape(s, [R, 4, CC // 4, 1]), [R, 4, CC // 4, 4]), [R, 4, CC])
        else:           # 4 / CC threads t = g·4/CC + j share group g
            s = tl.reshape(tl.broadcast_to(tl.reshape(s, [R, CC, 1, 1]), [R, CC, 4 // CC, CC]), [R, 4, CC])
    else:
        col = tl.arange(0, BLOCK_K)
        t = (col // 8) % 4 if V2 else (col // 2) % 4
        g = (t * CC + col // 32) // 4
        s = tl.load(s_ptr + base[:, None] + g[None, :], mask=r_ok[:, None], other=127)
    return s


@triton.jit
def mxfp4_scale_bf16(s, TWO_MULS: tl.constexpr):
    """The bf16 multiplier `mxfp4_word_bf16` takes for E8M0 scale bytes s (u8 / int tensor): with TWO_MULS the
    scale 2^(s-127) itself (s = 0: the bf16 subnormal 2^-127; 255: NaN); else 2^(s-1), the scale times the
    decoding's exponent bias 2^126 in one factor (a normal bf16 for s ≤ ONE_MUL_MAX_SCALE). Also called from the Gluon
    kernels (k3c.codegen.triton.moe_mxfp4_gluon)."""
    s = s.to(tl.int32)
    if TWO_MULS:
        bits = tl.where(s == 0, 0x40, tl.where(s == 255, 0x7FC0, s << 7))
    else:
        bits = (s + 126) << 7
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def mxfp4_tile_bf16(w_ptr, s, rows, r_ok, k0, KDIM: tl.constexpr, BLOCK_K: tl.constexpr, TWO_MULS: tl.constexpr,
                    V2: tl.constexpr, TILED: tl.constexpr):
    """The bf16 tile [R, BLOCK_K] (module docstring's column order, V2: `mma.sync`'s) of rows `rows` (i64 [R], masked by
    r_ok: 0), in-row columns k0 : k0+BLOCK_K of an MXFP4 matrix (packed bytes read as i32 words [.., KDIM/8]) with
    its scale bytes s (`mxfp4_scales`, FAST), from 16-byte loads and `mxfp4_word_bf16`. Scale E8M0 0 is 2^-127, 255
    NaN (TWO_MULS; else s ≤ 128 assumed). The words row-major or TILED (`mx_word_offset`): thread group t's CC
    consecutive words of a row start at a multiple of CC, so with CC dividing 32 (BLOCK_K ≤ 1024) they lie in one
    32-word piece of the tiled layout too, one 16-byte run or more either way."""
    CC: tl.constexpr = BLOCK_K // 32
    R: tl.constexpr = rows.shape[0]
    tl.static_assert(32 % CC == 0, "K tiles of at most 1024")
    run = mx_word_offset(0, k0 // 8 + tl.arange(0, 4) * CC, KDIM // 8, TILED)      # [4]: where t's run starts
    word = mx_word_offset(rows, 0, KDIM // 8, TILED)[:, None, None] + run[None, :, None] + \
        tl.arange(0, CC)[None, None, :]
    w = tl.load(w_ptr + word, mask=r_ok[:, None, None], other=0)
    mult = mxfp4_scale_bf16(s, TWO_MULS)
    v0, v4, v1, v5, v2, v6, v3, v7 = mxfp4_word_bf16(w, mult, TWO_MULS, TILED == 2)
    # [R, t, cc, e, p, cl] with code s = 2·cl + p, pair element e: code s + 4e
    v = tl.join(tl.join(tl.join(v0, v4), tl.join(v1, v5)), tl.join(tl.join(v2, v6), tl.join(v3, v7)))
    if V2:      # [R, cc, t, cl, p, e]: column 32·cc + 8t + 2q + e, q = 2·cl + p
        tile = tl.reshape(tl.permute(v, (0, 2, 1, 5, 4, 3)), [R, BLOCK_K])
    else:
        tile = tl.reshape(tl.permute(v, (0, 2, 5, 4, 1, 3)), [R, BLOCK_K])
    return tile


@triton.jit
def mxfp4_tile_f32(w_ptr, s, rows, r_ok, k0, KDIM: tl.constexpr, BLOCK_K: tl.constexpr, V2: tl.constexpr,
                   TILED: tl.constexpr):
    """`mxfp4_tile_bf16`'s tile in fp32 with the scale bytes s [R, BLOCK_K] (`mxfp4_scales`, not FAST), decoded
    per element from gathered words (portable: fp32 activations, Triton's interpreter). A code (s, em) becomes the
    fp16 pattern s·2^15 | em·2^9 = code · 2^-14 (em < 2: fp16 subnormals, which the fp16 -> fp32 conversion
    keeps), times 2^14 (exact), times the scale."""
    col = tl.arange(0, BLOCK_K)
    CC: tl.constexpr = BLOCK_K // 32
    if V2:
        k = k0 + 8 * (((col // 8) % 4) * CC + col // 32) + 4 * (col % 2) + (col // 2) % 4
    else:
        k = k0 + 8 * (((col // 2) % 4) * CC + col // 32) + 4 * (col % 2) + 2 * ((col // 16) % 2) + (col // 8) % 2
    word = tl.load(w_ptr + mx_word_offset(rows[:, None], (k // 8)[None, :], KDIM // 8, TILED), mask=r_ok[:, None],
                   other=0)
    code = mx_word_code(word, (k % 8)[None, :], TILED == 2).to(tl.uint16)
    v = (((code & 7) << 9) | ((code & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    s = s.to(tl.int32)
    scale = tl.where(s == 0, 0x400000, tl.where(s == 255, 0x7FC00000, s << 23)).to(tl.float32, bitcast=True)
    return v * 16384.0 * scale


@triton.jit
def mxfp4_weight_tile(w_ptr, s, rows, r_ok, k0, KDIM: tl.constexpr, BLOCK_K: tl.constexpr, FAST: tl.constexpr,
                      TWO_MULS: tl.constexpr, V2: tl.constexpr, TILED: tl.constexpr):
    """The decoded weight tile [R, BLOCK_K] with its scale bytes s (`mxfp4_scales`, same FAST): bf16
    `mxfp4_tile_bf16` with FAST, else fp32 `mxfp4_tile_f32`; words row-major or TILED (`mx_word_offset`)."""
    if FAST:
        tile = mxfp4_tile_bf16(w_ptr, s, rows, r_ok, k0, KDIM, BLOCK_K, TWO_MULS, V2, TILED)
    else:
        tile = mxfp4_tile_f32(w_ptr, s, rows, r_ok, k0, KDIM, BLOCK_K, V2, TILED)
    return tile


@triton.jit
def mx_act_tile(xp_ptr, rows_m, m_ok, k0, KDIM: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activations of token rows `rows_m` [M] for K tile k0 from the `mx_permute`d x [.., KDIM], as the dot's
    right operand [BLOCK_K, M]."""
    offs = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    x = tl.load(xp_ptr + rows_m.to(tl.int64)[:, None] * KDIM + offs[None, :], mask=m_ok[:, None], other=0.0)
    return tl.trans(x)


@triton.jit
def moe_up_mx_kernel(zp_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                     tile_row_end_ptr, hp_ptr, SITU_BETA, SITU_LINEAR_BETA, E: tl.constexpr, K: tl.constexpr,
                     D: tl.constexpr, I: tl.constexpr, ACT_SITU: tl.constexpr, FAST: tl.constexpr,
                     TWO_MULS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_K2: tl.constexpr, DOT_PRECISION: tl.constexpr, V2: tl.constexpr,
                     V2_H: tl.constexpr, TILED: tl.constexpr):
    """h = act(z W1[e]ᵀ, z W3[e]ᵀ) for one tile of sorted rows and BLOCK_R intermediate columns. zp: z [N, D]
    `mx_permute`d by BLOCK_D; w1/w3 the packed bytes as i32 words [E, I, D/8] (row-major or TILED,
    `mx_word_offset`), scales s1/s3 u8 [E, I, D/32];
    hp [N·k, I] written in `mx_permute` order of BLOCK_K2 (the down kernel's K tile). V2: z and the weights in
    the `mma.sync` order (`mx_mma_v2` of this launch's warps); V2_H: h in it (`mx_mma_v2` of the down kernel's)."""
    e, offs_m, m_ok, slot = expert_tile(tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, order_ptr, tl.program_id(0),
                                        BLOCK_M)
    if e < E:
        token = slot // K
        offs_i = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        i_ok = offs_i < I
        rows = e.to(tl.int64) * I + offs_i
        gate = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
        up = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            s1 = mxfp4_scales(s1_ptr, rows, i_ok, d0, D, BLOCK_D, FAST, V2)
            s3 = mxfp4_scales(s3_ptr, rows, i_ok, d0, D, BLOCK_D, FAST, V2)
            z = mx_act_tile(zp_ptr, token, m_ok, d0, D, BLOCK_D)
            w = mxfp4_weight_tile(w1_ptr, s1, rows, i_ok, d0, D, BLOCK_D, FAST, TWO_MULS, V2, TILED)
            gate = tl.dot(w.to(z.dtype), z, gate, input_precision=DOT_PRECISION)
            w = mxfp4_weight_tile(w3_ptr, s3, rows, i_ok, d0, D, BLOCK_D, FAST, TWO_MULS, V2, TILED)
            up = tl.dot(w.to(z.dtype), z, up, input_precision=DOT_PRECISION)
        h = glu(gate, up, SITU_BETA, SITU_LINEAR_BETA, ACT_SITU)
        col = mx_permuted_col(offs_i, BLOCK_K2, V2_H)
        tl.store(hp_ptr + offs_m.to(tl.int64)[None, :] * I + col[:, None], h.to(hp_ptr.dtype.element_ty),
                 mask=i_ok[:, None] & m_ok[None, :])


@triton.jit
def moe_down_mx_kernel(hp_ptr, w2_ptr, s2_ptr, weights_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                       tile_row_end_ptr, y_slot_ptr, E: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                       FAST: tl.constexpr, TWO_MULS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K2: tl.constexpr, DOT_PRECISION: tl.constexpr, V2: tl.constexpr,
                       TILED: tl.constexpr):
    """y_slot[(token, slot)] = (h W2[e]ᵀ) · weight for one tile and BLOCK_R output columns; hp [N·k, I] in
    `mx_permute` order of BLOCK_K2 (V2: the `mma.sync` one); w2 the packed bytes as i32 words [E, D, I/8]
    (row-major or TILED), scales s2
    u8 [E, D, I/32]."""
    e, offs_m, m_ok, slot = expert_tile(tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, order_ptr, tl.program_id(0),
                                        BLOCK_M)
    if e < E:
        offs_n = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        n_ok = offs_n < D
        rows = e.to(tl.int64) * D + offs_n
        acc = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
        for i0 in range(0, I, BLOCK_K2):
            s2 = mxfp4_scales(s2_ptr, rows, n_ok, i0, I, BLOCK_K2, FAST, V2)
            h = mx_act_tile(hp_ptr, offs_m, m_ok, i0, I, BLOCK_K2)
            w = mxfp4_weight_tile(w2_ptr, s2, rows, n_ok, i0, I, BLOCK_K2, FAST, TWO_MULS, V2, TILED)
            acc = tl.dot(w.to(h.dtype), h, acc, input_precision=DOT_PRECISION)
        weight = tl.load(weights_ptr + slot, mask=m_ok, other=0.0)
        tl.store(y_slot_ptr + slot[None, :] * D + offs_n[:, None], acc * weight[None, :],
                 mask=n_ok[:, None] & m_ok[None, :])
