"""KDA decode kernels (T = 1), the value dimension split across programs: one fused launch per step, or the
two-phase form (front-end kernel + state kernel) below.

Grid (NV, H, B): program (i_v, h, b) owns the state columns [i_v*BV, (i_v+1)*BV) of S[b, h] ([D, D], key dim
first, fp32 or bf16 in memory, fp32 in registers). Every program computes the whole front end of its head from
the raw projected inputs (conv over the W-input window, silu, l2norm of q and k, decay gate, beta: a few KB, mostly
L2 hits) and its own value slice of v, then the delta-rule step of K3-SPEC.md "KDA layer" on its [D, BV] tile:

    S' = Diag(exp g) S ;  u = beta (v - S'^T k) ;  S = S' + k u^T ;  o = S^T q

The state tile is read and written once with V-contiguous rows (BV elements per row: 256-byte lines at BV = 64
fp32), which is the whole HBM traffic that matters. The activations are read through their batch-row strides, so
the column views of one fused projection output need no copy. The per-head RMSNorm needs all D values of o, so the slices
meet through a last-arriver reduction: each program stores its o slice (fp32) to `o_part`, then increments the
head's counter (acq_rel atomic); the program that sees NV - 1 reads the complete o (L1-bypassing loads), writes
y = RMSNorm(o) * sigmoid(gate) for the head, writes the q/k conv state (every program of the head has read the old
one before its increment), and resets the counter to 0 for the next launch. Each program writes its own value
slice of the v conv state. With NV = 1 the epilogue runs directly, without the counter.

Two-phase form (`kda_decode_front_kernel` + `kda_decode_state_kernel`, two launches): the front end runs once per
head in its own kernel (grid (H, B)), which writes q, k, v and the decay exp(g) ([B, H, 4, D] fp32) and beta
([B, H] fp32) to a scratch buffer and the whole new conv state. The state kernel (grid (NV, H, B)) issues its state
tile's loads first, then waits for the front end's outputs, so the state bytes are in flight from the program's
start and no register holds front-end values meanwhile. With programmatic dependent launch (PDL = True, launched
with `launch_pdl`; sm_90+) the front kernel lets the state kernel start at once (`gdc_launch_dependents`) and the
state kernel's `gdc_wait` orders the scratch reads after the front kernel's writes; its reads before the wait
touch only the state, which the front kernel does not write, and which every kernel before the front kernel
(a plain launch) has finished with. Without PDL the two launches simply run in order.
Launchers live in `k3c.codegen.triton.kda`.
"""

import triton
import triton.language as tl

from k3c.codegen.triton._common import (
    decode_front_end,
    delta_rule_step,
    last_of_head,
    store_conv_window,
    store_norm_gate,
)


@triton.jit
def kda_decode_kernel(
    q_in, k_in, v_in, f_in, gate_in,      # [B, H*D] projected activations of the step (any float dtype; rows
                                          # may be strided, e.g. column views of one fused projection output)
    beta_in,                              # [B, H] beta logits (rows may be strided)
    conv_w_q, conv_w_k, conv_w_v,         # [H*D, W] fp32 depthwise conv weights
    A_log, dt_bias, o_norm_w,             # [>=H], [H*D], [D] fp32
    state_in, state_out,                  # [B, H, D, D] fp32 or bf16 (key dim, value dim)
    conv_in, conv_out,                    # [B, 3*H*D, W] fp32 or the activation dtype: q, k, v channels
    y,                                    # [B, H*D] output (dtype of q_in)
    o_part,                               # [B, H, D] fp32 scratch: o before the norm (NV > 1)
    counters,                             # [B, H] int32, zero between launches (NV > 1)
    s_q, s_k, s_v, s_f, s_g, s_beta,      # batch-row strides (elements) of q/k/v/f/gate/beta; last dim dense
    H: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
    BD: tl.constexpr, BW: tl.constexpr,   # next powers of two of D and W
    BV: tl.constexpr, NV: tl.constexpr,   # value columns per program, programs per head (NV = cdiv(D, BV))
    GATE_KIND: tl.constexpr, LOWER_BOUND: tl.constexpr, EPS: tl.constexpr,
    SCALE: tl.constexpr,                  # q scale D^-0.5 (K3-SPEC)
):
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    HD: tl.constexpr = H * D
    bh = b.to(tl.int64) * H + h

    i_k = tl.arange(0, BD)                                # key-dim lanes (rows of S), the whole head
    m_k = i_k < D
    i_v = pid_v * BV + tl.arange(0, BV)                   # this program's value columns
    m_v = i_v < D

    b64 = b.to(tl.int64)
    y_off = b64 * HD + h * D                              # y is contiguous [B, H*D]
    conv_q = b.to(tl.int64) * 3 * HD * W + (0 * HD + h * D) * W
    conv_k = b.to(tl.int64) * 3 * HD * W + (1 * HD + h * D) * W
    conv_v = b.to(tl.int64) * 3 * HD * W + (2 * HD + h * D) * W

    # Front end (K3-SPEC "KDA layer"): the W-input windows are also the new conv states.
    win_q, win_k, win_v, q, k, v, g = decode_front_end(
        q_in + b64 * s_q + h * D, k_in + b64 * s_k + h * D, v_in + b64 * s_v + h * D, f_in + b64 * s_f + h * D,
        conv_in + conv_q, conv_in + conv_k, conv_in + conv_v, conv_w_q + h * D * W, conv_w_k + h * D * W,
        conv_w_v + h * D * W, dt_bias + h * D, tl.exp(tl.load(A_log + h)), i_k, m_k, i_v, m_v, HD, W, BW, GATE_KIND,
        LOWER_BOUND, SCALE)
    beta = tl.sigmoid(tl.load(beta_in + b64 * s_beta + h).to(tl.float32))

    # Delta-rule step on the [D, BV] tile.
    s_off = bh * D * D + i_k[:, None] * D + i_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(state_in + s_off, mask=m_s, other=0.0).to(tl.float32) * tl.exp(g)[:, None]
    S, o = delta_rule_step(S, q, k, v, beta)
    tl.store(state_out + s_off, S.to(state_out.dtype.element_ty), mask=m_s)

    tl.debug_barrier()                                    # every lane has read the old v conv state
    store_conv_window(conv_out + conv_v, win_v, i_v, m_v, W, BW)

    if NV == 1:
        store_norm_gate(o, gate_in + b64 * s_g + h * D, o_norm_w, y + y_off, i_k, m_k, D, EPS)
        store_conv_window(conv_out + conv_q, win_q, i_k, m_k, W, BW)
        store_conv_window(conv_out + conv_k, win_k, i_k, m_k, W, BW)
    else:
        if last_of_head(o, o_part, counters, bh, i_v, m_v, D, NV):  # last program of the head: the epilogue
            o_all = tl.load(o_part + bh * D + i_k, mask=m_k, other=0.0, cache_modifier=".cg")
            store_norm_gate(o_all, gate_in + b64 * s_g + h * D, o_norm_w, y + y_off, i_k, m_k, D, EPS)
            store_conv_window(conv_out + conv_q, win_q, i_k, m_k, W, BW)
            store_conv_window(conv_out + conv_k, win_k, i_k, m_k, W, BW)


@triton.jit
def kda_decode_front_kernel(
    q_in, k_in, v_in, f_in, beta_in,      # [B, H*D] / [B, H] activations of the step (rows may be strided)
    conv_w_q, conv_w_k, conv_w_v,         # [H*D, W] fp32 depthwise conv weights
    A_log, dt_bias,                       # [>=H], [H*D] fp32
    conv_in, conv_out,                    # [B, 3*H*D, W] fp32 or the activation dtype (may alias)
    front,                                # [B, H, 4, D] fp32 out: q (l2norm * SCALE), k (l2norm), v, exp(g)
    beta_out,                             # [B, H] fp32 out: sigmoid(beta logits)
    s_q, s_k, s_v, s_f, s_beta,           # batch-row strides (elements); last dim dense
    H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    GATE_KIND: tl.constexpr, LOWER_BOUND: tl.constexpr, SCALE: tl.constexpr,
    PDL: tl.constexpr,                    # let the dependent state kernel launch now (programmatic launch)
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    HD: tl.constexpr = H * D
    b64 = b.to(tl.int64)
    bh = b64 * H + h
    i_k = tl.arange(0, BD)
    m_k = i_k < D
    conv_q = b64 * 3 * HD * W + (0 * HD + h * D) * W
    conv_k = b64 * 3 * HD * W + (1 * HD + h * D) * W
    conv_v = b64 * 3 * HD * W + (2 * HD + h * D) * W
    win_q, win_k, win_v, q, k, v, g = decode_front_end(
        q_in + b64 * s_q + h * D, k_in + b64 * s_k + h * D, v_in + b64 * s_v + h * D, f_in + b64 * s_f + h * D,
        conv_in + conv_q, conv_in + conv_k, conv_in + conv_v, conv_w_q + h * D * W, conv_w_k + h * D * W,
        conv_w_v + h * D * W, dt_bias + h * D, tl.exp(tl.load(A_log + h)), i_k, m_k, i_k, m_k, HD, W, BW, GATE_KIND,
        LOWER_BOUND, SCALE)
    out = front + bh * 4 * D + i_k
    tl.store(out, q, mask=m_k)
    tl.store(out + D, k, mask=m_k)
    tl.store(out + 2 * D, v, mask=m_k)
    tl.store(out + 3 * D, tl.exp(g), mask=m_k)
    tl.store(beta_out + bh, tl.sigmoid(tl.load(beta_in + b64 * s_beta + h).to(tl.float32)))

    tl.debug_barrier()                                    # every lane has read the old conv state
    store_conv_window(conv_out + conv_q, win_q, i_k, m_k, W, BW)
    store_conv_window(conv_out + conv_k, win_k, i_k, m_k, W, BW)
    store_conv_window(conv_out + conv_v, win_v, i_k, m_k, W, BW)


@triton.jit
def kda_decode_state_kernel(
    front, beta_in,                       # the front kernel's outputs: [B, H, 4, D] fp32, [B, H] fp32
    gate_in, o_norm_w,                    # [B, H*D] gate logits (rows may be strided), [D] fp32
    state_in, state_out,                  # [B, H, D, D] fp32 or bf16 (key dim, value dim)
    y,                                    # [B, H*D] output
    o_part, counters,                     # as kda_decode_kernel (NV > 1)
    s_g,                                  # batch-row stride of gate_in (elements)
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    EPS: tl.constexpr,
    PDL: tl.constexpr,                    # launched as a programmatic dependent of the front kernel
):
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    bh = b64 * H + h
    i_k = tl.arange(0, BD)
    m_k = i_k < D
    i_v = pid_v * BV + tl.arange(0, BV)
    m_v = i_v < D

    s_off = bh * D * D + i_k[:, None] * D + i_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    S = tl.load(state_in + s_off, mask=m_s, other=0.0)   # issued first: in flight while the front end finishes
    if PDL:
        tl.extra.cuda.gdc_wait()                          # the front kernel's writes are visible after this
    fr = front + bh * 4 * D
    q = tl.load(fr + i_k, mask=m_k, other=0.0)
    k = tl.load(fr + D + i_k, mask=m_k, other=0.0)
    v = tl.load(fr + 2 * D + i_v, mask=m_v, other=0.0)
    decay = tl.load(fr + 3 * D + i_k, mask=m_k, other=0.0)
    beta = tl.load(beta_in + bh)

    S = S.to(tl.float32) * decay[:, None]
    S, o = delta_rule_step(S, q, k, v, beta)
    tl.store(state_out + s_off, S.to(state_out.dtype.element_ty), mask=m_s)

    y_off = b64 * H * D + h * D
    if NV == 1:
        store_norm_gate(o, gate_in + b64 * s_g + h * D, o_norm_w, y + y_off, i_k, m_k, D, EPS)
    else:
        if last_of_head(o, o_part, counters, bh, i_v, m_v, D, NV):  # last program of the head: the epilogue
            o_all = tl.load(o_part + bh * D + i_k, mask=m_k, other=0.0, cache_modifier=".cg")
            store_norm_gate(o_all, gate_in + b64 * s_g + h * D, o_norm_w, y + y_off, i_k, m_k, D, EPS)
