"""Gated DSA (`k3.1-pro-tiny`, index_topk 16): dense-equivalence, sparsity, tie-breaking and index validity."""

from __future__ import annotations

import pytest
import torch

from models.config import K3Config
from models.layers import MLA
from modeltest_util import record, rel_err, tiny

CFG = K3Config.from_pretrained("k3.1-pro-tiny")
TOPK = CFG.index_topk
LAYER = CFG.dsa_layers[0]
PREFIX = f"layers.{LAYER}."


@pytest.fixture(scope="module")
def layers():
    """The first DSA layer of the tiny model, and a dense MLA (no indexer) holding the same weights."""
    sparse = tiny("k3.1-pro-tiny").model.layers[LAYER].self_attn
    assert TOPK == 16 and hasattr(sparse, "indexer")
    dense = MLA(CFG, sparse=False)
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")}, strict=True)
    return sparse, dense


def _empty_cache(B: int) -> dict:
    return {PREFIX + "kv": torch.zeros(B, 0, CFG.mla_cache_width), PREFIX + "index_k": torch.zeros(B, 0, CFG.index_head_dim)}


def _x(B: int, T: int, seed: int) -> torch.Tensor:
    return torch.randn(B, T, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))


def _run(layer, x, cache):
    new: dict = {}
    with torch.no_grad():
        y = layer(x, cache, new, PREFIX)
    return y, new


def _warm_cache(sparse, dense, L: int, B: int = 2, seed: int = 0):
    """Caches holding L tokens (written by a prefill through each layer)."""
    if L == 0:
        return _empty_cache(B), {PREFIX + "kv": torch.zeros(B, 0, CFG.mla_cache_width)}
    x = _x(B, L, seed)
    _, cs = _run(sparse, x, _empty_cache(B))
    _, cd = _run(dense, x, {PREFIX + "kv": torch.zeros(B, 0, CFG.mla_cache_width)})
    assert torch.equal(cs[PREFIX + "kv"], cd[PREFIX + "kv"])
    return cs, cd


def reference_indexer_scores(layer, x: torch.Tensor, keys_x: torch.Tensor) -> torch.Tensor:
    """I[t,s] = sum_j w[t,j] ReLU(q_I[t,j] . k_I[s]) in float64 from the spec (K3-SPEC.md "Gated DSA"), without
    the causal mask. x: [B,T,D] queries' inputs; keys_x: [B,L,D] every key token's input."""
    P = {n: p.detach().double() for n, p in layer.named_parameters()}
    J, Dk = CFG.index_num_heads, CFG.index_head_dim
    x, keys_x = x.double(), keys_x.double()
    a = x @ P["q_a_proj.weight"].T
    qr = a / torch.sqrt((a * a).mean(-1, keepdim=True) + 1e-6) * P["q_a_layernorm.weight"]
    q_i = (qr @ P["indexer.wq_b.weight"].T).reshape(*x.shape[:2], J, Dk)
    k = keys_x @ P["indexer.wk.weight"].T
    k = (k - k.mean(-1, keepdim=True)) / torch.sqrt(k.var(-1, unbiased=False, keepdim=True) + 1e-6)
    k = k * P["indexer.k_norm.weight"] + P["indexer.k_norm.bias"]
    w = (x @ P["indexer.weights_proj.weight"].T) * J ** -0.5 * Dk ** -0.5
    return torch.einsum("btj,btjs->bts", w, torch.einsum("btjd,bsd->btjs", q_i, k).relu())


# ---- dense equivalence -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, TOPK - 1, TOPK])
def test_prefill_with_at_most_topk_keys_equals_dense_mla(layers, T):
    sparse, dense = layers
    x = _x(2, T, seed=T)
    ys, _ = _run(sparse, x, _empty_cache(2))
    yd, _ = _run(dense, x, {PREFIX + "kv": torch.zeros(2, 0, CFG.mla_cache_width)})
    assert torch.equal(ys, yd)


def test_prefill_rows_beyond_topk_are_sparse(layers):
    sparse, dense = layers
    x = _x(2, TOPK + 1, seed=5)
    ys, _ = _run(sparse, x, _empty_cache(2))
    yd, _ = _run(dense, x, {PREFIX + "kv": torch.zeros(2, 0, CFG.mla_cache_width)})
    assert torch.equal(ys[:, :TOPK], yd[:, :TOPK])  # rows 0..15 see <= 16 keys: exactly dense
    assert not torch.allclose(ys[:, TOPK], yd[:, TOPK], atol=1e-6)  # row 16 sees 17 keys and drops one


@pytest.mark.parametrize("L", [1, TOPK - 1, TOPK, TOPK + 1])
def test_decode_at_context_length(layers, L):
    """Decode one token with L visible keys (L - 1 cached + itself)."""
    sparse, dense = layers
    cs, cd = _warm_cache(sparse, dense, L - 1, seed=L)
    x_prev = _x(2, L - 1, seed=L)
    x = _x(2, 1, seed=100 + L)
    ys, new = _run(sparse, x, cs)
    yd, _ = _run(dense, x, cd)
    assert new[PREFIX + "index_k"].shape == (2, L, CFG.index_head_dim)
    assert new[PREFIX + "kv"].shape == (2, L, CFG.mla_cache_width)
    idx = torch.ops.k3.dsa_topk(*_indexer_inputs(sparse, x, new), TOPK)
    assert idx.shape == (2, 1, TOPK)
    if L <= TOPK:
        assert torch.equal(ys, yd)
        want = list(range(L)) + [-1] * (TOPK - L)  # every visible key; -1 only for the missing ones
        for b in range(2):
            assert sorted(idx[b, 0, :L].tolist()) == want[:L] and idx[b, 0, L:].tolist() == want[L:]
    else:
        assert not torch.allclose(ys, yd, atol=1e-6)
        assert (idx >= 0).all() and (idx < L).all()
        # the one dropped key is the lowest-scoring one by the spec's indexer formula
        scores = reference_indexer_scores(sparse, x, torch.cat([x_prev, x], 1))
        for b in range(2):
            ranked = sorted(range(L), key=lambda s: (-scores[b, 0, s].item(), s))
            assert idx[b, 0].tolist() == ranked[:TOPK]


def _indexer_inputs(layer, x, new_cache):
    ix = layer.indexer
    qr = layer.q_a_layernorm(layer.q_a_proj(x))
    q_idx = ix.wq_b(qr).reshape(*x.shape[:2], ix.J, ix.Dk)
    w = ix.weights_proj(x) * (ix.J ** -0.5 * ix.Dk ** -0.5)
    return q_idx, w, new_cache[PREFIX + "index_k"]


# ---- only the top-k keys matter ----------------------------------------------------------------------------------
def test_only_selected_keys_influence_the_output(layers):
    sparse, dense = layers
    L = 40
    cs, _ = _warm_cache(sparse, dense, L - 1, B=1, seed=11)
    x_prev, x = _x(1, L - 1, seed=11), _x(1, 1, seed=12)
    y, _ = _run(sparse, x, cs)
    scores = reference_indexer_scores(sparse, x, torch.cat([x_prev, x], 1))[0, 0]
    selected = sorted(range(L), key=lambda s: (-scores[s].item(), s))[:TOPK]
    unselected = [s for s in range(L - 1) if s not in selected]
    assert len(unselected) >= L - 1 - TOPK
    for s in unselected[:6]:
        c = dict(cs)
        c[PREFIX + "kv"] = cs[PREFIX + "kv"].clone()
        c[PREFIX + "kv"][:, s] += 5.0
        y2, _ = _run(sparse, x, c)
        assert torch.equal(y2, y), f"key {s} is not selected but changed the output"
    for s in [p for p in selected if p < L - 1][:6]:
        c = dict(cs)
        c[PREFIX + "kv"] = cs[PREFIX + "kv"].clone()
        c[PREFIX + "kv"][:, s] += 5.0
        y2, _ = _run(sparse, x, c)
        assert (y2 - y).abs().max() > 1e-4, f"key {s} is selected but did not change the output"


# ---- the top-k op itself -----------------------------------------------------------------------------------------
def _one_dim_scores(a: list[float]):
    """q = [1, 0], w = 1, key s = [a_s, 0]: I[0, s] = ReLU(a_s) for a single query token seeing every key."""
    L = len(a)
    q_idx = torch.tensor([1.0, 0.0]).reshape(1, 1, 1, 2)
    w = torch.ones(1, 1, 1)
    k_idx = torch.stack([torch.tensor(a), torch.zeros(L)], -1).reshape(1, L, 2)
    return q_idx, w, k_idx


def test_ties_go_to_the_lowest_position():
    # scores 3 at positions 2, 4, 7; 1 elsewhere: best first, ties by position
    q, w, k = _one_dim_scores([1, 1, 3, 1, 3, 1, 1, 3, 1, 1])
    assert torch.ops.k3.dsa_topk(q, w, k, 5)[0, 0].tolist() == [2, 4, 7, 0, 1]
    # all keys score 0 (ReLU of negatives): the lowest positions win
    q, w, k = _one_dim_scores([-1, -2, -3, -4, -5, -6])
    assert torch.ops.k3.dsa_topk(q, w, k, 4)[0, 0].tolist() == [0, 1, 2, 3]
    # a later key with a strictly higher score beats an earlier one
    q, w, k = _one_dim_scores([1, 1, 1, 1, 2])
    assert torch.ops.k3.dsa_topk(q, w, k, 2)[0, 0].tolist() == [4, 0]


def test_topk_is_causal_and_never_points_past_the_visible_keys():
    gen = torch.Generator().manual_seed(0)
    for B, T, L in [(2, 40, 40), (2, 3, 20), (1, 1, 1), (2, 5, 5), (1, 2, 17)]:
        q = torch.randn(B, T, 4, 8, generator=gen)
        w = torch.randn(B, T, 4, generator=gen)
        k = torch.randn(B, L, 8, generator=gen)
        idx = torch.ops.k3.dsa_topk(q, w, k, TOPK)
        assert idx.shape == (B, T, TOPK) and idx.dtype == torch.int64
        for b in range(B):
            for t in range(T):
                visible = L - T + t + 1  # query t is at absolute position L - T + t
                row = idx[b, t].tolist()
                n = min(visible, TOPK)
                assert all(0 <= s < visible for s in row[:n]), (L, T, t, row)
                assert len(set(row[:n])) == n
                assert row[n:] == [-1] * (TOPK - n)  # -1 only when fewer than top-k keys are visible


def test_topk_matches_reference_ranking_on_random_scores():
    gen = torch.Generator().manual_seed(1)
    q, w, k = torch.randn(1, 30, 4, 8, generator=gen), torch.randn(1, 30, 4, generator=gen), torch.randn(1, 30, 8, generator=gen)
    idx = torch.ops.k3.dsa_topk(q, w, k, TOPK)
    S = torch.einsum("btj,btjs->bts", w.double(), torch.einsum("btjd,bsd->btjs", q.double(), k.double()).relu())
    for t in range(30):
        ranked = sorted(range(t + 1), key=lambda s: (-S[0, t, s].item(), s))[:TOPK]
        assert idx[0, t, :len(ranked)].tolist() == ranked


# ---- the dense MLA itself, against the spec -----------------------------------------------------------------------
def reference_mla(layer, cfg: K3Config, x: torch.Tensor) -> torch.Tensor:
    """Gated MLA, NoPE (K3-SPEC.md "Gated MLA"), causal over x, float64, token by token."""
    P = {n: p.detach().double() for n, p in layer.named_parameters()}
    A, nope, rope, vd, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def rms(v, w):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6) * w

    x = x.double()
    B, T, D = x.shape
    if cfg.q_lora_rank is None:
        q = x @ P["q_proj.weight"].T
    else:
        q = rms(x @ P["q_a_proj.weight"].T, P["q_a_layernorm.weight"]) @ P["q_b_proj.weight"].T
    q = q.reshape(B, T, A, nope + rope)
    ckv = x @ P["kv_a_proj_with_mqa.weight"].T
    c, k_pe = ckv[..., :r], ckv[..., r:]
    kv = (rms(c, P["kv_a_layernorm.weight"]) @ P["kv_b_proj.weight"].T).reshape(B, T, A, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    out = torch.zeros(B, T, A, vd, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for h in range(A):
                s = torch.stack([(q[b, t, h, :nope] @ k_nope[b, j, h] + q[b, t, h, nope:] @ k_pe[b, j])
                                 for j in range(t + 1)]) * (nope + rope) ** -0.5
                out[b, t, h] = torch.softmax(s, 0) @ v[b, :t + 1, h]
    out = out.reshape(B, T, A * vd)
    if cfg.mla_use_output_gate:
        out = out * torch.sigmoid(x @ P["g_proj.weight"].T)
    return out @ P["o_proj.weight"].T


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny", "k3.1-pro-tiny"])
def test_mla_vs_reference(preset):
    cfg = K3Config.from_pretrained(preset)
    i = next(i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) != "kda")
    layer = tiny(preset).model.layers[i].self_attn
    x = _x(2, 9, seed=3)
    p = f"layers.{i}."
    cache = {p + "kv": torch.zeros(2, 0, cfg.mla_cache_width), p + "index_k": torch.zeros(2, 0, max(cfg.index_head_dim, 1))}
    with torch.no_grad():
        y = layer(x, cache, {}, p)
    want = reference_mla(layer, cfg, x)
    assert record("MLA layer vs reference: rel", rel_err(y, want)) <= 1e-5
