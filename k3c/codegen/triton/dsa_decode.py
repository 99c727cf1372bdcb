"""DSA decode at long context: indexer scan, radix top-k selection (no sort), sparse latent attention.

Math: K3-SPEC.md "Gated DSA" (DeepSeek-V3.2 eq. 1): for the one new token of each batch row b,
    I[s] = sum_j w[j] * ReLU(q_I[j] . k_I[s])            over the L cached index keys s (all visible at decode)
and the attention reads the top-k keys of I (`mla_attention` with idx, absorbed form, `attention.launch_mla`, which
also runs this selection for decode at long context: `attention.launch_dsa_index_topk`).

Selection is a four-digit radix select on the scores' order-preserving 32-bit keys (u = float bits with the sign
flipped for positives and all bits flipped for negatives; unsigned order = float order), 8-bit digits, with global
histograms (BINS int32 per digit and row):
  dsa_scan_kernel     grid (programs, B): scores of n_blocks x BLOCK_S keys per program -> keys [B, L] (u32 bits
                      in an int32 tensor) and the histogram of digit 1 (bits 31..24), added with masked atomics
  dsa_refine_kernel   LEVEL 2..4: every program derives the digits chosen so far from the histograms (a suffix sum
                      over BINS), re-reads the keys (L2-resident: 4 bytes per key), and histograms the next digit
                      of the keys that match the prefix
  dsa_tie_count_kernel  the threshold key tau (all four digits); per program, the keys equal to tau (nothing to
                      count when all of them are selected: digit 4's histogram holds their number)
  dsa_gather_kernel   keys > tau (and keys == tau when all are selected) take slots from a per-row counter (one
                      atomic per block); else keys == tau fill the remaining slots by position (a prefix over the
                      programs' tie counts), as the reference's stable sort
The output is the reference's top-k SET (positions, int64 [B, 1, topk], -1 past min(L, topk)), in no particular
order (the attention is order-free), or in the reference's order with `ordered=True`.
FP8 index keys (optional): k_I as float8_e4m3fn with one fp32 scale per key (k = scale * k8; `quantize_index_keys`)
halve the bytes of the scan; the score is scale * sum_j w_j ReLU(q_j . k8) (scale > 0). With FP8_QUERY the scan also
quantizes q per head in registers (q_j = sq_j * q8_j, sq_j = max|q_j| / 448, folded into w_j: one fp8 x fp8 product).
E4m3's 3 mantissa bits move 3-6 % of a top-2048 set across the threshold (H200, Gaussian keys: overlap 0.94-0.97),
so with the exact keys at hand (`k_exact`, bf16) the selection re-ranks: the fp8 scan selects topk + RERANK_EXTRA
candidates, then
  dsa_rerank_kernel   grid (candidate blocks, B): exact scores of the candidates from the gathered exact keys, as
                      unique 64-bit keys (order key << 32 | ~position: ties by lowest position)
  dsa_rerank_rank_kernel  grid (candidate blocks of RANK_BLOCK, B): each candidate's rank = the number of larger
                      keys (all pairs, counted in an int32 tile and reduced once); rank < topk is its slot, so the
                      result comes in the reference's order
which equals the exact selection unless a key of the exact top-k ranks below topk + RERANK_EXTRA in fp8 order
(Gaussian keys, L = 1M, CPU simulation: worst rank 2.9K with fp8 q, so 2048 extra; 1 MB of exact keys per row).

Each kernel splits its row's keys evenly over the programs of grid axis 0 (`_row_range`); with device lengths
(`radix_topk(..., lengths=)`, i32 [B]: whole-step decode graphs) row b has lengths[b] + 1 keys, read in the
kernels, and L is only the bound that sizes the grids and scratch.

Public API: `dsa_decode_topk(q_i, w, k_i, topk, k_scale=None, ordered=False, k_exact=None)` -> idx, `radix_topk`
(its launches), `quantize_index_keys(k_i)` -> (k8, scale), and the kernels (`KERNELS`, in source order).
"""

import torch
import triton
import triton.language as tl

from k3c.errors import RuntimeInputError

SCAN_BLOCK = 128       # keys per scan step (one [SCAN_BLOCK, D] x [D, J] tensor-core product)
SCAN_WARPS = 4         # warps per scan program
SELECT_BLOCK = 1024    # keys per step of the refine / tie-count / gather passes
SCAN_PROGRAMS = 1056   # scan / refine programs per launch: about 8 per H200 SM
MAX_PROGRAMS = 2048    # bound of the programs per row of the refine / gather grid (<= SCAN_PROGRAMS + 1)
BITS = 8               # radix digit width: four digits per 32-bit key
BINS = 1 << BITS       # histogram bins per digit (tl.histogram's cost grows with the bin count)
FP8_MAX = 448.0        # largest float8_e4m3fn value
FP8_QUERY = True       # fp8 keys: quantize q per head in the scan too (fp8 x fp8 tensor-core product)
RERANK_EXTRA = 2048    # fp8 keys + exact keys: candidates beyond topk that the exact re-scoring sees
RERANK_BLOCK = 128     # candidates per re-scoring program
RANK_BLOCK = 32        # candidates per ranking program (each compares them with all the row's candidates)


@triton.jit
def _order_key(score):
    """Order-preserving uint32 of fp32 scores (-0.0 folded to +0.0)."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)          # signed int32 order == float order
    return (ordered ^ -2147483648).to(tl.uint32, bitcast=True)    # sign bit flipped: unsigned order


@triton.jit
def _to_e4m3(x):
    """fp32 (|x| <= 448) -> float8_e4m3fn, rounded to nearest even on the fp32 bits first (3 mantissa bits kept), so
    that the conversion itself is exact: the same bits as torch's cast on every backend (Triton's interpreter
    mis-rounds values that round up to the next binade, and subnormals). Below 2^-6 (e4m3 subnormals: multiples
    of 2^-9) the rounding is x * 2^9 to an integer by the 1.5 * 2^23 trick."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.where(tl.abs(x) < 0.015625, sub, normal).to(tl.float8e4nv)


@triton.jit
def _pick_bin(hist_row, k_rem, BINS: tl.constexpr):
    """Largest bin whose suffix count (this bin and above) reaches k_rem, and the count strictly above it.

    Returns (-1, total) when the row holds fewer than k_rem keys.
    """
    bins = tl.arange(0, BINS)
    h = tl.load(hist_row + bins)
    suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    chosen = tl.max(tl.where(suffix >= k_rem, bins, -1), 0)
    above = tl.sum(tl.where(bins > chosen, h, 0), 0)
    return chosen, above


@triton.jit
def _chosen_prefix(hist_row, K, DIGITS: tl.constexpr, BINS: tl.constexpr):
    """The first DIGITS digits of the K-th largest key, from the histograms of digits 1..DIGITS.

    Returns (prefix, keys above the prefix, everything): everything = the row has at most K keys (digit 1 found no
    bin), and then every key is selected.
    """
    prefix = tl.zeros([], tl.int64)
    above = tl.zeros([], tl.int32)
    first = tl.zeros([], tl.int32)
    for level in tl.static_range(DIGITS):
        d, a = _pick_bin(hist_row + level * BINS, K - above, BINS)
        if level == 0:
            first = d
        prefix = prefix * BINS + tl.maximum(d, 0)
        above = above + a
    return prefix, above, first < 0


@triton.jit
def _ties_fit(hist_row, tau, above, K, BINS: tl.constexpr):
    """Whether every key equal to tau is selected: their count (digit 4's histogram at tau's last digit, all 32
    bits equal) is at most the K - above slots left below the keys above tau."""
    n_tau = tl.load(hist_row + 3 * BINS + (tau & (BINS - 1)).to(tl.int32))
    return n_tau <= K - above


@triton.jit
def _row_range(len_ptr, b, L, BLOCK: tl.constexpr, LEN_FROM_PTR: tl.constexpr):
    """(keys of row b, blocks of BLOCK keys per program): L keys, or len_ptr[b] + 1 (i32 [B]: the context before
    the new token) with LEN_FROM_PTR, L then being the bound; the row's blocks split evenly over axis 0's programs."""
    n_valid = L
    if LEN_FROM_PTR:
        n_valid = tl.load(len_ptr + b).to(tl.int32) + 1
    n_prog = tl.num_programs(0)
    return n_valid, ((n_valid + BLOCK - 1) // BLOCK + n_prog - 1) // n_prog


@triton.jit
def dsa_scan_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, keys_ptr, hist_ptr, len_ptr, L,
                    J: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr,
                    FP8: tl.constexpr, QUERY_FP8: tl.constexpr, KEYS_FIRST: tl.constexpr, BINS: tl.constexpr,
                    BITS: tl.constexpr, DOT_PRECISION: tl.constexpr, LEN_FROM_PTR: tl.constexpr):
    """Scores of keys [pid*n_blocks*BLOCK_S, ...) of row b; q [B, J, D], w [B, J], k [B, L, D] (bf16/fp32, or
    fp8 with ks [B, L] fp32 scales; QUERY_FP8: q quantized per head here, its scale folded into w); keys [B, L]
    int32 (u32 bits); hist [B, 4, BINS] int32 (digit 1 added here). KEYS_FIRST: the product as keys x q^T."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_valid, n_blocks = _row_range(len_ptr, b, L, BLOCK_S, LEN_FROM_PTR)
    offs_j = tl.arange(0, BLOCK_J)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * J + offs_j)[:, None] * D + offs_d[None, :], mask=(offs_j < J)[:, None], other=0.0)
    w = tl.load(w_ptr + b * J + offs_j, mask=offs_j < J, other=0.0).to(tl.float32)
    if QUERY_FP8:       # q_j = sq_j * q8_j with sq_j > 0, so w_j ReLU(q_j . k) = (w_j sq_j) ReLU(q8_j . k)
        amax = tl.max(tl.abs(q.to(tl.float32)), 1)
        sq = tl.where(amax > 0, amax / 448.0, 1.0)
        q = _to_e4m3(q.to(tl.float32) / sq[:, None])
        w = w * sq
    hist = tl.zeros([BINS], tl.int32)
    n_pad = 0
    for i in range(n_blocks):
        offs_s = (pid * n_blocks + i) * BLOCK_S + tl.arange(0, BLOCK_S)
        ok = offs_s < n_valid
        k = tl.load(k_ptr + (b * L + offs_s)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        if KEYS_FIRST:  # keys x q^T [BLOCK_S, BLOCK_J]: keys as the MMA's M side, 3-10 % faster on the H200
            dots = tl.dot(k.to(q.dtype), tl.trans(q), input_precision=DOT_PRECISION)
            score = tl.sum(w[None, :] * tl.maximum(dots, 0.0), 1)
        else:           # q x keys^T [BLOCK_J, BLOCK_S]
            dots = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
            score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), 0)
        if FP8:
            score = score * tl.load(ks_ptr + b * L + offs_s, mask=ok, other=0.0)
        u = _order_key(score)
        tl.store(keys_ptr + b * L + offs_s, u.to(tl.int32, bitcast=True), mask=ok)
        hist += tl.histogram(tl.where(ok, u >> (32 - BITS), 0).to(tl.int32), BINS)
        n_pad += tl.sum((~ok).to(tl.int32), 0)
    bins = tl.arange(0, BINS)
    hist = tl.where(bins == 0, hist - n_pad, hist)                # padding lanes were counted in bin 0
    tl.atomic_add(hist_ptr + b * 4 * BINS + bins, hist, mask=hist > 0)


@triton.jit
def dsa_refine_kernel(keys_ptr, hist_ptr, len_ptr, L, K, LEVEL: tl.constexpr, BLOCK_R: tl.constexpr,
                      BINS: tl.constexpr, BITS: tl.constexpr, LEN_FROM_PTR: tl.constexpr):
    """Histogram of digit LEVEL (2..4) over the keys matching the LEVEL-1 digits chosen so far."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_valid, n_blocks = _row_range(len_ptr, b, L, BLOCK_R, LEN_FROM_PTR)
    row = hist_ptr + b * 4 * BINS
    prefix, above, everything = _chosen_prefix(row, K, LEVEL - 1, BINS)
    hist = tl.zeros([BINS], tl.int32)
    n_other = 0
    for i in range(n_blocks):
        offs = (pid * n_blocks + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = offs < n_valid
        u = tl.load(keys_ptr + b * L + offs, mask=ok, other=0).to(tl.uint32, bitcast=True)
        match = ok & ((u >> (32 - BITS * (LEVEL - 1))).to(tl.int64) == prefix)
        match = match & ((everything.to(tl.int32) + 0 * offs) == 0)
        digit = ((u >> (32 - BITS * LEVEL)) & (BINS - 1)).to(tl.int32)
        hist += tl.histogram(tl.where(match, digit, 0), BINS)
        n_other += tl.sum((~match).to(tl.int32), 0)
    bins = tl.arange(0, BINS)
    hist = tl.where(bins == 0, hist - n_other, hist)
    tl.atomic_add(row + (LEVEL - 1) * BINS + bins, hist, mask=hist > 0)


@triton.jit
def dsa_tie_count_kernel(keys_ptr, hist_ptr, ties_ptr, len_ptr, L, K, BLOCK_R: tl.constexpr, BINS: tl.constexpr,
                         MAX_P: tl.constexpr, LEN_FROM_PTR: tl.constexpr):
    """ties [B, MAX_P] int32: how many keys of program pid's range equal tau (0 when every key is taken). Nothing is
    counted (the counts stay 0) when all the row's ties fit (`_ties_fit`)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_valid, n_blocks = _row_range(len_ptr, b, L, BLOCK_R, LEN_FROM_PTR)
    tau, above, everything = _chosen_prefix(hist_ptr + b * 4 * BINS, K, 4, BINS)
    n_blocks = tl.where(_ties_fit(hist_ptr + b * 4 * BINS, tau, above, K, BINS) | everything, 0, n_blocks)
    n = 0
    for i in range(n_blocks):
        offs = (pid * n_blocks + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        u = tl.load(keys_ptr + b * L + offs, mask=offs < n_valid, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
        n += tl.sum(((offs < n_valid) & (u == tau)).to(tl.int32), 0)
    tl.store(ties_ptr + b * MAX_P + pid, tl.where(everything, 0, n))


@triton.jit
def dsa_gather_kernel(keys_ptr, hist_ptr, ties_ptr, count_ptr, idx_ptr, len_ptr, L, K, BLOCK_R: tl.constexpr,
                      BINS: tl.constexpr, MAX_P: tl.constexpr, LEN_FROM_PTR: tl.constexpr):
    """Positions of the top-K keys of row b into idx [B, K] int64 (pre-filled with -1).

    Keys above tau (and the keys equal to tau when they all fit, `_ties_fit`) take slots from the row's counter
    (count [B] int32, zeroed; one atomic per block of BLOCK_R keys, arrival order); otherwise keys equal to tau take
    slots above + rank, rank = their order by position among the row's ties (ties of the programs before pid, from
    `dsa_tie_count_kernel`, then in-block order), while rank < K - above: the lowest positions, as the reference's
    stable sort."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_valid, n_blocks = _row_range(len_ptr, b, L, BLOCK_R, LEN_FROM_PTR)
    tau, above, everything = _chosen_prefix(hist_ptr + b * 4 * BINS, K, 4, BINS)
    take_all = everything.to(tl.int32)
    fit = _ties_fit(hist_ptr + b * 4 * BINS, tau, above, K, BINS).to(tl.int32)
    p = tl.arange(0, MAX_P)
    rank0 = tl.sum(tl.load(ties_ptr + b * MAX_P + p, mask=p < pid, other=0), 0)     # 0s when the ties fit
    for i in range(n_blocks):
        offs = (pid * n_blocks + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = offs < n_valid
        u = tl.load(keys_ptr + b * L + offs, mask=ok, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
        eq = (u == tau).to(tl.int32)
        gt = (ok & (((u > tau).to(tl.int32) | take_all | (eq & fit)) != 0)).to(tl.int32)
        tie = (ok & ((eq & (1 - take_all) & (1 - fit)) != 0)).to(tl.int32)
        n_gt = tl.sum(gt, 0)
        base = tl.atomic_add(count_ptr + b, n_gt, mask=n_gt > 0, sem="relaxed")
        slot = base + tl.cumsum(gt, 0) - 1
        tl.store(idx_ptr + b * K + slot, offs.to(tl.int64), mask=gt != 0)
        rank = rank0 + tl.cumsum(tie, 0) - 1
        tl.store(idx_ptr + b * K + above + rank, offs.to(tl.int64), mask=(tie != 0) & (rank < K - above))
        rank0 += tl.sum(tie, 0)


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


def quantize_index_keys(k_i):
    """FP8 index keys: k_i [B, L, D] -> (k8 float8_e4m3fn [B, L, D], scale fp32 [B, L]), k ~= scale * k8.

    scale = max|k| / 448 per key (1 for an all-zero key), so every key uses the e4m3 range fully.
    """
    amax = k_i.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (k_i.float() / scale[..., None]).to(torch.float8_e4m3fn), scale.contiguous()


def dsa_decode_topk(q_i, w, k_i, topk, k_scale=None, ordered=False, k_exact=None, rerank_extra=RERANK_EXTRA):
    """Top-`topk` index positions for one new token per row: q_i [B, J, D] (or [B, 1, J, D]), w [B, J],
    k_i [B, L, D] (bf16/fp16/fp32, or float8_e4m3fn with k_scale [B, L] fp32, optionally with the exact keys
    k_exact [B, L, D] in q_i's dtype: then topk + rerank_extra fp8 candidates are re-ranked by their exact scores).

    Returns int64 [B, 1, topk]: the positions of the topk largest I[s], ties by lowest position, -1 past
    min(L, topk); in no particular order unless `ordered` (then as `dsa_index_topk_ref`: score descending, ties by
    position). Raises RuntimeInputError on mismatched shapes, a missing / unexpected k_scale, or k_exact without
    fp8 keys.
    """
    q_i = q_i.reshape(q_i.shape[0], q_i.shape[-2], q_i.shape[-1])
    B, J, D = q_i.shape
    L = k_i.shape[1]
    fp8 = k_i.dtype == torch.float8_e4m3fn
    if tuple(w.reshape(B, -1).shape) != (B, J) or k_i.shape[0] != B or k_i.shape[2] != D or L < 1:
        raise RuntimeInputError(f"dsa_decode_topk: q_i {tuple(q_i.shape)}, w {tuple(w.shape)}, "
                                f"k_i {tuple(k_i.shape)} mismatch")
    if fp8 != (k_scale is not None) or (fp8 and tuple(k_scale.shape) != (B, L)):
        raise RuntimeInputError("dsa_decode_topk: k_scale [B, L] fp32 goes with float8_e4m3fn keys, and only then")
    if k_exact is not None and (not fp8 or tuple(k_exact.shape) != (B, L, D) or k_exact.dtype != q_i.dtype):
        raise RuntimeInputError(f"dsa_decode_topk: k_exact must be [B, L, D] = {(B, L, D)} in q_i's dtype "
                                f"{q_i.dtype} with float8_e4m3fn k_i, got {tuple(k_exact.shape)} {k_exact.dtype}")
    return radix_topk(q_i, w.reshape(B, J), k_i, topk, k_scale, ordered, k_exact, rerank_extra)


def radix_topk(q_i, w, k_i, topk, k_scale, ordered, k_exact=None, rerank_extra=RERANK_EXTRA, lengths=None):
    """The launches of `dsa_decode_topk` (q_i [B, J, D], w [B, J]; shapes already checked; copied into generated
    `dsa_index_topk` modules). lengths: None, or i32 [B] on the device: row b then holds lengths[b] + 1 keys of k_i
    (the context before the new token, plus it) and L = k_i.shape[1] is only the bound (the launches do not depend
    on the lengths: a CUDA graph replays them at any context). Scratch: keys [B, L] int32, histograms [B, 4, BINS] and tie counts
    [B, MAX_PROGRAMS] int32, allocated here (re-ranking: candidate keys [B, topk + rerank_extra] int64)."""
    B, J, D = q_i.shape
    L = k_i.shape[1]
    fp8 = k_scale is not None
    from_ptr = lengths is not None
    n_sel = topk if k_exact is None else topk + rerank_extra
    dev = q_i.device
    keys = torch.empty((B, L), dtype=torch.int32, device=dev)
    hist = torch.zeros((B, 4, BINS), dtype=torch.int32, device=dev)
    count = torch.zeros((B,), dtype=torch.int32, device=dev)
    ties = torch.empty((B, MAX_PROGRAMS), dtype=torch.int32, device=dev)
    idx = torch.full((B, 1, n_sel), -1, dtype=torch.int64, device=dev)
    q = q_i.contiguous() if not fp8 else q_i.to(torch.bfloat16).contiguous()
    n_len = lengths if from_ptr else keys
    n_scan = triton.cdiv(L, SCAN_BLOCK)
    per_scan = max(1, triton.cdiv(n_scan * B, SCAN_PROGRAMS))
    n_ref = triton.cdiv(L, SELECT_BLOCK)
    per_ref = max(1, triton.cdiv(n_ref * B, SCAN_PROGRAMS))
    precision = "ieee" if q_i.dtype == torch.float32 else "tf32"
    scan_fp32 = q.dtype == torch.float32
    block_j = max(16, triton.next_power_of_2(J))
    dsa_scan_kernel[(triton.cdiv(n_scan, per_scan), B)](
        q, w.contiguous(), k_i.contiguous(), k_scale if fp8 else q, keys, hist, n_len, L, J=J, D=D,
        BLOCK_J=block_j, BLOCK_S=SCAN_BLOCK, FP8=fp8, QUERY_FP8=fp8 and FP8_QUERY,
        KEYS_FIRST=not scan_fp32,       # tensor-core products; fp32 (IEEE) keeps q x k^T
        BINS=BINS, BITS=BITS, DOT_PRECISION="ieee" if scan_fp32 else "tf32", LEN_FROM_PTR=from_ptr, num_warps=SCAN_WARPS)
    grid = (triton.cdiv(n_ref, per_ref), B)
    for level in (2, 3, 4):
        dsa_refine_kernel[grid](keys, hist, n_len, L, n_sel, LEVEL=level, BLOCK_R=SELECT_BLOCK, BINS=BINS,
                                BITS=BITS, LEN_FROM_PTR=from_ptr, num_warps=4)
    dsa_tie_count_kernel[grid](keys, hist, ties, n_len, L, n_sel, BLOCK_R=SELECT_BLOCK, BINS=BINS,
                               MAX_P=MAX_PROGRAMS, LEN_FROM_PTR=from_ptr, num_warps=4)
    dsa_gather_kernel[grid](keys, hist, ties, count, idx, n_len, L, n_sel, BLOCK_R=SELECT_BLOCK, BINS=BINS,
                            MAX_P=MAX_PROGRAMS, LEN_FROM_PTR=from_ptr, num_warps=4)
    if k_exact is not None:         # exact scores of the candidates: unique u64 keys, larger = better
        ck = torch.empty((B, n_sel), dtype=torch.int64, device=dev)
        dsa_rerank_kernel[(triton.cdiv(n_sel, RERANK_BLOCK), B)](
            q_i.contiguous(), w.contiguous(), k_exact.contiguous(), idx, ck, L, n_sel, J=J, D=D, BLOCK_J=block_j,
            BLOCK_C=RERANK_BLOCK, DOT_PRECISION=precision, num_warps=4)
        idx = torch.full((B, 1, topk), -1, dtype=torch.int64, device=dev)
        dsa_rerank_rank_kernel[(triton.cdiv(n_sel, RANK_BLOCK), B)](ck, idx, n_sel, topk, BLOCK_C=RANK_BLOCK,
                                                                   BLOCK_O=128, num_warps=4)
        return idx                  # in the reference's order already
    if ordered:     # the reference's order: score descending, ties by lowest position
        pos = idx[:, 0]
        u = torch.gather(keys, 1, pos.clamp(min=0)).to(torch.int64) & 0xFFFFFFFF
        rank = ((u - 2 ** 31) << 32) + (2 ** 32 - 1 - pos)
        rank = torch.where(pos >= 0, rank, torch.full_like(rank, -2 ** 63))
        idx = torch.gather(pos, 1, torch.sort(rank, dim=1, descending=True).indices)[:, None]
    return idx


# Source order for code generation (helpers first).
KERNELS = (_order_key, _to_e4m3, _pick_bin, _chosen_prefix, _ties_fit, _row_range, dsa_scan_kernel, dsa_refine_kernel,
           dsa_tie_count_kernel, dsa_gather_kernel, dsa_rerank_kernel, dsa_rerank_rank_kernel)
