"""KDA: the model's delta-rule recurrence (step, chunked, custom-op dispatch) and the full KDA layer.

References, independent of `models/ops.py`:
- `fla.ops.kda.naive.naive_recurrent_kda` (flash-linear-attention's reference). It scales q itself
  (`q * scale`), so it is given the *unscaled* l2-normalised q with `scale = K^-0.5`, while the model's ops take q
  already scaled (K3-SPEC.md "KDA layer"). Its g is the per-channel log-decay, as in the model.
- `spec_recurrence` below: the spec formula S_t = (I - beta k k^T) Diag(exp g) S_{t-1} + beta k v^T, o_t = S_t^T q_t,
  written with explicit K x K matrices in float64.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.naive import naive_recurrent_kda

from models.config import K3Config
from models.layers import KDA
from models.ops import kda_recurrence_chunked, kda_recurrence_step
from modeltest_util import max_abs, record

TOL = 1e-5  # fp32, max abs error (outputs and states are O(1))


def spec_recurrence(q, k, v, g, beta, state):
    """Per-token loop of the spec formula in float64. q scaled already. Shapes as the model's ops."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    S = state.double().clone()
    B, T, H, K = q.shape
    eye = torch.eye(K, dtype=torch.float64)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                kt = k[b, t, h][:, None]  # column vector [K,1]
                transition = (eye - beta[b, t, h] * kt @ kt.T) @ torch.diag(g[b, t, h].exp())
                S[b, h] = transition @ S[b, h] + beta[b, t, h] * kt @ v[b, t, h][None, :]
                o[b, t, h] = S[b, h].T @ q[b, t, h]
    return o, S


def make_inputs(B, T, H, K, V, gate, seed):
    gen = torch.Generator().manual_seed(seed)
    q_raw = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    if gate == "lower_bound":  # g = -5 everywhere: the K3 gate at its bound (a 16-token tile decays by e^-80)
        g = torch.full((B, T, H, K), -5.0)
    elif gate == "k3":  # K3's gate range: -5 * sigmoid(.) in (-5, 0)
        g = -5.0 * torch.sigmoid(2 * torch.randn(B, T, H, K, generator=gen))
    elif gate == "mild":  # slow decay: the state (and the non-zero initial state) persists over all 40 tokens
        g = -0.05 * torch.rand(B, T, H, K, generator=gen)
    elif gate == "unbounded":  # Kimi Linear's unbounded softplus gate, around -8 (cumulative -128 per 16 tokens)
        g = -8.0 + 0.5 * torch.randn(B, T, H, K, generator=gen)
    else:
        raise ValueError(gate)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    state = torch.randn(B, H, K, V, generator=gen)  # non-zero initial state
    return q_raw, k, v, g, beta, state


CASES = [(K, T, gate) for K in (60, 100) for T in (1, 2, 3, 17, 40) for gate in ("lower_bound", "k3", "unbounded", "mild")]


@pytest.mark.parametrize("K,T,gate", CASES)
def test_recurrence_vs_fla_and_spec(K, T, gate):
    B, H = 2, 2
    q_raw, k, v, g, beta, state = make_inputs(B, T, H, K, K, gate, seed=K * 100 + T)
    q = q_raw * K ** -0.5
    o_fla, s_fla = naive_recurrent_kda(q_raw, k, v, g, beta, scale=K ** -0.5, initial_state=state.clone(),
                                       output_final_state=True)
    o_ref, s_ref = spec_recurrence(q, k, v, g, beta, state)
    # the two references agree (so the mapping of scale / gate onto fla is the right one)
    assert max_abs(o_fla, o_ref) <= TOL and max_abs(s_fla, s_ref) <= TOL
    results = {
        "step": kda_recurrence_step(q, k, v, g, beta, state),
        "chunked": kda_recurrence_chunked(q, k, v, g, beta, state),
        "op": torch.ops.k3.kda_recurrence(q, k, v, g, beta, state),
    }
    for name, (o, s) in results.items():
        assert o.dtype == torch.float32 and s.dtype == torch.float32
        for ref_name, (o_r, s_r) in (("fla", (o_fla, s_fla)), ("spec", (o_ref, s_ref))):
            eo = record(f"kda {name} vs {ref_name}: output", max_abs(o, o_r))
            es = record(f"kda {name} vs {ref_name}: state", max_abs(s, s_r))
            assert eo <= TOL, f"{name} vs {ref_name}: output error {eo:.2e} (K={K}, T={T}, gate={gate})"
            assert es <= TOL, f"{name} vs {ref_name}: state error {es:.2e} (K={K}, T={T}, gate={gate})"
    # the state does not alias / mutate the input
    assert torch.equal(state, make_inputs(B, T, H, K, K, gate, seed=K * 100 + T)[5])


def test_recurrence_value_dim_differs_and_chunk_sizes():
    """V != K and chunk lengths other than 16 (the chunk split must not matter)."""
    q_raw, k, v, g, beta, state = make_inputs(1, 23, 3, 32, 48, "k3", seed=7)
    q = q_raw * 32 ** -0.5
    o_ref, s_ref = spec_recurrence(q, k, v, g, beta, state)
    for chunk in (1, 5, 16, 64):
        o, s = kda_recurrence_chunked(q, k, v, g, beta, state, chunk=chunk)
        assert record("kda chunked (V!=K, chunk 1/5/16/64) vs spec", max(max_abs(o, o_ref), max_abs(s, s_ref))) <= TOL


def test_recurrence_checks_itself():
    """The comparison can fail: a wrong gate sign / missing beta is caught by the spec reference."""
    q_raw, k, v, g, beta, state = make_inputs(1, 5, 1, 16, 16, "k3", seed=3)
    q = q_raw * 16 ** -0.5
    o_ref, _ = spec_recurrence(q, k, v, g, beta, state)
    o_bad, _ = kda_recurrence_step(q, k, v, g * 0.5, beta, state)
    assert max_abs(o_bad, o_ref) > 1e-2
    o_bad, _ = kda_recurrence_step(q, k, v, g, torch.ones_like(beta), state)
    assert max_abs(o_bad, o_ref) > 1e-2


# ---- the full KDA layer ------------------------------------------------------------------------------------------
def _random_layer(cfg: K3Config, seed: int) -> KDA:
    layer = KDA(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name == "o_norm.weight":
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name == "dt_bias":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return layer


def kda_layer_reference(layer: KDA, cfg: K3Config, x, conv_hist, S0):
    """Per-token KDA (K3-SPEC.md "KDA layer") in float64, written from the spec, not from models/layers.py.

    conv_hist: [B, 3HK, W] the raw projected q|k|v inputs of the W previous tokens (oldest first).
    Returns (y [B,T,D], final conv history [B,3HK,W], final state [B,H,K,K]).
    """
    P = {n: p.detach().double() for n, p in layer.named_parameters()}
    B, T, D = x.shape
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    x = x.double()
    hist = conv_hist.double().clone()
    S = S0.double().clone()
    a = P["A_log"][:H].exp()
    ys = []
    for t in range(T):
        xt = x[:, t]  # [B,D]
        raw = torch.cat([xt @ P["q_proj.weight"].T, xt @ P["k_proj.weight"].T, xt @ P["v_proj.weight"].T], -1)
        hist = torch.cat([hist[:, :, 1:], raw[:, :, None]], -1)  # the window ends with the current token
        conv_w = torch.cat([P["q_conv1d.weight"], P["k_conv1d.weight"], P["v_conv1d.weight"]], 0)[:, 0, :]  # [3HK,W]
        conv = (hist * conv_w).sum(-1)  # causal depthwise conv: weight[W-1] multiplies the current token
        act = conv * torch.sigmoid(conv)  # silu
        q, k, v = (c.reshape(B, H, K) for c in act.split(H * K, -1))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = ((xt @ P["f_a_proj.weight"].T) @ P["f_b_proj.weight"].T + P["dt_bias"]).reshape(B, H, K)
        if cfg.gate_lower_bound is not None:
            g = cfg.gate_lower_bound * torch.sigmoid(a[None, :, None] * f)
        else:
            g = -a[None, :, None] * torch.log1p(torch.exp(f))  # softplus
        beta = torch.sigmoid(xt @ P["b_proj.weight"].T)  # [B,H]
        o = torch.zeros(B, H, K, dtype=torch.float64)
        for b in range(B):
            for h in range(H):
                kk = k[b, h][:, None]
                S[b, h] = ((torch.eye(K, dtype=torch.float64) - beta[b, h] * kk @ kk.T) @ torch.diag(g[b, h].exp())
                           @ S[b, h] + beta[b, h] * kk @ v[b, h][None, :])
                o[b, h] = S[b, h].T @ q[b, h]
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + cfg.rms_norm_eps) * P["o_norm.weight"]
        if cfg.use_full_rank_gate:
            gate = xt @ P["g_proj.weight"].T
        else:
            gate = (xt @ P["g_a_proj.weight"].T) @ P["g_b_proj.weight"].T
        o = o.reshape(B, H * K) * torch.sigmoid(gate)
        ys.append(o @ P["o_proj.weight"].T)
    return torch.stack(ys, 1), hist, S


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("T", [1, 2, 3, 7])
@pytest.mark.parametrize("warm", [False, True], ids=["empty-cache", "warm-cache"])
def test_kda_layer_vs_per_token_reference(preset, T, warm):
    cfg = K3Config.from_pretrained(preset)
    cfg = dataclasses.replace(cfg, kda_head_dim=12, kda_num_heads=3)  # odd sizes: nothing relies on 16
    layer = _random_layer(cfg, seed=T)
    B, H, K, W, D = 2, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size, cfg.hidden_size
    gen = torch.Generator().manual_seed(100 + T)
    x = torch.randn(B, T, D, generator=gen)
    if warm:
        conv_hist = torch.randn(B, 3 * H * K, W, generator=gen)
        S0 = torch.randn(B, H, K, K, generator=gen)
    else:
        conv_hist, S0 = torch.zeros(B, 3 * H * K, W), torch.zeros(B, H, K, K)
    cache = {"l.conv_state": conv_hist.clone(), "l.kda_state": S0.clone()}
    new_cache: dict = {}
    with torch.no_grad():
        y = layer(x, cache, new_cache, "l.")
    y_ref, hist_ref, S_ref = kda_layer_reference(layer, cfg, x, conv_hist, S0)
    err = record("KDA layer vs per-token reference (output)", max_abs(y, y_ref))
    assert err <= TOL * max(1.0, y_ref.abs().max().item()), err
    # the cache after the call: the last W raw inputs and the final recurrent state
    assert record("KDA layer conv_state", max_abs(new_cache["l.conv_state"], hist_ref)) <= 1e-5
    assert record("KDA layer kda_state", max_abs(new_cache["l.kda_state"], S_ref)) <= TOL
    # inputs are not mutated (the cache is functional)
    assert torch.equal(cache["l.conv_state"], conv_hist) and torch.equal(cache["l.kda_state"], S0)


def test_kda_layer_uses_only_first_h_entries_of_a_log():
    """`A_log` stored longer than H (zero-padded) behaves as its first H entries (K3-SPEC.md "KDA layer")."""
    cfg = K3Config.from_pretrained("kimi-linear-tiny")
    layer = _random_layer(cfg, seed=1)
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    cache = {"l.conv_state": torch.zeros(1, 3 * H * K, W), "l.kda_state": torch.zeros(1, H, K, K)}
    with torch.no_grad():
        y = layer(x, dict(cache), {}, "l.")
        layer.A_log = torch.nn.Parameter(torch.cat([layer.A_log.data, torch.zeros(5)]))
        y_pad = layer(x, dict(cache), {}, "l.")
    assert torch.equal(y, y_pad)
