"""Sparse latent attention of DSA decode on Hopper tensor cores (Gluon: wgmma, cp.async gathers into a ring).

The math, grid, split-K partials and device lengths of `dsa_attention.mla_sparse_decode_kernel` (one program per
(b, block of 64 heads, key split)); what changes is where the operands live. q [64, DV + DR] is staged once in
shared memory and is wgmma's A operand for the scores; the selected latent rows are gathered with cp.async (one
16-byte copy per thread and chunk, zero-filled for masked slots) into a STAGES-deep shared-memory ring, the gather
of tile i + STAGES - 1 in flight while tile i's MMAs run; S = q kv^T and O += P kv[:, :DV] are `warpgroup_mma`s over
the ring slot (the values are a column slice of the same rows: every row read once). The 8 warps are two
warpgroups splitting the N dimension of both MMAs (scores: BLOCK_S / 2 keys each; output: DV / 2 columns each, a
[64, 256] f32 accumulator per warpgroup, 128 registers a thread); the softmax's row max / sum cross the two
warpgroups through shared memory. P goes to wgmma as a register operand.

`sparse_wgmma_ok` says when `attention.launch_mla` may take this kernel: a Hopper GPU (sm_90), bf16 / fp16 q and
kv, DV 256 or 512 and DR 64 (K3: 512 + 64), kv's strides multiples of 16. Elsewhere (the interpreter, CPUs, other
GPUs, fp32) it takes `mla_sparse_decode_kernel`, whose results this kernel matches (tests/kernels/test_dsa_wgmma.py).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from k3c.codegen.triton.gl_common import gl_async_copy, gl_thread_barrier


def sparse_wgmma_ok(q, kv, DV):
    """Whether `mla_sparse_decode_wgmma_kernel` runs this launch: a CUDA sm_90 device, bf16 / fp16 q and kv (rows
    [DV | DR], unit-stride), DV 256 or 512 and DR 64 (K3: 512 + 64; the ring and q then fit in shared memory), and
    kv's base and row strides multiples of 16 elements (Triton's divisibility specialisation: the 16-byte cp.async
    gathers need it)."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype and DV in (256, 512)
            and kv.shape[-1] - DV == 64 and kv.stride(0) % 16 == 0 and kv.stride(1) % 16 == 0
            and kv.data_ptr() % 16 == 0 and torch.cuda.get_device_capability(q.device)[0] == 9)


@gluon.jit
def _slot_pos(idx_ptr, b, S, start, end, j0, sparse, TOPK: gl.constexpr, BLOCK_S: gl.constexpr, L: gl.constexpr):
    """The kv positions of slots j0 .. j0 + BLOCK_S of row b ([BLOCK_S] i64 in layout L); -1 for a slot outside
    [start, end), an empty (-1) slot or a position >= S. Dense rows (not `sparse`): slot j is position j."""
    offs_j = j0 + gl.arange(0, BLOCK_S, layout=L)
    j_ok = (offs_j >= start) & (offs_j < end)
    pos = gl.load(idx_ptr + b * TOPK + offs_j, mask=j_ok & sparse, other=-1)
    pos = gl.where(sparse, pos, offs_j.to(gl.int64))
    return gl.where(j_ok & (pos < S), pos, -1)


@gluon.jit
def _gather_tile(kv_ptr, smem_v, smem_r, b, pos_v, pos_r, stride_kb, stride_ks, DV: gl.constexpr, DR: gl.constexpr,
                 LV: gl.constexpr, LR: gl.constexpr):
    """One ring slot as one cp.async commit group: the values (smem_v [BLOCK_S, DV]) and rope dims (smem_r
    [BLOCK_S, DR]) of row b's latent rows at positions pos_v / pos_r (`_slot_pos` in LV's / LR's row layout);
    position -1 is zero-filled."""
    cv = gl.arange(0, DV, layout=gl.SliceLayout(0, LV))
    rows_v = b * stride_kb + gl.where(pos_v >= 0, pos_v, 0) * stride_ks
    gl_async_copy(smem_v, kv_ptr + rows_v[:, None] + cv[None, :], (pos_v >= 0)[:, None] & (cv < DV)[None, :])
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, LR))
    rows_r = b * stride_kb + gl.where(pos_r >= 0, pos_r, 0) * stride_ks + DV
    gl_async_copy(smem_r, kv_ptr + rows_r[:, None] + cr[None, :], (pos_r >= 0)[:, None] & (cr < DR)[None, :])
    gl.nvidia.ampere.async_copy.commit_group()


@gluon.jit
def mla_sparse_decode_wgmma_kernel(
    q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr, len_ptr,         # as `mla_sparse_decode_kernel`
    S, keys_per_split, dense_max, stride_kb, stride_ks, qk_scale,
    H: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr, TOPK: gl.constexpr, SPLITS: gl.constexpr,
    LEN_FROM_PTR: gl.constexpr, BLOCK_S: gl.constexpr, STAGES: gl.constexpr,
):
    """One program per (b, block of 64 heads, key split): o (SPLITS == 1) or the split's f32 partial and log2-sum-exp,
    exactly as `mla_sparse_decode_kernel` writes them (module docstring)."""
    BLOCK_M: gl.constexpr = 64                               # one wgmma M tile: 64 heads per program
    dt: gl.constexpr = q_ptr.dtype.element_ty
    # register layouts: the gathers (16-byte chunks), the scores and the output (two warpgroups split N)
    LV: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DV // 8 if DV < 256 else 32), DV // 8 if DV < 256 else 32],
                                        [8, 1], [1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DR // 8 if DR < 256 else 32), DR // 8 if DR < 256 else 32],
                                        [8, 1], [1, 0])
    L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_S // 2, 16])
    L_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, DV // 2, 16])
    L_P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_O, k_width=2)
    SH_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, DV], dt)
    SH_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, DR], dt)
    SH_QV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DV], dt)
    SH_QR: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DR], dt)

    b = gl.program_id(0).to(gl.int64)
    split = gl.program_id(2)
    if LEN_FROM_PTR:
        S = gl.load(len_ptr + b).to(gl.int32) + 1
    sparse = S > dense_max
    n_keys = gl.where(sparse, TOPK, S)
    if LEN_FROM_PTR:                                         # split this row's keys over the SPLITS programs
        keys_per_split = ((n_keys + SPLITS - 1) // SPLITS + BLOCK_S - 1) // BLOCK_S * BLOCK_S
    start = split * keys_per_split
    end = gl.minimum(n_keys, start + keys_per_split)

    ring_v = gl.allocate_shared_memory(dt, [STAGES, BLOCK_S, DV], SH_V)
    ring_r = gl.allocate_shared_memory(dt, [STAGES, BLOCK_S, DR], SH_R)
    SV: gl.constexpr = gl.SliceLayout(1, LV)
    SR: gl.constexpr = gl.SliceLayout(1, LR)
    for t in gl.static_range(STAGES - 1):                    # the ring's first tiles, in flight from the start
        j0 = start + t * BLOCK_S
        _gather_tile(kv_ptr, ring_v.index(t), ring_r.index(t), b,
                     _slot_pos(idx_ptr, b, S, start, end, j0, sparse, TOPK, BLOCK_S, SV),
                     _slot_pos(idx_ptr, b, S, start, end, j0, sparse, TOPK, BLOCK_S, SR), stride_kb, stride_ks, DV, DR,
                     LV, LR)
    j0 = start + (STAGES - 1) * BLOCK_S                     # the next tile's rows, loaded one step ahead
    pos_v = _slot_pos(idx_ptr, b, S, start, end, j0, sparse, TOPK, BLOCK_S, SV)
    pos_r = _slot_pos(idx_ptr, b, S, start, end, j0, sparse, TOPK, BLOCK_S, SR)

    h0 = gl.program_id(1) * BLOCK_M
    hv = h0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LV))
    cv = gl.arange(0, DV, layout=gl.SliceLayout(0, LV))
    q_v = gl.load(q_ptr + ((b * H + hv) * (DV + DR))[:, None] + cv[None, :], mask=(hv < H)[:, None], other=0.0)
    hr = h0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LR))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, LR))
    q_r = gl.load(q_ptr + ((b * H + hr) * (DV + DR) + DV)[:, None] + cr[None, :], mask=(hr < H)[:, None], other=0.0)
    q_v_s = gl.allocate_shared_memory(dt, [BLOCK_M, DV], SH_QV, q_v)
    q_r_s = gl.allocate_shared_memory(dt, [BLOCK_M, DR], SH_QR, q_r)

    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=gl.SliceLayout(1, L_S))   # finite: masked tiles give p = 0
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, L_S))
    acc = gl.zeros([BLOCK_M, DV], gl.float32, layout=L_O)
    s_zero = gl.zeros([BLOCK_M, BLOCK_S], gl.float32, layout=L_S)
    n_tiles = gl.cdiv(end - start, BLOCK_S)
    for i in range(n_tiles):
        gl_thread_barrier()                                  # every warp is done with tile i - 1's slot
        nxt = i + STAGES - 1
        _gather_tile(kv_ptr, ring_v.index(nxt % STAGES), ring_r.index(nxt % STAGES), b, pos_v, pos_r, stride_kb,
                     stride_ks, DV, DR, LV, LR)
        j0 = start + (nxt + 1) * BLOCK_S
        pos_v = _slot_pos(idx_ptr, b, S, start, end, j0, sparse, TOPK, BLOCK_S, SV)
        pos_r = _slot_pos(idx_ptr, b, S, start, end, j0, sparse, TOPK, BLOCK_S, SR)
        key_ok = _slot_pos(idx_ptr, b, S, start, end, start + i * BLOCK_S, sparse, TOPK, BLOCK_S,
                           gl.SliceLayout(0, L_S)) >= 0
        gl.nvidia.ampere.async_copy.wait_group(STAGES - 1)   # this thread's copies of tile i have landed,
        gl.nvidia.hopper.fence_async_shared()                # visible to wgmma (q's stores too, at i = 0)
        gl_thread_barrier()                                  # ... and every thread's
        kv_v = ring_v.index(i % STAGES)
        kv_r = ring_r.index(i % STAGES)
        s = gl.nvidia.hopper.warpgroup_mma(q_v_s, kv_v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = gl.nvidia.hopper.warpgroup_mma(q_r_s, kv_r.permute((1, 0)), s, is_async=True)
        s = gl.nvidia.hopper.warpgroup_mma_wait(0, deps=(s,))

        s = gl.where(key_ok[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, L_O))[:, None]
        p_op = gl.convert_layout(p.to(dt), L_P)
        acc = gl.nvidia.hopper.warpgroup_mma(p_op, kv_v, acc, is_async=True)
        acc = gl.nvidia.hopper.warpgroup_mma_wait(0, deps=(acc,))
    gl.nvidia.ampere.async_copy.wait_group(0)                # the ring's trailing (masked) gathers

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, L_O))
    out = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]         # a head without keys writes 0
    h = h0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_O))
    c = gl.arange(0, DV, layout=gl.SliceLayout(0, L_O))
    if SPLITS == 1:
        gl.store(o_ptr + ((b * H + h) * DV)[:, None] + c[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(h < H)[:, None])
    else:
        part = (b * SPLITS + split) * H + h
        gl.store(o_ptr + (part * DV)[:, None] + c[None, :], out, mask=(h < H)[:, None])
        hs = h0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_S))
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        gl.store(lse_ptr + (b * SPLITS + split) * H + hs, lse, mask=hs < H)
