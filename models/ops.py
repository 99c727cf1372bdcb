"""The K3 family's custom operators, registered with `torch.library` under the `k3` namespace.

Only the parts that are not plain tensor algebra are custom ops: the KDA delta-rule recurrence, the DSA lightning
indexer's causal top-k, and MoE routing / expert application. Everything around them (convs, norms, gates, MLA,
AttnRes) is plain torch in `models/k3.py`, so `torch.export` shows it to the compiler. Each op has a CPU/CUDA
reference (the implementations below, device-agnostic torch) and a fake kernel for tracing with symbolic shapes.

Ops (all functional: states are returned, never mutated):
- `k3::kda_recurrence(q, k, v, g, beta, state) -> (o, new_state)`
- `k3::dsa_topk(q_idx, w, k_idx, topk) -> idx`
- `k3::moe_route(logits, bias, top_k, scaling, renormalize) -> (weights, ids)`
- `k3::moe_experts(z, weights, ids, w1, w3, w2, act, beta, linear_beta) -> y`
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 16  # tokens per chunk of the chunked (WY/UT) KDA form


# ---- KDA ---------------------------------------------------------------------------------------------------------
def kda_recurrence_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """KDA delta rule, one token at a time (K3-SPEC.md "KDA layer"; Kimi Linear report eq. 1).

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T ;  o_t = S_t^T q_t.
    q, k, g: [B,T,H,K]; v: [B,T,H,V]; beta: [B,T,H]; state: [B,H,K,V]. q already l2-normalised and scaled by
    K^-0.5; g is the log-decay (<= 0). Computed in fp32; returns (o [B,T,H,V] in v's dtype, state fp32).
    """
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = state.float().clone()
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)  # Diag(exp g_t) S_{t-1}
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)  # S^T k: what the state currently recalls for k_t
        S = S + torch.einsum("bhk,bhv->bhkv", kt, bt * (vt - pred))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return o.to(dtype), S


def kda_recurrence_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                           chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The same recurrence in chunked (WY/UT) form, exact up to fp32 rounding.

    Within a chunk with cumulative log-decay G_t = sum_{s<=t} g_s (per key channel) and pseudo-values u:
      u = (I + A)^-1 diag(beta) (V - (K * exp G) S_0),  A[t,i] = beta_t sum_d k_t k_i exp(G_t - G_i), i < t
      O = (Q * exp G) S_0 + (Q K^T masked incl., with exp(G_t - G_i)) u
      S_C = exp(G_C) S_0 + (K * exp(G_C - G))^T u
    Pairwise decays exp(G_t - G_i) with i <= t are <= 1, so no term overflows for any gate. Shapes as in
    `kda_recurrence_step`.
    """
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = state.float().clone()
    B, T, H, K = q.shape
    outs = []
    for c0 in range(0, T, chunk):
        qc, kc, vc, gc, bc = (x[:, c0:c0 + chunk].transpose(1, 2) for x in (q, k, v, g, beta))  # [B,H,C,...]
        C = qc.shape[2]
        G = gc.cumsum(2)  # [B,H,C,K]
        decay = (G.unsqueeze(3) - G.unsqueeze(2)).clamp(max=0).exp()  # [B,H,C(t),C(i),K]: exp(G_t - G_i) for i<=t
        kk = torch.einsum("bhtk,bhik,bhtik->bhti", kc, kc, decay)
        strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
        A = (kk * bc.unsqueeze(-1)).masked_fill(~strict, 0)
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("bhtk,bhkv->bhtv", kc * G.exp(), S))
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("bhtk,bhik,bhtik->bhti", qc, kc, decay).masked_fill(~(strict | eye.bool()), 0)
        outs.append(torch.einsum("bhtk,bhkv->bhtv", qc * G.exp(), S) + qk @ u)
        G_end = G[:, :, -1:]  # [B,H,1,K]
        S = G_end.squeeze(2).exp().unsqueeze(-1) * S + torch.einsum("bhtk,bhtv->bhkv", kc * (G_end - G).exp(), u)
    o = torch.cat(outs, 2).transpose(1, 2) if outs else v.new_zeros(v.shape)
    return o.to(dtype), S


@torch.library.custom_op("k3::kda_recurrence", mutates_args=())
def kda_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """KDA delta-rule recurrence: step form for decode (T == 1), chunked form for prefill (T > 1)."""
    o, S = (kda_recurrence_step if q.shape[1] == 1 else kda_recurrence_chunked)(q, k, v, g, beta, state)
    return o.contiguous(), S.contiguous()  # contiguous whatever the inputs' strides, as the fake says


@kda_recurrence.register_fake
def _(q, k, v, g, beta, state):
    return v.new_empty(v.shape), state.new_empty(state.shape, dtype=torch.float32)


# ---- DSA ---------------------------------------------------------------------------------------------------------
def dsa_scores(q_idx: Tensor, w: Tensor, k_idx: Tensor) -> Tensor:
    """Lightning-indexer scores I[t,s] = sum_j w[t,j] ReLU(q_idx[t,j] . k_idx[s]) (DeepSeek-V3.2, eq. 1), causal.

    q_idx: [B,T,J,D]; w: [B,T,J]; k_idx: [B,L,D] with the T current tokens last (query t is at absolute position
    L - T + t). Returns fp32 [B,T,L] with -inf where s > L - T + t.
    """
    T, L = q_idx.shape[1], k_idx.shape[1]
    s = torch.einsum("btjd,bsd->btjs", q_idx.float(), k_idx.float()).relu()
    scores = torch.einsum("btj,btjs->bts", w.float(), s)
    visible = torch.arange(L, device=q_idx.device)[None, :] <= (torch.arange(T, device=q_idx.device) + (L - T))[:, None]
    return scores.masked_fill(~visible, float("-inf"))


@torch.library.custom_op("k3::dsa_topk", mutates_args=())
def dsa_topk(q_idx: Tensor, w: Tensor, k_idx: Tensor, topk: int) -> Tensor:
    """Causal top-k of the lightning indexer: int64 [B,T,topk] key positions, best first, -1 where a row sees
    fewer than `topk` keys. Ties go to the lowest position (a stable sort). Shapes as in `dsa_scores`."""
    scores = dsa_scores(q_idx, w, k_idx)
    L = scores.shape[-1]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    picked = torch.gather(scores, -1, order)
    idx = torch.where(torch.isfinite(picked), order, torch.full_like(order, -1))
    if L < topk:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], topk - L), -1)], -1)
    return idx.contiguous()


@dsa_topk.register_fake
def _(q_idx, w, k_idx, topk):
    return q_idx.new_empty((q_idx.shape[0], q_idx.shape[1], topk), dtype=torch.int64)


# ---- MoE ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("k3::moe_route", mutates_args=())
def moe_route(logits: Tensor, bias: Tensor, top_k: int, scaling: float, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Sigmoid router with a selection-only bias (K3-SPEC.md "MLP and Stable LatentMoE"; DeepSeek-V3 §2.1.2).

    logits: [N,E] fp32 (x . gate^T); bias: [E] (e_score_correction_bias). s = sigmoid(logits); the top-k of
    s + bias are chosen (ties to the lowest expert id); weights p = s[chosen] / (sum s[chosen] + 1e-20) * scaling
    (without renormalize: s[chosen] * scaling). Returns (weights fp32 [N,k], ids int64 [N,k]).
    """
    s = logits.float().sigmoid()
    ids = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    p = s.gather(-1, ids)
    if renormalize:
        p = p / (p.sum(-1, keepdim=True) + 1e-20)
    return (p * scaling).contiguous(), ids.contiguous()


@moe_route.register_fake
def _(logits, bias, top_k, scaling, renormalize):
    n = logits.shape[0]
    return logits.new_empty((n, top_k), dtype=torch.float32), logits.new_empty((n, top_k), dtype=torch.int64)


def glu_act(g: Tensor, u: Tensor, act: str, beta: float, linear_beta: float) -> Tensor:
    """Gated activation. "situ" (SiTU-GLU, config activation_situ_beta / _linear_beta):
    [beta tanh(g/beta) * sigmoid(g)] * [linear_beta tanh(u/linear_beta)], bounded by beta*linear_beta.
    "silu" (SwiGLU): silu(g) * u."""
    if act == "situ":
        return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return torch.nn.functional.silu(g) * u


@torch.library.custom_op("k3::moe_experts", mutates_args=())
def moe_experts(z: Tensor, weights: Tensor, ids: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, act: str, beta: float,
                linear_beta: float) -> Tensor:
    """Weighted sum of routed experts: y_n = sum_i weights[n,i] * E_{ids[n,i]}(z_n), E(z) = w2 act(w1 z, w3 z).

    z: [N,D]; weights fp32 [N,k]; ids int64 [N,k]; w1, w3: [E,I,D]; w2: [E,D,I]. Tokens are grouped by expert so
    each expert's GEMMs run once. Accumulates in fp32; returns [N,D] in z's dtype.
    """
    out = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    tok = order // ids.shape[1]
    wt = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows, zz = tok[start:start + n], z[tok[start:start + n]]
            h = glu_act(zz @ w1[e].T, zz @ w3[e].T, act, beta, linear_beta)
            out.index_add_(0, rows, (h @ w2[e].T).float() * wt[start:start + n, None])
        start += n
    return out.to(z.dtype)


@moe_experts.register_fake
def _(z, weights, ids, w1, w3, w2, act, beta, linear_beta):
    return z.new_empty(z.shape)
