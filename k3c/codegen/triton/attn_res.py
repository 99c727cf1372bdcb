"""Triton kernels and emitters for Block Attention Residuals: `attn_res_inter` and `attn_res_merge`.

Math: K3-SPEC.md "Block Attention Residuals" (AttnRes paper, Algorithm 1); exact semantics: `attn_res_inter_ref`
and `attn_res_merge_ref` of k3c/ir/ops/model_attn.py. Keys are RMSNorm-without-weight of the sources,
K(x) = x · rsqrt(mean(x²) + eps), logits = K(x) · query, no 1/√d, softmax in fp32 (natural exp/log).

attn_res_inter (phase 1: all Q pseudo-queries of a block over the N sealed blocks), three kernels:
  - `attn_res_dots_kernel`, one program per (BLOCK_R rows r = b·T + t, block n, range of D): partial
    [BLOCK_R, D-range] x [D-range, BLOCK_Q] dots (exact fp32, "ieee") and sums of squares into f32 scratch; D is
    cut into ranges only as far as needed to fill the GPU (decode has a handful of rows, D = 7168);
  - `attn_res_softmax_kernel`, one program per BLOCK_R rows: logits[n, r, q] = Σ dots · rsqrt(Σ sumsq / D + eps),
    an online log-sum-exp over n -> lse [Q, R], then the softmax weights p[n, r, q] into an f32 scratch [N, R, Q];
  - `attn_res_combine_kernel`, one program per (row, BLOCK_D columns): o[q, r, :] = Σ_n p[n, r, q] · b_n[r, :].
  The N block tensors are separate arena values: the kernels address them as `base + offsets[n]` with
  offsets[n] = (b_n.data_ptr() − b_0.data_ptr()) / itemsize (a small i64 tensor built in `launch` and cached per
  set of addresses; all blocks have one dtype), so one compiled kernel serves every N.
attn_res_merge (phase 2), `attn_res_merge_kernel`, one program per (row, range of D): l_p = K(partial)·queries[index],
  m = logaddexp(lse[index], l_p), h = e^(lse − m) · o[index] + e^(l_p − m) · partial, in partial's dtype.

Public API: `emit_attn_res_inter(group)`, `emit_attn_res_merge(group)` -> module text (registered with
`k3c.codegen.triton.emitter`); launchers `launch_attn_res_inter`, `launch_attn_res_merge` (copied into the
emitted modules) and the kernels.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from k3c.codegen.triton import emitter, model_module, one_node
from k3c.ir.kernels import KernelGroup


# (device, data_ptr of each block) -> i64 [N] element offsets from block 0 (copied into the emitted module)
BLOCK_OFFSETS: dict = {}
MERGE_BLOCK_D = 1024    # attn_res_merge's column block
TARGET_PROGRAMS = 264   # attn_res_inter / attn_res_merge cut D into ranges until about this many programs (2 per H200 SM)


@triton.jit
def attn_res_dots_kernel(queries_ptr, base_ptr, offsets_ptr, dots_ptr, sumsq_ptr, R, N, d_per_split,
                         Q: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """Partial sums over one D range: dots[split, n, r, q] = Σ_d b_n[r, d] · queries[q, d] and
    sumsq[split, n, r] = Σ_d b_n[r, d]². Program (row block, block n, D split); scratch f32 [splits, N, R, Q] and
    [splits, N, R]; queries [Q, D] (any float), block n at base_ptr + offsets[n] ([R, D] rows)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    n = tl.program_id(1)
    split = tl.program_id(2)
    offs_q = tl.arange(0, BLOCK_Q)
    q_ok = offs_q < Q
    x_ptr = base_ptr + tl.load(offsets_ptr + n)
    dots = tl.zeros([BLOCK_R, BLOCK_Q], tl.float32)
    sumsq = tl.zeros([BLOCK_R], tl.float32)
    d_end = tl.minimum(D, (split + 1) * d_per_split)
    for d0 in range(split * d_per_split, d_end, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < d_end
        x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * D + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(queries_ptr + offs_q[None, :] * D + offs_d[:, None], mask=d_ok[:, None] & q_ok[None, :],
                    other=0.0).to(tl.float32)
        dots += tl.dot(x, w, input_precision="ieee")       # exact fp32: logits are not scaled by 1/sqrt(D)
        sumsq += tl.sum(x * x, 1)
    row = (split * N + n) * R + offs_r
    tl.store(dots_ptr + row[:, None] * Q + offs_q[None, :], dots, mask=r_ok[:, None] & q_ok[None, :])
    tl.store(sumsq_ptr + row, sumsq, mask=r_ok)


@triton.jit
def attn_res_softmax_kernel(dots_ptr, sumsq_ptr, p_ptr, lse_ptr, R, N, SPLITS, EPS, Q: tl.constexpr,
                            D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """logits[n, r, q] = (Σ_split dots) · rsqrt(Σ_split sumsq / D + EPS); lse[q, r] = logsumexp_n logits (f32
    [Q, R]); p[n, r, q] = exp(logits − lse) (f32 scratch [N, R, Q], holding the logits in between)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    offs_q = tl.arange(0, BLOCK_Q)
    mask = r_ok[:, None] & (offs_q < Q)[None, :]
    m = tl.full([BLOCK_R, BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R, BLOCK_Q], tl.float32)
    for n in range(N):
        dots = tl.zeros([BLOCK_R, BLOCK_Q], tl.float32)
        sumsq = tl.zeros([BLOCK_R], tl.float32)
        for split in range(SPLITS):
            row = (split * N + n) * R + offs_r
            dots += tl.load(dots_ptr + row[:, None] * Q + offs_q[None, :], mask=mask, other=0.0)
            sumsq += tl.load(sumsq_ptr + row, mask=r_ok, other=0.0)
        logits = dots * tl.rsqrt(sumsq / D + EPS)[:, None]
        tl.store(p_ptr + (n * R + offs_r)[:, None] * Q + offs_q[None, :], logits, mask=mask)
        m_new = tl.maximum(m, logits)
        l = l * tl.exp(m - m_new) + tl.exp(logits - m_new)   # n = 0: m = −inf gives l = 0 · 0 + 1
        m = m_new
    lse = m + tl.log(l)
    tl.store(lse_ptr + offs_q[None, :] * R + offs_r[:, None], lse, mask=mask)
    for n in range(N):                                     # logits -> softmax weights, in place
        ptrs = p_ptr + (n * R + offs_r)[:, None] * Q + offs_q[None, :]
        tl.store(ptrs, tl.exp(tl.load(ptrs, mask=mask, other=0.0) - lse), mask=mask)


@triton.jit
def attn_res_combine_kernel(base_ptr, offsets_ptr, p_ptr, o_ptr, R, N, Q: tl.constexpr, D: tl.constexpr,
                            BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """o[q, r, d] = Σ_n p[n, r, q] · b_n[r, d] for one row r and BLOCK_D columns; o f32 [Q, R, D]."""
    r = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_q = tl.arange(0, BLOCK_Q)
    q_ok = offs_q < Q
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for n in range(N):
        x = tl.load(base_ptr + tl.load(offsets_ptr + n) + r * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + (n * R + r) * Q + offs_q, mask=q_ok, other=0.0)
        acc += p[:, None] * x[None, :]
    tl.store(o_ptr + (offs_q[:, None] * R + r) * D + offs_d[None, :], acc, mask=q_ok[:, None] & d_ok[None, :])


def launch_attn_res_inter(queries, blocks, o, lse, *, eps):
    """queries [Q, D], blocks: N tensors [B, T, D] of one dtype -> o f32 [Q, B, T, D], lse f32 [Q, B, T].

    Scratch allocated here: partial dots f32 [splits, N, B·T, Q] and sums of squares [splits, N, B·T] (D is cut
    into `splits` ranges until about TARGET_PROGRAMS programs run), softmax weights f32 [N, B·T, Q]. The i64
    block offsets [N] are built once per set of block addresses and cached in BLOCK_OFFSETS (no host-to-device
    copy in steady state).
    Raises ValueError on mismatched shapes or dtypes.
    """
    Q, D = queries.shape
    R = blocks[0].numel() // D
    if any(b.shape != blocks[0].shape or b.dtype != blocks[0].dtype for b in blocks) or \
            tuple(o.shape) != (Q, *blocks[0].shape) or lse.numel() != Q * R:
        raise ValueError(f"attn_res_inter: queries {tuple(queries.shape)}, blocks "
                         f"{[tuple(b.shape) for b in blocks]}, o {tuple(o.shape)} mismatch")
    size = blocks[0].element_size()
    key = (queries.device, *(b.data_ptr() for b in blocks))
    offsets = BLOCK_OFFSETS.get(key)
    if offsets is None:                             # arena addresses repeat: build each offset table once
        if len(BLOCK_OFFSETS) >= 64:
            BLOCK_OFFSETS.clear()
        offsets = BLOCK_OFFSETS[key] = torch.tensor([(b.data_ptr() - blocks[0].data_ptr()) // size for b in blocks],
                                                    dtype=torch.int64, device=queries.device)
    N, BLOCK_R, BLOCK_D = len(blocks), 16, 64
    row_blocks = triton.cdiv(R, BLOCK_R)
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, row_blocks * N), triton.cdiv(D, BLOCK_D)))
    d_per_split = triton.cdiv(triton.cdiv(D, splits), BLOCK_D) * BLOCK_D
    splits = triton.cdiv(D, d_per_split)
    dots = torch.empty((splits, N, R, Q), dtype=torch.float32, device=queries.device)
    sumsq = torch.empty((splits, N, R), dtype=torch.float32, device=queries.device)
    p = torch.empty((N, R, Q), dtype=torch.float32, device=queries.device)
    BLOCK_Q = max(16, triton.next_power_of_2(Q))
    attn_res_dots_kernel[(row_blocks, N, splits)](queries, blocks[0], offsets, dots, sumsq, R, N, d_per_split, Q=Q,
                                                  D=D, BLOCK_R=BLOCK_R, BLOCK_Q=BLOCK_Q, BLOCK_D=BLOCK_D)
    attn_res_softmax_kernel[(row_blocks,)](dots, sumsq, p, lse, R, N, splits, float(eps), Q=Q, D=D, BLOCK_R=BLOCK_R,
                                           BLOCK_Q=BLOCK_Q)
    BLOCK_D = min(256, triton.next_power_of_2(D))
    attn_res_combine_kernel[(R, triton.cdiv(D, BLOCK_D))](blocks[0], offsets, p, o, R, len(blocks), Q=Q, D=D,
                                                          BLOCK_Q=triton.next_power_of_2(Q), BLOCK_D=BLOCK_D)


@triton.jit
def attn_res_merge_kernel(o_ptr, lse_ptr, x_ptr, queries_ptr, h_ptr, R, index, EPS, d_per_split, D: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Row r, columns [split · d_per_split, (split + 1) · d_per_split): h = e^(lse − m) · o[index, r] + e^(l_p − m) · x
    with m = logaddexp(lse[index, r], l_p). Every split of a row computes the row's l_p (x and queries[index] are
    re-read from L2), so decode's few rows still fill the GPU."""
    r = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    dot = tl.zeros([BLOCK_D], tl.float32)
    sumsq = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        x = tl.load(x_ptr + r * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        w = tl.load(queries_ptr + index * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        dot += x * w
        sumsq += x * x
    l_p = tl.sum(dot, 0) * tl.rsqrt(tl.sum(sumsq, 0) / D + EPS)
    l_o = tl.load(lse_ptr + index * R + r)
    m = tl.maximum(l_o, l_p)
    m = m + tl.log(tl.exp(l_o - m) + tl.exp(l_p - m))     # logaddexp
    w_o = tl.exp(l_o - m)
    w_p = tl.exp(l_p - m)
    d_end = tl.minimum(D, (split + 1) * d_per_split)
    for d0 in range(split * d_per_split, d_end, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < d_end
        x = tl.load(x_ptr + r * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + (index * R + r) * D + offs_d, mask=d_ok, other=0.0)
        tl.store(h_ptr + r * D + offs_d, (w_o * o + w_p * x).to(h_ptr.dtype.element_ty), mask=d_ok)


def launch_attn_res_merge(o, lse, partial, queries, h, *, index, eps):
    """o f32 [Q, B, T, D], lse f32 [Q, B, T], partial [B, T, D], queries [Q, D] -> h [B, T, D] (partial's dtype).

    Grid (rows, splits of D): D is cut into ranges of whole BLOCK_D blocks until about TARGET_PROGRAMS programs
    run (decode: a few rows). Raises ValueError on mismatched shapes or an index outside [0, Q).
    """
    Q, D = queries.shape
    R = partial.numel() // D
    if tuple(o.shape) != (Q, *partial.shape) or lse.numel() != Q * R or h.shape != partial.shape or \
            not 0 <= index < Q:
        raise ValueError(f"attn_res_merge: o {tuple(o.shape)}, partial {tuple(partial.shape)}, queries "
                         f"{tuple(queries.shape)}, index {index} mismatch")
    BLOCK_D = min(MERGE_BLOCK_D, triton.next_power_of_2(D))
    blocks = triton.cdiv(D, BLOCK_D)
    d_per_split = triton.cdiv(blocks, max(1, min(blocks, TARGET_PROGRAMS // max(R, 1)))) * BLOCK_D
    attn_res_merge_kernel[(R, triton.cdiv(D, d_per_split))](o, lse, partial, queries, h, R, index, float(eps),
                                                            d_per_split, D=D, BLOCK_D=BLOCK_D)


# ---- emitters --------------------------------------------------------------------------------------------------
SEMANTICS = "the op's `ref` in k3c/ir/ops/model_attn.py (K3-SPEC.md 'Block Attention Residuals')."


def _module(group, summary, consts, kernels, launcher, body):
    return model_module(group, summary, __name__, SEMANTICS, consts, kernels, launcher, body)


@emitter("attn_res_inter")
def emit_attn_res_inter(group: KernelGroup) -> str:
    """Module text for one `attn_res_inter` node: inputs (queries, b_0 .. b_{N−1}), outputs (o, lse).
    Raises UnsupportedError for a group that is not a single attn_res_inter node."""
    node, ip, op = one_node(group, "attn_res_inter")
    consts = [("EPS", float(node.attrs["eps"]), "RMSNorm eps of the keys (attn_res_norm)"),
              ("NUM_BLOCKS", len(node.inputs) - 1, "sealed blocks b_0 .. b_{N-1}"),
              ("BLOCK_OFFSETS", {}, "block addresses -> cached i64 offset table"),
              ("TARGET_PROGRAMS", TARGET_PROGRAMS, "split D until about this many programs (decode: few rows)")]
    blocks = ", ".join(f"inputs[{i}]" for i in ip[1:])
    body = ("def launch(inputs, outputs, sizes):\n"
            '    """ABI entry: inputs (queries, b_0 .. b_{N-1}), outputs (o f32 [Q,B,T,D], lse f32 [Q,B,T])."""\n'
            f"    launch_attn_res_inter(inputs[{ip[0]}], [{blocks}], outputs[{op[0]}], outputs[{op[1]}], eps=EPS)\n")
    return _module(group, f"Block AttnRes phase 1 over {len(ip) - 1} sealed block(s)", consts,
                   [attn_res_dots_kernel, attn_res_softmax_kernel, attn_res_combine_kernel], launch_attn_res_inter,
                   body)


@emitter("attn_res_merge")
def emit_attn_res_merge(group: KernelGroup) -> str:
    """Module text for one `attn_res_merge` node: inputs (o, lse, partial, queries), outputs [h].
    Raises UnsupportedError for a group that is not a single attn_res_merge node."""
    node, ip, op = one_node(group, "attn_res_merge")
    consts = [("INDEX", int(node.attrs["index"]), "this sublayer's pseudo-query row"),
              ("EPS", float(node.attrs["eps"]), "RMSNorm eps of the keys"),
              ("TARGET_PROGRAMS", TARGET_PROGRAMS, "split D until about this many programs (decode: few rows)"),
              ("MERGE_BLOCK_D", MERGE_BLOCK_D, "column block")]
    args = ", ".join(f"inputs[{i}]" for i in ip)
    body = ("def launch(inputs, outputs, sizes):\n"
            '    """ABI entry: inputs (o, lse, partial, queries), outputs [h [B,T,D]]."""\n'
            f"    launch_attn_res_merge({args}, outputs[{op[0]}], index=INDEX, eps=EPS)\n")
    return _module(group, "Block AttnRes phase 2 (online-softmax merge with the partial sum)", consts,
                   [attn_res_merge_kernel], launch_attn_res_merge, body)
