"""Exact re-ranking of DSA candidates selected on FP8 index keys, from the keys' 4-bit low residuals
(`--dsa-index-keys fp8-rerank`: `fp8_split_ref` / `dsa_index_topk_ref` with k_lo in k3c/ir/ops/model_attn.py).

The selection (`dsa_decode.radix_topk` at long-context decode, the score kernel + torch.topk otherwise) picks the
topk + E best by the FP8 score; two kernels then re-rank those candidates by the exact score of their joined keys
k = scale * (k8 + (nibble - 8) * ulp / 16) (the bf16 key, but for e4m3 subnormals),
I[s] = sum_j w[j] * ReLU(q_I[j] . k[s]) with q_I as given:
  dsa_rerank_kernel       reads each candidate's e4m3 key, scale and 64 B of residuals (D = 128), joins them in
                          registers (exact in f32, and in bf16: 8 significant bits), scores them (q's dtype x the
                          joined keys, f32 sums) and writes unique 64-bit keys (order key << 32 | 2^32 - 1 -
                          position)
  dsa_rerank_rank_kernel  each one's rank = the number of larger keys: its slot (the reference's order); the slots
                          past the valid candidates get -1; (K1)^2 comparisons per row over many programs
  dsa_rerank_select_kernel  or (rows >= RANK_SELECT_MIN_ROWS, unordered): one program per row, a radix select of
                          8-bit digits on the keys in registers, level after level until the threshold digit's
                          keys fit (typically 3 levels), the K best to their slots in no particular order
Only the candidates' residuals are read: the scan reads the e4m3 keys and scales alone (132 B per token at D = 128).

Public API: `rerank`, `RERANK_EXTRA` (E, BENCHMARKS.md "FP8 index keys + 4-bit residual"), the kernels (`KERNELS`,
with `rerank`: copied into generated `dsa_index_topk` modules).
"""

import torch
import triton
import triton.language as tl

from k3c.codegen.triton.dsa_decode import _order_key
from k3c.context import DSA_RERANK_EXTRA

RERANK_EXTRA = DSA_RERANK_EXTRA   # E: candidates beyond topk re-ranked exactly (Gaussian keys, B = 16 / 128K and 1M:
                                  # the exact top-2048's worst fp8 rank 2.5K-2.9K; E = 512 keeps >= 99.9 %, BENCHMARKS.md)
RERANK_BLOCK = 64      # candidates per re-scoring program ...
RERANK_WARPS = 8       # ... and its warps (sm_90, compiled ahead of time: 102 registers; 4 warps spill 176 B)
RANK_BLOCK = 32        # candidates per ranking program (each compares them with all the row's candidates)
RANK_SELECT_MIN_ROWS = 8   # rows from which an unordered re-rank takes the radix select instead of the all-pairs
                           # ranking (H200, E = 512: B = 1 7.0 us vs the select's 14.2; B = 16 29.9 vs 17.7; rows
                           # in between not timed; BENCHMARKS.md "FP8 index keys + 4-bit residual")
SELECT_WARPS = 8       # warps of a radix-select program


@triton.jit
def _join_e4m3(hi, nib):
    """f32 keys from e4m3 values hi and residual nibbles nib (int32 in [-8, 7]): hi + nib * u, u = ulp(hi) / 16 =
    2^(e - 7) for |hi| in [2^e, 2^(e+1)) (2^-13 below 2^-6), halved where hi is a power of two of at least 2^-5 and
    nib points toward zero (`_e4m3_unit`); exact in f32."""
    hf = hi.to(tl.float32)
    bits = hf.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 255
    half = ((bits & 0x7FFFFF) == 0) & (e >= 122) & (nib != 0) & ((nib < 0) != (hf < 0))
    sh = tl.maximum(e, 121) - 7 - half.to(tl.int32)
    return hf + nib.to(tl.float32) * (sh << 23).to(tl.float32, bitcast=True)


@triton.jit
def dsa_rerank_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, lo_ptr, cand_ptr, ck_ptr, L, K1, T,
                      J: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """grid (cdiv(K1, BLOCK_C), R): exact scores of candidates [pid*BLOCK_C, ...) of row r (batch b = r // T):
    q [R, J, D], w [R, J], cand [R, K1] int64 positions (-1: none), the keys k [B, L, D] e4m3, ks [B, L] f32 and
    lo [B, L, D / 2] u8 (nibble + 8; element 2i low, 2i + 1 high) -> ck [R, K1] int64: signed order key of the score
    << 32 | 2^32 - 1 - position (unique, larger = better, ties by lowest position); INT64_MIN for no candidate.
    The joined keys have at most 8 significant bits: exact in q's dtype (bf16 or f32), so the product is q's."""
    pid = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    b = r // T
    offs_j = tl.arange(0, BLOCK_J)
    offs_d = tl.arange(0, D)
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    pos = tl.load(cand_ptr + r * K1 + offs_c, mask=offs_c < K1, other=-1)
    ok = pos >= 0
    row = b * L + tl.maximum(pos, 0)
    q = tl.load(q_ptr + (r * J + offs_j)[:, None] * D + offs_d[None, :], mask=(offs_j < J)[:, None], other=0.0)
    w = tl.load(w_ptr + r * J + offs_j, mask=offs_j < J, other=0.0).to(tl.float32)
    hi = tl.load(k_ptr + row[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    byte = tl.load(lo_ptr + row[:, None] * (D // 2) + (offs_d // 2)[None, :], mask=ok[:, None], other=136)
    nib = ((byte.to(tl.int32) >> ((offs_d & 1) * 4)[None, :]) & 15) - 8
    k = _join_e4m3(hi, nib).to(q.dtype)
    dots = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                        # [BLOCK_J, BLOCK_C]
    score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), 0) * tl.load(ks_ptr + row, mask=ok, other=1.0)
    signed = (_order_key(score).to(tl.int32, bitcast=True) ^ -2147483648).to(tl.int64)   # signed order: float's
    key = tl.where(ok, (signed << 32) + (4294967295 - pos), -9223372036854775808)
    tl.store(ck_ptr + r * K1 + offs_c, key, mask=offs_c < K1)


@triton.jit
def dsa_rerank_rank_kernel(ck_ptr, idx_ptr, K1, K, BLOCK_C: tl.constexpr, BLOCK_O: tl.constexpr):
    """grid (cdiv(K1, BLOCK_C), R): the rank of candidates [pid*BLOCK_C, ...) of row r among all K1 (ck [R, K1]
    from `dsa_rerank_kernel`) = the number of larger keys, counted in a [BLOCK_C, BLOCK_O] int32 tile over the row
    and reduced once; rank < K is the candidate's slot in idx [R, K] int64. The keys are unique, so the slots are
    too, and idx comes out in the reference's order (score descending, ties by lowest position); slots from the
    row's valid candidates up to K get -1 (written by the programs whose candidate index is that slot; K <= K1)."""
    pid = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    key = tl.load(ck_ptr + r * K1 + offs_c, mask=offs_c < K1, other=-9223372036854775808)
    count = tl.zeros([BLOCK_C, BLOCK_O], tl.int32)
    n_ok = tl.zeros([BLOCK_O], tl.int32)
    for o in range(0, K1, BLOCK_O):
        offs_o = o + tl.arange(0, BLOCK_O)
        other = tl.load(ck_ptr + r * K1 + offs_o, mask=offs_o < K1, other=-9223372036854775808)
        count += (other[None, :] > key[:, None]).to(tl.int32)
        n_ok += (other != -9223372036854775808).to(tl.int32)
    rank = tl.sum(count, 1)
    n_valid = tl.sum(n_ok, 0)
    pos = 4294967295 - (key & 4294967295)
    tl.store(idx_ptr + r * K + rank, pos, mask=(key != -9223372036854775808) & (rank < K))
    tl.store(idx_ptr + r * K + offs_c, tl.full([BLOCK_C], -1, tl.int64), mask=(offs_c >= n_valid) & (offs_c < K))


@triton.jit
def dsa_rerank_select_kernel(ck_ptr, idx_ptr, K1, K, BLOCK: tl.constexpr):
    """grid (R,): the K largest of row r's keys ck [R, K1] (`dsa_rerank_kernel`; unique, INT64_MIN for none; BLOCK
    >= K1) by a radix select of 8-bit digits from the top, all in registers: each level histograms the digit of
    the keys that share the bits resolved so far, picks the threshold digit d, until the keys in d fit whole; the
    selected positions to idx [R, K] in arrival order, -1 past min(K, valid)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    key = tl.load(ck_ptr + r * K1 + offs, mask=offs < K1, other=-9223372036854775808)
    ok = key != -9223372036854775808
    u = (key ^ -9223372036854775808).to(tl.uint64, bitcast=True)       # unsigned order == signed order of key
    n_ok = tl.sum(ok.to(tl.int32), 0)
    need = tl.minimum(n_ok, K)
    done = need == n_ok                                                 # every valid candidate is taken
    pshift = tl.zeros([], tl.int32) + 64                                # resolved: the bits from pshift up
    prefix = tl.zeros([BLOCK], tl.uint64)                               # ... = prefix (broadcast over lanes)
    bins = tl.arange(0, 256)
    while done == 0:
        ds = pshift - 8
        match = ok & ((pshift >= 64) | ((u >> tl.minimum(pshift, 63).to(tl.uint64)) == prefix))
        digit = ((u >> ds.to(tl.uint64)) & 255).to(tl.int32)
        hist = tl.histogram(tl.where(match, digit, 0), 256)
        hist = tl.where(bins == 0, hist - tl.sum((~match).to(tl.int32), 0), hist)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        d = tl.max(tl.where(suffix >= need, bins, -1), 0)
        a = tl.sum(tl.where(bins > d, hist, 0), 0)
        h_d = tl.sum(tl.where(bins == d, hist, 0), 0)
        prefix = (prefix << 8) | d.to(tl.uint64)
        pshift = ds
        done = h_d == need - a                                          # bin d fits whole (unique keys: by bit 0)
        need = need - a
    sel = ok & ((pshift >= 64) | ((u >> tl.minimum(pshift, 63).to(tl.uint64)) >= prefix))
    sel_i = sel.to(tl.int32)
    n_sel = tl.sum(sel_i, 0)
    pos = 4294967295 - (key & 4294967295)
    tl.store(idx_ptr + r * K + tl.cumsum(sel_i, 0) - 1, pos, mask=sel_i != 0)
    tl.store(idx_ptr + r * K + offs, tl.full([BLOCK], -1, tl.int64), mask=(offs >= n_sel) & (offs < K))


def rerank(q_i, w, k8, k_scale, k_lo, cand, out, T=1, ck=None, ordered=False):
    """The `out.shape[-1]` best of the candidates by exact score (module docstring): q_i [R, J, D] (bf16 / f32),
    w [R, J] (R = B * T rows; row r scores batch r // T's keys), k8 [B, L, D] float8_e4m3fn, k_scale [B, L] f32,
    k_lo [B, L, D / 2] u8, cand [R, K1] int64 (positions, -1 none; K1 >= K), out [R, K] int64 (contiguous): the
    set, -1 past the valid candidates, in the reference's order when `ordered` or R < RANK_SELECT_MIN_ROWS (the
    all-pairs ranking), else in no particular order (the radix select). ck: None, or int64 scratch of R * K1."""
    R, J, D = q_i.shape
    K1, K = cand.shape[-1], out.shape[-1]
    ck = torch.empty((R * K1,), dtype=torch.int64, device=q_i.device) if ck is None else ck
    dsa_rerank_kernel[(triton.cdiv(K1, RERANK_BLOCK), R)](
        q_i, w, k8, k_scale, k_lo, cand, ck, k8.shape[1], K1, T, J=J, D=D,
        BLOCK_J=max(16, triton.next_power_of_2(J)), BLOCK_C=RERANK_BLOCK,
        DOT_PRECISION="ieee" if q_i.dtype == torch.float32 else "tf32", num_warps=RERANK_WARPS)
    if R >= RANK_SELECT_MIN_ROWS and not ordered:
        dsa_rerank_select_kernel[(R,)](ck, out, K1, K, BLOCK=triton.next_power_of_2(K1), num_warps=SELECT_WARPS)
    else:
        dsa_rerank_rank_kernel[(triton.cdiv(K1, RANK_BLOCK), R)](ck, out, K1, K, BLOCK_C=RANK_BLOCK, BLOCK_O=128,
                                                                 num_warps=4)
    return out


# Source order for code generation (helpers first).
KERNELS = (_join_e4m3, dsa_rerank_kernel, dsa_rerank_rank_kernel, dsa_rerank_select_kernel, rerank)
