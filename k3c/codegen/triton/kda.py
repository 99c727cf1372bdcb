"""Fused KDA token mixer on Triton: launchers, the plain-torch reference, and kernel-module emission.

The fused op covers everything of K3-SPEC.md "KDA layer" between the projections and o_proj:

    q, k, v = silu(causal_depthwise_conv(q_in / k_in / v_in))           conv state: last W raw inputs
    q = l2norm(q) * D^-0.5 ; k = l2norm(k)                               l2norm: x / sqrt(sum x^2 + 1e-6)
    g = LB * sigmoid(exp(A_log[h]) * (f + dt_bias))                     gate "lower_bound" (K3, LB = -5)
    g = -exp(A_log[h]) * softplus(f + dt_bias)                           gate "softplus" (Kimi Linear)
    beta = sigmoid(beta_logits)
    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T   (fp32 state [B, H, D, D])
    y_t = RMSNorm_per_head(S_t^T q_t; o_norm.weight, eps) * sigmoid(gate_logits_t)

Public API:
    kda_fused_reference  per-token torch loop straight from the spec (tests, interpreter fallback)
    kda_decode           one decode step (T = 1): one fused kernel launch, or the front end and the state kernel
                         as two launches joined by programmatic dependent launch (`decode_split`); value dim split
                         over programs, state (fp32 or bf16) and conv state in place
    kda_prefill          any T >= 1, chunk-parallel tensor-core kernels for bounded gates, recurrent kernel otherwise
    kda_spec_replay      rebuild state + conv state from cached draft inputs, replaying n_accepted tokens
    emit_source          standalone kernel-module text for the code generator
Kernels: `kda_decode.kda_decode_kernel` / `kda_decode_front_kernel` / `kda_decode_state_kernel`,
`kda_recurrent.kda_recurrent_kernel`, `kda_chunk.kda_chunk_front_kernel` / `kda_chunk_prep_kernel` /
`kda_chunk_state_kernel` / `kda_norm_gate_kernel`; helpers in `_common`.
All launchers also run on CPU tensors under TRITON_INTERPRET=1 (fp32; the interpreter has no bf16 arithmetic).
The activations may be row-strided views (the column views of one fused projection output): the kernels take
their batch / token strides, so they are read in place.
"""

import inspect
import os

import torch
import torch.nn.functional as F
import triton

from k3c.codegen.triton import _common, take_scratch
from k3c.codegen.triton.kda_chunk import (kda_chunk_front_kernel, kda_chunk_prep_kernel, kda_chunk_state_kernel,
                                          kda_norm_gate_kernel)
from k3c.codegen.triton.kda_decode import kda_decode_front_kernel, kda_decode_kernel, kda_decode_state_kernel
from k3c.codegen.triton.kda_recurrent import kda_recurrent_kernel
from k3c.errors import RuntimeInputError, UnsupportedError

# Decay-gate kinds (K3-SPEC "KDA layer"): kernel constexpr GATE_KIND.
GATE_KINDS = {"lower_bound": 0, "softplus": 1}
CHUNK = 16            # tokens per chunk of the chunked prefill (one tensor-core tile; 32 is supported, slower)
# Decode split (H200, D = 128, BENCHMARKS.md "KDA decode"): block_v = 64 is the fastest at B = 16 and 64 for fp32
# and bf16 states; grids of at most DECODE_SMALL_GRID programs at block_v = 16 (B = 1: 768) take block_v = 16.
# num_warps = one per DECODE_WARP_BYTES of state tile (fp32: 4 at block_v 64, 1 at 16; bf16: 2 and 1).
DECODE_BLOCK_V = 64
DECODE_SMALL_BLOCK_V = 16
DECODE_SMALL_GRID = 1024
DECODE_WARP_BYTES = 8192
# Two-phase decode (front-end kernel + state kernel, PDL; BENCHMARKS.md "KDA round 5"): faster from B = 16 on
# (H200, H = 96: fp32 state 65.6 -> 64.1 us at B = 16, 244.3 -> 235.6 at 64; bf16 50.3 -> 46.5, 181.3 -> 159.6),
# slower at B = 1 (8.7 -> 12.2 us: the front kernel's latency is not hidden), so it is the default from
# DECODE_FRONT_MIN_ROWS rows x heads (B*H) on. Its state kernel's (block_v, num_warps) by state element bytes
# (fp32: 4, bf16: 2), the fastest measured.
DECODE_VARIANTS = ("fused", "front", "front_serial")   # front_serial: two launches without PDL (measurement)
DECODE_FRONT_MIN_ROWS = 1536
DECODE_FRONT_SPLIT = {4: (64, 4), 2: (32, 2)}
DECODE_FRONT_WARPS = 2  # warps per program of the front-end kernel (1 and 4 measured the same or slower)
CHUNK_BLOCK_V = 64    # state columns per program of the chunked prefill's state pass
# Chunked prefill, split into a token-parallel front kernel and the intra-chunk prep kernel (H200, T = 8192,
# BENCHMARKS.md "KDA round 8"): prep 2 warps 1.03 ms (4 warps 1.28, 4 with 128 registers 1.31); front 16 tokens x 2
# warps 0.43 ms (32 x 4: 0.52, 64 x 8: 1.04). Round 9: the O buffer in the activation dtype (2.66 -> 2.58 ms); a
# chunk-32 prep joining two 16-row blocks took 1.76 ms (state pass 0.67), 2.84 ms in all.
CHUNK_PREP_WARPS = 2  # warps per program of the chunked prefill's intra-chunk kernel
CHUNK_FRONT_TOKENS = 16  # tokens per program of the chunked prefill's front kernel (conv, silu, l2norm)
CHUNK_FRONT_WARPS = 2    # warps per program of that front kernel
SAFE_LOG_DECAY = 80.0  # largest |log-decay| between a chunk's reference row and any row (exp stays finite in fp32)


def kda_fused_reference(q_in, k_in, v_in, f, beta_logits, gate_logits, conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias,
                        o_norm_weight, state, conv_state, *, gate_kind="lower_bound", lower_bound=-5.0, eps=1e-5,
                        lengths=None):
    """The fused KDA op as a per-token torch loop, written directly from K3-SPEC.md "KDA layer".

    Shapes (H heads, head dim D = o_norm_weight.numel(), conv width W):
        q_in, k_in, v_in, f, gate_logits: [B, T, H*D] (projection outputs; f is f_b_proj(f_a_proj(x)) without
        dt_bias); beta_logits: [B, T, H]; conv_w_q/k/v: [H*D, W]; A_log: [>= H] (first H used); dt_bias: [H*D];
        o_norm_weight: [D]; state: [B, H, D, D] (key dim, value dim); conv_state: [B, 3*H*D, W] (q, k, v channels,
        last W raw inputs oldest first); lengths: None or [B] ints (tokens to process per row, <= T).
    Computes in fp64 if q_in is fp64, else fp32. Does not modify its inputs.
    Returns (y [B, T, H*D] in q_in's dtype, zero past each row's length; new state fp32-or-fp64; new conv state).
    Raises RuntimeInputError on inconsistent shapes, UnsupportedError on an unknown gate kind.
    """
    if gate_kind not in GATE_KINDS:
        raise UnsupportedError(f"KDA gate kind {gate_kind!r} (expected one of {sorted(GATE_KINDS)})")
    B, T, HD = q_in.shape
    D = o_norm_weight.numel()
    if HD % D:
        raise RuntimeInputError(f"KDA: channel count {HD} is not a multiple of head dim {D}")
    H = HD // D
    ct = torch.float64 if q_in.dtype == torch.float64 else torch.float32
    x = torch.cat([q_in, k_in, v_in], -1).to(ct)                                    # [B, T, 3HD]
    w = torch.cat([conv_w_q, conv_w_k, conv_w_v], 0).to(ct)                         # [3HD, W]
    window = conv_state.to(ct).clone()                                              # [B, 3HD, W]
    S = state.to(ct).clone()                                                        # [B, H, D, D]
    a = A_log[:H].to(ct).exp().view(1, H, 1)
    n = torch.full((B,), T) if lengths is None else torch.as_tensor(lengths).reshape(-1).expand(B).cpu()
    y = torch.zeros(B, T, H, D, dtype=ct, device=q_in.device)
    for t in range(T):
        live = (n > t).to(q_in.device)                                              # rows still replaying
        window = torch.where(live.view(B, 1, 1), torch.cat([window[..., 1:], x[:, t, :, None]], -1), window)
        qkv = F.silu((window * w).sum(-1))                                          # conv of the W inputs ending at t
        q, k, v = (c.reshape(B, H, D) for c in qkv.split(HD, -1))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        fb = f[:, t].to(ct).view(B, H, D) + dt_bias.to(ct).view(1, H, D)
        if gate_kind == "lower_bound":
            g = lower_bound * torch.sigmoid(a * fb)
        else:
            g = -a * F.softplus(fb)
        beta = torch.sigmoid(beta_logits[:, t].to(ct)).view(B, H, 1, 1)
        S_decayed = g.exp()[..., None] * S                                          # Diag(exp g) S
        kTS = torch.einsum("bhk,bhkv->bhv", k, S_decayed)
        S_new = S_decayed - beta * k[..., None] * kTS[:, :, None, :] + beta * k[..., None] * v[:, :, None, :]
        S = torch.where(live.view(B, 1, 1, 1), S_new, S)
        o = torch.einsum("bhkv,bhk->bhv", S, q)                                     # S_t^T q_t
        o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * o_norm_weight.to(ct)
        y_t = o * torch.sigmoid(gate_logits[:, t].to(ct).view(B, H, D))
        y[:, t] = torch.where(live.view(B, 1, 1), y_t, 0.0)
    return y.reshape(B, T, HD).to(q_in.dtype), S, window


_DECODE_SCRATCH = {}  # (device, B*H, D, front) -> decode scratch tensors; counters are 0 between launches
_PDL_DEVICES = {}     # CUDA device index -> whether it supports programmatic dependent launch


def _decode_scratch(device, rows, D, front):
    """The decode kernels' scratch for `rows` = B*H heads: (o_part [rows*D] fp32, counters [rows] int32) and, when
    `front` (two-phase form), (front [rows*4*D] fp32: q, k, v, exp(g) per head; beta [rows] fp32).

    Allocated once per (device, rows, D, front) and reused (the kernels leave the counters at 0), so a captured
    CUDA graph replays without allocations. Launches sharing it must not run concurrently on different streams.
    """
    key = (str(device), rows, D, front)
    if key not in _DECODE_SCRATCH:
        f32 = dict(dtype=torch.float32, device=device)
        _DECODE_SCRATCH[key] = (torch.empty(rows * D, **f32), torch.zeros(rows, dtype=torch.int32, device=device))
        if front:
            _DECODE_SCRATCH[key] += (torch.empty(rows * 4 * D, **f32), torch.empty(rows, **f32))
    return _DECODE_SCRATCH[key]


def _pdl_supported(device):
    """Whether kernels on `device` may use programmatic dependent launch: CUDA with compute capability >= 9.0."""
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _PDL_DEVICES:
        _PDL_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL_DEVICES[index]


def _launch_kda(mode, q_in, k_in, v_in, f, beta_logits, gate_logits, conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias,
                o_norm_weight, state, conv_state, *, gate_kind, lower_bound, eps, lengths, state_out,
                conv_state_out, store_output, num_warps, block_v=None, y_out=None, scratch=None, variant=None):
    """Check shapes/devices and launch the `mode` kernels ("decode": T = 1, split over V; "recurrent": token loop
    over the (B, H) grid; "chunk": chunk-parallel prep + state pass split over V + norm epilogue); returns y or None.
    block_v: value columns per program of the decode / chunk state kernels (None: `decode_split` / CHUNK_BLOCK_V);
    variant: decode form, one of DECODE_VARIANTS (None: `decode_split`'s choice).
    Activations may be row-strided views (any batch / token strides, dense last dim; others are copied); y is
    returned contiguous, in y_out when given (a contiguous tensor of q_in's shape and dtype). scratch: the chunk
    path's planned buffers by name (ws, ws_p, ws_glast, o_buf; `kda_abi.kda_fused_scratch`), None: allocated here."""
    if q_in.dim() != 3:
        raise RuntimeInputError(f"KDA: q_in must be [B, T, H*D], got {tuple(q_in.shape)}")
    B, T, HD = q_in.shape
    D = o_norm_weight.numel()
    W = conv_w_q.shape[-1]
    if T < 1 or HD % D:
        raise RuntimeInputError(f"KDA: need T >= 1 and H*D divisible by D={D}, got {tuple(q_in.shape)}")
    H = HD // D
    expect = {"k_in": (k_in, (B, T, HD)), "v_in": (v_in, (B, T, HD)), "f": (f, (B, T, HD)),
              "gate_logits": (gate_logits, (B, T, HD)), "beta_logits": (beta_logits, (B, T, H)),
              "conv_w_q": (conv_w_q, (HD, W)), "conv_w_k": (conv_w_k, (HD, W)), "conv_w_v": (conv_w_v, (HD, W)),
              "dt_bias": (dt_bias, (HD,)), "state": (state, (B, H, D, D)), "conv_state": (conv_state, (B, 3 * HD, W))}
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != shape:
            raise RuntimeInputError(f"KDA: {name} must have shape {shape}, got {tuple(tensor.shape)}")
    if A_log.numel() < H:
        raise RuntimeInputError(f"KDA: A_log has {A_log.numel()} entries, fewer than H={H}")
    for name, tensor in (("conv_w_q", conv_w_q), ("A_log", A_log), ("dt_bias", dt_bias),
                         ("o_norm_weight", o_norm_weight)):
        if tensor.dtype != torch.float32:
            raise UnsupportedError(f"KDA: {name} must be float32, got {tensor.dtype}")
    state_out = state if state_out is None else state_out
    conv_state_out = conv_state if conv_state_out is None else conv_state_out
    for name, tensor in (("conv_state", conv_state), ("conv_state_out", conv_state_out)):
        if tensor.dtype not in (torch.float32, q_in.dtype):
            raise UnsupportedError(f"KDA: {name} must be float32 or the activations' {q_in.dtype}, got "
                                   f"{tensor.dtype}")
    for name, tensor in (("state", state), ("state_out", state_out)):
        if tensor.dtype not in (torch.float32, torch.bfloat16):
            raise UnsupportedError(f"KDA: {name} must be float32 or bfloat16, got {tensor.dtype}")
    if not (state.is_contiguous() and conv_state.is_contiguous()):
        raise RuntimeInputError("KDA: state and conv_state must be contiguous (they are updated in place)")
    if q_in.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UnsupportedError("KDA Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    if gate_kind not in GATE_KINDS:
        raise UnsupportedError(f"KDA gate kind {gate_kind!r} (expected one of {sorted(GATE_KINDS)})")
    if mode == "decode" and (T != 1 or lengths is not None or not store_output):
        raise RuntimeInputError(f"KDA decode: one token per row and no lengths, got T={T}")
    if lengths is not None:
        lengths = torch.as_tensor(lengths, device=q_in.device).to(torch.int32).reshape(-1).expand(B).contiguous()
    if y_out is not None and (tuple(y_out.shape) != (B, T, HD) or y_out.dtype != q_in.dtype
                              or not y_out.is_contiguous()):
        raise RuntimeInputError(f"KDA: y_out must be contiguous {q_in.dtype} {(B, T, HD)}, got "
                                f"{y_out.dtype} {tuple(y_out.shape)} strides {y_out.stride()}")
    if store_output and y_out is None:
        y_out = torch.empty(q_in.shape, dtype=q_in.dtype, device=q_in.device)
    y = y_out if store_output else None
    BD = triton.next_power_of_2(D)
    BW = triton.next_power_of_2(W)
    # activations keep their row strides (column views of a fused projection output); only the last dim must be
    # dense. q, k, v, f, gate, beta and their (batch, token) strides:
    q_in, k_in, v_in, f, gate_logits, beta_logits = acts = [
        t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
        for t in (q_in, k_in, v_in, f, gate_logits, beta_logits)]
    st = {name: (t.stride(0), t.stride(1)) for name, t in zip("qkvfgb", acts)}
    conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias, o_norm_weight = wts = [
        t.contiguous() for t in (conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias, o_norm_weight)]
    has_len = lengths is not None
    lens = lengths if has_len else q_in
    gate = dict(GATE_KIND=GATE_KINDS[gate_kind], LOWER_BOUND=float(lower_bound))
    if mode == "decode":
        BV, warps, variant = decode_split(B, H, D, state.element_size(), block_v, variant)
        NV = triton.cdiv(D, BV)
        if variant == "fused":
            o_part, counters = _decode_scratch(q_in.device, B * H, D, False) if NV > 1 else (q_in, q_in)
            kda_decode_kernel[(NV, H, B)](
                *acts, *wts, state, state_out, conv_state, conv_state_out, y, o_part, counters,
                *(st[n][0] for n in "qkvfgb"), H=H, D=D, W=W, BD=BD, BW=BW, BV=BV, NV=NV, EPS=float(eps),
                SCALE=D ** -0.5, num_warps=num_warps or warps, **gate)
        else:
            pdl = variant == "front" and _pdl_supported(q_in.device)
            o_part, counters, front, beta = _decode_scratch(q_in.device, B * H, D, True)
            kda_decode_front_kernel[(H, B)](
                q_in, k_in, v_in, f, beta_logits, *wts[:5], conv_state, conv_state_out, front, beta,
                *(st[n][0] for n in "qkvfb"), H=H, D=D, W=W, BD=BD, BW=BW, SCALE=D ** -0.5, PDL=pdl,
                num_warps=DECODE_FRONT_WARPS, **gate)
            kda_decode_state_kernel[(NV, H, B)](
                front, beta, gate_logits, wts[5], state, state_out, y, o_part, counters, st["g"][0], H=H, D=D,
                BD=BD, BV=BV, NV=NV, EPS=float(eps), PDL=pdl, num_warps=num_warps or warps, launch_pdl=pdl)
    elif mode == "recurrent":
        kda_recurrent_kernel[(B, H)](
            *acts, *wts, state, state_out, conv_state, conv_state_out, y if store_output else q_in, lens, T,
            *(s for n in "qkvfgb" for s in st[n]), H=H, D=D, W=W, BD=BD, BW=BW, EPS=float(eps), SCALE=D ** -0.5,
            HAS_LENGTHS=has_len, STORE_Y=store_output, num_warps=num_warps or (4 if BD <= 64 else 8),
            num_stages=1,  # no software pipelining of the token loop: 3 stages need 476 KB smem at D=128
            **gate)
    else:
        # TF32 (10-bit mantissa) is below the storage precision of a bf16/fp16 model; an fp32 model gets fp32 dots
        dot = "tf32" if q_in.device.type == "cuda" and q_in.dtype != torch.float32 else "ieee"
        NC = triton.cdiv(T, CHUNK)
        ws = take_scratch(scratch, "ws", (4, B, H, NC, CHUNK, D), q_in.dtype, q_in.device)
        ws_p = take_scratch(scratch, "ws_p", (B, H, NC, CHUNK, CHUNK), q_in.dtype, q_in.device)
        ws_glast = take_scratch(scratch, "ws_glast", (B, H, NC, D), torch.float32, q_in.device)
        kda_chunk_front_kernel[(triton.cdiv(T, CHUNK_FRONT_TOKENS), H, B)](
            q_in, k_in, v_in, *wts[:3], conv_state, lens, ws, T, NC, *(s for n in "qkv" for s in st[n]), B, H=H,
            D=D, W=W, BD=BD, SCALE=D ** -0.5, HAS_LENGTHS=has_len, BT=CHUNK, BTOK=CHUNK_FRONT_TOKENS,
            num_warps=CHUNK_FRONT_WARPS)
        kda_chunk_prep_kernel[(NC, H, B)](
            f, beta_logits, *wts[3:5], lens, ws[0], ws[1], ws[2], ws[3], ws_p, ws_glast, T, NC,
            *(s for n in "fb" for s in st[n]), H=H, D=D, BD=BD, HAS_LENGTHS=has_len, BT=CHUNK,
            LOG2_BT=CHUNK.bit_length() - 1, INV_PRECISION="ieee", DOT_PRECISION=dot, num_warps=CHUNK_PREP_WARPS,
            **gate)
        BV = min(BD, block_v or CHUNK_BLOCK_V)
        fuse = BV == BD
        o_buf = y if fuse or not store_output else take_scratch(scratch, "o_buf", (B, T, HD), q_in.dtype,
                                                                q_in.device)   # O in the activation dtype
        kda_chunk_state_kernel[(triton.cdiv(D, BV), H, B)](
            ws[0], ws[1], ws[2], ws[3], ws_p, ws_glast, q_in, k_in, v_in, gate_logits, o_norm_weight, state,
            state_out, conv_state, conv_state_out, o_buf if store_output else q_in, lens, T, NC,
            *(s for n in "qkvg" for s in st[n]), H=H, D=D, W=W, BD=BD, BW=BW, BV=BV, EPS=float(eps),
            HAS_LENGTHS=has_len, STORE_Y=store_output, FUSE_NORM=fuse, BT=CHUNK, DOT_PRECISION=dot,
            num_warps=num_warps or 4, num_stages=2)
        if store_output and not fuse:
            rows = 16
            kda_norm_gate_kernel[(triton.cdiv(T * H, rows), B)](
                o_buf, gate_logits, o_norm_weight, y, lens, T, *st["g"], H=H, D=D, BD=BD, EPS=float(eps),
                HAS_LENGTHS=has_len, BR=rows, num_warps=4)
    return y


def decode_split(B, H, D, state_bytes, block_v=None, variant=None):
    """(block_v, num_warps, variant) of the decode step for B rows of H heads of dim D, state elements of
    `state_bytes` bytes (4: fp32, 2: bf16). variant (one of DECODE_VARIANTS; None: "front" from
    DECODE_FRONT_MIN_ROWS rows x heads on, else "fused"). block_v given: that split (capped at D's power of two)
    with one warp per DECODE_WARP_BYTES of state tile; else DECODE_FRONT_SPLIT for the two-phase forms and the
    DECODE_* rule above for the fused kernel. Raises UnsupportedError on an unknown variant."""
    if variant is None:
        variant = "front" if B * H >= DECODE_FRONT_MIN_ROWS else "fused"
    if variant not in DECODE_VARIANTS:
        raise UnsupportedError(f"KDA decode variant {variant!r} (expected one of {DECODE_VARIANTS})")
    BD = triton.next_power_of_2(D)
    if block_v is None and variant != "fused" and state_bytes in DECODE_FRONT_SPLIT:
        block_v, warps = DECODE_FRONT_SPLIT[state_bytes]
        return min(BD, block_v), warps, variant
    if block_v is None:
        small = B * H * triton.cdiv(D, DECODE_SMALL_BLOCK_V) <= DECODE_SMALL_GRID
        block_v = DECODE_SMALL_BLOCK_V if small else DECODE_BLOCK_V
    BV = min(BD, block_v)
    return BV, max(1, BD * BV * state_bytes // DECODE_WARP_BYTES), variant


def chunk_is_safe(gate_kind, lower_bound, chunk=None):
    """Whether the chunked kernels are exact for this gate at `chunk` tokens per chunk (None: CHUNK): bounded
    gates only, with (chunk - 1 - (chunk - 1) // 2) * |lower_bound| <= SAFE_LOG_DECAY (the farthest row from the
    chunk's middle reference row; `kda_chunk` docstring)."""
    bt = chunk or CHUNK
    return gate_kind == "lower_bound" and (bt - 1 - (bt - 1) // 2) * abs(float(lower_bound)) <= SAFE_LOG_DECAY


def kda_prefill(q_in, k_in, v_in, f, beta_logits, gate_logits, conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias,
                o_norm_weight, state, conv_state, *, gate_kind="lower_bound", lower_bound=-5.0, eps=1e-5,
                lengths=None, state_out=None, conv_state_out=None, method="auto", store_output=True, num_warps=None,
                block_v=None):
    """Fused KDA over T >= 1 tokens per row, carrying the recurrent state and the conv state in and out.

    Shapes/dtypes as `kda_fused_reference`: activations [B, T, H*D] (fp32/bf16/fp16, beta_logits [B, T, H]),
    conv weights [H*D, W] fp32, A_log [>= H] fp32, dt_bias [H*D] fp32, o_norm_weight [D] fp32, state
    [B, H, D, D] fp32 or bf16 (kept in fp32 inside the kernels), conv_state [B, 3*H*D, W] fp32 or the
    activations' dtype (it holds raw projected inputs, so that dtype is exact; bf16 halves its bytes), both
    contiguous. gate_kind: "lower_bound" (K3, config linear_attn_config.gate_lower_bound) or "softplus" (Kimi
    Linear); eps: o_norm's rms_norm_eps.
    lengths: None or int / [B] ints <= T (only the first lengths[b] tokens of row b are used; y past them is left
    unwritten). State and conv state are updated in place unless state_out / conv_state_out (same shapes) are given.
    method: "chunk" (CHUNK-token WY/UT tensor-core kernels, chunk-parallel; bounded gate, `chunk_is_safe`
    only; a workspace of about 4*T*H*D activation-dtype elements per row, plus T*H*D more when block_v < D),
    "recurrent" (token loop, any gate), or "auto" (chunk when safe and T >= 16). block_v: state columns per program
    of the chunk state pass (default CHUNK_BLOCK_V; D fuses the norm epilogue into it).
    Returns y [B, T, H*D] in q_in's dtype (None if store_output is False).
    Raises RuntimeInputError on shape mismatch, UnsupportedError on dtype/device/gate/method not supported.
    """
    if method not in ("auto", "chunk", "recurrent"):
        raise UnsupportedError(f"KDA prefill method {method!r}")
    safe = chunk_is_safe(gate_kind, lower_bound)
    if method == "chunk" and not safe:
        raise UnsupportedError(f"KDA chunked prefill (chunk {CHUNK}) needs a lower-bounded gate with "
                               f"{CHUNK - 1 - (CHUNK - 1) // 2}*|bound| <= {SAFE_LOG_DECAY}, "
                               f"got gate {gate_kind!r}, bound {lower_bound}")
    chunked = method == "chunk" or (method == "auto" and safe and q_in.shape[1] >= CHUNK)
    return _launch_kda("chunk" if chunked else "recurrent", q_in, k_in, v_in, f, beta_logits, gate_logits,
                       conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias, o_norm_weight, state, conv_state,
                       gate_kind=gate_kind, lower_bound=lower_bound, eps=eps, lengths=lengths, state_out=state_out,
                       conv_state_out=conv_state_out, store_output=store_output, num_warps=num_warps,
                       block_v=block_v)


def kda_decode(q_in, k_in, v_in, f, beta_logits, gate_logits, conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias,
               o_norm_weight, state, conv_state, *, gate_kind="lower_bound", lower_bound=-5.0, eps=1e-5,
               num_warps=None, block_v=None, variant=None):
    """One fused KDA decode step: conv-state roll + conv + silu + l2norm + gate + beta + recurrence + RMSNorm +
    sigmoid gate, with state [B, H, D, D] (fp32 or bf16) and conv_state [B, 3*H*D, W] updated in place. The value
    dim is split over cdiv(D, block_v) programs per head. variant: "fused" (one launch), "front" (front-end
    kernel, then the state kernel as its programmatic dependent launch where the GPU has PDL), "front_serial"
    (the same two launches without PDL); None: `decode_split`'s choice, as are block_v / num_warps when None.

    Activations are [B, H*D] (or [B, 1, H*D]), beta_logits [B, H] (or [B, 1, H]), contiguous or row-strided views
    with a dense last dim; other shapes, dtypes and errors
    as `kda_prefill`. Returns y with q_in's shape and dtype.
    """
    shape = q_in.shape
    q_in, k_in, v_in, f, gate_logits = (t.reshape(t.shape[0], 1, t.shape[-1]) for t in
                                        (q_in, k_in, v_in, f, gate_logits))
    beta_logits = beta_logits.reshape(beta_logits.shape[0], 1, beta_logits.shape[-1])
    y = _launch_kda("decode", q_in, k_in, v_in, f, beta_logits, gate_logits, conv_w_q, conv_w_k,
                    conv_w_v, A_log, dt_bias, o_norm_weight, state, conv_state, gate_kind=gate_kind,
                    lower_bound=lower_bound, eps=eps, lengths=None, state_out=None, conv_state_out=None,
                    store_output=True, num_warps=num_warps, block_v=block_v, variant=variant)
    return y.reshape(shape)


def kda_spec_replay(q_in, k_in, v_in, f, beta_logits, conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias, state,
                    conv_state, n_accepted, *, gate_kind="lower_bound", lower_bound=-5.0, method="auto"):
    """Speculative decoding (K3 report §3.4): replay the accepted draft tokens to rebuild the state, in place.

    q_in, k_in, v_in, f: [B, k, H*D] cached projected inputs of the k draft tokens; beta_logits [B, k, H];
    state [B, H, D, D] / conv_state [B, 3*H*D, W] (dtypes as `kda_prefill`) as they were BEFORE the draft tokens
    (no snapshots);
    n_accepted: int or [B] ints in [0, k]. Afterwards state/conv_state equal those after running the first
    n_accepted[b] draft tokens of each row. No output is written. Raises as `kda_prefill`, and RuntimeInputError
    if n_accepted is outside [0, k].
    """
    B, k_draft, _ = q_in.shape
    n = torch.as_tensor(n_accepted).reshape(-1)
    if n.numel() not in (1, B) or int(n.min()) < 0 or int(n.max()) > k_draft:
        raise RuntimeInputError(f"KDA replay: n_accepted must be one int or {B} ints in [0, {k_draft}]")
    norm_stub = torch.ones(state.shape[-1], dtype=torch.float32, device=q_in.device)      # epilogue is skipped
    kda_prefill(q_in, k_in, v_in, f, beta_logits, q_in, conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias, norm_stub,
                state, conv_state, gate_kind=gate_kind, lower_bound=lower_bound, lengths=n, method=method,
                store_output=False)


# ----------------------------------------------------------------------------------------------------------------
# Code generation: a standalone module per kernel family.

_FAMILIES = {  # family -> (kernels to include, IR node it implements by default)
    "decode": ((kda_decode_kernel, kda_decode_front_kernel, kda_decode_state_kernel), "kda.fused_decode"),
    "prefill": ((kda_decode_kernel, kda_decode_front_kernel, kda_decode_state_kernel, kda_recurrent_kernel,
                 kda_chunk_front_kernel, kda_chunk_prep_kernel, kda_chunk_state_kernel, kda_norm_gate_kernel),
                "kda.fused_prefill"),
    "spec_replay": ((kda_recurrent_kernel, kda_chunk_front_kernel, kda_chunk_prep_kernel, kda_chunk_state_kernel),
                    "kda.spec_replay"),
}

_LAUNCH_TEMPLATE = '''

def launch(q_in, k_in, v_in, f, beta_logits, gate_logits, conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias,
           o_norm_weight, state, conv_state, lengths=None, state_out=None, conv_state_out=None, store_output=True):
    """{doc}

    Activations [B, T, H*D] with H = HEADS, D = HEAD_DIM (decode: T = 1); beta_logits [B, T, H];
    conv weights [H*D, CONV_SIZE] fp32; A_log [>= H], dt_bias [H*D], o_norm_weight [D] fp32;
    state [B, H, D, D] fp32 or bf16 and conv_state [B, 3*H*D, CONV_SIZE] fp32 or the activations' dtype,
    updated in place unless *_out are given;
    lengths: None or [B] ints (tokens per row; spec replay: n_accepted). Returns y [B, T, H*D] or None.
    Raises RuntimeInputError / UnsupportedError (k3c.errors) on inputs this specialization does not fit.
    """
    if q_in.shape[-1] != HEADS * HEAD_DIM or o_norm_weight.numel() != HEAD_DIM or conv_w_q.shape[-1] != CONV_SIZE:
        raise RuntimeInputError(f"kernel specialized for H={{HEADS}}, D={{HEAD_DIM}}, W={{CONV_SIZE}}")
    return _launch_kda({mode!r}, q_in, k_in, v_in, f, beta_logits, gate_logits, conv_w_q, conv_w_k, conv_w_v,
                       A_log, dt_bias, o_norm_weight, state, conv_state, gate_kind=GATE_KIND, lower_bound=LOWER_BOUND,
                       eps=EPS, lengths=lengths, state_out=state_out, conv_state_out=conv_state_out,
                       store_output=store_output, num_warps=None)
'''


def emit_source(spec):
    """Standalone Python module text implementing one KDA kernel family for one layer specialization.

    spec keys: "family" ("decode" | "prefill" | "spec_replay"), "heads" (H), "head_dim" (D), "conv_size" (W,
    default 4), "gate_kind" ("lower_bound" | "softplus"), "lower_bound" (default -5.0), "eps" (default 1e-5),
    optional "ir_nodes" (names of the IR nodes implemented, for the header) and "chunked" (prefill/spec_replay:
    use the chunk-parallel CHUNK-token tensor-core kernels; default: when the gate is safely bounded).
    The module imports torch, triton and k3c.errors only; it holds a header naming the IR nodes and the
    specialization constants, the `@triton.jit` helper and kernel sources, `_launch_kda`, and
    `launch(q_in, k_in, v_in, f, beta_logits, gate_logits, conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias,
    o_norm_weight, state, conv_state, lengths=None, state_out=None, conv_state_out=None, store_output=True)`.
    Raises UnsupportedError on an unknown family / gate kind or an unsafe chunked request, RuntimeInputError on a
    missing key.
    """
    family = spec.get("family")
    if family not in _FAMILIES:
        raise UnsupportedError(f"KDA emit_source: family {family!r} (expected one of {sorted(_FAMILIES)})")
    try:
        H, D = int(spec["heads"]), int(spec["head_dim"])
    except KeyError as missing:
        raise RuntimeInputError(f"KDA emit_source: spec lacks {missing}") from None
    W = int(spec.get("conv_size", 4))
    gate_kind = spec.get("gate_kind", "lower_bound")
    lower_bound = float(spec.get("lower_bound", -5.0))
    eps = float(spec.get("eps", 1e-5))
    if gate_kind not in GATE_KINDS:
        raise UnsupportedError(f"KDA gate kind {gate_kind!r}")
    safe = chunk_is_safe(gate_kind, lower_bound)
    chunked = family != "decode" and bool(spec.get("chunked", safe))
    if chunked and not safe:
        raise UnsupportedError("KDA emit_source: chunked kernel requested for an unbounded or too-low gate")
    kernels, default_node = _FAMILIES[family]
    mode = "decode" if family == "decode" else "chunk" if chunked else "recurrent"
    nodes = ", ".join(spec.get("ir_nodes", [default_node]))
    doc = {"decode": "One fused KDA decode step (T = 1).",
           "prefill": "Fused KDA prefill over T >= 1 tokens.",
           "spec_replay": "Replay accepted draft tokens (lengths = n_accepted); call with store_output=False."}[family]
    header = (
        f'"""k3c generated kernel module: KDA {family}.\n\n'
        f"Implements IR node(s): {nodes}\n"
        f"Specialization: H={H}, D={D}, W={W}, gate={gate_kind}, lower_bound={lower_bound}, eps={eps}, "
        f"kernels={', '.join(k.fn.__name__ for k in kernels)}; {family} runs {mode!r}\n"
        f"Math: K3-SPEC.md 'KDA layer'. Emitted by k3c.codegen.triton.kda.emit_source.\n"
        f'"""\n\nimport os\n\nimport torch\nimport triton\nimport triton.language as tl\n\n'
        f"from k3c.errors import RuntimeInputError, UnsupportedError\n\n"
        f"HEADS = {H}  # linear_attn_config.num_heads\nHEAD_DIM = {D}  # linear_attn_config.head_dim\n"
        f"CONV_SIZE = {W}  # short_conv_kernel_size\nGATE_KIND = {gate_kind!r}\n"
        f"LOWER_BOUND = {lower_bound!r}  # linear_attn_config.gate_lower_bound\nEPS = {eps!r}  # rms_norm_eps\n"
        f"GATE_KINDS = {GATE_KINDS!r}\nCHUNK = {CHUNK}\nDECODE_BLOCK_V = {DECODE_BLOCK_V}\n"
        f"DECODE_SMALL_BLOCK_V = {DECODE_SMALL_BLOCK_V}\nDECODE_SMALL_GRID = {DECODE_SMALL_GRID}\n"
        f"DECODE_WARP_BYTES = {DECODE_WARP_BYTES}\nDECODE_VARIANTS = {DECODE_VARIANTS!r}\n"
        f"DECODE_FRONT_MIN_ROWS = {DECODE_FRONT_MIN_ROWS}\nDECODE_FRONT_SPLIT = {DECODE_FRONT_SPLIT!r}\n"
        f"DECODE_FRONT_WARPS = {DECODE_FRONT_WARPS}\n"
        f"CHUNK_BLOCK_V = {CHUNK_BLOCK_V}\nCHUNK_PREP_WARPS = {CHUNK_PREP_WARPS}\n"
        f"CHUNK_FRONT_TOKENS = {CHUNK_FRONT_TOKENS}\nCHUNK_FRONT_WARPS = {CHUNK_FRONT_WARPS}\n"
        f"_DECODE_SCRATCH = {{}}\n_PDL_DEVICES = {{}}\n")
    parts = [header]
    parts += [inspect.getsource(fn.fn) for fn in _common.HELPERS]
    parts += [inspect.getsource(kernel.fn) for kernel in kernels]
    parts += [inspect.getsource(take_scratch), inspect.getsource(_decode_scratch), inspect.getsource(_pdl_supported),
              inspect.getsource(decode_split),
              inspect.getsource(_launch_kda)]
    parts.append(_LAUNCH_TEMPLATE.format(doc=doc, mode=mode))
    return "\n\n".join(parts)
