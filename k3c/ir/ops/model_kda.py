"""Model-level ops of the KDA token mixer: rms_norm, l2norm, causal_conv1d, kda_recurrence, kda_fused.

Formulas: /work/shared/K3-SPEC.md, "KDA layer" (Kimi Linear report eq. 1; fla `fla/ops/kda/naive.py`).
References compute in fp32 and round once to the output dtype. Dims: B batch, T new tokens, H heads,
K = V = head_dim, W conv kernel (4).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from k3c.errors import IRError
from k3c.ir.ops.registry import Attr, need_dtype, need_eq, need_rank, op, per_elem
from k3c.ir.types import FLOAT_DTYPES, dim, numel

_F = {"f32", "bf16", "f16"}
#: storage dtypes of the recurrent state `kda_fused` reads and writes (`CompileContext.kda_state_dtype`)
STATE_DTYPES = {"f32", "bf16"}


# ---- norms ------------------------------------------------------------------------------------------------------
def rms_norm_ref(x, weight, eps: float):
    """y = x · rsqrt(mean(x², -1) + eps) [· weight], in fp32, returned in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


@op("rms_norm", inputs=["x", "weight?"], attrs={"eps": Attr("float")}, kind="model",
    ref=lambda a, x, w=None: [rms_norm_ref(x, w, a["eps"])], flops=per_elem(4))
def _rms_norm(attrs, x, w=None):
    """rms_norm(x [..., D], weight? [D]) {eps} -> x's type. RMSNorm over the last dim (weight may be fp32)."""
    need_dtype("rms_norm", x, _F)
    if w is not None:
        need_dtype("rms_norm", w, _F, "weight")
        if w.rank != 1:
            raise IRError(f"rms_norm: weight must be [D], got {w}")
        need_eq("rms_norm", w.shape[0], x.shape[-1], "weight size vs last dim")
    return [x]


def l2norm_ref(x, eps: float = 1e-6, d: int = -1):
    """y = x / sqrt(Σ x² + eps) along `d` (K3-SPEC.md: l2norm eps 1e-6), fp32 inside, x.dtype out."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(d, keepdim=True) + eps)).to(x.dtype)


@op("l2norm", inputs=["x"], attrs={"eps": Attr("float", 1e-6), "dim": Attr("int", -1)}, kind="model",
    ref=lambda a, x: [l2norm_ref(x, a["eps"], a["dim"])], flops=per_elem(3))
def _l2norm(attrs, x):
    """l2norm(x) {eps=1e-6, dim=-1} -> x's type: x / sqrt(Σ x² + eps)."""
    need_dtype("l2norm", x, _F)
    return [x]


# ---- short conv ------------------------------------------------------------------------------------------------
def causal_conv1d_ref(x, weight, state):
    """x [B,T,C], weight [C,1,W], state [B,C,W] -> (y [B,T,C] x.dtype, new state [B,C,W] state.dtype).

    window = [state | xᵀ] ([B, C, W+T]); y_t = Σ_w weight[c,0,w] · window[:, c, t+1+w]; new state = last W
    columns of window. The first state column is not read by the output (it only needs W−1 past inputs) but is
    kept, as the state holds the last W inputs (same layout as models/layers.py and fla causal_conv1d_update).
    """
    W = weight.shape[-1]
    window = torch.cat([state.float(), x.float().transpose(1, 2)], -1)
    y = F.conv1d(window[:, :, 1:], weight.float(), groups=weight.shape[0])
    return y.transpose(1, 2).to(x.dtype), window[:, :, -W:].to(state.dtype).contiguous()


@op("causal_conv1d", inputs=["x", "weight", "conv_state"], kind="model",
    ref=lambda a, x, w, s: list(causal_conv1d_ref(x, w, s)),
    flops=lambda a, ins, outs: numel(ins[0]) * ins[1].shape[2] * 2)
def _causal_conv1d(attrs, x, w, s):
    """causal_conv1d(x [B,T,C], weight [C,1,W], conv_state [B,C,W]) -> (y [B,T,C], new_state [B,C,W]).

    Depthwise causal conv over [state | x], no bias, no activation. See `causal_conv1d_ref`.
    """
    need_rank("causal_conv1d", x, 3, "x")
    need_rank("causal_conv1d", w, 3, "weight")
    need_rank("causal_conv1d", s, 3, "conv_state")
    need_eq("causal_conv1d", w.shape[0], x.shape[2], "weight channels vs x channels")
    need_eq("causal_conv1d", w.shape[1], 1, "weight must be depthwise [C,1,W]")
    need_eq("causal_conv1d", s.shape[0], x.shape[0], "state batch")
    need_eq("causal_conv1d", s.shape[1], x.shape[2], "state channels")
    need_eq("causal_conv1d", s.shape[2], w.shape[2], "state width vs kernel")
    return [x, s]


# ---- delta rule ------------------------------------------------------------------------------------------------
def kda_recurrence_ref(q, k, v, g, beta, state, scale: float = 1.0):
    """Per-token KDA delta rule (K3-SPEC.md "KDA layer"), fp32:

        S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ ;  o_t = S_tᵀ (scale · q_t)

    q, k, g [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; state [B,H,K,V]. Returns (o [B,T,H,V] v.dtype, S fp32).
    """
    qf, kf, vf, gf, bf = (t.float() for t in (q, k, v, g, beta))
    S = state.float().clone()
    o = torch.empty(vf.shape, dtype=torch.float32)
    for t in range(q.shape[1]):
        S = S * gf[:, t].exp().unsqueeze(-1)
        kt = kf[:, t]
        recall = (kt.unsqueeze(-1) * S).sum(-2)  # kᵀ S: [B,H,V]
        S = S + (bf[:, t, :, None] * kt).unsqueeze(-1) * (vf[:, t] - recall).unsqueeze(-2)
        o[:, t] = (qf[:, t].unsqueeze(-1) * S).sum(-2) * scale
    return o.to(v.dtype), S


def _check_qkvg(name, q, k, v, g, beta, state):
    for t, n in ((q, "q"), (k, "k"), (v, "v"), (g, "g")):
        need_rank(name, t, 4, n)
        need_dtype(name, t, _F, n)
    need_rank(name, beta, 3, "beta")
    need_rank(name, state, 4, "state")
    need_dtype(name, state, {"f32"}, "state")
    for t, n in ((k, "k"), (g, "g")):
        for i in range(4):
            need_eq(name, t.shape[i], q.shape[i], f"{n} dim {i} vs q")
    for i in range(3):
        need_eq(name, v.shape[i], q.shape[i], f"v dim {i} vs q")
        need_eq(name, beta.shape[i], q.shape[i], f"beta dim {i} vs q")
    for i, d in enumerate((q.shape[0], q.shape[2], q.shape[3], v.shape[3])):
        need_eq(name, state.shape[i], d, f"state dim {i}")


@op("kda_recurrence", inputs=["q", "k", "v", "g", "beta", "state"], attrs={"scale": Attr("float", 1.0)},
    kind="model", ref=lambda a, *t: list(kda_recurrence_ref(*t, scale=a["scale"])),
    flops=lambda a, ins, outs: numel(ins[2]) * ins[0].shape[3] * 8)
def _kda_recurrence(attrs, q, k, v, g, beta, state):
    """kda_recurrence(q, k, v, g, beta, state) {scale=1} -> (o [B,T,H,V] v.dtype, new_state [B,H,K,V] f32).

    Matches `k3::kda_recurrence` of models/ops.py (q already l2-normalised and scaled there: scale stays 1), whose
    state is f32; a state stored in bf16 (`kda_state="bf16"` at import) reaches it through casts, which `fuse_kda`
    folds into `kda_fused`, the op that carries the storage dtype.
    """
    _check_qkvg("kda_recurrence", q, k, v, g, beta, state)
    return [v, state]


# ---- the whole mixer -------------------------------------------------------------------------------------------
KDA_FUSED_INPUTS = ["q", "k", "v", "f", "beta", "gate", "q_conv", "k_conv", "v_conv", "A_log", "dt_bias",
                    "o_norm", "state", "conv_state"]


def kda_fused_ref(attrs, q, k, v, f, beta, gate, q_conv, k_conv, v_conv, A_log, dt_bias, o_norm, state,
                  conv_state):
    """The KDA layer between the input projections and o_proj (K3-SPEC.md "KDA layer"), fp32 inside:

        q, k, v = silu(causal_conv1d(·)) on conv_state rows [0:HK], [HK:2HK], [2HK:3HK]
        q = l2norm(q per head) · K^-0.5 ; k = l2norm(k per head)
        a = exp(A_log[:H]) per head ; f' = f + dt_bias
        g = lower_bound · sigmoid(a · f')            (gate="lower_bound", K3)
        g = −a · softplus(f')                       (gate="softplus", Kimi Linear)
        o, S = kda_recurrence(q, k, v, g, sigmoid(beta), state)
        y = rms_norm_per_head(o; o_norm, eps) ⊙ sigmoid(gate)       -> [B, T, H·V]

    The state is read in its storage dtype (f32 or bf16), widened to f32, carried in f32 over the T tokens and
    rounded to the storage dtype once at the end (round to nearest even), as the Triton kernels store it
    (`k3c/codegen/triton/kda_*.py`: load, `.to(float32)`, ..., `.to(state_out.dtype)` on store).
    """
    H, K = attrs["heads"], attrs["head_dim"]
    B, T, HK = q.shape
    cs = conv_state
    outs, states = [], []
    for x, w, i in ((q, q_conv, 0), (k, k_conv, 1), (v, v_conv, 2)):
        y, s = causal_conv1d_ref(x.float(), w, cs[:, i * HK:(i + 1) * HK])
        outs.append(F.silu(y).view(B, T, H, K))
        states.append(s)
    qh, kh, vh = outs
    qh = l2norm_ref(qh, 1e-6) * K ** -0.5
    kh = l2norm_ref(kh, 1e-6)
    a = A_log.float().reshape(-1)[:H].exp().view(1, 1, H, 1)
    fb = (f.float() + dt_bias.float()).view(B, T, H, K)
    if attrs["gate"] == "lower_bound":
        g = attrs["lower_bound"] * torch.sigmoid(a * fb)
    else:
        g = -a * F.softplus(fb)
    o, S = kda_recurrence_ref(qh, kh, vh, g, torch.sigmoid(beta.float()), state)
    o = rms_norm_ref(o, o_norm, attrs["eps"]) * torch.sigmoid(gate.float().view(B, T, H, K))
    return [o.reshape(B, T, HK).to(q.dtype), S.to(state.dtype), torch.cat(states, 1).to(conv_state.dtype)]


@op("kda_fused", inputs=KDA_FUSED_INPUTS,
    attrs={"heads": Attr("int"), "head_dim": Attr("int"),
           "gate": Attr("str", "lower_bound", ("lower_bound", "softplus")),
           "lower_bound": Attr("float", -5.0), "eps": Attr("float", 1e-5)},
    kind="model", ref=kda_fused_ref,
    flops=lambda a, ins, outs: numel(ins[2]) * (a["head_dim"] * 8 + 3 * 2 * ins[6].shape[2] + 30))
def _kda_fused(attrs, q, k, v, f, beta, gate, q_conv, k_conv, v_conv, A_log, dt_bias, o_norm, state, conv_state):
    """kda_fused(q, k, v, f [B,T,H·K], beta [B,T,H], gate [B,T,H·K], q_conv, k_conv, v_conv [H·K,1,W],
    A_log [>=H elements], dt_bias [H·K], o_norm [K], state [B,H,K,K] f32 or bf16 (its storage dtype),
    conv_state [B,3·H·K,W]) {heads, head_dim, gate="lower_bound"|"softplus", lower_bound=-5, eps (o_norm)}
    -> (y [B,T,H·K] q.dtype (pre-o_proj), new state (state's type), new conv state). See `kda_fused_ref`.
    """
    n = "kda_fused"
    H, K = attrs["heads"], attrs["head_dim"]
    HK = H * K
    need_rank(n, q, 3, "q")
    B, T = q.shape[0], q.shape[1]
    for t, nm in ((q, "q"), (k, "k"), (v, "v"), (f, "f"), (gate, "gate")):
        need_rank(n, t, 3, nm)
        need_dtype(n, t, _F, nm)
        need_eq(n, t.shape[0], B, f"{nm} batch")
        need_eq(n, t.shape[1], T, f"{nm} tokens")
        need_eq(n, t.shape[2], HK, f"{nm} width vs heads·head_dim")
    need_rank(n, beta, 3, "beta")
    need_eq(n, beta.shape[2], H, "beta heads")
    for t, nm in ((q_conv, "q_conv"), (k_conv, "k_conv"), (v_conv, "v_conv")):
        if t != q_conv:
            raise IRError(f"{n}: conv weights differ: {q_conv} vs {t}")
        need_rank(n, t, 3, nm)
        need_eq(n, t.shape[0], HK, f"{nm} channels")
        need_eq(n, t.shape[1], 1, f"{nm} is depthwise")
    W = q_conv.shape[2]
    if not A_log.is_concrete() or math.prod(A_log.shape) < H:
        raise IRError(f"{n}: A_log {A_log} needs >= {H} elements")
    need_eq(n, numel(dt_bias), HK, "dt_bias size")
    need_rank(n, o_norm, 1, "o_norm")
    need_eq(n, o_norm.shape[0], K, "o_norm size")
    need_dtype(n, state, STATE_DTYPES, "state")
    if tuple(state.shape) != (B, H, K, K) and any(dim(a - b) != 0 for a, b in zip(state.shape, (B, H, K, K))):
        raise IRError(f"{n}: state {state} is not [B,{H},{K},{K}]")
    need_rank(n, conv_state, 3, "conv_state")
    for i, d in enumerate((B, 3 * HK, W)):
        need_eq(n, conv_state.shape[i], d, f"conv_state dim {i}")
    for t in (A_log, dt_bias, o_norm, q_conv):
        need_dtype(n, t, FLOAT_DTYPES - {"f8e4m3"})
    return [q, state, conv_state]

