"""Small `@triton.jit` helpers shared by the k3c Triton kernels.

Every helper here is plain Triton (no module globals other than `triton` / `tl`), so that a code generator can
paste its source (`inspect.getsource`) into a standalone kernel module. `HELPERS` lists them in dependency order.
Formulas come from K3-SPEC.md, section "KDA layer".
"""

import triton
import triton.language as tl

@triton.jit
def silu(x):
    """silu(x) = x * sigmoid(x), elementwise, fp32."""
    return x * tl.sigmoid(x)


@triton.jit
def softplus(x):
    """softplus(x) = log(1 + exp(x)); returns x for x > 20 (torch.nn.functional.softplus's threshold)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def l2_normalize(x, AXIS: tl.constexpr):
    """x / sqrt(sum(x^2, AXIS) + 1e-6) (K3-SPEC 'l2norm'); masked-out lanes must hold 0."""
    inv_norm = tl.rsqrt(tl.sum(x * x, AXIS) + 1e-6)
    if AXIS == 0:
        return x * inv_norm
    else:
        return x * inv_norm[:, None]


@triton.jit
def kda_decay_gate(f_biased, a, GATE_KIND: tl.constexpr, LOWER_BOUND: tl.constexpr):
    """Log-decay g from f + dt_bias and a = exp(A_log[h]).

    GATE_KIND 0 (K3, config linear_attn_config.gate_lower_bound): g = LOWER_BOUND * sigmoid(a * f_biased).
    GATE_KIND 1 (Kimi Linear): g = -a * softplus(f_biased).
    """
    if GATE_KIND == 0:
        return LOWER_BOUND * tl.sigmoid(a * f_biased)
    else:
        return -a * softplus(f_biased)


@triton.jit
def conv_silu_rows(x_ptr, stride_t, w_ptr, conv_ptr, pos, chan, mask, first, W: tl.constexpr, D: tl.constexpr):
    """silu(causal depthwise conv) of one q/k/v channel group for a [BTOK, BD] block (positions `pos` [BTOK]
    relative to this call's start, channels `chan` [BD]): out[p, c] = silu(sum_j w[c, j] * x[p - (W-1) + j, c]),
    as W shifted, vectorizable row loads; inputs at negative positions come from the conv state (the last W raw
    inputs, oldest first: column W-1 is position -1), added only where `first` (the block holds positions
    0..W-2) as [BD] vectors, so that the tile keeps its row-load layout. x_ptr / w_ptr / conv_ptr: the group's
    channel 0 of this row's raw inputs (any float dtype), its [C, W] fp32 weight rows and its conv state rows (fp32
    or the activation dtype); mask: [BTOK, BD] lanes to compute, within D channels (others return 0)."""
    acc = tl.zeros((pos.shape[0], chan.shape[0]), dtype=tl.float32)
    m_c = chan < D
    for j in tl.static_range(W):
        p = pos[:, None] - (W - 1) + j
        w_j = tl.load(w_ptr + chan * W + j, mask=m_c, other=0.0)
        acc += tl.load(x_ptr + p * stride_t + chan[None, :], mask=mask & (p >= 0), other=0.0).to(tl.float32) \
            * w_j[None, :]
    if first:
        for t in tl.static_range(W - 1):                # row t, taps j < W-1-t read conv state column t+1+j
            old = tl.zeros_like(chan).to(tl.float32)
            for j in tl.static_range(W - 1 - t):
                old += tl.load(w_ptr + chan * W + j, mask=m_c, other=0.0) * \
                    tl.load(conv_ptr + chan * W + t + 1 + j, mask=m_c, other=0.0).to(tl.float32)
            acc += tl.where(mask & (pos == t)[:, None], old[None, :], 0.0)
    return silu(acc)


@triton.jit
def load_conv_weight(w_ptr, chan, chan_mask, W: tl.constexpr, BW: tl.constexpr):
    """The [BD, BW] tile of a group's depthwise conv weight ([C, W] fp32 rows); padding lanes are 0."""
    j = tl.arange(0, BW)
    return tl.load(w_ptr + chan[:, None] * W + j[None, :], mask=chan_mask[:, None] & (j[None, :] < W), other=0.0)


@triton.jit
def conv_window(x_ptr, conv_ptr, t, chan, chan_mask, stride_t, W: tl.constexpr, BW: tl.constexpr):
    """The [BD, BW] tile of the W raw inputs ending at position t (oldest first; padding lanes 0) for [BD] channels.

    Positions before 0 come from the conv state (column W-1 is position -1). For t = 0 the tile is also the new
    conv state after one decode step.
    """
    j = tl.arange(0, BW)
    p = t - (W - 1) + j[None, :] + 0 * chan[:, None]        # [BD, BW] positions of the window
    m = chan_mask[:, None] & (j[None, :] < W)
    x_new = tl.load(x_ptr + p * stride_t + chan[:, None], mask=m & (p >= 0), other=0.0).to(tl.float32)
    x_old = tl.load(conv_ptr + chan[:, None] * W + (W + p), mask=m & (p < 0), other=0.0).to(tl.float32)
    return x_new + x_old


@triton.jit
def store_conv_window(conv_ptr, win, chan, chan_mask, W: tl.constexpr, BW: tl.constexpr):
    """Store a [BD, BW] window tile (`conv_window`) as the channels' conv state rows ([C, W] at conv_ptr, fp32 or
    the activation dtype: rounded to it)."""
    j = tl.arange(0, BW)
    tl.store(conv_ptr + chan[:, None] * W + j[None, :], win.to(conv_ptr.dtype.element_ty),
             mask=chan_mask[:, None] & (j[None, :] < W))


@triton.jit
def decode_front_end(q_ptr, k_ptr, v_ptr, f_ptr, conv_q, conv_k, conv_v, w_q, w_k, w_v, dtb_ptr, a, i_k, m_k, i_v,
                     m_v, STRIDE: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, GATE_KIND: tl.constexpr,
                     LOWER_BOUND: tl.constexpr, SCALE: tl.constexpr):
    """The front end of one head's decode step (K3-SPEC "KDA layer"), from its raw projected inputs.

    q_ptr / k_ptr / v_ptr / f_ptr: the head's channel 0 of the step's activations; conv_q / conv_k / conv_v: the
    head's rows of the old conv state; w_q / w_k / w_v: its conv weight rows ([C, W] fp32); dtb_ptr: its dt_bias;
    a = exp(A_log[h]); i_k / m_k: the [BD] key channels (q, k, gate), i_v / m_v: the value channels of v.
    Returns (win_q, win_k [BD, BW], win_v [BV, BW]: the W-input windows, also the new conv state rows;
    q = l2norm(silu(conv)) * SCALE, k = l2norm(silu(conv)) [BD]; v = silu(conv) [BV]; g [BD] log-decay), fp32.
    """
    win_q = conv_window(q_ptr, conv_q, 0, i_k, m_k, STRIDE, W, BW)
    win_k = conv_window(k_ptr, conv_k, 0, i_k, m_k, STRIDE, W, BW)
    win_v = conv_window(v_ptr, conv_v, 0, i_v, m_v, STRIDE, W, BW)
    q = silu(tl.sum(win_q * load_conv_weight(w_q, i_k, m_k, W, BW), 1))
    k = silu(tl.sum(win_k * load_conv_weight(w_k, i_k, m_k, W, BW), 1))
    v = silu(tl.sum(win_v * load_conv_weight(w_v, i_v, m_v, W, BW), 1))
    f = tl.load(f_ptr + i_k, mask=m_k, other=0.0).to(tl.float32)
    g = kda_decay_gate(f + tl.load(dtb_ptr + i_k, mask=m_k, other=0.0), a, GATE_KIND, LOWER_BOUND)
    return win_q, win_k, win_v, l2_normalize(q, 0) * SCALE, l2_normalize(k, 0), v, g


@triton.jit
def causal_conv_silu_token(x_ptr, conv_ptr, w_tile, t, chan, chan_mask, stride_t, W: tl.constexpr,
                           BW: tl.constexpr):
    """silu(causal depthwise conv) (`conv_silu_rows`) for one position t and [BD] channels, as one [BD, BW] window
    load and a row sum.

    w_tile: the group's weight tile from `load_conv_weight` (loaded once, outside the token loop).
    """
    return silu(tl.sum(conv_window(x_ptr, conv_ptr, t, chan, chan_mask, stride_t, W, BW) * w_tile, 1))


@triton.jit
def roll_conv_state(x_ptr, conv_in_ptr, conv_out_ptr, n, stride_t, chan, chan_mask, W: tl.constexpr,
                    BW: tl.constexpr):
    """Write the last W raw inputs ending at position n-1 (oldest first) as the group's new conv state.

    Positions before 0 come from the old state (conv_in_ptr), so n < W keeps part of it. The old state is read
    completely before the barrier and written after it, so conv_out_ptr may alias conv_in_ptr.
    """
    j = tl.arange(0, BW)
    p = n - W + j[None, :]                                  # [1, BW] positions of the new state's columns
    m = chan_mask[:, None] & (j[None, :] < W)
    from_x = tl.load(x_ptr + p * stride_t + chan[:, None], mask=m & (p >= 0), other=0.0).to(tl.float32)
    from_old = tl.load(conv_in_ptr + chan[:, None] * W + (W + p), mask=m & (p < 0), other=0.0).to(tl.float32)
    tl.debug_barrier()
    tl.store(conv_out_ptr + chan[:, None] * W + j[None, :], (from_x + from_old).to(conv_out_ptr.dtype.element_ty),
             mask=m)


@triton.jit
def rms_norm_sigmoid_gate(o, norm_w, gate_logits, D: tl.constexpr, EPS: tl.constexpr, AXIS: tl.constexpr):
    """RMSNorm over the head dim (AXIS) with weight norm_w, times sigmoid(gate_logits) (K3-SPEC KDA epilogue).

    o's masked lanes must be 0; mean(o^2) divides by the true head dim D.
    """
    inv_rms = tl.rsqrt(tl.sum(o * o, AXIS) / D + EPS)
    if AXIS == 0:
        return o * inv_rms * norm_w * tl.sigmoid(gate_logits)
    else:
        return o * inv_rms[:, None] * norm_w * tl.sigmoid(gate_logits)


@triton.jit
def store_norm_gate(o, gate_ptr, norm_ptr, y_ptr, chan, chan_mask, D: tl.constexpr, EPS: tl.constexpr):
    """Store y = `rms_norm_sigmoid_gate`(o) for one head: o [BD] fp32 (masked lanes 0), gate logits and y at
    gate_ptr / y_ptr + chan (any float dtype; y rounded to its dtype), norm weight [D] fp32 at norm_ptr + chan."""
    gl = tl.load(gate_ptr + chan, mask=chan_mask, other=0.0).to(tl.float32)
    norm_w = tl.load(norm_ptr + chan, mask=chan_mask, other=0.0)
    out = rms_norm_sigmoid_gate(o, norm_w, gl, D, EPS, 0)
    tl.store(y_ptr + chan, out.to(y_ptr.dtype.element_ty), mask=chan_mask)


@triton.jit
def delta_rule_step(S, q, k, v, beta):
    """One KDA delta-rule step on a state tile S [BD, BV] fp32 whose decay is applied already (K3-SPEC KDA
    recurrence): u = beta (v − kᵀS), S' = S + k uᵀ, o = qᵀS'. q, k [BD], v [BV] fp32, beta a scalar; returns
    (S', o [BV])."""
    u = beta * (v - tl.sum(k[:, None] * S, 0))
    S = S + k[:, None] * u[None, :]
    return S, tl.sum(q[:, None] * S, 0)


@triton.jit
def last_of_head(o, o_part, counters, bh, cols, col_mask, D: tl.constexpr, NV: tl.constexpr):
    """A decode program's part of a head split over NV value blocks: store its o columns (fp32 at o_part + bh·D +
    cols) and count itself in at counters[bh] (release / acquire); returns whether it is the head's last, which then
    sees every part and has reset the counter to 0 for the next launch."""
    tl.store(o_part + bh * D + cols, o, mask=col_mask)
    tl.debug_barrier()                                    # all lanes' o stores precede the release below
    last = tl.atomic_add(counters + bh, 1, sem="acq_rel", scope="gpu") == NV - 1
    if last:
        tl.atomic_xchg(counters + bh, 0, sem="relaxed", scope="gpu")
    return last


# Source order for code generation (each helper's dependencies come first).
HELPERS = (silu, softplus, l2_normalize, kda_decay_gate, conv_silu_rows, load_conv_weight, conv_window,
           store_conv_window, decode_front_end, causal_conv_silu_token, roll_conv_state,
           rms_norm_sigmoid_gate, store_norm_gate, delta_rule_step, last_of_head)
