"""Fused KDA token-by-token kernel: decode step (T = 1), recurrent prefill (any T) and speculative replay.

One program per (batch row b, head h) walks the row's tokens in order with the state S[h] ([D, D], key dim
first) in fp32 registers (stored as fp32 or bf16: loaded and widened once, rounded once when written back). Per
token, everything of K3-SPEC.md "KDA layer" between the projections and o_proj:
conv (from the raw projected inputs and the conv state) -> silu -> l2norm (q scaled by D^-0.5) -> decay gate ->
beta -> delta-rule update -> o = S^T q -> per-head RMSNorm -> * sigmoid(output gate). At the end the state and the
conv state are written (in place when the output pointers alias the inputs).
Launchers live in `k3c.codegen.triton.kda`.
"""

import triton
import triton.language as tl

from k3c.codegen.triton._common import (
    causal_conv_silu_token,
    delta_rule_step,
    kda_decay_gate,
    load_conv_weight,
    l2_normalize,
    rms_norm_sigmoid_gate,
    roll_conv_state,
)


@triton.jit
def kda_recurrent_kernel(
    q_in, k_in, v_in, f_in, gate_in,      # [B, T, H*D] projected activations (any float dtype)
    beta_in,                              # [B, T, H] beta logits
    conv_w_q, conv_w_k, conv_w_v,         # [H*D, W] fp32 depthwise conv weights
    A_log, dt_bias, o_norm_w,             # [>=H], [H*D], [D] fp32
    state_in, state_out,                  # [B, H, D, D] fp32 or bf16 (key dim, value dim)
    conv_in, conv_out,                    # [B, 3*H*D, W] fp32 or the activation dtype: q, k, v channels
    y,                                    # [B, T, H*D] output (dtype of q_in)
    lengths,                              # [B] int32 tokens to process per row (HAS_LENGTHS) else unused
    T,                                    # tokens stored per row
    s_qb, s_qt, s_kb, s_kt, s_vb, s_vt,   # (batch, token) strides (elements) of the activations; last dim dense
    s_fb, s_ft, s_gb, s_gt, s_bb, s_bt,   # (f, gate, beta)
    H: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
    BD: tl.constexpr, BW: tl.constexpr,   # next powers of two of D and W
    GATE_KIND: tl.constexpr, LOWER_BOUND: tl.constexpr, EPS: tl.constexpr,
    SCALE: tl.constexpr,                  # q scale D^-0.5 (K3-SPEC)
    HAS_LENGTHS: tl.constexpr, STORE_Y: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    HD: tl.constexpr = H * D
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths + b)

    i_k = tl.arange(0, BD)                                # key-dim lanes (rows of S)
    i_v = tl.arange(0, BD)                                # value-dim lanes (columns of S)
    m_k = i_k < D
    m_v = i_v < D

    # Per-head parameters.
    a = tl.exp(tl.load(A_log + h))                        # exp(A_log[h])
    dtb = tl.load(dt_bias + h * D + i_k, mask=m_k, other=0.0)
    norm_w = tl.load(o_norm_w + i_v, mask=m_v, other=0.0)

    # Row bases: input (b, t=0, head h), conv state rows of the head's q/k/v channels, state S[b, h].
    b64 = b.to(tl.int64)
    q_row = q_in + b64 * s_qb + h * D                     # (b, t = 0, head h) of each activation
    k_row = k_in + b64 * s_kb + h * D
    v_row = v_in + b64 * s_vb + h * D
    y_off = b64 * T * HD + h * D                          # y is contiguous [B, T, H*D]
    conv_q = b.to(tl.int64) * 3 * HD * W + (0 * HD + h * D) * W
    conv_k = b.to(tl.int64) * 3 * HD * W + (1 * HD + h * D) * W
    conv_v = b.to(tl.int64) * 3 * HD * W + (2 * HD + h * D) * W
    s_off = (b.to(tl.int64) * H + h) * D * D + i_k[:, None] * D + i_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(state_in + s_off, mask=m_s, other=0.0).to(tl.float32)   # fp32 or bf16 storage, fp32 in the loop

    w_q = load_conv_weight(conv_w_q + h * D * W, i_k, m_k, W, BW)
    w_k = load_conv_weight(conv_w_k + h * D * W, i_k, m_k, W, BW)
    w_v = load_conv_weight(conv_w_v + h * D * W, i_v, m_v, W, BW)

    for t in range(0, n):
        q = causal_conv_silu_token(q_row, conv_in + conv_q, w_q, t, i_k, m_k, s_qt, W, BW)
        k = causal_conv_silu_token(k_row, conv_in + conv_k, w_k, t, i_k, m_k, s_kt, W, BW)
        v = causal_conv_silu_token(v_row, conv_in + conv_v, w_v, t, i_v, m_v, s_vt, W, BW)
        q = l2_normalize(q, 0) * SCALE
        k = l2_normalize(k, 0)

        f = tl.load(f_in + b64 * s_fb + t * s_ft + h * D + i_k, mask=m_k, other=0.0).to(tl.float32)
        g = kda_decay_gate(f + dtb, a, GATE_KIND, LOWER_BOUND)                     # log-decay, [BD]
        beta = tl.sigmoid(tl.load(beta_in + b64 * s_bb + t * s_bt + h).to(tl.float32))

        # S_t = (I - beta k k^T) Diag(exp g) S_{t-1} + beta k v^T, written as a rank-1 correction.
        S, o = delta_rule_step(S * tl.exp(g)[:, None], q, k, v, beta)              # o_t = S_t^T q_t

        if STORE_Y:
            gl = tl.load(gate_in + b64 * s_gb + t * s_gt + h * D + i_v, mask=m_v, other=0.0).to(tl.float32)
            out = rms_norm_sigmoid_gate(o, norm_w, gl, D, EPS, 0)
            tl.store(y + y_off + t * HD + i_v, out.to(y.dtype.element_ty), mask=m_v)

    tl.store(state_out + s_off, S.to(state_out.dtype.element_ty), mask=m_s)
    roll_conv_state(q_row, conv_in + conv_q, conv_out + conv_q, n, s_qt, i_k, m_k, W, BW)
    roll_conv_state(k_row, conv_in + conv_k, conv_out + conv_k, n, s_kt, i_k, m_k, W, BW)
    roll_conv_state(v_row, conv_in + conv_v, conv_out + conv_v, n, s_vt, i_v, m_v, W, BW)
