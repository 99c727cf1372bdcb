"""Sparse latent attention of DSA decode: one new token per batch row over its top-k latent rows (absorbed MLA).

Math: `mla_attention_ref` (k3c/ir/ops/model_attn.py) with idx, T = 1, absorbed (K3-SPEC.md "Gated MLA" / "Gated
DSA"): for the heads h of the new token of row b,
    o[b, h] = softmax_s(scale * q[b, h] . kv[b, s]) kv[b, s, :DV]        over the slots s of idx[b] (-1: none)
kv rows are [DV latent values | DR rope dims] (K3: 512 + 64). `attention.mla_attention_kernel` computes this too but
reads every gathered row twice (scores in 64-column chunks, then the values) and re-loads q for every key block;
`mla_sparse_decode_kernel` loads its heads' q once ([BLOCK_M, DV] and [BLOCK_M, DR], kept in registers) and every
gathered row once, as a [BLOCK_S, DV] tile (scores and values) and a [BLOCK_S, DR] tile (scores). One program per
(b, block of BLOCK_M heads, key split); the splits write (o, log2-sum-exp) partials that
`attention.mla_combine_kernel` merges, in the layout of `attention.launch_mla`, which picks this kernel (on a
Hopper GPU at K3's shapes, its wgmma form `dsa_attention_wgmma.mla_sparse_decode_wgmma_kernel` instead). (Loading
the next block's idx slots one step ahead, as a loop-carried tensor, fails Triton 3.6's layout pass on the H200.)

Device lengths (LEN_FROM_PTR, i32 [B]): row b has lengths[b] + 1 keys and the dense guard is taken per row on the
device (S <= dense_max: keys 0..S-1 instead of idx), as in `mla_attention_kernel`.
"""

import triton
import triton.language as tl


@triton.jit
def mla_sparse_decode_kernel(
    q_ptr, kv_ptr, idx_ptr,                 # q [B,1,H,DV+DR]; kv rows (strides below); idx [B,1,TOPK] i64
    o_ptr,                                  # [B,1,H,DV] output (SPLITS == 1) or [B,SPLITS,H,DV] f32 partials
    lse_ptr,                                # [B,SPLITS,H] f32 log2-sum-exp of each split (SPLITS > 1)
    len_ptr,                                # LEN_FROM_PTR: [B] i32 context length per row (keys before this token)
    S, keys_per_split, dense_max,           # keys (LEN_FROM_PTR: the bound), slots per split, dense guard (-1: never)
    stride_kb, stride_ks,                   # kv strides in elements (batch, position); the last dim is unit-stride
    qk_scale,                               # attrs.scale * log2(e): scores in the base-2 domain
    H: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, TOPK: tl.constexpr, SPLITS: tl.constexpr,
    LEN_FROM_PTR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    h = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = h < H
    if LEN_FROM_PTR:
        S = tl.load(len_ptr + b).to(tl.int32) + 1
    sparse = (S + 0 * tl.arange(0, BLOCK_S)) > dense_max    # a vector: masks combine with it as bool
    n_keys = tl.where(tl.max(sparse.to(tl.int32), 0) > 0, TOPK, S)
    if LEN_FROM_PTR:                                        # split this row's keys over the SPLITS programs
        keys_per_split = ((n_keys + SPLITS - 1) // SPLITS + BLOCK_S - 1) // BLOCK_S * BLOCK_S
    start = split * keys_per_split
    end = tl.minimum(n_keys, start + keys_per_split)

    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    v_ok = offs_v < DV
    r_ok = offs_r < DR
    q_rows = (b * H + h) * (DV + DR)
    q_v = tl.load(q_ptr + q_rows[:, None] + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
    q_r = tl.load(q_ptr + q_rows[:, None] + DV + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)           # finite start: a fully masked block gives p = 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in range(start, end, BLOCK_S):
        offs_j = j0 + tl.arange(0, BLOCK_S)
        j_ok = offs_j < end
        pos = tl.load(idx_ptr + b * TOPK + offs_j, mask=j_ok & sparse, other=-1)
        pos = tl.where(sparse, pos, offs_j.to(tl.int64))
        key_ok = j_ok & (pos >= 0) & (pos < S)              # T = 1: every key s < S is visible (causal)
        rows = b * stride_kb + tl.where(key_ok, pos, 0) * stride_ks
        kv = tl.load(kv_ptr + rows[:, None] + offs_v[None, :], mask=key_ok[:, None] & v_ok[None, :], other=0.0)
        kr = tl.load(kv_ptr + rows[:, None] + DV + offs_r[None, :], mask=key_ok[:, None] & r_ok[None, :],
                     other=0.0)
        scores = tl.dot(q_v, tl.trans(kv.to(q_v.dtype)), input_precision=DOT_PRECISION)
        scores += tl.dot(q_r, tl.trans(kr.to(q_r.dtype)), input_precision=DOT_PRECISION)
        scores = tl.where(row_ok[:, None] & key_ok[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]        # a row without keys writes 0
    if SPLITS == 1:
        tl.store(o_ptr + (b * H + h)[:, None] * DV + offs_v[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & v_ok[None, :])
    else:
        part = (b * SPLITS + split) * H + h
        tl.store(o_ptr + part[:, None] * DV + offs_v[None, :], out, mask=row_ok[:, None] & v_ok[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_ok)
