"""DSA decode kernels (k3c.codegen.triton.dsa_decode) under the Triton interpreter, fp32, small shapes.

Oracle: `dsa_index_topk_ref` (k3c/ir/ops/model_attn.py: torch scores + stable sort) for the selected set, and a
torch gather + softmax for the sparse attention. FP8 keys run with fp8 q (FP8_QUERY, the default): the interpreter's
bf16 tl.dot is not exact, its fp8 one is.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors need the interpreter; set before triton.jit runs

import pytest
import torch

from k3c.codegen.triton.attention import launch_mla
from k3c.codegen.triton import dsa_decode
from k3c.codegen.triton.dsa_decode import dsa_decode_topk, quantize_index_keys
from k3c.errors import RuntimeInputError
from k3c.ir.ops.model_attn import dsa_index_topk_ref, fp8_split_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests run the kernels under TRITON_INTERPRET=1")

B, J, D = 2, 4, 32


def index_inputs(L, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, J, D, generator=gen), torch.randn(B, J, generator=gen),
            torch.randn(B, L, D, generator=gen))


def as_sets(idx):
    return [set(row.tolist()) - {-1} for row in idx.reshape(idx.shape[0], -1)]


@pytest.mark.parametrize("L,topk", [(3000, 64), (1500, 700), (40, 64), (64, 64)])
def test_topk_set_equals_reference(L, topk):
    q_i, w, k_i = index_inputs(L, seed=L + topk)
    idx = dsa_decode_topk(q_i, w, k_i, topk)
    ref = dsa_index_topk_ref({"topk": topk}, q_i[:, None], w[:, None], k_i)[0]
    assert idx.shape == (B, 1, topk)
    assert as_sets(idx) == as_sets(ref)
    assert ((idx >= 0).sum(-1) == min(L, topk)).all()                    # -1 exactly past min(L, topk)
    assert torch.equal(dsa_decode_topk(q_i, w, k_i, topk, ordered=True), ref)


@pytest.mark.parametrize("case", ["repeated keys", "zero scores"])
def test_ties_at_threshold_as_reference(case):
    # repeated keys: every score appears 8 times, the threshold score is tied across positions; zero scores: w > 0,
    # so 1/16 of the keys (all four ReLU terms 0) score exactly 0, and the threshold falls among them
    if case == "repeated keys":
        L, topk = 800, 100
        q_i, w, k_i = index_inputs(L // 8, seed=3)
        k_i = k_i.repeat_interleave(8, dim=1)
    else:
        L, topk = 1500, 1450
        q_i, w, k_i = index_inputs(L, seed=4)
        w = w.abs()
    idx = dsa_decode_topk(q_i, w, k_i, topk, ordered=True)
    ref = dsa_index_topk_ref({"topk": topk}, q_i[:, None], w[:, None], k_i)[0]
    assert torch.equal(idx, ref)


@pytest.mark.parametrize("bins,base,chunk,scale", [
    (256, dsa_decode.BASE, 8, 1.0),         # the window (11-22 candidates, 2-3 steps of the finishing select)
    (2048, 0, 4096, 1.0),                   # every 11-bit value a bin (no clamping)
    (256, dsa_decode.BASE, 64, 2.0 ** 40),  # scores above the window: the threshold in the top edge bin (~300)
    (256, dsa_decode.BASE, 64, 2.0 ** -40),  # scores below it: the threshold in the bottom edge bin
])
def test_first_digit_variants_select_the_reference_set(monkeypatch, bins, base, chunk, scale):
    # the first digit's histogram window and the finishing select's chunking: the set (and, sorted, the reference's
    # order) for thresholds inside the window and in its clamped edge bins, with 1/8 of the scores tied 8-fold
    L, topk = 900, 40
    q_i, w, k_i = index_inputs(L // 8 * 7, seed=11)
    k_i = torch.cat([k_i, k_i[:, :L // 8]], 1)                         # tied scores: positions s and s + 7L/8
    w = w * scale
    monkeypatch.setattr(dsa_decode, "BINS", bins)
    monkeypatch.setattr(dsa_decode, "BASE", base)
    monkeypatch.setattr(dsa_decode, "FINISH_CHUNK", chunk)
    ref = dsa_index_topk_ref({"topk": topk}, q_i[:, None], w[:, None], k_i)[0]
    idx = dsa_decode_topk(q_i, w, k_i, topk)
    assert as_sets(idx) == as_sets(ref)
    assert ((idx >= 0).sum(-1) == topk).all()
    assert torch.equal(dsa_decode_topk(q_i, w, k_i, topk, ordered=True), ref)


@pytest.mark.parametrize("dense", [dsa_decode.NEXT_DENSE, 0])
def test_collect_counts_the_candidates_next_digit(monkeypatch, dense):
    # the collect pass's histogram of the candidates' next 8 bits (hist[b, BINS:BINS + 256], by one atomic per
    # candidate or, NEXT_DENSE = 0, a block histogram) = torch's count over the kernel's order keys; the rows are
    # ones whose finishing select takes it as its first level (the candidates share the first digit's bits, differ
    # above SHIFT - 8 and outnumber the slots left), and the set is the reference's
    monkeypatch.setattr(dsa_decode, "NEXT_DENSE", dense)
    L, topk, dd = 1200, 48, dsa_decode
    q_i, w, k_i = index_inputs(L, seed=41)
    w = w.abs()                                                         # positive scores: an interior bin
    scratch = torch.full((dd.radix_scratch_words(B, L),), -5, dtype=torch.int32)
    idx = dd.radix_topk(q_i, w, k_i, topk, None, False, scratch=scratch)
    u = scratch[:B * L].view(B, L).long() & 0xFFFFFFFF
    digit = ((u >> dd.SHIFT) - dd.BASE).clamp(0, dd.BINS - 1)
    t = digit.gather(1, u.topk(topk, dim=1).indices[:, -1:])                # the K-th largest key's bin
    cand = digit == t
    nxt = (u >> (dd.SHIFT - 8)) & 255
    want = torch.stack([torch.bincount(nxt[b][cand[b]], minlength=256) for b in range(B)]).int()
    assert torch.equal(scratch[2 * B * L:].view(B, dd.HIST_STRIDE)[:, dd.BINS:dd.BINS + 256], want)
    lo, hi = [torch.where(cand, u, fill).amin(1) if fill > 0 else torch.where(cand, u, fill).amax(1)
              for fill in (2 ** 32, -1)]
    assert ((lo >> dd.SHIFT == hi >> dd.SHIFT) & ((lo ^ hi) >= 2 ** (dd.SHIFT - 8))
            & (cand.sum(1) > topk - (digit > t).sum(1))).all()
    ref = dsa_index_topk_ref({"topk": topk}, q_i[:, None], w[:, None], k_i)[0]
    assert as_sets(idx) == as_sets(ref)


@pytest.mark.parametrize("case,chunk", [("8-fold ties", 2), ("8-fold ties", 64), ("over the list's capacity", 64)])
def test_refine_pass_lists_the_threshold_digit(monkeypatch, case, chunk):
    # REFINE: the refine pass takes the candidates above the next digit's threshold digit d (counter hist[LIST0 - 2])
    # and lists those in d (hist[LIST0:], count at LIST0 - 1) = torch's split of the kernel's order keys; the finish
    # resolves that list (FINISH_CHUNK_REFINED = 2: several steps per level, and the position bits by the walk over
    # ties; 64: by the radix). 8-fold ties: every score 8 times, so the list holds ties. Over the capacity: 1600
    # copies of one key at the threshold (d holds more than the list's HIST_STRIDE - 4 - LIST0 words): no refine,
    # the finish takes the whole candidate list. The reference's set and order either way. Inputs on a grid of 1/4
    # (w: 1/16, positive: an interior bin), so that every score is exact and copies tie in the kernel too.
    monkeypatch.setattr(dsa_decode, "FINISH_CHUNK_REFINED", chunk)
    dd = dsa_decode
    q_i, w, k_i = index_inputs(150 if case == "8-fold ties" else 400, seed=51)
    q_i, k_i, w = (q_i * 4).round() / 4, (k_i * 4).round() / 4, (w.abs() * 16).round() / 16 + 1 / 16
    if case == "8-fold ties":
        k_i, topk = k_i.repeat_interleave(8, dim=1), 100
    else:
        s = torch.einsum("bj,bjs->bs", w, torch.einsum("bjd,bsd->bjs", q_i, k_i).relu())
        mid = s.argsort(1)[:, 300]                                      # 99 keys score above it
        k_i = torch.cat([k_i, k_i[torch.arange(B), mid][:, None].expand(B, 1600, D)], 1)
        topk = 99 + 700
    L = k_i.shape[1]
    scratch = torch.full((dd.radix_scratch_words(B, L),), -5, dtype=torch.int32)
    idx = dd.radix_topk(q_i, w, k_i, topk, None, False, scratch=scratch)
    ref = dsa_index_topk_ref({"topk": topk}, q_i[:, None], w[:, None], k_i)[0]
    assert as_sets(idx) == as_sets(ref)
    assert torch.equal(dsa_decode_topk(q_i, w, k_i, topk, ordered=True), ref)
    u = scratch[:B * L].view(B, L).long() & 0xFFFFFFFF
    hist = scratch[2 * B * L:].view(B, dd.HIST_STRIDE)
    list0 = dd.BINS + 258
    cand = (u >> dd.SHIFT) == (u >> dd.SHIFT).gather(1, u.topk(topk, dim=1).indices[:, -1:])
    nxt = (u >> (dd.SHIFT - 8)) & 255
    for b in range(B):
        need = topk - int((u[b] >> dd.SHIFT > (u[b] >> dd.SHIFT)[cand[b]][0]).sum())
        count = torch.bincount(nxt[b][cand[b]], minlength=256)
        d = int(((count.flip(0).cumsum(0) >= need).nonzero()[0]).item())
        d = 255 - d                                                     # the threshold digit
        in_d = (cand[b] & (nxt[b] == d)).nonzero()[:, 0]
        if case == "over the list's capacity":
            assert len(in_d) > dd.HIST_STRIDE - 4 - list0 and hist[b, list0 - 2:list0].tolist() == [0, 0]
        else:
            assert hist[b, list0 - 2:list0].tolist() == [int(count[d + 1:].sum()), len(in_d)] and len(in_d) >= 8
            assert sorted(hist[b, list0:list0 + len(in_d)].tolist()) == in_d.tolist()


def test_long_rows_finish_with_their_own_chunk(monkeypatch):
    # rows of at least FINISH_LONG_KEYS keys: the finishing select's FINISH_CHUNK_LONG candidates per step (here 32,
    # so several steps per level), the same set as the reference
    L, topk = 1500, 700
    monkeypatch.setattr(dsa_decode, "FINISH_LONG_KEYS", L)
    monkeypatch.setattr(dsa_decode, "FINISH_CHUNK_LONG", 32)
    monkeypatch.setattr(dsa_decode, "FINISH_CHUNK", 100)       # not a power of 2: the short path would fail to build
    q_i, w, k_i = index_inputs(L, seed=31)
    ref = dsa_index_topk_ref({"topk": topk}, q_i[:, None], w[:, None], k_i)[0]
    assert torch.equal(dsa_decode_topk(q_i, w, k_i, topk, ordered=True), ref)


@pytest.mark.parametrize("H,Dl,dv,batched", [(16, 48, 32, False), (40, 40, 32, False), (80, 48, 32, True)])
def test_sparse_attention_matches_torch(monkeypatch, H, Dl, dv, batched):
    # (40, 40, 32): 2 head blocks, 8 rope dims; batched: B rows reach SPARSE_BATCHED_ROWS, so SPARSE_HEAD_BLOCK_BATCHED
    # (64) heads per program, the second block of 80 heads partly masked
    from k3c.codegen.triton import attention
    monkeypatch.setattr(attention, "SPARSE_BATCHED_ROWS", B if batched else B + 1)
    L, topk = 500, 200                                                  # key splits + combine
    q_i, w, k_i = index_inputs(L, seed=5)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(B, 1, H, Dl, generator=gen)
    kv = torch.randn(B, L, Dl, generator=gen)
    out = torch.empty(B, 1, H, dv)
    launch_mla(q, kv, None, dsa_decode_topk(q_i, w, k_i, topk), out, absorbed=True, causal=True, scale=Dl ** -0.5,
               v_dim=dv, dense_max_keys=None)                           # the selection as an unordered set
    idx = dsa_index_topk_ref({"topk": topk}, q_i[:, None], w[:, None], k_i)[0][:, 0]       # [B, topk]
    rows = torch.gather(kv, 1, idx[..., None].expand(B, topk, Dl))                           # [B, topk, Dl]
    p = torch.softmax(torch.einsum("bhd,bsd->bhs", q[:, 0], rows) * Dl ** -0.5, -1)
    want = torch.einsum("bhs,bsd->bhd", p, rows[..., :dv])[:, None]
    assert (out - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("L,topk,extra,zero", [(600, 48, 208, False), (1200, 200, 56, False), (40, 64, 16, False),
                                               (300, 32, 16, True)],
                         ids=["extra > topk", "extra < topk", "short row", "zero keys"])
def test_fp8_rerank_equals_reference(L, topk, extra, zero):
    # `--dsa-index-keys fp8-rerank`: topk + extra candidates on the e4m3 keys, re-ranked from the joined keys (e4m3 +
    # 4-bit residual) by the radix select (a set) or the all-pairs ranking (ordered): the reference's set and order;
    # on bf16 keys that is the exact selection (extra chosen above the fp8 rank of the exact top-k's worst key),
    # which fp8 alone misses; zero keys: every score tied, the lowest positions at both stages
    assert dsa_decode.FP8_QUERY
    q_i, w, k_i = index_inputs(L, seed=L + topk)
    k_i = torch.zeros_like(k_i) if zero else k_i.to(torch.bfloat16).float()
    k8, ks, lo = fp8_split_ref({}, k_i)
    ref = dsa_index_topk_ref({"topk": topk, "rerank": extra}, q_i[:, None], w[:, None], k8, ks, lo)[0]
    exact = dsa_index_topk_ref({"topk": topk}, q_i[:, None], w[:, None], k_i)[0]
    idx = dsa_decode_topk(q_i, w, k8, topk, k_scale=ks, k_lo=lo, rerank_extra=extra)        # the radix select
    ordered = dsa_decode_topk(q_i, w, k8, topk, k_scale=ks, k_lo=lo, rerank_extra=extra, ordered=True)   # ranks
    assert as_sets(idx) == as_sets(ref) == as_sets(exact) and torch.equal(ordered, ref)
    assert ((idx >= 0).sum(-1) == min(L, topk)).all()
    if L > topk + extra and not zero:
        assert as_sets(dsa_decode_topk(q_i, w, k8, topk, k_scale=ks)) != as_sets(exact)
    if zero:
        assert as_sets(idx) == [set(range(topk))] * B


def test_errors():
    q_i, w, k_i = index_inputs(100, seed=7)
    with pytest.raises(RuntimeInputError):
        dsa_decode_topk(q_i, w[:, :2], k_i, 16)
    with pytest.raises(RuntimeInputError):
        dsa_decode_topk(q_i, w, k_i, 16, k_scale=torch.ones(B, 100))
    k8, ks = quantize_index_keys(k_i)
    lo = torch.zeros(B, 100, D // 2, dtype=torch.uint8)
    with pytest.raises(RuntimeInputError):
        dsa_decode_topk(q_i, w, k_i, 16, k_lo=lo)                        # residuals only with fp8 keys
    with pytest.raises(RuntimeInputError):
        dsa_decode_topk(q_i, w, k8, 16, k_scale=ks, k_lo=lo[:, :50])


@pytest.mark.parametrize("case", ["all tied", "ties among negatives", "lengths over garbage"])
def test_heavy_ties_take_the_lowest_positions(monkeypatch, case):
    # more tied candidates than FINISH_CHUNK: the finishing select resolves u, then walks the row's keys in position
    # order for the ties (TIE_BLOCK per step). all tied: every key zero, so every score 0 (a zeroed index cache);
    # ties among negatives: 2/3 of the keys zero, the rest random with w of both signs, the threshold among the
    # zeros and the bin holding them also holds the negative scores (u levels first); lengths: rows shorter than the
    # bound over scratch pre-filled with the zero score's order key (ties past the row's keys must not be taken)
    monkeypatch.setattr(dsa_decode, "FINISH_CHUNK", 64)
    monkeypatch.setattr(dsa_decode, "TIE_BLOCK", 128)
    L, topk = 1500, 300
    q_i, w, k_i = index_inputs(L, seed=21)
    if case == "all tied":
        k_i = torch.zeros_like(k_i)
    else:
        zero = torch.rand(B, L, generator=torch.Generator().manual_seed(22)) < 2 / 3
        k_i = torch.where(zero[..., None], 0.0, k_i)
    if case != "lengths over garbage":
        ref = dsa_index_topk_ref({"topk": topk}, q_i[:, None], w[:, None], k_i)[0]
        assert torch.equal(dsa_decode_topk(q_i, w, k_i, topk, ordered=True), ref)
        idx = dsa_decode_topk(q_i, w, k_i, topk)
    else:
        lengths = torch.tensor([700, 1199], dtype=torch.int32)             # rows of 701 and 1200 keys
        ref = [dsa_index_topk_ref({"topk": topk}, q_i[b:b + 1, None], w[b:b + 1, None], k_i[b:b + 1, :n + 1])[0][0]
               for b, n in enumerate(lengths.tolist())]
        scratch = torch.full((dsa_decode.radix_scratch_words(B, L),), -2 ** 31, dtype=torch.int32)
        idx = dsa_decode.radix_topk(q_i, w, k_i, topk, None, False, lengths=lengths, scratch=scratch)
        ref = torch.cat(ref)
    if case == "all tied":
        assert as_sets(idx) == [set(range(topk))] * B
    assert as_sets(idx) == as_sets(ref)
    assert ((idx >= 0).sum(-1) == topk).all()

