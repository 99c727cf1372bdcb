"""Exact re-ranking of DSA candidates selected on FP8 index keys (e4m3 keys + the exact keys at hand).

`dsa_decode.radix_topk` selects topk + RERANK_EXTRA candidates on the quantized keys; two kernels then re-rank them
by their exact scores (K3-SPEC.md "Gated DSA": I[s] = sum_j w[j] * ReLU(q_I[j] . k_I[s]), in q's dtype):
  dsa_rerank_kernel       their exact scores as unique 64-bit keys (order key << 32 | ~position)
  dsa_rerank_rank_kernel  each one's rank = the number of larger keys: its slot (the reference's order)
The result equals the exact selection unless a key of the exact top-k ranks below topk + RERANK_EXTRA in the
quantized order (Gaussian keys, L = 1M, CPU simulation: worst rank 2.9K with fp8 q, so 2048 extra; 1 MB of exact
keys per row). Not used by compiled artifacts (`--dsa-index-keys fp8` keeps no exact keys: they would cost more
bytes than bf16 keys); the benchmarks measure what it restores (BENCHMARKS.md, "FP8 index keys").

Public API: `rerank_topk` (called by `dsa_decode.dsa_decode_topk` with k_exact) and the kernels.
"""

import torch
import triton
import triton.language as tl

from k3c.codegen.triton.dsa_decode import _order_key, radix_topk

RERANK_EXTRA = 2048    # candidates beyond topk that the exact re-scoring sees
RERANK_BLOCK = 128     # candidates per re-scoring program
RANK_BLOCK = 32        # candidates per ranking program (each compares them with all the row's candidates)


@triton.jit
def dsa_rerank_kernel(q_ptr, w_ptr, k_ptr, cand_ptr, ck_ptr, L, K1,
                      J: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """Exact scores of candidates [pid*BLOCK_C, ...) of row b: cand [B, K1] int64 positions (-1: none), k [B, L, D]
    exact keys (q's dtype) -> ck [B, K1] int64 key (signed order key of the score << 32) + (2^32-1 - s): unique,
    larger = better, ties by lowest position; INT64_MIN for no candidate."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_J)
    offs_d = tl.arange(0, D)
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    pos = tl.load(cand_ptr + b * K1 + offs_c, mask=offs_c < K1, other=-1)
    ok = pos >= 0
    q = tl.load(q_ptr + (b * J + offs_j)[:, None] * D + offs_d[None, :], mask=(offs_j < J)[:, None], other=0.0)
    w = tl.load(w_ptr + b * J + offs_j, mask=offs_j < J, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + (b * L + tl.maximum(pos, 0))[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    dots = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)        # [BLOCK_J, BLOCK_C]
    score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), 0)
    signed = (_order_key(score).to(tl.int32, bitcast=True) ^ -2147483648).to(tl.int64)   # signed order: float's
    key = tl.where(ok, (signed << 32) + (4294967295 - pos), -9223372036854775808)
    tl.store(ck_ptr + b * K1 + offs_c, key, mask=offs_c < K1)


@triton.jit
def dsa_rerank_rank_kernel(ck_ptr, idx_ptr, K1, K, BLOCK_C: tl.constexpr, BLOCK_O: tl.constexpr):
    """grid (cdiv(K1, BLOCK_C), B): the rank of candidates [pid*BLOCK_C, ...) of row b among all K1 (ck [B, K1]
    from `dsa_rerank_kernel`) = the number of larger keys, counted in a [BLOCK_C, BLOCK_O] int32 tile over the row
    and reduced once; rank < K is the candidate's slot in idx [B, K] int64 (pre-filled with -1). The keys are
    unique, so the slots are too, and idx comes out in the reference's order (score descending, ties by lowest
    position)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    key = tl.load(ck_ptr + b * K1 + offs_c, mask=offs_c < K1, other=-9223372036854775808)
    count = tl.zeros([BLOCK_C, BLOCK_O], tl.int32)
    for o in range(0, K1, BLOCK_O):
        offs_o = o + tl.arange(0, BLOCK_O)
        other = tl.load(ck_ptr + b * K1 + offs_o, mask=offs_o < K1, other=-9223372036854775808)
        count += (other[None, :] > key[:, None]).to(tl.int32)
    rank = tl.sum(count, 1)
    pos = 4294967295 - (key & 4294967295)
    tl.store(idx_ptr + b * K + rank, pos, mask=(key != -9223372036854775808) & (rank < K))


def rerank_topk(q_i, w, k_i, k_scale, k_exact, topk, rerank_extra=None):
    """The top-`topk` positions by exact score among the topk + `rerank_extra` (None: RERANK_EXTRA) best by the
    quantized keys: q_i [B, J, D], w [B, J], k_i [B, L, D] float8_e4m3fn with k_scale [B, L] fp32, k_exact
    [B, L, D] in q_i's dtype (shapes checked by `dsa_decode.dsa_decode_topk`). Returns int64 [B, 1, topk] in the
    reference's order (score descending, ties by lowest position), -1 past min(L, topk)."""
    B, J, D = q_i.shape
    L = k_i.shape[1]
    n_sel = topk + (RERANK_EXTRA if rerank_extra is None else rerank_extra)
    cand = radix_topk(q_i, w, k_i, n_sel, k_scale, False)[:, 0]       # [B, n_sel] positions, -1 past the keys
    ck = torch.empty((B, n_sel), dtype=torch.int64, device=q_i.device)
    dsa_rerank_kernel[(triton.cdiv(n_sel, RERANK_BLOCK), B)](
        q_i.contiguous(), w.contiguous(), k_exact.contiguous(), cand, ck, L, n_sel, J=J, D=D,
        BLOCK_J=max(16, triton.next_power_of_2(J)), BLOCK_C=RERANK_BLOCK,
        DOT_PRECISION="ieee" if q_i.dtype == torch.float32 else "tf32", num_warps=4)
    out = torch.full((B, 1, topk), -1, dtype=torch.int64, device=q_i.device)
    dsa_rerank_rank_kernel[(triton.cdiv(n_sel, RANK_BLOCK), B)](ck, out, n_sel, topk, BLOCK_C=RANK_BLOCK,
                                                               BLOCK_O=128, num_warps=4)
    return out
