"""The radix select's last two passes (`dsa_decode`: the module docstring there gives the selection): the refine
pass, which splits the collect pass's candidates by their next digit over many programs, and the finishing select,
one program per row, over the candidates left (the refine pass's short list, or all of them).

Scratch layout (`dsa_decode.radix_topk`): order keys keys [B, L] (u32 bits in int32), candidate positions
cand [B, L], per row hist [HIST_STRIDE] int32: the first digit's BINS, the next digit's 256, the refine pass's two
counters (LIST0 - 2, - 1) and its list (LIST0 .. HIST_STRIDE - 4), then the candidates' signed order-key min and
max and the collect pass's two counters.

Public API: `dsa_refine_kernel`, `dsa_finish_kernel` and their helpers (`KERNELS`, in source order).
"""

import triton
import triton.language as tl


@triton.jit
def _cand_keys(keys_row, list_ptr, offs, n_cand):
    """(valid, position, unique uint64 key (u << 32) | (2^32 - 1 - position)) of the candidates offs of a row's list
    (positions in the row's keys)."""
    ok = offs < n_cand
    pos = tl.load(list_ptr + offs, mask=ok, other=0)
    u = tl.load(keys_row + pos, mask=ok, other=0).to(tl.uint32, bitcast=True)
    return ok, pos, (u.to(tl.uint64) << 32) | (4294967295 - pos.to(tl.int64)).to(tl.uint64)


@triton.jit
def _bit_length(x):
    """Bits of x (int64 in [0, 2^32)): 0 for 0, else floor(log2 x) + 1 (the exponent of x as an exact float64)."""
    e = ((x.to(tl.float64).to(tl.int64, bitcast=True) >> 52) & 2047) - 1022
    return tl.where(x > 0, e, 0)


@triton.jit
def _row_state(row, HIST_STRIDE: tl.constexpr):
    """Row's state after the collect pass: (candidates, keys collected above, the candidates' u min and max)."""
    lo = (tl.load(row + HIST_STRIDE - 4) ^ -2147483648).to(tl.int64) & 4294967295
    hi = (tl.load(row + HIST_STRIDE - 3) ^ -2147483648).to(tl.int64) & 4294967295
    return tl.load(row + HIST_STRIDE - 1), tl.load(row + HIST_STRIDE - 2), lo, hi


@triton.jit
def _next_split(row, n_cand, need, lo, hi, BINS: tl.constexpr, SHIFT: tl.constexpr, BASE: tl.constexpr):
    """The split of a row's candidates by their next digit (hist[BINS:BINS + 256], `dsa_collect_kernel`): (use: it
    applies (more candidates than the `need` keys still needed, sharing u's bits from SHIFT up in an interior
    first-digit bin, differing above SHIFT - 8), the threshold digit d, keys above it, keys in it)."""
    v = lo >> SHIFT
    use = ((n_cand > need) & (_bit_length(lo ^ hi) > SHIFT - 8) & (v == (hi >> SHIFT)) & (v > BASE)
           & (v < BASE + BINS - 1))
    bins = tl.arange(0, 256)
    hist = tl.load(row + BINS + bins)
    suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    d = tl.max(tl.where(suffix >= need, bins, -1), 0)
    return use, d, tl.sum(tl.where(bins > d, hist, 0), 0), tl.sum(tl.where(bins == d, hist, 0), 0)


@triton.jit
def dsa_refine_kernel(keys_ptr, hist_ptr, cand_ptr, idx_ptr, L, K, BLOCK: tl.constexpr, LIST0: tl.constexpr,
                      CAP: tl.constexpr, BINS: tl.constexpr, SHIFT: tl.constexpr, BASE: tl.constexpr,
                      HIST_STRIDE: tl.constexpr):
    """grid (programs, B): when the next digit's split applies to row b (`_next_split`) and its threshold digit d
    holds at most CAP candidates, the candidates (blocks of BLOCK, program p taking blocks p, p + programs, ...)
    whose next digit (u >> (SHIFT - 8)) & 255 is above d go to idx after the collected ones (slots from the counter
    hist[b, LIST0 - 2]), those in d to the row's short list hist[b, LIST0:LIST0 + CAP] (slots from hist[b, LIST0 -
    1]), arrival order; the finish then resolves only that list. Else nothing (the finish takes the whole list)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = hist_ptr + b * HIST_STRIDE
    n_cand, above, lo, hi = _row_state(row, HIST_STRIDE)
    use, d, a, h_d = _next_split(row, n_cand, K - above, lo, hi, BINS, SHIFT, BASE)
    if use & (h_d <= CAP):
        for s0 in range(pid * BLOCK, n_cand, tl.num_programs(0) * BLOCK):
            offs = s0 + tl.arange(0, BLOCK)
            ok = offs < n_cand
            pos = tl.load(cand_ptr + b * L + offs, mask=ok, other=0)
            u = tl.load(keys_ptr + b * L + pos, mask=ok, other=0).to(tl.uint32, bitcast=True)
            nd = ((u >> (SHIFT - 8)) & 255).to(tl.int32)
            gt = (ok & (nd > d)).to(tl.int32)
            eq = (ok & (nd == d)).to(tl.int32)
            n_gt = tl.sum(gt, 0)
            base = tl.atomic_add(row + LIST0 - 2, n_gt, mask=n_gt > 0, sem="relaxed")
            tl.store(idx_ptr + b * K + above + base + tl.cumsum(gt, 0) - 1, pos.to(tl.int64), mask=gt != 0)
            n_eq = tl.sum(eq, 0)
            base = tl.atomic_add(row + LIST0 - 1, n_eq, mask=n_eq > 0, sem="relaxed")
            tl.store(row + LIST0 + base + tl.cumsum(eq, 0) - 1, pos, mask=eq != 0)


@triton.jit
def _digit_hist(c, match, ds, width):
    """256-bin histogram of the 8-bit digits (c >> ds) & (2^width - 1) of the matching 64-bit keys c."""
    digit = ((c >> ds.to(tl.uint64)) & ((1 << width) - 1).to(tl.uint64)).to(tl.int32)
    hist = tl.histogram(tl.where(match, digit, 0), 256)
    return tl.where(tl.arange(0, 256) == 0, hist - tl.sum((~match).to(tl.int32), 0), hist)


@triton.jit
def dsa_finish_kernel(keys_ptr, hist_ptr, cand_ptr, idx_ptr, len_ptr, L, K, CHUNK: tl.constexpr,
                      TIE_BLOCK: tl.constexpr, HIST_STRIDE: tl.constexpr, LEN_FROM_PTR: tl.constexpr,
                      BINS: tl.constexpr, SHIFT: tl.constexpr, BASE: tl.constexpr, NEXT: tl.constexpr,
                      REFINE: tl.constexpr, LIST0: tl.constexpr, CAP: tl.constexpr):
    """grid (B,): the K - above best of row b's candidates (`dsa_collect_kernel`; above = the keys it selected) by
    their unique 64-bit keys c = (u << 32) | (2^32 - 1 - position) (larger u first, then the lower position: the
    reference's ties): a radix select of 8-bit digits, level after level until the bin of the remaining keys fits
    whole. It starts below the bits all candidates share (those of their smallest and largest u, from the collect
    pass: none to resolve when all are tied; NEXT: when the next digit's split applies (`_next_split`), the first
    level is the collect pass's count of bits SHIFT - 8 .. SHIFT - 1, and with REFINE, when its threshold digit holds
    at most CAP candidates, the refine pass has taken the keys above it and listed those in it: the list is then
    those, hist[b, LIST0:]), resolves u (digits aligned to end at bit 32), then the positions:
      - at most CHUNK candidates: the position bits by the same radix, the candidates in registers throughout;
      - more (heavy ties at the threshold value u*, e.g. every score equal): the keys with u > u* from the list,
        then the lowest positions with u == u* by a walk over the row's keys in position order (TIE_BLOCK per step,
        a prefix count, until enough are found: one step when the ties are dense), instead of up to 4 more levels
        over every candidate.
    The first CHUNK candidates stay in registers across the levels, the rest are re-read per level in CHUNKs. Then
    their positions to idx [B, K] after the ones taken before, -1 in the slots past the row's keys (lengths as in
    `_row_range`)."""
    b = tl.program_id(0).to(tl.int64)
    row = hist_ptr + b * HIST_STRIDE
    n_cand, above, lo, hi = _row_state(row, HIST_STRIDE)
    keys_row = keys_ptr + b * L
    need = K - above
    n_diff = _bit_length(lo ^ hi)                           # the candidates share u's bits from n_diff up
    pshift = 32 + n_diff                                    # ... so c's bits from pshift up: prefix
    prefix = (lo >> n_diff).to(tl.uint64)
    done = n_cand <= need                                   # all candidates fit (none, or a row of <= K keys)
    take_all = done
    lst = cand_ptr + b * L                                  # the list: the collect pass's candidates ...
    n_list = n_cand
    written = above
    if NEXT:
        use, d, a, h_d = _next_split(row, n_cand, need, lo, hi, BINS, SHIFT, BASE)
        prefix = tl.where(use, (((lo >> SHIFT) << 8) | d).to(tl.uint64), prefix)
        pshift = tl.where(use, 32 + SHIFT - 8, pshift)
        done = tl.where(use, h_d == need - a, done)
        need = tl.where(use, need - a, need)
        if REFINE:
            if use & (h_d <= CAP):                          # ... or the refine pass's: those in the digit d
                lst = row + LIST0
                n_list = h_d
                written = above + a
    few = n_list <= CHUNK
    n_chunks = (n_list + CHUNK - 1) // CHUNK
    ok0, pos0, c_0 = _cand_keys(keys_row, lst, tl.arange(0, CHUNK), n_list)
    bins = tl.arange(0, 256)
    more = (done == 0) & ((pshift > 32) | few)
    while more:
        ds = tl.where(pshift > 32, tl.maximum(pshift - 8, 32), tl.maximum(pshift - 8, 0))
        width = pshift - ds
        wide = pshift >= 64
        shift = tl.minimum(pshift, 63).to(tl.uint64)
        hist = _digit_hist(c_0, ok0 & (wide | ((c_0 >> shift) == prefix)), ds, width)
        for c0 in range(1, n_chunks):
            ok, pos, c = _cand_keys(keys_row, lst, c0 * CHUNK + tl.arange(0, CHUNK), n_list)
            hist += _digit_hist(c, ok & (wide | ((c >> shift) == prefix)), ds, width)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        d = tl.max(tl.where(suffix >= need, bins, -1), 0)
        a = tl.sum(tl.where(bins > d, hist, 0), 0)
        h_d = tl.sum(tl.where(bins == d, hist, 0), 0)
        prefix = (prefix << width.to(tl.uint64)) | d.to(tl.uint64)
        pshift = ds
        done = h_d == need - a                              # bin d fits whole: every key >= the prefix is taken
        need = need - a
        more = (done == 0) & ((pshift > 32) | few)
    tie = tl.where(done, 0, 1).to(tl.uint64)               # pshift = 32, prefix = u*: need keys with u == u*
    shift = tl.minimum(pshift, 63).to(tl.uint64)
    sel = (ok0 & (take_all | ((c_0 >> shift) >= prefix + tie))).to(tl.int32)
    tl.store(idx_ptr + b * K + written + tl.cumsum(sel, 0) - 1, pos0.to(tl.int64), mask=sel != 0)
    written += tl.sum(sel, 0)
    n_read = tl.where((tie != 0) & (hi.to(tl.uint64) == prefix), 1, n_chunks)     # none above u*: list done
    for c0 in range(1, n_read):
        ok, pos, c = _cand_keys(keys_row, lst, c0 * CHUNK + tl.arange(0, CHUNK), n_list)
        sel = (ok & (take_all | ((c >> shift) >= prefix + tie))).to(tl.int32)
        tl.store(idx_ptr + b * K + written + tl.cumsum(sel, 0) - 1, pos.to(tl.int64), mask=sel != 0)
        written += tl.sum(sel, 0)
    n_valid = L
    if LEN_FROM_PTR:
        n_valid = tl.load(len_ptr + b).to(tl.int32) + 1
    rem = tl.where(tie != 0, need, 0)                       # at least rem keys of the row have u == u*
    s0 = 0
    while (rem > 0) & (s0 < n_valid):
        offs_t = s0 + tl.arange(0, TIE_BLOCK)
        in_row = offs_t < n_valid
        u_t = tl.load(keys_row + offs_t, mask=in_row, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        hit = (in_row & (u_t == prefix)).to(tl.int32)
        rank = tl.cumsum(hit, 0)
        take = (hit != 0) & (rank <= rem)
        tl.store(idx_ptr + b * K + written + rank - 1, offs_t.to(tl.int64), mask=take)
        n_take = tl.sum(take.to(tl.int32), 0)
        written += n_take
        rem -= n_take
        s0 += TIE_BLOCK
    for s0 in range(0, K, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        tl.store(idx_ptr + b * K + offs, tl.full([CHUNK], -1, tl.int64), mask=(offs >= written) & (offs < K))


# Source order for code generation (helpers first).
KERNELS = (_cand_keys, _bit_length, _row_state, _next_split, dsa_refine_kernel, _digit_hist, dsa_finish_kernel)
