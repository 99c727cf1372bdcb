"""Triton kernels and the emitter of the DSA lightning indexer op `dsa_index_topk` (the key selection of a DSA layer).

Math: K3-SPEC.md "Gated DSA" (DeepSeek-V3.2 eq. 1), I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s]) over the
visible keys s; exact semantics: `dsa_index_topk_ref` of k3c/ir/ops/model_attn.py (a set of the top-k positions,
ties by lowest position, -1 past min(L, topk)).

`dsa_score_kernel` writes one int64 sort key per (b, t, s) into a scratch tensor, planned in the
arena (`dsa_index_topk_scratch`); high word: the score's order-preserving int32 bits, INT32_MIN when s is not
visible; low word: 2³² − 1 − s, so equal scores order by lowest position, as the reference's stable sort. `torch.topk`
over these unique keys (inside `launch`: O(L) selection, sorted, deterministic) gives the ref's order exactly.
Decode (T = 1) with L ≥ RADIX_MIN_KEYS keys instead runs the radix select of `dsa_decode` (five launches: zero the
histogram, scan + first-digit histogram, collect, refine, finishing select): the same set (exact ties by lowest position) in
no particular order, which the op's contract allows (`dsa_index_topk`: a set; the sparse attention is order-free),
no O(L) int64 sort keys, no torch op.
FP8 keys (`--dsa-index-keys fp8`: k_i float8_e4m3fn with k_scale f32 [B, L], `k3c.frontend.index_keys`): the
op's FP8 semantics (`dsa_index_topk_ref`): q rounded to bf16, then e4m3 per head with its scale folded into w
(`fp8_query` here, in torch, for the score kernel; in registers in the radix scan, FP8_QUERY, whose rounding
`dsa_decode._to_e4m3` matches torch's cast), score = k_scale[s] · Σ_j w'_j ReLU(q8_j · k8_s). The score kernel
widens both e4m3 operands to tf32 (exact; Triton's interpreter computes bf16 products wrongly, and an e4m3
product needs K >= 32, more than the tiny presets' D) for its product; the radix scan multiplies them as e4m3.
FP8 keys with 4-bit residuals (`--dsa-index-keys fp8-rerank`: k_lo u8 [B, L, D/2], attr rerank = E): either path
selects topk + E candidates into planned scratch ("rerank"), which `dsa_rerank.rerank` re-scores from the joined
keys and ranks into `out` (the reference's order).
Device lengths (`lengths` i32 [B], the kernel ABI's `sizes["lengths"]`): k_i is the bound, row b holds
lengths[b] + T keys, read in the kernels (the keys past the row's are not visible); the grids follow the bound, so a
CUDA graph replays them at any context.

Public API: `emit_dsa_index_topk(group)` -> module text (registered with `k3c.codegen.triton.emitter` for the kind
"dsa_index_topk"), `dsa_index_topk_scratch(group)`, the launcher `launch_dsa_index_topk` (copied into the emitted
modules), `fp8_query` and `dsa_score_kernel`.
"""

from __future__ import annotations

import inspect

import sympy
import torch
import triton
import triton.language as tl

from k3c.codegen.backend import ScratchSpec
from k3c.codegen.triton import dsa_decode, dsa_rerank, emitter, model_module, one_node, scratch, take_scratch
from k3c.codegen.triton.dsa_decode import radix_topk
from k3c.codegen.triton.dsa_rerank import rerank
from k3c.ir.kernels import KernelGroup
from k3c.ir.types import TensorType

SCRATCH_BYTES = 1 << 28     # cap of dsa_index_topk's i64 sort-key scratch; T is processed in row chunks under it
RADIX_MIN_KEYS = 16384      # decode (T = 1) with at least this many keys: radix select (`dsa_decode.radix_topk`)
RADIX_ROW_PAD = dsa_decode.HIST_STRIDE // 2   # i64 words per row of the radix select's histogram + counters
FP8_RADIX_MIN_D = 32   # the radix scan's e4m3 x e4m3 tl.dot needs K >= 32 (Triton 3.6, H200): narrower fp8 keys
                       # (the tiny presets' D = 16) take the score kernel at every length
SEMANTICS = "the op's `ref` in k3c/ir/ops/model_attn.py (K3-SPEC.md 'Gated DSA')."


@triton.jit
def dsa_score_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, key_ptr, len_ptr, T, L, t0, n_rows,
                     J: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr, LEN_FROM_PTR: tl.constexpr,
                     FP8: tl.constexpr):
    """Sort keys of I[t,s] = Σ_j w[t,j]·ReLU(q_I[t,j]·k_I[s]) for tokens t0 .. t0+n_rows−1 (see module docstring).

    q [B,T,J,D], w [B,T,J], k [B,L,D]; key_ptr: i64 [B, n_rows, L]. Program: (b·n_rows + t − t0, key block).
    FP8: q and k e4m3 (q from `fp8_query`, its scales in w), ks [B, L] f32 the keys' scales: I = ks[s]·Σ_j ....
    LEN_FROM_PTR: row b holds len_ptr[b] + T keys (i32 [B]); L is the bound, the keys past the row's are not visible.
    """
    pid = tl.program_id(0)
    b = (pid // n_rows).to(tl.int64)
    t = t0 + pid % n_rows
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = offs_s < L
    n_keys = L
    if LEN_FROM_PTR:
        n_keys = tl.load(len_ptr + b).to(tl.int32) + T
    offs_j = tl.arange(0, BLOCK_J)
    j_ok = offs_j < J
    dots = tl.zeros([BLOCK_J, BLOCK_S], tl.float32)
    for d0 in tl.static_range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(q_ptr + ((b * T + t) * J + offs_j)[:, None] * D + offs_d[None, :],
                    mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        k = tl.load(k_ptr + (b * L + offs_s)[:, None] * D + offs_d[None, :],
                    mask=(offs_s < n_keys)[:, None] & d_ok[None, :], other=0.0)
        if FP8:     # e4m3 values are exact in tf32: the products are those of the e4m3 operands
            dots += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="tf32")
        else:
            dots += tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    w = tl.load(w_ptr + (b * T + t) * J + offs_j, mask=j_ok, other=0.0).to(tl.float32)
    score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), 0)
    if FP8:
        score = score * tl.load(ks_ptr + b * L + offs_s, mask=offs_s < n_keys, other=0.0)
    score = tl.where(score == 0.0, 0.0, score)             # −0.0 -> +0.0: the reference's sort sees them equal
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)   # signed int32 order == float order
    visible = s_ok & (offs_s <= n_keys - T + t)
    int32_min = tl.full([BLOCK_S], -2147483648, tl.int32)  # below every float's key, incl. −inf
    ordered = tl.where(visible, ordered, int32_min)
    low = tl.full([BLOCK_S], 4294967295, tl.int64) - offs_s.to(tl.int64)   # 2^32 − 1 − s: lower s sorts first
    key = (ordered.to(tl.int64) << 32) + low
    tl.store(key_ptr + (pid.to(tl.int64) * L + offs_s), key, mask=s_ok)


def fp8_query(q_i, w):
    """The FP8 scan's query (`dsa_index_topk_ref`): q_i [..., J, D] rounded to bf16, then e4m3 per head (scale =
    max|q_j| / 448, 1 for a zero head), w [..., J] times those scales. Returns (q8 float8_e4m3fn, w f32). The scale
    divides by a tensor: correctly rounded on CUDA too, as the reference (torch on CUDA multiplies by the fp32
    reciprocal of a Python scalar divisor: an ulp off for half the scales, and q8 then rounds differently at e4m3
    midpoints, which bf16 q hits often; the GPU set differed in 9 of 256 keys, BENCHMARKS.md DSA round 7)."""
    qf = q_i.to(torch.bfloat16).float()
    amax = qf.abs().amax(-1)
    sq = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    return (qf / sq[..., None]).to(torch.float8_e4m3fn).contiguous(), (w.float() * sq).contiguous()


def launch_dsa_index_topk(q_i, w, k_i, out, *, topk, k_scale=None, k_lo=None, rerank_extra=0, lengths=None,
                          scratch=None):
    """Run `dsa_index_topk`: q_i [B,T,J,D], w [B,T,J], k_i [B,L,D] -> out i64 [B,T,topk] (−1 padding).

    k_scale: None, or f32 [B,L] with float8_e4m3fn k_i (FP8 keys; the module docstring gives the scores). k_lo:
    None, or their residuals u8 [B,L,D/2] with rerank_extra = E >= 1 (the module docstring; `out` contiguous).

    lengths: None, or i32 [B] on the device, the context of each row before these T tokens: row b then holds
    lengths[b] + T keys and L is only the bound (the launches do not depend on the lengths: a CUDA graph replays
    them at any context; the result is the same as for k_i cut to the row's keys).
    Result (the op's contract, `dsa_index_topk` in k3c/ir/ops/model_attn.py): row (b, t) holds the set of the topk
    best visible positions (ties by lowest position) in its first min(visible, topk) slots, then −1; the order within
    the set is unspecified (the attention over it is order-free). Here: the reference's order, except decode (T = 1)
    with L ≥ RADIX_MIN_KEYS (and, with fp8 keys, D ≥ FP8_RADIX_MIN_D), which runs the radix select of `dsa_decode`
    (no order, written into `out`, contiguous).
    Scratch: `scratch["keys"]` (the planned buffer, `dsa_index_topk_scratch`), else allocated here: flat i64
    [max(B·(L + RADIX_ROW_PAD), min(SCRATCH_BYTES // 8, B·T·L))]; the sort keys take [B, rows, L] of it for rows =
    max(1, min(T, its size // (B·L))) of T per pass, the radix select its int32 words
    (`dsa_decode.radix_scratch_words`); with k_lo also `scratch["rerank"]`, i64 [2·B·T·(topk + E)]: the candidates
    and their exact keys.
    Raises ValueError on mismatched shapes or a non-contiguous `out` for the radix select.
    """
    B, T, J, D = q_i.shape
    L = k_i.shape[1]
    if tuple(w.shape) != (B, T, J) or tuple(k_i.shape) != (B, L, D) or tuple(out.shape) != (B, T, topk):
        raise ValueError(f"dsa_index_topk: q_i {tuple(q_i.shape)}, w {tuple(w.shape)}, k_i {tuple(k_i.shape)}, "
                         f"out {tuple(out.shape)} mismatch")
    from_ptr = lengths is not None
    if from_ptr and tuple(lengths.shape) != (B,):
        raise ValueError(f"dsa_index_topk: lengths {tuple(lengths.shape)}, expected ({B},)")
    fp8 = k_scale is not None
    if fp8 != (k_i.dtype == torch.float8_e4m3fn) or (fp8 and tuple(k_scale.shape) != (B, L)):
        raise ValueError(f"dsa_index_topk: k_scale f32 [B, L] = {(B, L)} goes with float8_e4m3fn k_i and only then "
                         f"(k_i {k_i.dtype}, k_scale {None if k_scale is None else tuple(k_scale.shape)})")
    if (k_lo is not None) != (rerank_extra > 0) or \
            (k_lo is not None and (not fp8 or tuple(k_lo.shape) != (B, L, D // 2))):
        raise ValueError(f"dsa_index_topk: k_lo u8 [B, L, D/2] = {(B, L, D // 2)} goes with fp8 keys and "
                         f"rerank_extra >= 1, and only then (k_lo {None if k_lo is None else tuple(k_lo.shape)}, "
                         f"rerank_extra {rerank_extra})")
    keys = take_scratch(scratch, "keys", (max(B * L + B * RADIX_ROW_PAD, min(SCRATCH_BYTES // 8, B * T * L)),),
                        torch.int64, q_i.device)
    K1, dest = topk + rerank_extra, out                     # the selection's size and destination
    if k_lo is not None:
        if not out.is_contiguous():
            raise ValueError(f"dsa_index_topk: out {tuple(out.shape)} must be contiguous")
        rr = take_scratch(scratch, "rerank", (2 * B * T * K1,), torch.int64, q_i.device)
        dest, ck = rr[:B * T * K1].view(B, T, K1), rr[B * T * K1:]
    if T == 1 and L >= RADIX_MIN_KEYS and (not fp8 or D >= FP8_RADIX_MIN_D):   # the set, into out: no torch op
        if not out.is_contiguous():
            raise ValueError(f"dsa_index_topk: out {tuple(out.shape)} must be contiguous")
        radix_topk(q_i[:, 0], w[:, 0], k_i, K1, k_scale, False, lengths=lengths, out=dest,
                   scratch=keys.view(torch.int32))
    else:
        kk = min(K1, L)
        if kk < K1:
            dest[..., kk:] = -1
        rows = max(1, min(T, keys.numel() // (B * L)))
        BLOCK_S = 64
        precision = "ieee" if q_i.dtype == torch.float32 else "tf32"
        q_s, w_s = fp8_query(q_i, w) if fp8 else (q_i, w)
        for t0 in range(0, T, rows):
            n = min(rows, T - t0)
            dsa_score_kernel[(B * n, triton.cdiv(L, BLOCK_S))](
                q_s, w_s, k_i, k_scale if fp8 else w_s, keys, lengths if from_ptr else q_s, T, L, t0, n, J=J, D=D,
                BLOCK_J=max(16, triton.next_power_of_2(J)),
                BLOCK_D=64 if D > 64 else max(16, triton.next_power_of_2(D)),
                BLOCK_S=BLOCK_S, DOT_PRECISION=precision, LEN_FROM_PTR=from_ptr, FP8=fp8)
            chunk = keys.view(-1)[:B * n * L].view(B, n, L)       # the kernel's [B, n, L] layout
            top = torch.topk(chunk, kk, dim=-1, sorted=True).values
            pos = 4294967295 - (top & 4294967295)                  # undo the low word 2^32 − 1 − s
            visible = (top >> 32) != -2147483648
            dest[:, t0:t0 + n, :kk] = torch.where(visible, pos, torch.full_like(pos, -1))
    if k_lo is not None:      # the candidates re-ranked by their joined keys' exact scores, into out
        rerank(q_i.reshape(B * T, J, D).contiguous(), w.reshape(B * T, J).contiguous(), k_i, k_scale, k_lo,
               dest.view(B * T, K1), out.view(B * T, topk), T=T, ck=ck)


# ---- emitter ---------------------------------------------------------------------------------------------------
def _module(group, summary, consts, kernels, launcher, body):
    return model_module(group, summary, __name__, SEMANTICS, consts, kernels, launcher, body)


@emitter("dsa_index_topk")
def emit_dsa_index_topk(group: KernelGroup) -> str:
    """Module text for one `dsa_index_topk` node: inputs (q_i, w, k_i[, k_scale[, k_lo]]), outputs [idx]. Raises
    UnsupportedError for a group that is not a single dsa_index_topk node."""
    node, ip, op = one_node(group, "dsa_index_topk")
    consts = [("TOPK", node.attrs["topk"], "index_topk"),
              ("SCRATCH_BYTES", SCRATCH_BYTES, "cap of the i64 sort-key scratch (rows of T per pass)"),
              ("RADIX_MIN_KEYS", RADIX_MIN_KEYS, "decode with at least this many keys: radix select"),
              ("FP8_RADIX_MIN_D", FP8_RADIX_MIN_D, "radix select of fp8 keys: at least this key width"),
              ("SCAN_BLOCK", dsa_decode.SCAN_BLOCK, "radix select: keys per scan step"),
              ("SCAN_WARPS", dsa_decode.SCAN_WARPS, "radix select: warps per scan program"),
              ("SCAN_STAGES", dsa_decode.SCAN_STAGES, "radix select: the scan's pipeline depth"),
              ("SELECT_BLOCK", dsa_decode.SELECT_BLOCK, "radix select: keys per collect step"),
              ("SCAN_PROGRAMS", dsa_decode.SCAN_PROGRAMS, "radix select: scan / collect programs per launch"),
              ("SHIFT", dsa_decode.SHIFT, "radix select: first digit = order key >> SHIFT"),
              ("BINS", dsa_decode.BINS, "radix select: first-digit histogram bins (a window of its values)"),
              ("BASE", dsa_decode.BASE, "radix select: the window's first value"),
              ("HIST_STRIDE", dsa_decode.HIST_STRIDE, "radix select: int32 histogram + counter words per row"),
              ("RADIX_ROW_PAD", RADIX_ROW_PAD, "radix select: i64 scratch words per row beyond the keys"),
              ("REFINE", dsa_decode.REFINE, "radix select: the refine pass splits the candidates by the next digit"),
              ("REFINE_BLOCK", dsa_decode.REFINE_BLOCK, "... candidates per step of a refine program"),
              ("REFINE_PROGRAMS", dsa_decode.REFINE_PROGRAMS, "... refine programs per launch"),
              ("FINISH_CHUNK_REFINED", dsa_decode.FINISH_CHUNK_REFINED, "radix select: finishing step with REFINE"),
              ("FINISH_WARPS_REFINED", dsa_decode.FINISH_WARPS_REFINED, "... and its warps"),
              ("FINISH_CHUNK", dsa_decode.FINISH_CHUNK, "radix select: candidates per finishing step"),
              ("FINISH_WARPS", dsa_decode.FINISH_WARPS, "radix select: warps of the finishing program"),
              ("FINISH_LONG_KEYS", dsa_decode.FINISH_LONG_KEYS, "radix select: rows from which the finish takes"),
              ("FINISH_CHUNK_LONG", dsa_decode.FINISH_CHUNK_LONG, "... this many candidates per step"),
              ("FINISH_WARPS_LONG", dsa_decode.FINISH_WARPS_LONG, "... and warps"),
              ("TIE_BLOCK", dsa_decode.TIE_BLOCK, "radix select: keys per step of the finishing walk over ties"),
              ("COLLECT_NEXT", dsa_decode.COLLECT_NEXT, "radix select: the collect pass counts the next digit"),
              ("NEXT_DENSE", dsa_decode.NEXT_DENSE, "... by atomics per candidate up to this many per block"),
              ("FP8_QUERY", True, "fp8 index keys: e4m3 q in the scan (the op's semantics, dsa_index_topk_ref)"),
              ("RERANK", node.attrs.get("rerank", 0), "fp8-rerank: candidates beyond TOPK re-ranked exactly"),
              ("RERANK_BLOCK", dsa_rerank.RERANK_BLOCK, "... per re-scoring program"),
              ("RERANK_WARPS", dsa_rerank.RERANK_WARPS, "... its warps"),
              ("RANK_BLOCK", dsa_rerank.RANK_BLOCK, "... per ranking program"),
              ("RANK_SELECT_MIN_ROWS", dsa_rerank.RANK_SELECT_MIN_ROWS, "... rows from which a radix select ranks"),
              ("SELECT_WARPS", dsa_rerank.SELECT_WARPS, "... its warps")]
    body = (
        "def launch(inputs, outputs, sizes, scratch=None):\n"
        '    """ABI entry: inputs (q_i, w, k_i[, k_scale[, k_lo]]), outputs [idx i64 [B,T,TOPK]], scratch: the planned '
        'sort keys (and re-rank candidates)."""\n'
        f"    launch_dsa_index_topk(inputs[{ip[0]}], inputs[{ip[1]}], inputs[{ip[2]}], outputs[{op[0]}], topk=TOPK,\n"
        f"                          k_scale={f'inputs[{ip[3]}]' if len(ip) > 3 else None}, "
        f"k_lo={f'inputs[{ip[4]}]' if len(ip) > 4 else None}, rerank_extra=RERANK,\n"
        '                          lengths=sizes.get("lengths"), scratch=scratch)\n')
    body = inspect.getsource(radix_topk) + "\n\n" + body
    return _module(group, "dsa_index_topk (score kernel + torch.topk on packed int64 keys; decode at long context: "
                   "radix select)", consts, [take_scratch, fp8_query, dsa_score_kernel, *dsa_decode.KERNELS,
                                             *dsa_rerank.KERNELS],
                   launch_dsa_index_topk, body)


@scratch("dsa_index_topk")
def dsa_index_topk_scratch(group: KernelGroup) -> list[ScratchSpec]:
    """The scratch of one `dsa_index_topk` launch (`launch_dsa_index_topk`): the flat i64 sort keys or radix-select
    words [max(B·(L + RADIX_ROW_PAD), min(SCRATCH_BYTES // 8, B·T·L))] for q_i [B, T, ·, ·] and k_i [B, L, ·],
    non-decreasing in B, T and L (so the plan at the bounds holds every call); with k_lo also "rerank", i64
    [2·B·T·(topk + rerank)]. Raises UnsupportedError for a group that is not a single dsa_index_topk node."""
    node, _, _ = one_node(group, "dsa_index_topk")
    (B, T), L = node.inputs[0].type.shape[:2], node.inputs[2].type.shape[1]
    n = sympy.Max(B * L + B * RADIX_ROW_PAD, sympy.Min(SCRATCH_BYTES // 8, B * T * L))
    specs = [ScratchSpec("keys", TensorType((n,), "i64"))]
    if len(node.inputs) > 4:
        specs.append(ScratchSpec("rerank", TensorType((2 * B * T * (node.attrs["topk"] + node.attrs["rerank"]),),
                                                      "i64")))
    return specs
