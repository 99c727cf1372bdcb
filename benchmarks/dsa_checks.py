"""Inputs, torch references and the compiled decode step of `bench_dsa.py` (K3.1 shapes: indexer J = 32 heads x
DI = 128, top-2048, absorbed latent attention over H = 96 heads x DL = 576, values the first DV = 512).

References: `ref_topk` (torch fp32 scores + torch.topk), `ref_topk_fp8` (the FP8 option's scores, `dsa_index_topk_ref`'s
semantics), `ref_topk_rerank` (the fp8-rerank option's selection, the same semantics, in torch on the device),
`ref_attention` (torch gather + softmax); `compiled_decode` runs one decode step as the compiled model launches it
(index keys bf16, fp8 or fp8-rerank), `decode_bytes` is its HBM floor's bytes.
"""

import torch

from k3c.codegen.triton import attention, dsa_index, dsa_rerank
from k3c.codegen.triton.attention import launch_mla
from k3c.codegen.triton.dsa_decode import dsa_decode_topk, quantize_index_keys
from k3c.ir.ops.model_attn import _fp8_query, fp8_join_ref, fp8_split_ref

J, DI, TOPK, H, DL, DV = 32, 128, 2048, 96, 576, 512
SCALE = (128 + 64) ** -0.5




def make(B, L, seed, dev):
    """The bench's inputs on `dev`: index q_i [B, J, DI] bf16, w [B, J], keys k_i [B, L, DI] bf16 with their e4m3
    form (k8, ks) and their fp8-rerank form (k8r, ksr, lor: `fp8_split_ref`), attention q [B, 1, H, DL] and
    latents kv [B, L, DL] bf16 (seeded Gaussians)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    bf = torch.bfloat16
    k_i = torch.randn(B, L, DI, generator=g, device=dev).to(bf)
    k8, ks = quantize_index_keys(k_i)
    k8r, ksr, lor = fp8_split_ref({}, k_i)
    return dict(q_i=torch.randn(B, J, DI, generator=g, device=dev).to(bf),
                w=torch.randn(B, J, generator=g, device=dev) * J ** -0.5, k_i=k_i, k8=k8, ks=ks, k8r=k8r, ksr=ksr,
                lor=lor,
                q=torch.randn(B, 1, H, DL, generator=g, device=dev).to(bf),
                kv=torch.randn(B, L, DL, generator=g, device=dev).to(bf))


def dsa_decode(q_i, w, k_i, q, kv, k_scale=None, k_lo=None):
    """One DSA decode step: the radix top-k set (k_lo: re-ranked, fp8-rerank), then the absorbed sparse latent
    attention over it."""
    out = torch.empty((q.shape[0], 1, H, DV), dtype=q.dtype, device=q.device)
    launch_mla(q, kv, None, dsa_decode_topk(q_i, w, k_i, TOPK, k_scale, k_lo=k_lo), out, absorbed=True,
               causal=True, scale=SCALE, v_dim=DV, dense_max_keys=None)
    return out


def ref_topk(x, k_i):
    s = torch.einsum("bj,bjs->bs", x["w"].float(), torch.einsum("bjd,bsd->bjs", x["q_i"].float(), k_i).relu())
    return torch.topk(s, TOPK, dim=-1).indices


def ref_attention(x, idx):
    B = idx.shape[0]
    rows = torch.gather(x["kv"], 1, idx[..., None].expand(B, TOPK, DL)).float()
    p = torch.softmax(torch.einsum("bhd,bsd->bhs", x["q"][:, 0].float(), rows) * SCALE, -1)
    return torch.einsum("bhs,bsd->bhd", p, rows[..., :DV])[:, None]


def ref_topk_fp8(x):
    """torch.topk of the FP8 option's scores (`dsa_index_topk_ref`'s: e4m3 q per head, e4m3 keys x their scales)."""
    q8, w8 = _fp8_query(x["q_i"], x["w"])
    s = torch.einsum("bj,bjs->bs", w8, torch.einsum("bjd,bsd->bjs", q8, x["k8"].float()).relu()) * x["ks"]
    return torch.topk(s, TOPK, dim=-1).indices


def ref_topk_rerank(x, extra):
    """The fp8-rerank option's set (`dsa_index_topk_ref` with k_lo): the TOPK + extra best fp8 scores (e4m3 q, the
    e4m3 keys of `fp8_split_ref` x their scales; torch.topk), re-ranked by the joined keys' fp32 scores."""
    q8, w8 = _fp8_query(x["q_i"], x["w"])
    s8 = torch.einsum("bj,bjs->bs", w8, torch.einsum("bjd,bsd->bjs", q8, x["k8r"].float()).relu()) * x["ksr"]
    cand = torch.topk(s8, TOPK + extra, dim=-1).indices
    keys = torch.gather(fp8_join_ref(x["k8r"], x["ksr"], x["lor"]), 1, cand[..., None].expand(*cand.shape, DI))
    s = torch.einsum("bj,bjc->bc", x["w"].float(), torch.einsum("bjd,bcd->bjc", x["q_i"].float(), keys).relu())
    return torch.gather(cand, 1, torch.topk(s, TOPK, dim=-1).indices)


def decode_buffers(B, L, dev, extra=dsa_rerank.RERANK_EXTRA):
    """The compiled decode step's planned buffers: the index select's i64 scratch ("keys"; "rerank": fp8-rerank's
    candidates and their keys, for `extra`), the attention's split-K partials ("o_part", "lse"), the selection idx
    and the output o."""
    rows = attention.split_rows(B, H, True)
    return dict(keys=torch.empty((B * (L + dsa_index.RADIX_ROW_PAD),), dtype=torch.int64, device=dev),
                rerank=torch.empty((2 * B * (TOPK + extra),), dtype=torch.int64, device=dev),
                o_part=torch.empty((rows * H * DV,), dtype=torch.float32, device=dev),
                lse=torch.empty((rows * H,), dtype=torch.float32, device=dev),
                idx=torch.empty((B, 1, TOPK), dtype=torch.int64, device=dev),
                o=torch.empty((B, 1, H, DV), dtype=torch.bfloat16, device=dev))


KEY_FORMS = {"bf16": ("k_i", None, None), "fp8": ("k8", "ks", None), "fp8-rerank": ("k8r", "ksr", "lor")}
# index keys: tensor, scales, residuals


def compiled_decode(s, keys, bufs, lengths, mod=None, extra=dsa_rerank.RERANK_EXTRA):
    """One DSA decode step as the compiled model launches it (device lengths, planned scratch, dense guard at
    TOPK): `dsa_index.launch_dsa_index_topk` (mod: a dsa_decode module instead, e.g. the baseline, through its
    `radix_topk`, which launch_dsa_index_topk calls the same way) into idx, then `launch_mla`. keys: a KEY_FORMS
    name; extra: fp8-rerank's E (bufs from `decode_buffers` with the same). Returns the output o."""
    k, ks, lo = (s[n] if n else None for n in KEY_FORMS[keys])
    if mod is None:
        dsa_index.launch_dsa_index_topk(s["q_i"][:, None], s["w"][:, None], k, bufs["idx"], topk=TOPK, k_scale=ks,
                                        k_lo=lo, rerank_extra=extra if lo is not None else 0, lengths=lengths,
                                        scratch=bufs)
    else:
        mod.radix_topk(s["q_i"], s["w"], k, TOPK, ks, False, lengths=lengths, out=bufs["idx"],
                       scratch=bufs["keys"].view(torch.int32))
    launch_mla(s["q"], s["kv"], None, bufs["idx"], bufs["o"], absorbed=True, causal=True, scale=SCALE, v_dim=DV,
               dense_max_keys=TOPK, lengths=lengths, scratch=bufs)
    return bufs["o"]


def tiny_fp8_check(B, dev, L=20000, Jt=4, Dt=16, topk=256):
    """The compiled path with 16-wide fp8 keys (k3.1-pro-tiny's indexer; `dsa_index.FP8_RADIX_MIN_D` sends them to the
    score kernel + torch.topk at every length), against `dsa_index_topk_ref` on the CPU: set overlap (min over rows),
    whether the e4m3 query quantized on `dev` equals the CPU's, and for each row that differs: its w, the reference
    threshold score, the keys tied with it, and the reference scores of the keys only the kernel took."""
    from k3c.ir.ops.model_attn import dsa_index_topk_ref
    g = torch.Generator(device=dev).manual_seed(5)
    q_i = torch.randn(B, 1, Jt, Dt, generator=g, device=dev)
    w = torch.randn(B, 1, Jt, generator=g, device=dev)
    k8, ks = quantize_index_keys(torch.randn(B, L, Dt, generator=g, device=dev))
    out = torch.empty(B, 1, topk, dtype=torch.int64, device=dev)
    dsa_index.launch_dsa_index_topk(q_i, w, k8, out, topk=topk, k_scale=ks)
    cpu = [t.cpu() for t in (q_i, w, k8, ks)]
    ref = dsa_index_topk_ref({"topk": topk}, *cpu)[0]
    q8, w8 = _fp8_query(*cpu[:2])
    score = torch.einsum("bj,bjs->bs", w8[:, 0], torch.einsum("bjd,bsd->bjs", q8[:, 0], cpu[2].float()).relu()) * cpu[3]
    r = dict(q8_equal_on_device=bool(torch.equal(dsa_index.fp8_query(q_i, w)[0].cpu().float(), q8)), rows={})
    ov = []
    for b, (got, want) in enumerate(zip(out.cpu()[:, 0], ref[:, 0])):
        only = sorted(set(got.tolist()) - set(want.tolist()))
        ov.append(1 - len(only) / topk)
        if only:
            tau = score[b, want[-1]].item()
            r["rows"][b] = dict(w=cpu[1][b, 0].tolist(), threshold=tau, tied=int((score[b] == tau).sum()),
                                kernel_only_scores=score[b, only].tolist()[:12])
    r["overlap_min"] = min(ov)
    return r


def decode_bytes(B, L, keys, extra=dsa_rerank.RERANK_EXTRA):
    """HBM floor bytes of one decode step: index keys (+ scales; fp8-rerank: + the TOPK + extra candidates' keys,
    scales and residuals), the TOPK selected latent rows, q_i, w, q, o. keys: a KEY_FORMS name."""
    rerank = B * (TOPK + extra) * (DI * 3 // 2 + 4) if keys == "fp8-rerank" else 0
    return (B * L * (DI + 4 if keys != "bf16" else 2 * DI) + rerank + B * TOPK * DL * 2 + B * J * (DI * 2 + 4)
            + B * H * DL * 2 + B * H * DV * 2)


def overlap(a, b):
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    return min(len(set(a[i].tolist()) & set(b[i].tolist())) / TOPK for i in range(a.shape[0]))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
