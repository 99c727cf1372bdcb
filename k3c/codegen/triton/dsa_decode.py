"""DSA decode at long context: indexer scan, radix top-k selection (no sort), sparse latent attention.

Math: K3-SPEC.md "Gated DSA" (DeepSeek-V3.2 eq. 1): for the one new token of each batch row b,
    I[s] = sum_j w[j] * ReLU(q_I[j] . k_I[s])            over the L cached index keys s (all visible at decode)
and the attention reads the top-k keys of I (`mla_attention` with idx, absorbed form, `attention.launch_mla`, which
also runs this selection for decode at long context: `dsa_index.launch_dsa_index_topk`).

Selection is a radix select on the scores' order-preserving 32-bit keys (u = float bits with the sign flipped for
positives and all bits flipped for negatives; unsigned order = float order) in five launches, with no torch op and
no scratch that must arrive zeroed:
  dsa_init_kernel     grid (B,): zeroes the row's digit histograms and its counters
  dsa_scan_kernel     grid (programs, B): scores -> keys [B, L] (u32 bits in int32) and the histogram of the first
                      digit, the top 11 bits u >> 21 (a bin spans a factor 2^(1/4) of positive scores) in a window
                      of BINS values (`_first_digit`; the rest clamp into the edge bins)
  dsa_collect_kernel  the threshold bin t: keys above it to the output, keys in it to a candidate list, their u
                      range and (COLLECT_NEXT) the histogram of their next 8 bits
  dsa_refine_kernel   (REFINE, with COLLECT_NEXT) that histogram's threshold digit d: the candidates above it to the
                      output, those in it (24 of the 6.4K per row at 1M, 4-17 at 128K in the H200 bench) to a short
                      list, over many programs
  dsa_finish_kernel   grid (B,): the remaining K - above among the candidates (1.0K-6.4K per row in the H200 bench
                      at L = 128K-1M, or the refine pass's short list) by a radix select of 8-bit digits on unique
                      64-bit keys (u << 32 | 2^32 - 1 - position: ties by lowest position, as the reference's stable
                      sort); heavy ties by a walk in position order. Exact for any input: clamped or tied bins only
                      cost more passes.
The last two are in `dsa_select`.
The output is the reference's top-k SET (positions, int64 [B, 1, topk], -1 past min(L, topk)) in no particular
order (the op's contract; the attention is order-free), or in the reference's order with `ordered=True` (a torch
sort: tests and the fp8 logits script).
FP8 index keys (optional, the compile option `--dsa-index-keys fp8`; k = scale * k8, float8_e4m3fn with one fp32
scale per key, `quantize_index_keys`) halve the scan's bytes; the score is scale * sum_j w_j ReLU(q_j . k8) with
FP8_QUERY: q quantized per head in registers, q_j = sq_j * q8_j with sq_j = max|q_j| / 448 folded into w_j (one
fp8 x fp8 product; both divisions correctly rounded, `tl.math.div_rn`, as the reference's). With the keys' 4-bit
residuals (`k_lo`, `--dsa-index-keys fp8-rerank`) the selection's topk + E candidates are re-ranked exactly
(`dsa_rerank`, which builds on this module).

The scan and collect kernels split a row's keys evenly over the programs of grid axis 0 (`_row_range`); with device
lengths (`radix_topk(..., lengths=)`, i32 [B]: whole-step decode graphs) row b has lengths[b] + 1 keys, read in the
kernels, and L is only the bound that sizes the grids and scratch.

Public API: `dsa_decode_topk(q_i, w, k_i, topk, k_scale=None, ordered=False, k_lo=None)` -> idx (with k_lo:
`dsa_rerank.rerank`), `radix_topk`
(its launches, into a given `out` and planned scratch), `radix_scratch_words`, `quantize_index_keys(k_i, dtype)` ->
(k8, scale), and the kernels (`KERNELS`, in source order, `dsa_select`'s included).
"""

import torch
import triton
import triton.language as tl

from k3c.codegen.triton import dsa_select
from k3c.codegen.triton.dsa_select import dsa_finish_kernel, dsa_refine_kernel
from k3c.errors import RuntimeInputError

SCAN_BLOCK = 128       # keys per scan step (one [SCAN_BLOCK, D] x [D, J] tensor-core product)
SCAN_WARPS = 4         # warps per scan program
SCAN_STAGES = 3        # its software-pipeline depth (Triton's default; 4 was 3-19 us slower on the H200)
SELECT_BLOCK = 1024    # keys per step of the collect pass
SCAN_PROGRAMS = 528    # scan / collect programs per launch: about 4 per H200 SM (vs 1056: top-k set 3.2-4.3 us
                       # faster at B = 16 / 128K and B = 1 / 128K-1M, bf16 and fp8 keys; BENCHMARKS.md DSA round 6)
SHIFT = 21             # first digit: the top 11 bits of the order key (u >> 21: sign, exponent, 2 mantissa bits)
BINS = 256             # its histogram: a window of 256 of the 2048 values (tl.histogram's cost grows with the
                       # bins: all 2048 made the top-k 2.4-4.4x slower on the H200, BENCHMARKS.md)
BASE = 1404            # the window's first value: positive scores in [2^-32, 2^32) (1024 + 4 x (127 - 32)); below
                       # it bin 0, above it bin 255 (u >> 21 of a positive float = 1024 + 4 x exponent + 2 bits)
HIST_STRIDE = 2052     # int32 words per row: histogram (2048 bins at most; with COLLECT_NEXT the first digit's
                       # BINS, the next digit's 256, the refine pass's two counters and its list of the threshold
                       # sub-bin's positions), the candidates' signed order-key min and max, the two counters
REFINE = True          # with COLLECT_NEXT: the refine pass splits the candidates by the next digit over many
                       # programs, so the finish resolves only the threshold digit's few (dsa_refine_kernel; fp8
                       # top-k set 64.0 vs 77.5 us at B = 1 / 1M, 112.7 vs 126.5 at B = 16 / 128K: DSA round 8)
REFINE_BLOCK = 256     # candidates per step of a refine program
REFINE_PROGRAMS = 264  # refine programs per launch (split over the rows; about 2 per H200 SM)
FINISH_CHUNK_REFINED = 512   # the finish's candidates per step with REFINE (the digit's: 4-24 in the bench)
FINISH_WARPS_REFINED = 4     # ... and warps (2048 x 8 warps: 1.3-2.5 us slower)
FINISH_CHUNK = 4096    # candidates per step of the finishing select without REFINE (one program per row)
FINISH_WARPS = 8       # its warps
FINISH_LONG_KEYS = 1 << 20   # rows (the bound L) of at least this many keys, whose threshold bins hold more candidates
FINISH_CHUNK_LONG = 8192     # (6.4K at 1M in the H200 bench), instead: all of them in registers, by 16 warps
FINISH_WARPS_LONG = 16       # (top-k set 111.4 vs 118.2 us; at 128K 1.0-4.4K candidates, where it loses 7 us at B = 1)
TIE_BLOCK = 8192       # keys per step of its walk over tied keys in position order (more than a chunk tied)
COLLECT_NEXT = True    # the collect pass also counts the candidates' next 8 bits (u >> (SHIFT - 8) & 255, words
                       # [BINS, BINS + 256) of the row): the finishing select's first level, read instead of computed
NEXT_DENSE = 64        # ... by one masked atomic per candidate, or, in a block of more candidates (ties, a dense
                       # bin: no thousands of atomics on one word), a local histogram and one atomic per bin
FP8_MAX = 448.0        # largest float8_e4m3fn value
FP8_QUERY = True       # fp8 keys: quantize q per head in the scan too (fp8 x fp8 tensor-core product)


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
def _first_digit(u, SHIFT: tl.constexpr, BASE: tl.constexpr, BINS: tl.constexpr):
    """The first-digit bin of order keys u (uint32): (u >> SHIFT) - BASE clamped to [0, BINS) (non-decreasing in u)."""
    return tl.minimum(tl.maximum((u >> SHIFT).to(tl.int32) - BASE, 0), BINS - 1)


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
def dsa_init_kernel(hist_ptr, HIST_STRIDE: tl.constexpr, ZERO: tl.constexpr):
    """grid (B,): clears row b's accumulators, the only scratch the later kernels accumulate into (hist
    [B, HIST_STRIDE] int32): the first ZERO words to 0 (the first-digit bins, and with COLLECT_NEXT the next digit's
    256 after them), the candidates' signed order-key min and max (words HIST_STRIDE - 4, - 3) to INT32_MAX and
    INT32_MIN, the two counters (- 2, - 1) to 0."""
    b = tl.program_id(0).to(tl.int64)
    tl.store(hist_ptr + b * HIST_STRIDE + tl.arange(0, ZERO), tl.zeros([ZERO], tl.int32))
    tail = tl.arange(0, 4)
    tl.store(hist_ptr + b * HIST_STRIDE + HIST_STRIDE - 4 + tail,
             tl.where(tail == 0, 2147483647, tl.where(tail == 1, -2147483648, 0)))


@triton.jit
def dsa_scan_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, keys_ptr, hist_ptr, len_ptr, L,
                    J: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr,
                    SCALED: tl.constexpr, QUERY_FP8: tl.constexpr,
                    KEYS_FIRST: tl.constexpr, BINS: tl.constexpr,
                    SHIFT: tl.constexpr, BASE: tl.constexpr, HIST_STRIDE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, LEN_FROM_PTR: tl.constexpr):
    """Scores of keys [pid*n_blocks*BLOCK_S, ...) of row b; q [B, J, D], w [B, J], k [B, L, D] (bf16/fp32, or
    SCALED: e4m3 with ks [B, L] fp32 scales; QUERY_FP8: q quantized per head here to e4m3 as `fp8_quantize_ref`
    does, with correctly rounded divisions (Triton's `/` is approximate on the GPU: an ulp off moves q / sq across
    e4m3 rounding midpoints), its scale folded into w); keys [B, L] int32 (u32 bits); hist [B, HIST_STRIDE] int32:
    the first digit's histogram (`_first_digit`), added once per program. KEYS_FIRST: the product as keys x q^T."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_valid, n_blocks = _row_range(len_ptr, b, L, BLOCK_S, LEN_FROM_PTR)
    offs_j = tl.arange(0, BLOCK_J)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * J + offs_j)[:, None] * D + offs_d[None, :], mask=(offs_j < J)[:, None], other=0.0)
    w = tl.load(w_ptr + b * J + offs_j, mask=offs_j < J, other=0.0).to(tl.float32)
    if QUERY_FP8:       # q_j = sq_j * q8_j with sq_j > 0, so w_j ReLU(q_j . k) = (w_j sq_j) ReLU(q8_j . k)
        amax = tl.max(tl.abs(q.to(tl.float32)), 1)
        sq = tl.where(amax > 0, tl.math.div_rn(amax, tl.full([BLOCK_J], 448.0, tl.float32)), 1.0)
        q = _to_e4m3(tl.math.div_rn(q.to(tl.float32), tl.broadcast_to(sq[:, None], (BLOCK_J, D))))
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
        if SCALED:
            score = score * tl.load(ks_ptr + b * L + offs_s, mask=ok, other=0.0)
        u = _order_key(score)
        tl.store(keys_ptr + b * L + offs_s, u.to(tl.int32, bitcast=True), mask=ok)
        hist += tl.histogram(tl.where(ok, _first_digit(u, SHIFT, BASE, BINS), 0), BINS)
        n_pad += tl.sum((~ok).to(tl.int32), 0)
    bins = tl.arange(0, BINS)
    hist = tl.where(bins == 0, hist - n_pad, hist)                # padding lanes were counted in bin 0
    tl.atomic_add(hist_ptr + b * HIST_STRIDE + bins, hist, mask=hist > 0)


@triton.jit
def dsa_collect_kernel(keys_ptr, hist_ptr, cand_ptr, idx_ptr, len_ptr, L, K, BLOCK_R: tl.constexpr,
                       BINS: tl.constexpr, SHIFT: tl.constexpr, BASE: tl.constexpr, HIST_STRIDE: tl.constexpr,
                       LEN_FROM_PTR: tl.constexpr, NEXT: tl.constexpr, NEXT_DENSE: tl.constexpr):
    """The threshold bin t of the first digit (the K-th largest key's, from the scan's histogram): keys above it are
    selected (their positions to idx [B, K] int64, slots from the row's counter hist[b, HIST_STRIDE - 2]), keys in
    it are candidates (positions to cand [B, L] int32, slots from hist[b, HIST_STRIDE - 1]); one atomic per block of
    BLOCK_R keys and kind, arrival order; the candidates' smallest and largest signed order key (u ^ 2^31) to
    hist[b, HIST_STRIDE - 4] and [- 3], one atomic each per program. NEXT, t not an edge bin: the candidates' next
    8 bits (u >> (SHIFT - 8)) & 255 counted in hist[b, BINS:BINS + 256] (one masked atomic per candidate; a block of
    more than NEXT_DENSE candidates adds a local histogram instead). A row of at most K keys (no bin reaches K) is
    selected whole."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_valid, n_blocks = _row_range(len_ptr, b, L, BLOCK_R, LEN_FROM_PTR)
    row = hist_ptr + b * HIST_STRIDE
    t, _ = _pick_bin(row, K, BINS)
    lo = tl.full([BLOCK_R], 2147483647, tl.int32)
    hi = tl.full([BLOCK_R], -2147483648, tl.int32)
    for i in range(n_blocks):
        offs = (pid * n_blocks + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = offs < n_valid
        u = tl.load(keys_ptr + b * L + offs, mask=ok, other=0).to(tl.uint32, bitcast=True)
        digit = _first_digit(u, SHIFT, BASE, BINS)
        gt = (ok & (digit > t)).to(tl.int32)
        eq = (ok & (digit == t)).to(tl.int32)
        n_gt = tl.sum(gt, 0)
        base = tl.atomic_add(row + HIST_STRIDE - 2, n_gt, mask=n_gt > 0, sem="relaxed")
        tl.store(idx_ptr + b * K + base + tl.cumsum(gt, 0) - 1, offs.to(tl.int64), mask=gt != 0)
        n_eq = tl.sum(eq, 0)
        base = tl.atomic_add(row + HIST_STRIDE - 1, n_eq, mask=n_eq > 0, sem="relaxed")
        tl.store(cand_ptr + b * L + base + tl.cumsum(eq, 0) - 1, offs, mask=eq != 0)
        if NEXT:
            if (t > 0) & (t < BINS - 1):        # not the clamped edge bins (e.g. a zeroed cache's tied scores)
                nd = ((u >> (SHIFT - 8)) & 255).to(tl.int32)
                if n_eq > NEXT_DENSE:
                    h = tl.histogram(tl.where(eq != 0, nd, 0), 256)
                    h = tl.where(tl.arange(0, 256) == 0, h - (BLOCK_R - n_eq), h)
                    tl.atomic_add(row + BINS + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")
                else:
                    tl.atomic_add(row + BINS + nd, tl.full([BLOCK_R], 1, tl.int32), mask=eq != 0, sem="relaxed")
        signed = u.to(tl.int32, bitcast=True) ^ -2147483648          # signed order == u's unsigned order
        lo = tl.where(eq != 0, tl.minimum(lo, signed), lo)
        hi = tl.where(eq != 0, tl.maximum(hi, signed), hi)
    lo_min = tl.min(lo, 0)
    hi_max = tl.max(hi, 0)
    tl.atomic_min(row + HIST_STRIDE - 4, lo_min, mask=lo_min < 2147483647, sem="relaxed")
    tl.atomic_max(row + HIST_STRIDE - 3, hi_max, mask=hi_max > -2147483648, sem="relaxed")


def quantize_index_keys(k_i):
    """FP8 index keys: k_i [B, L, D] -> (k8 float8_e4m3fn [B, L, D], scale fp32 [B, L]), k ~= scale * k8, as
    `fp8_quantize_ref`: scale = max|k| / 448 per key (1 for an all-zero key), so every key uses the range fully;
    tensor divisors, correctly rounded on every device."""
    amax = k_i.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    return (k_i.float() / scale[..., None]).to(torch.float8_e4m3fn), scale.contiguous()


def dsa_decode_topk(q_i, w, k_i, topk, k_scale=None, ordered=False, k_lo=None, rerank_extra=None):
    """Top-`topk` index positions for one new token per row: q_i [B, J, D] (or [B, 1, J, D]), w [B, J],
    k_i [B, L, D] (bf16/fp16/fp32, or float8_e4m3fn with k_scale [B, L] fp32), optionally with the keys' 4-bit
    residuals k_lo [B, L, D / 2] uint8 (`fp8_split_ref`): then topk + rerank_extra (default
    `dsa_rerank.RERANK_EXTRA`) fp8 candidates are re-ranked by the exact scores of their joined keys
    (`dsa_rerank.rerank`).

    Returns int64 [B, 1, topk]: the positions of the topk largest I[s], ties by lowest position, -1 past
    min(L, topk); in no particular order unless `ordered` (then as `dsa_index_topk_ref`: score descending, ties by
    position). Raises RuntimeInputError on mismatched shapes, a missing / unexpected k_scale, or k_lo without
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
        raise RuntimeInputError("dsa_decode_topk: k_scale [B, L] fp32 goes with float8_e4m3fn keys, and only "
                                "then")
    if k_lo is not None and (not fp8 or tuple(k_lo.shape) != (B, L, D // 2) or k_lo.dtype != torch.uint8):
        raise RuntimeInputError(f"dsa_decode_topk: k_lo must be uint8 [B, L, D / 2] = {(B, L, D // 2)} with "
                                f"float8_e4m3fn k_i, got {tuple(k_lo.shape)} {k_lo.dtype}")
    if k_lo is None:
        return radix_topk(q_i, w.reshape(B, J), k_i, topk, k_scale, ordered)
    from k3c.codegen.triton import dsa_rerank  # it builds on this module: imported here, not above
    n_sel = topk + (dsa_rerank.RERANK_EXTRA if rerank_extra is None else rerank_extra)
    cand = radix_topk(q_i, w.reshape(B, J), k_i, n_sel, k_scale, False)[:, 0]
    out = torch.empty((B, 1, topk), dtype=torch.int64, device=q_i.device)
    dsa_rerank.rerank(q_i.contiguous(), w.reshape(B, J).contiguous(), k_i.contiguous(), k_scale.contiguous(),
                      k_lo.contiguous(), cand, out.view(B, topk), ordered=ordered)
    return out


def radix_scratch_words(B, L):
    """int32 words of `radix_topk`'s scratch for B rows of L keys: keys and candidates [B, L] each, then
    [B, HIST_STRIDE] histogram + counters."""
    return B * (2 * L + HIST_STRIDE)


def radix_topk(q_i, w, k_i, topk, k_scale, ordered, lengths=None, out=None, scratch=None):
    """The launches of `dsa_decode_topk` (q_i [B, J, D], w [B, J]; shapes already checked; copied into generated
    `dsa_index_topk` modules): dsa_init_kernel, dsa_scan_kernel, dsa_collect_kernel, dsa_finish_kernel. Result:
    int64 [B, 1, topk] (`out`, contiguous, written in place, or new), the selected positions first in no particular
    order, then -1 (see `dsa_decode_topk`); `ordered` sorts it (torch).
    lengths: None, or i32 [B] on the device: row b then holds lengths[b] + 1 keys of k_i (the context before the new
    token, plus it) and L = k_i.shape[1] is only the bound (the launches do not depend on the lengths: a CUDA graph
    replays them at any context). scratch: None (allocated here) or a contiguous int32 tensor of at least
    `radix_scratch_words(B, L)` words (the planned buffer); nothing in it needs to be zero."""
    B, J, D = q_i.shape
    L = k_i.shape[1]
    fp8 = k_scale is not None
    from_ptr = lengths is not None
    dev = q_i.device
    words = radix_scratch_words(B, L)
    buf = torch.empty((words,), dtype=torch.int32, device=dev) if scratch is None else scratch[:words]
    keys, cand, hist = buf[:B * L], buf[B * L:2 * B * L], buf[2 * B * L:]
    if out is None:
        out = torch.empty((B, 1, topk), dtype=torch.int64, device=dev)
    q = q_i.contiguous() if not fp8 else q_i.to(torch.bfloat16).contiguous()
    n_len = lengths if from_ptr else keys
    n_scan = triton.cdiv(L, SCAN_BLOCK)
    per_scan = max(1, triton.cdiv(n_scan * B, SCAN_PROGRAMS))
    n_ref = triton.cdiv(L, SELECT_BLOCK)
    per_ref = max(1, triton.cdiv(n_ref * B, SCAN_PROGRAMS))
    scan_fp32 = q.dtype == torch.float32
    block_j = max(16, triton.next_power_of_2(J))
    digit = dict(BINS=BINS, SHIFT=SHIFT, BASE=BASE, HIST_STRIDE=HIST_STRIDE)
    list0 = BINS + 258                  # the first digit's bins, the next digit's, the refine pass's counters
    zero = triton.next_power_of_2(list0)
    nxt = COLLECT_NEXT and zero <= HIST_STRIDE - 4
    refine = nxt and REFINE
    dsa_init_kernel[(B,)](hist, HIST_STRIDE=HIST_STRIDE, ZERO=zero if nxt else BINS, num_warps=1)
    dsa_scan_kernel[(triton.cdiv(n_scan, per_scan), B)](
        q, w.contiguous(), k_i.contiguous(), k_scale if fp8 else q, keys, hist, n_len, L, J=J, D=D,
        BLOCK_J=block_j, BLOCK_S=SCAN_BLOCK, SCALED=fp8, QUERY_FP8=fp8 and FP8_QUERY,
        KEYS_FIRST=not scan_fp32,       # tensor-core products; fp32 (IEEE) keeps q x k^T
        DOT_PRECISION="ieee" if scan_fp32 else "tf32", LEN_FROM_PTR=from_ptr, num_warps=SCAN_WARPS,
        num_stages=SCAN_STAGES,
        **digit)
    dsa_collect_kernel[(triton.cdiv(n_ref, per_ref), B)](keys, hist, cand, out, n_len, L, topk,
                                                         BLOCK_R=SELECT_BLOCK, LEN_FROM_PTR=from_ptr, NEXT=nxt,
                                                         NEXT_DENSE=NEXT_DENSE, num_warps=4, **digit)
    cap = HIST_STRIDE - 4 - list0                               # the refine pass's list: the rest of the bins
    if refine:
        n_fine = max(1, min(REFINE_PROGRAMS // B, triton.cdiv(L, REFINE_BLOCK)))
        dsa_refine_kernel[(n_fine, B)](keys, hist, cand, out, L, topk, BLOCK=REFINE_BLOCK, LIST0=list0, CAP=cap,
                                       num_warps=4, **digit)
        chunk, warps = FINISH_CHUNK_REFINED, FINISH_WARPS_REFINED
    elif L >= FINISH_LONG_KEYS:
        chunk, warps = FINISH_CHUNK_LONG, FINISH_WARPS_LONG
    else:
        chunk, warps = FINISH_CHUNK, FINISH_WARPS
    dsa_finish_kernel[(B,)](keys, hist, cand, out, n_len, L, topk, CHUNK=chunk, TIE_BLOCK=TIE_BLOCK,
                            LEN_FROM_PTR=from_ptr, NEXT=nxt, REFINE=refine, LIST0=list0, CAP=cap, num_warps=warps,
                            **digit)
    if ordered:     # the reference's order: score descending, ties by lowest position
        pos = out[:, 0]
        u = torch.gather(keys.view(B, L), 1, pos.clamp(min=0)).to(torch.int64) & 0xFFFFFFFF
        rank = ((u - 2 ** 31) << 32) + (2 ** 32 - 1 - pos)
        rank = torch.where(pos >= 0, rank, torch.full_like(rank, -2 ** 63))
        out.copy_(torch.gather(pos, 1, torch.sort(rank, dim=1, descending=True).indices)[:, None])
    return out


# Source order for code generation (helpers first).
KERNELS = (_order_key, _to_e4m3, _pick_bin, _first_digit, _row_range, dsa_init_kernel, dsa_scan_kernel,
           dsa_collect_kernel, *dsa_select.KERNELS, radix_scratch_words)
