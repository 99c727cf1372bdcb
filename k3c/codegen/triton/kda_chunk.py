"""Fused chunked KDA prefill kernel (WY/UT form on 16-token tiles, tensor-core `tl.dot`).

One program per (batch row b, head h) walks the row in chunks of BT = 16 tokens with the fp32 state S ([D, D], key
dim first) in registers. Within a chunk (positions i, j; gc = cumulative log-decay inside the chunk, Gamma =
exp(gc); all from K3-SPEC.md "KDA layer", chunk algorithm of Kimi Linear):

    A[i, j] = beta_i * sum_d k_i[d] k_j[d] exp(gc_i[d] - gc_j[d])        (j < i, else 0)
    Tinv    = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8)           (A nilpotent: A^16 = 0)
    Wm      = Tinv @ (beta * Gamma * K)      U = Tinv @ (beta * V) - Wm @ S      (the delta-rule residuals u_i)
    O       = (Q * Gamma) @ S + (P masked j <= i) @ U,   P[i, j] = sum_d q_i k_j exp(gc_i - gc_j)
    S      <- exp(gc_last) * S + (K * exp(gc_last - gc))^T @ U

exp(gc_i - gc_j) is split as exp(gc_i - r) * exp(r - gc_j) with r the tile's first row so that both factors are
matrix operands. With the K3 lower bound (g > LOWER_BOUND = -5) a 16-token tile keeps r - gc_j < 15 * 5 = 75, so
exp stays finite in fp32; the launcher sends unbounded gates (Kimi Linear) to the recurrent kernel instead.
Conv, silu, l2norm, gate, beta and the RMSNorm + sigmoid-gate epilogue are fused as in `kda_recurrent`.
"""

import triton
import triton.language as tl

from k3c.codegen.triton._common import (
    causal_conv_silu,
    kda_decay_gate,
    l2_normalize,
    rms_norm_sigmoid_gate,
    roll_conv_state,
)


@triton.jit
def kda_chunk_kernel(
    q_in, k_in, v_in, f_in, gate_in,      # [B, T, H*D] projected activations (any float dtype)
    beta_in,                              # [B, T, H] beta logits
    conv_w_q, conv_w_k, conv_w_v,         # [H*D, W] fp32 depthwise conv weights
    A_log, dt_bias, o_norm_w,             # [>=H], [H*D], [D] fp32
    state_in, state_out,                  # [B, H, D, D] fp32 (key dim, value dim)
    conv_in, conv_out,                    # [B, 3*H*D, W] fp32: q, k, v channels
    y,                                    # [B, T, H*D] output (dtype of q_in)
    lengths,                              # [B] int32 tokens to process per row (HAS_LENGTHS) else unused
    T,                                    # tokens stored per row
    H: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
    BD: tl.constexpr, BW: tl.constexpr,   # next powers of two of D and W
    GATE_KIND: tl.constexpr, LOWER_BOUND: tl.constexpr, EPS: tl.constexpr,
    SCALE: tl.constexpr,                  # q scale D^-0.5 (K3-SPEC)
    HAS_LENGTHS: tl.constexpr, STORE_Y: tl.constexpr,
    BT: tl.constexpr,                     # chunk (tile) length, 16
    LOG2_BT: tl.constexpr,                # log2(BT)
    INV_PRECISION: tl.constexpr,          # tl.dot precision inside (I + A)^-1 ("ieee": fp32 FMA, 16x16 only)
    DOT_PRECISION: tl.constexpr,          # tl.dot input precision for fp32 operands ("tf32" or "ieee")
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    HD: tl.constexpr = H * D
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths + b)

    i_t = tl.arange(0, BT)                                # token lanes inside the chunk
    i_k = tl.arange(0, BD)
    i_v = tl.arange(0, BD)
    m_k = i_k < D
    m_v = i_v < D
    lower = i_t[:, None] > i_t[None, :]                   # strictly lower triangle (j < i)
    diag = i_t[:, None] == i_t[None, :]

    a = tl.exp(tl.load(A_log + h))
    dtb = tl.load(dt_bias + h * D + i_k, mask=m_k, other=0.0)
    norm_w = tl.load(o_norm_w + i_v, mask=m_v, other=0.0)

    x_off = b.to(tl.int64) * T * HD + h * D
    conv_q = b.to(tl.int64) * 3 * HD * W + (0 * HD + h * D) * W
    conv_k = b.to(tl.int64) * 3 * HD * W + (1 * HD + h * D) * W
    conv_v = b.to(tl.int64) * 3 * HD * W + (2 * HD + h * D) * W
    s_off = (b.to(tl.int64) * H + h) * D * D + i_k[:, None] * D + i_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(state_in + s_off, mask=m_s, other=0.0)

    for c0 in range(0, n, BT):
        pos = c0 + i_t
        valid = pos < n
        m_tk = valid[:, None] & m_k[None, :]
        m_tv = valid[:, None] & m_v[None, :]

        # Fused front end: conv + silu + l2norm, gate, beta. Padded rows (pos >= n) are all zero.
        q = causal_conv_silu(q_in + x_off, conv_in + conv_q, conv_w_q + h * D * W, pos[:, None], i_k[None, :],
                             m_tk, HD, W)
        k = causal_conv_silu(k_in + x_off, conv_in + conv_k, conv_w_k + h * D * W, pos[:, None], i_k[None, :],
                             m_tk, HD, W)
        v = causal_conv_silu(v_in + x_off, conv_in + conv_v, conv_w_v + h * D * W, pos[:, None], i_v[None, :],
                             m_tv, HD, W)
        q = l2_normalize(q, 1) * SCALE
        k = l2_normalize(k, 1)
        f = tl.load(f_in + x_off + pos[:, None] * HD + i_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        g = tl.where(m_tk, kda_decay_gate(f + dtb[None, :], a, GATE_KIND, LOWER_BOUND), 0.0)
        beta = tl.load(beta_in + (b.to(tl.int64) * T + pos) * H + h, mask=valid, other=0.0).to(tl.float32)
        beta = tl.where(valid, tl.sigmoid(beta), 0.0)

        gc = tl.cumsum(g, 0)                                            # cumulative log-decay in the chunk
        g_ref = tl.sum(tl.where(i_t[:, None] == 0, gc, 0.0), 0)        # r: first row
        g_last = tl.sum(tl.where(i_t[:, None] == BT - 1, gc, 0.0), 0)  # padded rows have g = 0
        decay_in = tl.exp(gc - g_ref[None, :])                          # <= 1
        k_out = k * tl.exp(g_ref[None, :] - gc)                         # <= exp(-(BT-1) * LOWER_BOUND)

        A = tl.dot(k * decay_in, tl.trans(k_out), input_precision=DOT_PRECISION)
        A = tl.where(lower, A * beta[:, None], 0.0)
        P = tl.dot(q * decay_in, tl.trans(k_out), input_precision=DOT_PRECISION)
        P = tl.where(lower | diag, P, 0.0)

        # Tinv = (I + A)^-1. A is strictly lower triangular, so A^BT = 0 and
        # (I + A)^-1 = sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)(I + A^8): log2(BT) - 1 squarings, no row loop.
        power = A
        Tinv = tl.where(diag, 1.0, 0.0) - A
        for _ in tl.static_range(LOG2_BT - 1):
            power = tl.dot(power, power, input_precision=INV_PRECISION)
            Tinv = Tinv + tl.dot(Tinv, power, input_precision=INV_PRECISION)

        gamma = tl.exp(gc)
        Wm = tl.dot(Tinv, (beta[:, None] * gamma) * k, input_precision=DOT_PRECISION)
        U = tl.dot(Tinv, beta[:, None] * v, input_precision=DOT_PRECISION)
        U = U - tl.dot(Wm, S, input_precision=DOT_PRECISION)
        O = tl.dot(q * gamma, S, input_precision=DOT_PRECISION)
        O = O + tl.dot(P, U, input_precision=DOT_PRECISION)
        k_end = k * tl.exp(g_last[None, :] - gc)                        # decay from token j to the chunk end
        S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(k_end), U, input_precision=DOT_PRECISION)

        if STORE_Y:
            y_off = x_off + pos[:, None] * HD + i_v[None, :]
            gl = tl.load(gate_in + y_off, mask=m_tv, other=0.0).to(tl.float32)
            out = rms_norm_sigmoid_gate(O, norm_w[None, :], gl, D, EPS, 1)
            tl.store(y + y_off, out.to(y.dtype.element_ty), mask=m_tv)

    tl.store(state_out + s_off, S, mask=m_s)
    roll_conv_state(q_in + x_off, conv_in + conv_q, conv_out + conv_q, n, HD, i_k, m_k, W, BW)
    roll_conv_state(k_in + x_off, conv_in + conv_k, conv_out + conv_k, n, HD, i_k, m_k, W, BW)
    roll_conv_state(v_in + x_off, conv_in + conv_v, conv_out + conv_v, n, HD, i_v, m_v, W, BW)
