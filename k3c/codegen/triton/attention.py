"""Triton kernels and the emitter of the global-layer attention op `mla_attention` (MLA, and DSA's sparse
attention over the selected keys; the DSA indexer is `dsa_index`).

Math: K3-SPEC.md "Gated MLA" / "Gated DSA"; exact semantics: `mla_attention_ref` and `dsa_index_topk_ref` of
k3c/ir/ops/model_attn.py. Query t of T new tokens sits at absolute position S − T + t and sees keys s ≤ S − T + t.

mla_attention (flash-style online softmax over key blocks, fp32 accumulation, base-2 exponentials):
  - absorbed (MQA over the latent, FlashMLA layout): one program per (b, t, block of BLOCK_M heads); the heads of a
    block share every latent row kv[b, s] ([r + rope] values); scores = q·kv, values = kv[:, :v_dim];
  - unabsorbed (per-head q, k, v): one program per (b, block of BLOCK_M tokens, h);
  - idx [B, T, topk] (DSA): the program walks the topk slots of its token and gathers those latent rows (slot −1 is
    never loaded); then a program holds one token. dense_max_keys guard: when S ≤ dense_max_keys the launcher
    runs the dense causal path and idx is not read;
  - DSA decode (absorbed, idx, T = 1, kv rows with rope dims): `dsa_attention.mla_sparse_decode_kernel` instead,
    which loads q and every gathered row once (SPARSE_DECODE); on a Hopper GPU (bf16 / fp16) its wgmma form
    `dsa_attention_wgmma.mla_sparse_decode_wgmma_kernel` (SPARSE_WGMMA: q in shared memory, a cp.async ring);
  - split-K (flash decoding): when B·T·head-blocks programs cannot fill the GPU, the keys are split over a third grid
    axis; the splits write (o, log2-sum-exp) partials to scratch planned in the arena (`mla_attention_scratch`) and
    `mla_combine_kernel` merges them.
Device lengths (`lengths` i32 [B], the kernel ABI's `sizes["lengths"]`): the key tensors are the bound, row b holds
lengths[b] + T keys, read in the kernels: grids and split counts follow the bound (a CUDA graph replays them at any
context), each split covers 1/splits of its row's keys and the DSA guard is taken per row; the results equal those of
the tensors cut to each row's keys.

Public API: `emit_mla_attention(group)` -> module text (registered with `k3c.codegen.triton.emitter` for the kind
"mla_attention"); the launcher `launch_mla` (copied into the emitted modules) and the kernels.
"""

from __future__ import annotations

import sympy
import torch
import triton
import triton.language as tl

from k3c.codegen.backend import ScratchSpec
from k3c.codegen.triton import emitter, model_module, one_node, scratch, take_scratch
from k3c.codegen.triton.dsa_attention import mla_sparse_decode_kernel
from k3c.codegen.triton.dsa_attention_wgmma import (_gather_tile, _slot_pos, mla_sparse_decode_wgmma_kernel,
                                                   sparse_wgmma_ok)
from k3c.codegen.triton.gl_common import gl_async_copy, gl_async_load_named, gl_barrier_named, gl_thread_barrier
from k3c.ir.kernels import KernelGroup
from k3c.ir.types import TensorType


# Launch policy (copied into every emitted module, where the runtime may retune it).
TARGET_PROGRAMS = 264       # split-K (flash decoding) until about this many programs: 2 per H200 SM (132 SMs)
MIN_KEYS_PER_SPLIT = 64     # no key split shorter than this (DSA top-2048 at B = 1: 24 -> 14 us vs 256)
MAX_SPLITS = 64
HEAD_BLOCK_WIDE = 32        # absorbed form, v_dim >= 256: heads per program (each head block re-reads the latent;
                            # 32 measured fastest on an H200 for 64 heads, bf16, v_dim 512; 64 overflows shared
                            # memory with 64-key tiles)
SPARSE_DECODE = True        # absorbed DSA decode (idx, T = 1, rope dims): `mla_sparse_decode_kernel` (rows read once)
SPARSE_HEAD_BLOCK = 32      # its heads per program (B·T < SPARSE_BATCHED_ROWS: more programs for few rows)
SPARSE_HEAD_BLOCK_BATCHED = 64  # ... with B·T >= SPARSE_BATCHED_ROWS: each gathered row read by fewer head blocks
SPARSE_BATCHED_ROWS = 8     # H200 (BENCHMARKS.md round 5): B = 16 64 heads 64.7 us vs 32 heads 77.4; B = 1 17.8 vs
                            # 15.5 (B = 2..15 untimed)
SPARSE_STAGES = 2           # its software-pipeline depth
SPARSE_BLOCK_S = 64         # its keys per step (bf16 / fp16; fp32: 16)
SPARSE_WARPS = 8            # its warps per program
SPARSE_WGMMA = True         # on sm_90 (bf16 / fp16): `mla_sparse_decode_wgmma_kernel` instead (64 heads per program)
WGMMA_BLOCK_S = 64          # its keys per ring slot
WGMMA_STAGES = 2            # its ring slots (64 keys x 2 + q: 220 KB of shared memory, one program per SM)
SPARSE_TARGET_PROGRAMS = 128  # its split-K target (programs; B = 1 is capped by MIN_KEYS_PER_SPLIT instead): about one
                              # wave of one program per H200 SM (~200 registers x 8 warps each); B = 16, 64 heads:
                              # 4 splits 64.7 us, 9 (288 programs, 3 waves) 71.9 (BENCHMARKS.md round 5)


@triton.jit
def mla_attention_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr,           # q [B,T,H,D]; k/v rows (strides below); idx [B,T,TOPK] i64 (USE_IDX)
    o_ptr,                                  # [B,T,H,DV] output (SPLITS == 1) or [B*T,SPLITS,H,DV] f32 partials
    lse_ptr,                                # [B*T,SPLITS,H] f32 log2-sum-exp of each split (SPLITS > 1)
    len_ptr,                                # LEN_FROM_PTR: [B] i32 context length per row (keys before this call)
    T, S, n_tblocks, keys_per_split,        # new tokens, keys (LEN_FROM_PTR: the bound), token blocks per batch row,
                                            # keys (or slots) per split (LEN_FROM_PTR: derived here)
    dense_max,                              # USE_IDX: rows with at most this many keys run dense (-1: never)
    stride_kb, stride_ks, stride_kh,        # key strides in elements (kh = 0: absorbed, all heads share kv rows)
    stride_vb, stride_vs, stride_vh,        # value strides in elements
    qk_scale,                               # attrs.scale · log2(e): scores in the base-2 domain
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, TOPK: tl.constexpr,
    HEADS_LAYOUT: tl.constexpr,             # True: rows = heads of one token; False: rows = tokens of one head
    ROWS_T: tl.constexpr,                   # tokens per program in the tokens layout (1 with idx)
    USE_IDX: tl.constexpr, CAUSAL: tl.constexpr, SPLITS: tl.constexpr, LEN_FROM_PTR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,            # "ieee" for fp32 inputs (exact), "tf32" otherwise (ignored for bf16)
):
    pid_bt = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bt // n_tblocks).to(tl.int64)
    tb = pid_bt % n_tblocks
    offs_m = tl.arange(0, BLOCK_M)
    if HEADS_LAYOUT:
        t_row = tb + 0 * offs_m
        h_row = pid_h * BLOCK_M + offs_m
        row_ok = h_row < H
        k_head = 0
        t_first = tb
        t_last = tb
    else:
        t_row = tb * ROWS_T + offs_m
        h_row = pid_h + 0 * offs_m
        row_ok = (offs_m < ROWS_T) & (t_row < T)
        k_head = pid_h
        t_first = tb * ROWS_T
        t_last = tl.minimum(t_first + ROWS_T - 1, T - 1)
    if LEN_FROM_PTR:                                        # the row's keys: its context in device memory + T
        S = tl.load(len_ptr + b).to(tl.int32) + T
    if CAUSAL:
        n_keys = S - T + t_last + 1                         # keys visible to the block's last token
    else:
        n_keys = S
    sparse = (S + 0 * tl.arange(0, BLOCK_S)) > dense_max    # USE_IDX: walk the index slots of token t_first
    if USE_IDX:                                             # (a vector: masks combine with it as bool)
        n_keys = tl.where(tl.max(sparse.to(tl.int32), 0) > 0, TOPK, n_keys)
    if LEN_FROM_PTR:                                        # split this row's keys over the SPLITS programs
        keys_per_split = ((n_keys + SPLITS - 1) // SPLITS + BLOCK_S - 1) // BLOCK_S * BLOCK_S
    start = split * keys_per_split
    end = tl.minimum(n_keys, start + keys_per_split)

    q_rows = ((b * T + t_row) * H + h_row) * D              # [BLOCK_M] element offsets of the query rows
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)           # finite start: a fully masked block gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in range(start, end, BLOCK_S):
        offs_j = j0 + tl.arange(0, BLOCK_S)
        j_ok = offs_j < end
        if USE_IDX:
            pos = tl.load(idx_ptr + (b * T + t_first) * TOPK + offs_j, mask=j_ok & sparse, other=-1)
            pos = tl.where(sparse, pos, offs_j.to(tl.int64))
            key_ok = j_ok & (pos >= 0) & (pos < S)
            pos = tl.where(key_ok, pos, 0)
        else:
            pos = offs_j.to(tl.int64)
            key_ok = j_ok
        k_rows = b * stride_kb + pos * stride_ks + k_head * stride_kh
        scores = tl.zeros([BLOCK_M, BLOCK_S], tl.float32)
        for d0 in tl.static_range(0, D, BLOCK_D):           # head dim in BLOCK_D chunks (576 = 9 x 64)
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            scores += tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        allow = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            allow = allow & (pos[None, :] <= (S - T + t_row)[:, None])
        scores = tl.where(allow, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = b * stride_vb + pos * stride_vs + k_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + offs_dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]        # a row without keys writes 0
    if SPLITS == 1:
        o_rows = ((b * T + t_row) * H + h_row) * DV
        tl.store(o_ptr + o_rows[:, None] + offs_dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok[None, :])
    else:
        part = ((b * T + t_row) * SPLITS + split) * H + h_row
        tl.store(o_ptr + part[:, None] * DV + offs_dv[None, :], out, mask=row_ok[:, None] & dv_ok[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_ok)


@triton.jit
def mla_combine_kernel(part_ptr, lse_ptr, o_ptr, H: tl.constexpr, DV: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr):
    """o[bt, h] = Σ_i 2^(lse_i − M) o_i / Σ_i 2^(lse_i − M) over the key splits i (M = max lse_i)."""
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_i = tl.arange(0, BLOCK_SPLITS)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = (bt * SPLITS + offs_i) * H + h
    lse = tl.load(lse_ptr + rows, mask=offs_i < SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part = tl.load(part_ptr + rows[:, None] * DV + offs_dv[None, :],
                   mask=(offs_i < SPLITS)[:, None] & (offs_dv < DV)[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + (bt * H + h) * DV + offs_dv, out.to(o_ptr.dtype.element_ty), mask=offs_dv < DV)


def split_rows(tokens, H, absorbed):
    """A bound of the split-K partial rows B·T·splits of `launch_mla` for `tokens` = B·T query rows of H heads,
    non-decreasing in `tokens`: split-K runs only while programs < target (TARGET_PROGRAMS; the sparse decode
    kernel: SPARSE_TARGET_PROGRAMS), with splits ≤ min(MAX_SPLITS, ⌈target / programs⌉); absorbed, programs ≥ B·T,
    so B·T·splits < 2·target; else programs ≥ B·T·H / ROWS (ROWS ≤ 32 tokens per program), so
    B·T·splits < 2·32·TARGET_PROGRAMS / H."""
    target = max(TARGET_PROGRAMS, SPARSE_TARGET_PROGRAMS) if absorbed else TARGET_PROGRAMS
    return min(tokens * MAX_SPLITS, 2 * target if absorbed else -(-64 * target // H))


def launch_mla(q, k, v, idx, out, *, absorbed, causal, scale, v_dim, dense_max_keys, lengths=None, scratch=None):
    """Run `mla_attention` (see the module docstring of the emitted module for the semantics).

    q [B,T,H,D]; absorbed: k = kv [B,S,D] (v ignored), values kv[..., :v_dim]; else k [B,S,H,D], v [B,S,H,Dv].
    idx: None or i64 [B,T,topk]; out: [B,T,H,Dv] (q's dtype), fully written. lengths: None, or i32 [B] on q's device,
    the context of each row before these T tokens: then row b has lengths[b] + T keys, S is only the bound of the
    key tensors, the grid and the split-K count are fixed by that bound and the DSA guard is taken per row on the
    device (nothing here depends on the lengths: a CUDA graph replays it at any context). Scratch: with split-K,
    f32 partials [B·T, splits, H, Dv] and [B·T, splits, H], the fronts of `scratch["o_part"]` / `scratch["lse"]`
    (the planned buffers of `split_rows(B·T, H, absorbed)` rows, `mla_attention_scratch`), else allocated here.
    Raises ValueError on mismatched shapes.
    """
    B, T, H, D = q.shape
    S = k.shape[1]
    if absorbed:
        DV = v_dim
        v, sv = k, (k.stride(0), k.stride(1), 0)
        sk = sv
    else:
        DV = v.shape[3]
        sk, sv = (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))
    if k.shape[0] != B or k.shape[-1] != D or tuple(out.shape) != (B, T, H, DV) or S < 1:
        raise ValueError(f"mla_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, out {tuple(out.shape)} mismatch")
    from_ptr = lengths is not None
    if from_ptr and tuple(lengths.shape) != (B,):
        raise ValueError(f"mla_attention: lengths {tuple(lengths.shape)}, expected ({B},)")
    use_idx = idx is not None and (from_ptr or dense_max_keys is None or S > dense_max_keys)
    dense_max = dense_max_keys if from_ptr and use_idx and dense_max_keys is not None else -1
    topk = idx.shape[2] if use_idx else 1
    BLOCK_DV = triton.next_power_of_2(DV)
    BLOCK_D = 64 if D > 64 else max(16, triton.next_power_of_2(D))
    wide = BLOCK_DV >= 256                          # [BLOCK_M, BLOCK_DV] accumulator: keep it in registers
    BLOCK_S = 64 if q.dtype != torch.float32 else (16 if wide else 32)   # fp32 tiles: half the shared memory
    if absorbed:                                    # one token, a block of heads sharing the latent rows
        BLOCK_M = max(16, min(triton.next_power_of_2(H), HEAD_BLOCK_WIDE if wide else 64))
        rows_t, n_tb, n_hb = 1, T, triton.cdiv(H, BLOCK_M)
    else:                                           # one head, a block of tokens (one token when gathering idx)
        BLOCK_M = 16 if use_idx or wide else 32
        rows_t = 1 if use_idx else BLOCK_M
        n_tb, n_hb = triton.cdiv(T, rows_t), H
    sparse_decode = SPARSE_DECODE and absorbed and use_idx and T == 1 and D > DV
    wgmma = sparse_decode and SPARSE_WGMMA and sparse_wgmma_ok(q, k, DV)
    if sparse_decode:                               # q and every gathered row loaded once (`dsa_attention`)
        head_block = SPARSE_HEAD_BLOCK_BATCHED if B * T >= SPARSE_BATCHED_ROWS else SPARSE_HEAD_BLOCK
        BLOCK_M = 64 if wgmma else max(16, min(triton.next_power_of_2(H), head_block))
        BLOCK_S = WGMMA_BLOCK_S if wgmma else SPARSE_BLOCK_S if q.dtype != torch.float32 else 16
        n_hb = triton.cdiv(H, BLOCK_M)
    n_keys = (max(topk, min(S, dense_max)) if from_ptr else topk) if use_idx else S   # at most, per row
    programs = B * n_tb * n_hb
    target = SPARSE_TARGET_PROGRAMS if sparse_decode else TARGET_PROGRAMS
    splits = 1
    if programs < target and n_keys > MIN_KEYS_PER_SPLIT:
        splits = min(triton.cdiv(target, programs), triton.cdiv(n_keys, MIN_KEYS_PER_SPLIT), MAX_SPLITS)
    keys_per_split = triton.cdiv(triton.cdiv(n_keys, splits), BLOCK_S) * BLOCK_S
    splits = triton.cdiv(n_keys, keys_per_split)
    if splits > 1:
        rows = split_rows(B * T, H, absorbed)
        if B * T * splits > rows:
            raise ValueError(f"mla_attention: {B * T} x {splits} split-K rows exceed the bound {rows} (split_rows)")
        o_dst = take_scratch(scratch, "o_part", (rows * H * DV,), torch.float32, q.device)
        lse = take_scratch(scratch, "lse", (rows * H,), torch.float32, q.device)
        o_dst, lse = o_dst[:B * T * splits * H * DV].view(B * T, splits, H, DV), lse[:B * T * splits * H]
    else:
        o_dst, lse = out, out
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if wgmma:
        mla_sparse_decode_wgmma_kernel[(B, n_hb, splits)](
            q, k, idx, o_dst, lse, lengths if from_ptr else q, S, keys_per_split, dense_max, k.stride(0),
            k.stride(1), scale * 1.4426950408889634, H=H, DV=DV, DR=D - DV, TOPK=topk, SPLITS=splits,
            LEN_FROM_PTR=from_ptr, BLOCK_S=BLOCK_S, STAGES=WGMMA_STAGES, num_warps=8)
    elif sparse_decode:
        mla_sparse_decode_kernel[(B, n_hb, splits)](
            q, k, idx, o_dst, lse, lengths if from_ptr else q, S, keys_per_split, dense_max, k.stride(0),
            k.stride(1), scale * 1.4426950408889634, H=H, DV=DV, DR=D - DV, TOPK=topk, SPLITS=splits,
            LEN_FROM_PTR=from_ptr, BLOCK_M=BLOCK_M, BLOCK_S=BLOCK_S, BLOCK_DV=BLOCK_DV,
            BLOCK_DR=max(16, triton.next_power_of_2(D - DV)), DOT_PRECISION=precision, num_warps=SPARSE_WARPS,
            num_stages=SPARSE_STAGES)
    else:
        mla_attention_kernel[(B * n_tb, n_hb, splits)](
            q, k, v, idx if use_idx else q, o_dst, lse, lengths if from_ptr else q, T, S, n_tb, keys_per_split,
            dense_max, *sk, *sv,
            scale * 1.4426950408889634,  # log2(e): exp(x) = exp2(x · log2 e)
            H=H, D=D, DV=DV, TOPK=topk, HEADS_LAYOUT=absorbed, ROWS_T=rows_t, USE_IDX=use_idx, CAUSAL=causal,
            SPLITS=splits, LEN_FROM_PTR=from_ptr, BLOCK_M=BLOCK_M, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D,
            BLOCK_DV=BLOCK_DV, DOT_PRECISION=precision, num_warps=8 if wide else 4, num_stages=2)
    if splits > 1:
        mla_combine_kernel[(B * T, H)](o_dst, lse, out, H=H, DV=DV, SPLITS=splits,
                                       BLOCK_SPLITS=triton.next_power_of_2(splits), BLOCK_DV=BLOCK_DV)


# ---- emitter ---------------------------------------------------------------------------------------------------
SEMANTICS = "the op's `ref` in k3c/ir/ops/model_attn.py (K3-SPEC.md 'Gated MLA', 'Gated DSA')."


def _module(group, summary, consts, kernels, launcher, body, takes_views=False):
    return model_module(group, summary, __name__, SEMANTICS, consts, kernels, launcher, body, takes_views)


@emitter("mla_attention")
def emit_mla_attention(group: KernelGroup) -> str:
    """Module text for one `mla_attention` node (absorbed or not, with or without idx / dense guard).

    launch(inputs, outputs, sizes): inputs in the group's order (q, k[, v][, idx]), outputs [o]; k and v (cache
    pool views, a prefix of their positions) are read through their strides (`TAKES_VIEWS`), q and idx made
    contiguous. The module constants TARGET_PROGRAMS / MIN_KEYS_PER_SPLIT / MAX_SPLITS steer split-K. Raises
    UnsupportedError for a group that is not a single mla_attention node.
    """
    node, ip, op = one_node(group, "mla_attention")
    a = node.attrs
    n_in = len(node.inputs)
    has_v = not a["absorbed"]
    has_idx = n_in == (4 if has_v else 3)
    consts = [("ABSORBED", a["absorbed"], "MQA over the latent"), ("CAUSAL", a["causal"], ""),
              ("SCALE", float(a["scale"]), "softmax scale"), ("V_DIM", a["v_dim"], "absorbed: latent values used"),
              ("DENSE_MAX_KEYS", a["dense_max_keys"], "DSA guard: S <= this runs dense causal, idx unread"),
              ("TARGET_PROGRAMS", TARGET_PROGRAMS, "split-K until about this many programs (2 per H200 SM)"),
              ("MIN_KEYS_PER_SPLIT", MIN_KEYS_PER_SPLIT, "no key split shorter than this"),
              ("MAX_SPLITS", MAX_SPLITS, ""),
              ("HEAD_BLOCK_WIDE", HEAD_BLOCK_WIDE, "heads per program when v_dim >= 256"),
              ("SPARSE_DECODE", SPARSE_DECODE, "DSA decode (absorbed, idx, T = 1): mla_sparse_decode_kernel"),
              ("SPARSE_HEAD_BLOCK", SPARSE_HEAD_BLOCK, "its heads per program (B·T < SPARSE_BATCHED_ROWS)"),
              ("SPARSE_HEAD_BLOCK_BATCHED", SPARSE_HEAD_BLOCK_BATCHED, "its heads per program, more rows"),
              ("SPARSE_BATCHED_ROWS", SPARSE_BATCHED_ROWS, "B·T from which it takes SPARSE_HEAD_BLOCK_BATCHED"),
              ("SPARSE_STAGES", SPARSE_STAGES, "its software-pipeline depth"),
              ("SPARSE_BLOCK_S", SPARSE_BLOCK_S, "its keys per step (bf16 / fp16)"),
              ("SPARSE_WARPS", SPARSE_WARPS, "its warps per program"),
              ("SPARSE_TARGET_PROGRAMS", SPARSE_TARGET_PROGRAMS, "its split-K target (programs)"),
              ("SPARSE_WGMMA", SPARSE_WGMMA, "on sm_90: its wgmma form (mla_sparse_decode_wgmma_kernel)"),
              ("WGMMA_BLOCK_S", WGMMA_BLOCK_S, "the wgmma form's keys per ring slot"),
              ("WGMMA_STAGES", WGMMA_STAGES, "the wgmma form's ring slots")]
    v_arg = f"_unit_last(inputs[{ip[2]}])" if has_v else "None"
    idx_arg = f"inputs[{ip[-1]}].contiguous()" if has_idx else "None"
    body = (
        "def _unit_last(t):\n"
        '    """`t` when its last dim is unit-stride (the kernel takes the other strides), else a contiguous copy."""\n'
        "    return t if t.stride(-1) == 1 else t.contiguous()\n\n\n"
        "def launch(inputs, outputs, sizes, scratch=None):\n"
        '    """ABI entry: inputs (q, k[, v][, idx]) and outputs [o] are the group\'s tensors at `sizes`; scratch: the '
        'planned split-K partials."""\n'
        f"    launch_mla(inputs[{ip[0]}].contiguous(), _unit_last(inputs[{ip[1]}]), {v_arg}, {idx_arg}, "
        f"outputs[{op[0]}],\n               absorbed=ABSORBED,\n"
        "               causal=CAUSAL, scale=SCALE, v_dim=V_DIM, dense_max_keys=DENSE_MAX_KEYS,\n"
        '               lengths=sizes.get("lengths"), scratch=scratch)\n')
    title = f"mla_attention ({'absorbed' if a['absorbed'] else 'unabsorbed'}{', DSA idx' if has_idx else ''})"
    return _module(group, title, consts, [take_scratch, split_rows, mla_attention_kernel, mla_sparse_decode_kernel,
                                          sparse_wgmma_ok, gl_async_load_named, gl_async_copy, gl_barrier_named,
                                          gl_thread_barrier, _slot_pos, _gather_tile, mla_sparse_decode_wgmma_kernel,
                                          mla_combine_kernel], launch_mla, body, takes_views=True)


@scratch("mla_attention")
def mla_attention_scratch(group: KernelGroup) -> list[ScratchSpec]:
    """The split-K partials of one `mla_attention` launch (`launch_mla`): o_part f32 [R·H·Dv] and lse f32 [R·H]
    for R = split_rows(B·T, H, absorbed) rows (q [B, T, H, ·], Dv = v_dim absorbed, else v's last dim), non-decreasing
    in B and T. Raises UnsupportedError for a group that is not a single mla_attention node."""
    node, _, _ = one_node(group, "mla_attention")
    a = node.attrs
    B, T, H = node.inputs[0].type.shape[:3]
    DV = a["v_dim"] if a["absorbed"] else node.inputs[2].type.shape[3]
    target = max(TARGET_PROGRAMS, SPARSE_TARGET_PROGRAMS)                # `split_rows`, symbolic
    rows = sympy.Min(B * T * MAX_SPLITS, 2 * target if a["absorbed"] else -(-64 * TARGET_PROGRAMS // H))
    return [ScratchSpec("o_part", TensorType((rows * H * DV,), "f32")),
            ScratchSpec("lse", TensorType((rows * H,), "f32"))]
