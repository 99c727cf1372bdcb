"""MoE routing (`k3::moe_route`), routed experts (`k3::moe_experts`), the SiTU-GLU activation and the MoE layer."""

from __future__ import annotations

import math

import pytest
import torch

from models.config import K3Config
from models.layers import MoE
from models.ops import glu_act
from modeltest_util import record, rel_err

LN3, LN9 = math.log(3.0), math.log(9.0)


# ---- router --------------------------------------------------------------------------------------------------------
def test_router_hand_example():
    """logits [0, ln 3, -ln 3, ln 9] -> s = sigmoid = [1/2, 3/4, 1/4, 9/10].
    No bias, top-2: experts 3 (0.9), 1 (0.75); weights 0.9/1.65, 0.75/1.65 (x scaling 2.446).
    Bias [0, 0, 1, 0]: s + bias = [0.5, 0.75, 1.25, 0.9] -> experts 2, 3; weights from the *unbiased* s:
    0.25/1.15, 0.9/1.15 (x 2.446)."""
    logits = torch.tensor([[0.0, LN3, -LN3, LN9]])
    w, ids = torch.ops.k3.moe_route(logits, torch.zeros(4), 2, 2.446, True)
    assert ids.tolist() == [[3, 1]] and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.allclose(w, torch.tensor([[0.9 / 1.65, 0.75 / 1.65]]) * 2.446, atol=1e-6, rtol=0)
    w, ids = torch.ops.k3.moe_route(logits, torch.tensor([0.0, 0.0, 1.0, 0.0]), 2, 2.446, True)
    assert ids.tolist() == [[2, 3]]  # the bias changed the choice
    assert torch.allclose(w, torch.tensor([[0.25 / 1.15, 0.9 / 1.15]]) * 2.446, atol=1e-6, rtol=0)
    # without renormalisation: s[chosen] * scaling
    w, ids = torch.ops.k3.moe_route(logits, torch.tensor([0.0, 0.0, 1.0, 0.0]), 2, 2.0, False)
    assert ids.tolist() == [[2, 3]]
    assert torch.allclose(w, torch.tensor([[0.5, 1.8]]), atol=1e-6, rtol=0)


def test_router_ties_go_to_the_lowest_expert():
    w, ids = torch.ops.k3.moe_route(torch.zeros(1, 6), torch.tensor([0.0, 1, 0, 1, 0, 1]), 2, 1.0, True)
    assert ids.tolist() == [[1, 3]]
    assert torch.allclose(w, torch.tensor([[0.5, 0.5]]))


def test_router_bias_chooses_but_does_not_weigh():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=gen)
    _, ids0 = torch.ops.k3.moe_route(logits, torch.zeros(16), 4, 1.0, True)
    bias = 0.5 * torch.randn(16, generator=gen)
    w, ids = torch.ops.k3.moe_route(logits, bias, 4, 2.446, True)
    assert not torch.equal(ids, ids0)  # the bias changes some choices
    # the chosen set is the top-4 of s + bias ...
    s = logits.double().sigmoid()
    want_ids = torch.topk(s + bias.double(), 4, dim=-1).indices
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    # ... and the weights are the unbiased scores of that set, renormalised to routed_scaling_factor
    chosen = s.gather(-1, ids)
    assert record("router weights vs s[chosen]/sum*scale", (w - chosen / chosen.sum(-1, keepdim=True) * 2.446).abs().max().item()) <= 1e-6
    assert torch.allclose(w.sum(-1).double(), torch.full((64,), 2.446, dtype=torch.float64), atol=1e-5)
    # a constant shift of the bias changes nothing, weights included (they never saw the bias)
    w2, ids2 = torch.ops.k3.moe_route(logits, bias + 3.0, 4, 2.446, True)
    assert torch.equal(ids2, ids) and torch.equal(w2, w)


# ---- SiTU-GLU ------------------------------------------------------------------------------------------------------
def test_situ_hand_numbers():
    """act(g, u) = [4 tanh(g/4) sigmoid(g)] [25 tanh(u/25)].
    g = ln 9: tanh(ln 9 / 4) = tanh(ln 3 / 2) = (3 - 1)/(3 + 1) = 1/2, sigmoid(ln 9) = 9/10 -> gate 4 * 1/2 * 9/10 = 1.8.
    u = 25 ln 2: tanh(ln 2) = (4 - 1)/(4 + 1) = 3/5 -> 15.  act = 27.
    g = -ln 9, u = -25 ln 2: gate 4 * (-1/2) * 1/10 = -0.2, linear -15 -> act = 3.
    g = 0 -> 0.  g = u = 1000 -> 4 * 1 * 1 * 25 * 1 = 100 (the bound)."""
    g = torch.tensor([LN9, -LN9, 0.0, 1000.0, LN9])
    u = torch.tensor([25 * math.log(2), -25 * math.log(2), 7.0, 1000.0, 0.0])
    got = glu_act(g, u, "situ", 4.0, 25.0)
    assert torch.allclose(got, torch.tensor([27.0, 3.0, 0.0, 100.0, 0.0]), atol=1e-5, rtol=0), got
    # SwiGLU (Kimi Linear): silu(g) * u = ln 9 * 0.9 * 2
    assert torch.allclose(glu_act(torch.tensor([LN9]), torch.tensor([2.0]), "silu", 4.0, 25.0),
                          torch.tensor([LN9 * 0.9 * 2]), atol=1e-6)


def test_situ_is_bounded_by_100():
    gen = torch.Generator().manual_seed(0)
    g = torch.cat([torch.randn(10000, generator=gen) * 1e4, torch.tensor([1e30, -1e30, float("inf"), -float("inf")])])
    u = torch.cat([torch.randn(10000, generator=gen) * 1e4, torch.tensor([1e30, -1e30, float("inf"), float("inf")])])
    act = glu_act(g, u, "situ", 4.0, 25.0)
    assert torch.isfinite(act).all() and act.abs().max() <= 100.0
    assert act.max() > 99.9 and act.min() < -99.9  # the bound is approached from both sides (u's sign)
    # for g < 0 the gate factor 4 tanh(g/4) sigmoid(g) stays small (minimum about -0.27 near g = -1.22, e.g.
    # g = -1.2: 4 tanh(-0.3) sigmoid(-1.2) = 4 * -0.2913 * 0.2315 = -0.2697), so |act| < 25 * 0.28 there
    neg = glu_act(torch.linspace(-50, 0, 5001), torch.full((5001,), 1e9), "situ", 4.0, 25.0)
    assert -25 * 0.28 < neg.min() < -25 * 0.26


# ---- routed experts ------------------------------------------------------------------------------------------------
def _situ(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


def _silu_glu(g, u):
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts_vs_per_token_loop(act):
    gen = torch.Generator().manual_seed(3)
    N, D, I, E, k = 23, 16, 8, 6, 3
    z = torch.randn(N, D, generator=gen)
    w1, w3 = torch.randn(E, I, D, generator=gen), torch.randn(E, I, D, generator=gen)
    w2 = torch.randn(E, D, I, generator=gen) / 4
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(N)])  # expert E-1 is never used
    weights = torch.rand(N, k, generator=gen)
    y = torch.ops.k3.moe_experts(z, weights, ids, w1, w3, w2, act, 4.0, 25.0)
    fn = _situ if act == "situ" else _silu_glu
    want = torch.zeros(N, D, dtype=torch.float64)
    for n in range(N):
        for i in range(k):
            e = int(ids[n, i])
            zz = z[n].double()
            h = fn(w1[e].double() @ zz, w3[e].double() @ zz)
            want[n] += weights[n, i].double() * (w2[e].double() @ h)
    assert y.shape == (N, D) and y.dtype == torch.float32
    assert record(f"moe_experts ({act}) vs per-token loop: rel", rel_err(y, want)) <= 1e-5


def test_moe_experts_bf16_returns_input_dtype():
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(5, 8, generator=gen).bfloat16()
    w = torch.randn(3, 4, 8, generator=gen).bfloat16()
    y = torch.ops.k3.moe_experts(z, torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.int64), w, w, w.transpose(1, 2).contiguous(),
                                 "situ", 4.0, 25.0)
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny"])
def test_moe_layer_vs_reference(preset, tiny_model):
    """The whole (Latent)MoE block of a tiny model vs the spec formula, token by token in float64."""
    cfg = K3Config.from_pretrained(preset)
    model = tiny_model(preset)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    assert isinstance(moe, MoE)
    P = {n: p.double() for n, p in moe.named_parameters()}
    x = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = moe(x)
    act = _situ if cfg.hidden_act == "situ" else _silu_glu
    want = torch.zeros(2, 5, cfg.hidden_size, dtype=torch.float64)
    for b in range(2):
        for t in range(5):
            xt = x[b, t].double()
            s = torch.sigmoid(P["gate.weight"] @ xt)
            chosen = sorted(range(cfg.num_experts), key=lambda e: -(s[e] + P["gate.e_score_correction_bias"][e]).item())
            chosen = chosen[:cfg.num_experts_per_token]
            p = s[chosen] / s[chosen].sum() * cfg.routed_scaling_factor
            z = P["routed_expert_down_proj.weight"] @ xt if cfg.routed_expert_hidden_size else xt
            r = sum(p[i] * (P["experts.w2"][e] @ act(P["experts.w1"][e] @ z, P["experts.w3"][e] @ z))
                    for i, e in enumerate(chosen))
            if cfg.routed_expert_hidden_size:
                r = r / torch.sqrt((r * r).mean() + cfg.rms_norm_eps) * P["routed_expert_norm.weight"]
                r = P["routed_expert_up_proj.weight"] @ r
            sh = P["shared_experts.down_proj.weight"] @ act(P["shared_experts.gate_proj.weight"] @ xt,
                                                            P["shared_experts.up_proj.weight"] @ xt)
            want[b, t] = r + sh
    assert record(f"MoE layer ({preset}) vs reference: rel", rel_err(y, want)) <= 1e-5
