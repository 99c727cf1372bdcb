"""Chunk-parallel KDA prefill: intra-chunk kernel over (chunk, head, row), state pass split over V, norm epilogue.

Within a chunk of BT tokens (positions i, j; gc = cumulative log-decay inside the chunk, Gamma = exp(gc); K3-SPEC.md
"KDA layer", chunk algorithm of Kimi Linear / FLA chunk_kda):

    A[i, j] = beta_i * sum_d k_i[d] k_j[d] exp(gc_i[d] - gc_j[d])        (j < i, else 0)
    Tinv    = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(BT/2))   (A nilpotent: A^BT = 0)
    Wm      = Tinv @ (beta * Gamma * K)      U0 = Tinv @ (beta * V)
    P[i, j] = sum_d q_i k_j exp(gc_i - gc_j)  (j <= i)
and across chunks, with S the state at the chunk start ([D, D], key dim first):
    U = U0 - Wm @ S                           (the delta-rule residuals u_i)
    O = (Q * Gamma) @ S + P @ U
    S <- exp(gc_last) * S + (K * exp(gc_last - gc))^T @ U

Kernels (launched in this order by `k3c.codegen.triton.kda._launch_kda`):
  kda_chunk_front_kernel  grid (token blocks, H, B): token-parallel conv + silu (+ l2norm for q and k, q scaled)
                          of BTOK tokens of one head's q, k and v; writes them (activation dtype) into the
                          workspace tiles of Q*Gamma, K*exp(gc_last - gc) and U0, which the prep kernel reads.
  kda_chunk_prep_kernel   grid (chunks, H, B): gate + beta, A, P, Tinv, Wm, U0 from the front kernel's q, k, v;
                          writes Q*Gamma, K*exp(gc_last - gc), Wm, U0 ([BT, D] each, activation dtype; in place of
                          q, k, v), P ([BT, BT]) and gc_last ([D] fp32) to a workspace. Every chunk is independent:
                          this is the bulk of the FLOPs.
  kda_chunk_state_kernel  grid (NV, H, B): the sequential pass over chunks, program i_v holding the state columns
                          [i_v*BV, (i_v+1)*BV) in fp32 registers (tensor-core tl.dot on operands in the
                          workspace dtype, fp32 accumulation); writes O and the final state, and
                          rolls the conv state (after the front kernel has read it). With BV = D it also applies
                          the RMSNorm + sigmoid gate and writes y; otherwise O goes to a buffer in the
                          activation dtype (half the bytes of fp32: the norm reads it once) and
  kda_norm_gate_kernel    grid (row blocks, B) writes y = RMSNorm_per_head(O) * sigmoid(gate).
exp(gc_i - gc_j) is split as exp(gc_i - r) * exp(r - gc_j) with r the gc of the chunk's middle row REF =
(BT - 1) // 2, so that both factors are matrix operands; with the K3 lower bound (g > LOWER_BOUND = -5) every
factor of a needed entry (j <= i) stays below exp(max(REF, BT - 1 - REF) * 5): exp(40) at BT = 16, exp(80) at
BT = 32, finite in fp32 (the launcher sends unbounded gates to the recurrent kernel instead). Entries j > i with
i < r < j can overflow; they are masked away.
"""

import triton
import triton.language as tl

from k3c.codegen.triton._common import (
    conv_silu_rows,
    kda_decay_gate,
    rms_norm_sigmoid_gate,
    roll_conv_state,
)


@triton.jit
def kda_chunk_front_kernel(
    q_in, k_in, v_in,                     # [B, T, H*D] projected activations (any float dtype)
    conv_w_q, conv_w_k, conv_w_v,         # [H*D, W] fp32 depthwise conv weights
    conv_in,                              # [B, 3*H*D, W] fp32 or activation dtype: q, k, v channels (read)
    lengths,                              # [B] int32 tokens per row (HAS_LENGTHS) else unused
    ws,                                   # [4, B, H, NC*BT, D] workspace: q, k, v go to ws[0], ws[1], ws[3]
    T, NC,                                # tokens stored per row, chunks per row (cdiv(T, BT))
    s_qb, s_qt, s_kb, s_kt, s_vb, s_vt,   # (batch, token) strides (elements) of the activations; last dim dense
    B, H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, SCALE: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, BT: tl.constexpr,
    BTOK: tl.constexpr,                   # tokens per program
):
    """Token-parallel front end, grid (cdiv(T, BTOK), H, B): BTOK tokens of one head's q, k and v channels, causal
    conv + silu (`_common.conv_silu_rows`), then l2norm * SCALE (q) or l2norm (k); rows past the length are not
    written."""
    blk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    HD: tl.constexpr = H * D
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths + b)
    pos = blk * BTOK + tl.arange(0, BTOK)
    i_k = tl.arange(0, BD)
    m = (pos < n)[:, None] & (i_k < D)[None, :]
    b64 = b.to(tl.int64)
    conv = conv_in + b64 * 3 * HD * W + h * D * W
    first = blk * BTOK < W - 1                          # the block reads the conv state
    out = ws + ((b64 * H + h) * NC * BT + pos[:, None]) * D + i_k[None, :]
    slot = B * H * NC * BT * D                          # elements per workspace slot
    dt = ws.dtype.element_ty
    q = conv_silu_rows(q_in + b64 * s_qb + h * D, s_qt, conv_w_q + h * D * W, conv, pos, i_k, m, first, W, D)
    q = q * (SCALE * tl.rsqrt(tl.sum(q * q, 1) + 1e-6))[:, None]
    tl.store(out, q.to(dt), mask=m)
    k = conv_silu_rows(k_in + b64 * s_kb + h * D, s_kt, conv_w_k + h * D * W, conv + HD * W, pos, i_k, m, first,
                       W, D)
    k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    tl.store(out + slot, k.to(dt), mask=m)
    v = conv_silu_rows(v_in + b64 * s_vb + h * D, s_vt, conv_w_v + h * D * W, conv + 2 * HD * W, pos, i_k, m,
                       first, W, D)
    tl.store(out + 3 * slot, v.to(dt), mask=m)


@triton.jit
def kda_chunk_prep_kernel(
    f_in,                                 # [B, T, H*D] gate projection (any float dtype)
    beta_in,                              # [B, T, H] beta logits
    A_log, dt_bias,                       # [>=H], [H*D] fp32
    lengths,                              # [B] int32 tokens per row (HAS_LENGTHS) else unused
    ws_qg, ws_kend, ws_w, ws_u,           # [B, H, NC, BT, D] workspace (activation dtype); in: q, k, -, v
    ws_p,                                 # [B, H, NC, BT, BT] workspace
    ws_glast,                             # [B, H, NC, D] fp32 workspace
    T, NC,                                # tokens stored per row, chunks per row (cdiv(T, BT))
    s_fb, s_ft, s_bb, s_bt,               # (batch, token) strides (elements) of f and beta; last dim dense
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    GATE_KIND: tl.constexpr, LOWER_BOUND: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    BT: tl.constexpr, LOG2_BT: tl.constexpr,
    INV_PRECISION: tl.constexpr,          # tl.dot precision inside (I + A)^-1 ("ieee": fp32 FMA)
    DOT_PRECISION: tl.constexpr,          # tl.dot input precision for fp32 operands ("tf32" or "ieee")
):
    """One chunk of one head, grid (NC, H, B), on the front kernel's normalized q, k, v (read from ws_qg, ws_kend,
    ws_u, which it overwrites in place, each program its own tile): gate, beta, A, P, Tinv, Wm, U0."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    REF: tl.constexpr = (BT - 1) // 2                   # decay reference row r (module docstring)
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths + b)

    i_t = tl.arange(0, BT)
    i_k = tl.arange(0, BD)
    m_k = i_k < D
    pos = c * BT + i_t
    valid = pos < n
    m_tk = valid[:, None] & m_k[None, :]
    lower = i_t[:, None] > i_t[None, :]
    diag = i_t[:, None] == i_t[None, :]
    chunk = (b.to(tl.int64) * H + h) * NC + c
    tile = chunk * BT * D + i_t[:, None] * D + i_k[None, :]

    b64 = b.to(tl.int64)
    f = tl.load(f_in + b64 * s_fb + h * D + pos[:, None] * s_ft + i_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    dtb = tl.load(dt_bias + h * D + i_k, mask=m_k, other=0.0)
    g = tl.where(m_tk, kda_decay_gate(f + dtb[None, :], tl.exp(tl.load(A_log + h)), GATE_KIND, LOWER_BOUND), 0.0)
    beta = tl.load(beta_in + b64 * s_bb + pos * s_bt + h, mask=valid, other=0.0).to(tl.float32)
    beta = tl.where(valid, tl.sigmoid(beta), 0.0)
    q = tl.load(ws_qg + tile, mask=m_tk, other=0.0).to(tl.float32)
    k = tl.load(ws_kend + tile, mask=m_tk, other=0.0).to(tl.float32)

    gc = tl.cumsum(g, 0)                                            # padded rows have g = 0
    g_ref = tl.sum(tl.where(i_t[:, None] == REF, gc, 0.0), 0)      # r
    g_last = tl.sum(tl.where(i_t[:, None] == BT - 1, gc, 0.0), 0)
    decay_in = tl.exp(gc - g_ref[None, :])                          # <= exp(REF * |LOWER_BOUND|)
    k_out = k * tl.exp(g_ref[None, :] - gc)                         # <= exp((BT - 1 - REF) * |LOWER_BOUND|)
    # entries j > i may overflow to inf / nan (exp(gc_i - r) * exp(r - gc_j) with i < r < j): masked to 0
    A = tl.dot(k * decay_in, tl.trans(k_out), input_precision=DOT_PRECISION)
    A = tl.where(lower, A * beta[:, None], 0.0)
    P = tl.dot(q * decay_in, tl.trans(k_out), input_precision=DOT_PRECISION)
    P = tl.where(lower | diag, P, 0.0)

    # (I + A)^-1 = sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)...: A strictly lower triangular, A^BT = 0.
    power = A
    Tinv = tl.where(diag, 1.0, 0.0) - A
    for _ in tl.static_range(LOG2_BT - 1):
        power = tl.dot(power, power, input_precision=INV_PRECISION)
        Tinv = Tinv + tl.dot(Tinv, power, input_precision=INV_PRECISION)

    gamma = tl.exp(gc)
    v = tl.load(ws_u + tile, mask=m_tk, other=0.0).to(tl.float32)
    Wm = tl.dot(Tinv, (beta[:, None] * gamma) * k, input_precision=DOT_PRECISION)
    U0 = tl.dot(Tinv, beta[:, None] * v, input_precision=DOT_PRECISION)

    m_tile = (i_t[:, None] < BT) & m_k[None, :]
    dt = ws_qg.dtype.element_ty
    tl.store(ws_qg + tile, (q * gamma).to(dt), mask=m_tile)
    tl.store(ws_kend + tile, (k * tl.exp(g_last[None, :] - gc)).to(dt), mask=m_tile)    # <= 1
    tl.store(ws_w + tile, Wm.to(dt), mask=m_tile)
    tl.store(ws_u + tile, U0.to(dt), mask=m_tile)
    tl.store(ws_p + chunk * BT * BT + i_t[:, None] * BT + i_t[None, :], P.to(dt))
    tl.store(ws_glast + chunk * D + i_k, g_last, mask=m_k)


@triton.jit
def kda_chunk_state_kernel(
    ws_qg, ws_kend, ws_w, ws_u, ws_p, ws_glast,   # workspace of kda_chunk_prep_kernel
    q_in, k_in, v_in, gate_in,            # [B, T, H*D] (q/k/v: conv-state roll; gate: fused epilogue)
    o_norm_w,                             # [D] fp32
    state_in, state_out,                  # [B, H, D, D] fp32 or bf16
    conv_in, conv_out,                    # [B, 3*H*D, W] fp32 or the activation dtype
    y,                                    # [B, T, H*D] output (FUSE_NORM) or fp32 O buffer (not FUSE_NORM)
    lengths, T, NC,
    s_qb, s_qt, s_kb, s_kt, s_vb, s_vt,   # (batch, token) strides (elements) of q/k/v/gate; last dim dense
    s_gb, s_gt,
    H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    BV: tl.constexpr,                     # state columns per program (BD: one program per head)
    EPS: tl.constexpr, HAS_LENGTHS: tl.constexpr, STORE_Y: tl.constexpr,
    FUSE_NORM: tl.constexpr,              # BV == BD: apply RMSNorm + sigmoid gate here and write y
    BT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    HD: tl.constexpr = H * D
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths + b)

    i_t = tl.arange(0, BT)
    i_k = tl.arange(0, BD)
    m_k = i_k < D
    i_v = pid_v * BV + tl.arange(0, BV)
    m_v = i_v < D
    bh = b.to(tl.int64) * H + h
    s_off = bh * D * D + i_k[:, None] * D + i_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(state_in + s_off, mask=m_s, other=0.0).to(tl.float32)
    b64 = b.to(tl.int64)
    y_row = b64 * T * HD + h * D                          # y / O buffer: contiguous [B, T, H*D]
    dt = ws_w.dtype.element_ty
    if FUSE_NORM:
        norm_w = tl.load(o_norm_w + i_v, mask=m_v, other=0.0)

    for c in range(0, tl.cdiv(n, BT)):
        chunk = bh * NC + c
        tile_k = chunk * BT * D + i_t[:, None] * D + i_k[None, :]
        tile_v = chunk * BT * D + i_t[:, None] * D + i_v[None, :]
        m_tk = (i_t[:, None] < BT) & m_k[None, :]
        m_tv = (i_t[:, None] < BT) & m_v[None, :]
        # matrix operands in the workspace dtype (bf16 models: bf16 tensor-core products, fp32 accumulation)
        S_op = S.to(dt)
        Wm = tl.load(ws_w + tile_k, mask=m_tk, other=0.0)
        U = tl.load(ws_u + tile_v, mask=m_tv, other=0.0).to(tl.float32)
        U = U - tl.dot(Wm, S_op, input_precision=DOT_PRECISION)
        U_op = U.to(dt)
        if STORE_Y:
            qg = tl.load(ws_qg + tile_k, mask=m_tk, other=0.0)
            P = tl.load(ws_p + chunk * BT * BT + i_t[:, None] * BT + i_t[None, :])
            O = tl.dot(qg, S_op, input_precision=DOT_PRECISION) + tl.dot(P, U_op, input_precision=DOT_PRECISION)
            pos = c * BT + i_t
            m_o = (pos < n)[:, None] & m_v[None, :]
            o_off = y_row + pos[:, None] * HD + i_v[None, :]
            if FUSE_NORM:
                gl = tl.load(gate_in + b64 * s_gb + h * D + pos[:, None] * s_gt + i_v[None, :], mask=m_o,
                             other=0.0).to(tl.float32)
                O = rms_norm_sigmoid_gate(O, norm_w[None, :], gl, D, EPS, 1)
            tl.store(y + o_off, O.to(y.dtype.element_ty), mask=m_o)
        kend = tl.load(ws_kend + tile_k, mask=m_tk, other=0.0)
        g_last = tl.load(ws_glast + chunk * D + i_k, mask=m_k, other=0.0)
        S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(kend), U_op, input_precision=DOT_PRECISION)

    tl.store(state_out + s_off, S.to(state_out.dtype.element_ty), mask=m_s)
    conv_b = b64 * 3 * HD * W + h * D * W
    roll_conv_state(v_in + b64 * s_vb + h * D, conv_in + conv_b + 2 * HD * W, conv_out + conv_b + 2 * HD * W, n,
                    s_vt, i_v, m_v, W, BW)
    if pid_v == 0:
        roll_conv_state(q_in + b64 * s_qb + h * D, conv_in + conv_b, conv_out + conv_b, n, s_qt, i_k, m_k, W, BW)
        roll_conv_state(k_in + b64 * s_kb + h * D, conv_in + conv_b + HD * W, conv_out + conv_b + HD * W, n, s_kt,
                        i_k, m_k, W, BW)


@triton.jit
def kda_norm_gate_kernel(
    o_buf,                                # [B, T, H*D] activation dtype: O of kda_chunk_state_kernel
    gate_in,                              # [B, T, H*D] output-gate logits
    o_norm_w,                             # [D] fp32
    y,                                    # [B, T, H*D] output (dtype of the activations)
    lengths, T,
    s_gb, s_gt,                           # (batch, token) strides (elements) of gate_in; last dim dense
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, EPS: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    BR: tl.constexpr,                     # (token, head) rows per program
):
    r = tl.program_id(0) * BR + tl.arange(0, BR)          # row = t * H + h
    b = tl.program_id(1)
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths + b)
    i_k = tl.arange(0, BD)
    m = (r < n * H)[:, None] & (i_k < D)[None, :]
    off = b.to(tl.int64) * T * H * D + r[:, None] * D + i_k[None, :]
    o = tl.load(o_buf + off, mask=m, other=0.0).to(tl.float32)
    g_off = b.to(tl.int64) * s_gb + (r // H)[:, None] * s_gt + (r % H)[:, None] * D + i_k[None, :]
    gl = tl.load(gate_in + g_off, mask=m, other=0.0).to(tl.float32)
    norm_w = tl.load(o_norm_w + i_k, mask=i_k < D, other=0.0)
    tl.store(y + off, rms_norm_sigmoid_gate(o, norm_w[None, :], gl, D, EPS, 1).to(y.dtype.element_ty), mask=m)
