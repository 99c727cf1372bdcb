"""Model-level ops of the MoE block: moe_route, moe_experts (the collectives are `collective.py`).

Formulas: /work/shared/K3-SPEC.md "MLP and Stable LatentMoE" (router: DeepSeek-V3 §2.1.2). Signatures follow
`k3::moe_route` / `k3::moe_experts` of models/ops.py (note: moe_experts takes weights before ids).
"""

from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F

from k3c.errors import IRError
from k3c.ir.ops.registry import Attr, need_dtype, need_eq, need_rank, op
from k3c.ir.formats import MXFP4_GROUP, WEIGHT_FORMATS, mxfp4_dequantize
from k3c.ir.types import TensorType, dim, numel


def moe_route_ref(attrs, logits, bias):
    """s = sigmoid(logits) (fp32); ids = top-k of s + bias (ties to the lowest expert id, stable sort);
    weights = s[ids] / (Σ s[ids] + 1e-20) · scaling  (renormalize=False: s[ids] · scaling).
    The bias only chooses; it never enters the weights. Returns (weights f32 [N,k], ids i64 [N,k])."""
    s = logits.float().sigmoid()
    ids = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices[:, :attrs["top_k"]]
    p = s.gather(-1, ids)
    if attrs["renormalize"]:
        p = p / (p.sum(-1, keepdim=True) + 1e-20)
    return [p * attrs["scaling"], ids]


@op("moe_route", inputs=["logits", "bias"],
    attrs={"top_k": Attr("int"), "scaling": Attr("float", 1.0), "renormalize": Attr("bool", True)},
    kind="model", ref=moe_route_ref, flops=lambda a, ins, outs: numel(ins[0]) * 8)
def _moe_route(attrs, logits, bias):
    """moe_route(logits f32 [N,E], bias [E]) {top_k, scaling=1, renormalize=True} -> (weights f32 [N,k], ids i64)."""
    n = "moe_route"
    need_rank(n, logits, 2, "logits")
    need_dtype(n, logits, {"f32"}, "logits")
    need_rank(n, bias, 1, "bias")
    need_eq(n, bias.shape[0], logits.shape[1], "bias size vs experts")
    k = attrs["top_k"]
    if k < 1 or (isinstance(logits.shape[1], int) and k > logits.shape[1]):
        raise IRError(f"{n}: top_k {k} out of range for {logits.shape[1]} experts")
    return [TensorType((logits.shape[0], k), "f32"), TensorType((logits.shape[0], k), "i64")]


def glu_act(g, u, act: str, beta: float, linear_beta: float):
    """SiTU-GLU: [β·tanh(g/β) ⊙ sigmoid(g)] ⊙ [β_lin·tanh(u/β_lin)] (config activation_situ_beta / _linear_beta);
    SwiGLU ("silu"): silu(g) ⊙ u."""
    if act == "situ":
        return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return F.silu(g) * u


def moe_experts_ref(attrs, z, weights, ids, w1, w3, w2, *scales):
    """y_n = Σ_i weights[n,i] · w2_e act(w1_e z_n, w3_e z_n), e = ids[n,i] (ids < 0 are skipped).

    Same precision as models/ops.py: expert GEMMs and the activation in z's dtype, the weighted sum in fp32,
    result in z.dtype. weight_format "mxfp4": w1/w3/w2 are packed uint8 and `scales` their E8M0 scales; they are
    dequantized (k3c.ir.formats, exact in fp32) and cast to z's dtype first. A plain per-expert loop (the oracle,
    not a fast path).
    """
    if attrs["weight_format"] == "mxfp4":
        w1, w3, w2 = (mxfp4_dequantize(w, s).to(z.dtype) for w, s in zip((w1, w3, w2), scales))
    out = torch.zeros(z.shape, dtype=torch.float32)
    for e in torch.unique(ids[ids >= 0]).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        zz = z[rows]
        h = glu_act(zz @ w1[e].T, zz @ w3[e].T, attrs["act"], attrs["situ_beta"], attrs["situ_linear_beta"])
        out.index_add_(0, rows, (h @ w2[e].T).float() * weights[rows, slot, None].float())
    return [out.to(z.dtype)]


def _moe_bytes(ins, outs):
    """Activations, routing and the weights of the experts the tokens can touch: min(E, N·k) experts (every
    chosen expert's w1, w3 and w2, and their scales, are read once; the others are not read at all)."""
    z, weights, ids, w1 = ins[:4]
    per_expert = sympy.sympify(sum(numel(t) * _isz(t) for t in ins[3:])) / w1.shape[0]
    touched = sympy.Min(w1.shape[0], numel(ids))
    act = sum(numel(t) * _isz(t) for t in (z, weights, ids, outs[0]))
    return dim(sympy.ceiling(act + touched * per_expert))


def _isz(t):
    from k3c.ir.types import itemsize

    return itemsize(t.dtype)


@op("moe_experts", inputs=["z", "weights", "ids", "w1", "w3", "w2", "w1_scale?", "w3_scale?", "w2_scale?"],
    attrs={"act": Attr("str", "situ", ("situ", "silu")), "situ_beta": Attr("float", 4.0),
           "situ_linear_beta": Attr("float", 25.0), "weight_format": Attr("str", "dense", WEIGHT_FORMATS),
           "scale_max": Attr("int", 255)},
    kind="model", ref=moe_experts_ref,
    flops=lambda a, ins, outs: numel(ins[2]) * ins[3].shape[1] * ins[0].shape[1] * 6,
    bytes=lambda a, ins, outs: _moe_bytes(ins, outs))
def _moe_experts(attrs, z, weights, ids, w1, w3, w2, *scales):
    """moe_experts(z [N,D], weights f32 [N,k], ids i64 [N,k], w1 [E,I,D], w3 [E,I,D], w2 [E,D,I])
    {act="situ"|"silu", situ_beta=4, situ_linear_beta=25, weight_format="dense", scale_max=255} -> y [N,D] z.dtype.

    weight_format "mxfp4" (k3c.ir.formats): w1/w3 u8 [E,I,D/2], w2 u8 [E,D,I/2] packed E2M1 pairs, followed by
    w1_scale/w3_scale u8 [E,I,D/32] and w2_scale u8 [E,D,I/32] (E8M0). scale_max: an upper bound on those scale
    bytes, a fact of the weights the driver reads from the checkpoint (255: nothing known); code generators may
    pick a cheaper exact decoding under it, the value is the same. See `moe_experts_ref`. Raises IRError for
    mismatched shapes or dtypes, or scale_max outside 0..255."""
    n = "moe_experts"
    need_rank(n, z, 2, "z")
    need_rank(n, weights, 2, "weights")
    need_rank(n, ids, 2, "ids")
    need_dtype(n, ids, {"i64", "i32"}, "ids")
    for i in range(2):
        need_eq(n, weights.shape[i], ids.shape[i], f"weights dim {i} vs ids")
    need_eq(n, ids.shape[0], z.shape[0], "ids tokens vs z")
    mx = attrs["weight_format"] == "mxfp4"
    if not 0 <= attrs["scale_max"] <= 255:
        raise IRError(f"{n}: scale_max {attrs['scale_max']} is not an E8M0 byte (0..255)")
    if len(scales) != (3 if mx else 0):
        raise IRError(f"{n}: weight_format {attrs['weight_format']!r} takes {3 if mx else 0} scale inputs, "
                      f"found {len(scales)}")
    pack = 2 if mx else 1
    for t, nm in ((w1, "w1"), (w3, "w3"), (w2, "w2")):
        need_rank(n, t, 3, nm)
        if t.dtype != ("u8" if mx else z.dtype):
            raise IRError(f"{n}: {nm} {t} must be {'u8 (packed MXFP4)' if mx else 'of the dtype of z ' + str(z)}")
    if w1 != w3:
        raise IRError(f"{n}: w1 {w1} and w3 {w3} differ")
    E, I, D = w1.shape[0], w1.shape[1], w1.shape[2] * pack
    need_eq(n, D, z.shape[1], "w1 in features vs z")
    for i, (got, want) in enumerate(((w2.shape[0], E), (w2.shape[1], D), (w2.shape[2] * pack, I))):
        need_eq(n, got, want, f"w2 dim {i}")
    for t, w, nm in zip(scales, (w1, w3, w2), ("w1_scale", "w3_scale", "w2_scale")):
        need_dtype(n, t, {"u8"}, nm)
        need_rank(n, t, 3, nm)
        need_eq(n, t.shape[0], w.shape[0], f"{nm} dim 0")
        need_eq(n, t.shape[1], w.shape[1], f"{nm} dim 1")
        need_eq(n, t.shape[2] * (MXFP4_GROUP // 2), w.shape[2], f"{nm} groups vs packed bytes")
    return [z]
