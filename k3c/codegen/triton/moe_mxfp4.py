"""MXFP4 expert GEMM kernels of `moe_experts` (k3c.codegen.triton.moe): packed E2M1 weights + E8M0 scales
(k3c.ir.formats) decoded in registers, 8 codes per 32-bit word, feeding bf16 (or fp32) tensor-core dots.

Orientation: the weight tile is the dot's left operand, out[r, m] = Σ_k W[r, k] · x[m, k] for BLOCK_R weight rows
and a tile of BLOCK_M token rows (a GEMV at decode: the MMA's M dimension is the weights', its N the tokens').

K order. A packed 32-bit word q holds the codes c0..c7 of k = 8q..8q+7 (c_2j in the low nibble of byte j). The
decoding (`mxfp4_words_bf16`) turns one word into four bf16 pairs with 2 shifts and a masked or each, the pairs
the bit positions give for free: (c0, c4), (c2, c6) of the even k and (c1, c5), (c3, c7) of the odd k. So a
K tile of BLOCK_K weights becomes two operands of BLOCK_K/2 columns, "even" and "odd", whose column 4q + j holds
k = 8q + 2·σ(j) (+ 1 for odd), σ = (0, 2, 1, 3). The dot sums over k in any order, so the activations are stored
once in the same order (`mx_permute`: per BLOCK_K tile, the even half then the odd half); the up kernel writes h
directly in the down kernel's order. Both halves are exact: the dots see the same products, summed differently.

Decoding a word (bf16 activations on the GPU: inline PTX, Hopper has no E2M1 convert). A code s·8 + em (em =
exponent and mantissa bits) moved to bf16 bits 15 (sign) and 8..6 (em) is the bf16 number code · 2^-126 (em < 2
lands on bf16 subnormals, which `mul.bf16x2` keeps); one `mul.bf16x2` by 2^(s_E8M0 − 1) = 2^126 · scale gives
code · scale exactly (TWO_MULS: by 2^126, then by the scale: exact for every E8M0 value, 2^(s−1) overflows bf16
for s > 128). 5 instructions per bf16 pair (triton_kernels' Hopper upcast needs a pre-twiddled weight layout for
its 4; the artifact keeps the checkpoint's bytes). Elsewhere (fp32 activations, Triton's interpreter, which has no
inline assembly): `mxfp4_codes_f32`, the same tensors from bytes gathered in σ order, decoded in fp32.

Public API: `mx_block_k(K)`, `mx_permute(x, block_k)`, the jit helpers and `moe_up_mx_kernel`,
`moe_down_mx_kernel` (launched by `launch_moe_experts`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3c.codegen.triton.moe_act import glu


def mx_block_k(K: int, most: int = 256) -> int:
    """The K tile for an MXFP4 reduction of length K (a multiple of 32): the largest power of two ≤ `most` that
    divides K (≥ 32), so tiles never straddle the end and `mx_permute` is a view."""
    b = most
    while K % b:
        b //= 2
    return b


def mx_permute(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [N, K] -> the same values [N, K] in the MXFP4 kernels' K order (module docstring): per tile of block_k,
    column par·block_k/2 + 4q + j holds k = 8q + 2·σ(j) + par, σ = (0, 2, 1, 3). A contiguous copy."""
    N, K = x.shape
    return x.reshape(N, K // block_k, block_k // 8, 2, 2, 2).permute(0, 1, 5, 2, 4, 3).reshape(N, K)


@triton.jit
def mx_permuted_col(k, BLOCK_K: tl.constexpr):
    """`mx_permute`'s column of natural column k (int tensor)."""
    r = k % BLOCK_K
    w = r % 8
    return k - r + (w % 2) * (BLOCK_K // 2) + (r // 8) * 4 + ((w // 2) % 2) * 2 + w // 4


@triton.jit
def mxfp4_words_bf16(p, mult, TWO_MULS: tl.constexpr):
    """p u8 [R, G, 16] (the packed bytes of G 32-value groups, natural order), mult bf16 [R, G, 16] (each group's
    2^(s − 1), or with TWO_MULS its scale 2^(s − 127)) -> (even, odd) bf16 [R, G, 16] in σ order. PTX sm_90."""
    if TWO_MULS:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, u, b;
            mov.b32 b, 0x7e807e80;
            shl.b32 t, $4, 6; and.b32 t, t, 0x01c001c0; shl.b32 u, $4, 12; and.b32 u, u, 0x80008000;
            or.b32 t, t, u; mul.bf16x2 t, t, b; mul.bf16x2 $0, t, $5;
            shr.b32 t, $4, 2; and.b32 t, t, 0x01c001c0; shl.b32 u, $4, 4; and.b32 u, u, 0x80008000;
            or.b32 t, t, u; mul.bf16x2 t, t, b; mul.bf16x2 $1, t, $5;
            shl.b32 t, $4, 2; and.b32 t, t, 0x01c001c0; shl.b32 u, $4, 8; and.b32 u, u, 0x80008000;
            or.b32 t, t, u; mul.bf16x2 t, t, b; mul.bf16x2 $2, t, $5;
            shr.b32 t, $4, 6; and.b32 t, t, 0x01c001c0; and.b32 u, $4, 0x80008000;
            or.b32 t, t, u; mul.bf16x2 t, t, b; mul.bf16x2 $3, t, $5;
            }""",
            "=r,=r,=r,=r,r,r,r", [p, mult], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, u;
        shl.b32 t, $4, 6; and.b32 t, t, 0x01c001c0; shl.b32 u, $4, 12; and.b32 u, u, 0x80008000;
        or.b32 t, t, u; mul.bf16x2 $0, t, $5;
        shr.b32 t, $4, 2; and.b32 t, t, 0x01c001c0; shl.b32 u, $4, 4; and.b32 u, u, 0x80008000;
        or.b32 t, t, u; mul.bf16x2 $1, t, $5;
        shl.b32 t, $4, 2; and.b32 t, t, 0x01c001c0; shl.b32 u, $4, 8; and.b32 u, u, 0x80008000;
        or.b32 t, t, u; mul.bf16x2 $2, t, $5;
        shr.b32 t, $4, 6; and.b32 t, t, 0x01c001c0; and.b32 u, $4, 0x80008000;
        or.b32 t, t, u; mul.bf16x2 $3, t, $5;
        }""",
        "=r,=r,=r,=r,r,r,r", [p, mult], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def mxfp4_codes_f32(p, scale):
    """p u8 [R, G, 16] bytes already in σ order, scale fp32 [R, G] -> (even, odd) fp32 [R, G, 16] = code · scale.
    A code (s, em) becomes the fp16 pattern s·2^15 | em·2^9 = code · 2^-14 (em < 2: fp16 subnormals, which the
    fp16 -> fp32 conversion keeps), times 2^14 (exact)."""
    p = p.to(tl.uint16)
    lo = (((p & 7) << 9) | ((p & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((p & 0x70) << 5) | ((p & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    s = scale[:, :, None] * 16384.0
    return lo * s, hi * s


@triton.jit
def mxfp4_weight_tile(w_ptr, s_ptr, rows, r_ok, k0, KDIM: tl.constexpr, BLOCK_K: tl.constexpr,
                      FAST: tl.constexpr, TWO_MULS: tl.constexpr):
    """Rows `rows` (i64 [R], masked by r_ok), columns k0 : k0+BLOCK_K of an MXFP4 matrix (packed u8 [.., KDIM/2],
    scales u8 [.., KDIM/32]) -> (even, odd) [R, BLOCK_K/2] in σ order: bf16 with FAST (`mxfp4_words_bf16`), else
    fp32 (`mxfp4_codes_f32`). E8M0 0 is 2^-127, 255 NaN (OCP MX v1.0 §5.4.1). Masked rows read as 0."""
    G: tl.constexpr = BLOCK_K // 32
    offs_g = tl.arange(0, G)
    offs_j = tl.arange(0, 16)
    if FAST:
        byte = offs_g[:, None] * 16 + offs_j[None, :]
    else:   # σ order: position 4q + j of a group reads byte 4q + σ(j)
        byte = offs_g[:, None] * 16 + (offs_j - offs_j % 4 + 2 * (offs_j % 2) + (offs_j % 4) // 2)[None, :]
    p = tl.load(w_ptr + rows[:, None, None] * (KDIM // 2) + k0 // 2 + byte[None, :, :], mask=r_ok[:, None, None],
                other=0)
    s = tl.load(s_ptr + rows[:, None] * (KDIM // 32) + k0 // 32 + offs_g[None, :], mask=r_ok[:, None],
                other=127).to(tl.int32)
    R: tl.constexpr = p.shape[0]
    if FAST:
        if TWO_MULS:
            bits = tl.where(s == 0, 0x40, tl.where(s == 255, 0x7FC0, s << 7))
        else:
            bits = (s + 126) << 7
        mult = tl.broadcast_to(bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)[:, :, None], [R, G, 16])
        even, odd = mxfp4_words_bf16(p, mult, TWO_MULS)
    else:
        bits = tl.where(s == 0, 0x400000, tl.where(s == 255, 0x7FC00000, s << 23))
        even, odd = mxfp4_codes_f32(p, bits.to(tl.float32, bitcast=True))
    return tl.reshape(even, [R, BLOCK_K // 2]), tl.reshape(odd, [R, BLOCK_K // 2])


@triton.jit
def mx_act_tile(xp_ptr, rows_m, m_ok, k0, KDIM: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activations of token rows `rows_m` [M] for K tile k0 from the `mx_permute`d x [.., KDIM], as the dots'
    right operands: (even, odd) [BLOCK_K/2, M]."""
    offs = k0 + tl.arange(0, BLOCK_K // 2)
    ptr = xp_ptr + rows_m.to(tl.int64)[None, :] * KDIM + offs[:, None]
    return tl.load(ptr, mask=m_ok[None, :], other=0.0), tl.load(ptr + BLOCK_K // 2, mask=m_ok[None, :], other=0.0)


@triton.jit
def moe_up_mx_kernel(zp_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                     tile_row_end_ptr, hp_ptr, SITU_BETA, SITU_LINEAR_BETA, E: tl.constexpr, K: tl.constexpr,
                     D: tl.constexpr, I: tl.constexpr, ACT_SITU: tl.constexpr, FAST: tl.constexpr,
                     TWO_MULS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_K2: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """h = act(z W1[e]ᵀ, z W3[e]ᵀ) for one tile of sorted rows and BLOCK_R intermediate columns. zp: z [N, D]
    `mx_permute`d by BLOCK_D; w1/w3 packed u8 [E, I, D/2], scales s1/s3 u8 [E, I, D/32]; hp [N·k, I] written in
    `mx_permute` order of BLOCK_K2 (the down kernel's K tile)."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < E:
        offs_m = tl.load(tile_row0_ptr + tile) + tl.arange(0, BLOCK_M)
        m_ok = offs_m < tl.load(tile_row_end_ptr + tile)
        token = tl.load(order_ptr + offs_m, mask=m_ok, other=0) // K
        offs_i = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        i_ok = offs_i < I
        rows = e.to(tl.int64) * I + offs_i
        gate = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
        up = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            z0, z1 = mx_act_tile(zp_ptr, token, m_ok, d0, D, BLOCK_D)
            w0, w1 = mxfp4_weight_tile(w1_ptr, s1_ptr, rows, i_ok, d0, D, BLOCK_D, FAST, TWO_MULS)
            gate = tl.dot(w0.to(z0.dtype), z0, gate, input_precision=DOT_PRECISION)
            gate = tl.dot(w1.to(z0.dtype), z1, gate, input_precision=DOT_PRECISION)
            w0, w1 = mxfp4_weight_tile(w3_ptr, s3_ptr, rows, i_ok, d0, D, BLOCK_D, FAST, TWO_MULS)
            up = tl.dot(w0.to(z0.dtype), z0, up, input_precision=DOT_PRECISION)
            up = tl.dot(w1.to(z0.dtype), z1, up, input_precision=DOT_PRECISION)
        h = glu(gate, up, SITU_BETA, SITU_LINEAR_BETA, ACT_SITU)
        col = mx_permuted_col(offs_i, BLOCK_K2)
        tl.store(hp_ptr + offs_m.to(tl.int64)[None, :] * I + col[:, None], h.to(hp_ptr.dtype.element_ty),
                 mask=i_ok[:, None] & m_ok[None, :])


@triton.jit
def moe_down_mx_kernel(hp_ptr, w2_ptr, s2_ptr, weights_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr,
                       tile_row_end_ptr, y_slot_ptr, E: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                       FAST: tl.constexpr, TWO_MULS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K2: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """y_slot[(token, slot)] = (h W2[e]ᵀ) · weight for one tile and BLOCK_R output columns; hp [N·k, I] in
    `mx_permute` order of BLOCK_K2; w2 packed u8 [E, D, I/2], scales s2 u8 [E, D, I/32]."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < E:
        offs_m = tl.load(tile_row0_ptr + tile) + tl.arange(0, BLOCK_M)
        m_ok = offs_m < tl.load(tile_row_end_ptr + tile)
        slot = tl.load(order_ptr + offs_m, mask=m_ok, other=0)           # flat (token · K + slot) index
        offs_n = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        n_ok = offs_n < D
        rows = e.to(tl.int64) * D + offs_n
        acc = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
        for i0 in range(0, I, BLOCK_K2):
            h0, h1 = mx_act_tile(hp_ptr, offs_m, m_ok, i0, I, BLOCK_K2)
            w0, w1 = mxfp4_weight_tile(w2_ptr, s2_ptr, rows, n_ok, i0, I, BLOCK_K2, FAST, TWO_MULS)
            acc = tl.dot(w0.to(h0.dtype), h0, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(w1.to(h0.dtype), h1, acc, input_precision=DOT_PRECISION)
        weight = tl.load(weights_ptr + slot, mask=m_ok, other=0.0)
        tl.store(y_slot_ptr + slot[None, :] * D + offs_n[:, None], acc * weight[None, :],
                 mask=n_ok[:, None] & m_ok[None, :])
