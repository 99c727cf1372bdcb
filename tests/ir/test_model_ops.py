"""Model-level op references against naive loops written here from the K3-SPEC.md formulas."""

import math

import pytest
import torch

from k3c.errors import IRError, UnsupportedError
from k3c.ir.ops import get_op, simulate_collective
from k3c.ir.types import TensorType


def run(name, *tensors, **attrs):
    d = get_op(name)
    return d.ref(d.normalize_attrs(attrs), *tensors)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---- KDA ----------------------------------------------------------------------------------------------------------
def naive_delta_rule(q, k, v, g, beta, S0):
    """Matrix form per token, per batch and head: S = (I - b k kᵀ) diag(exp g) S + b k vᵀ; o = Sᵀ q."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    S = S0.double().clone()
    for b in range(B):
        for h in range(H):
            for t in range(T):
                kt = k[b, t, h].double()
                I = torch.eye(K, dtype=torch.float64)
                S[b, h] = (I - beta[b, t, h].double() * torch.outer(kt, kt)) @ torch.diag(
                    g[b, t, h].double().exp()) @ S[b, h] + beta[b, t, h].double() * torch.outer(kt, v[b, t, h].double())
                o[b, t, h] = S[b, h].T @ q[b, t, h].double()
    return o, S


def kda_inputs(B=2, T=5, H=2, K=4, seed=0):
    g_ = gen(seed)
    q = torch.randn(B, T, H, K, generator=g_)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1)
    v = torch.randn(B, T, H, K, generator=g_)
    g = -torch.rand(B, T, H, K, generator=g_) * 2
    beta = torch.rand(B, T, H, generator=g_)
    S0 = torch.randn(B, H, K, K, generator=g_)
    return q, k, v, g, beta, S0


def test_kda_recurrence_matches_per_token_matrix_loop():
    q, k, v, g, beta, S0 = kda_inputs()
    o, S = run("kda_recurrence", q, k, v, g, beta, S0)
    o_ref, S_ref = naive_delta_rule(q, k, v, g, beta, S0)
    assert S.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S.double(), S_ref, rtol=1e-5, atol=1e-5)


def test_kda_recurrence_matches_fla_naive():
    fla_naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, g, beta, S0 = kda_inputs(seed=1)
    o, S = run("kda_recurrence", q, k, v, g, beta, S0)
    o2, S2 = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=S0, output_final_state=True)
    torch.testing.assert_close(o, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S, S2, rtol=1e-5, atol=1e-5)


def test_kda_recurrence_split_in_two_calls_equals_one():
    q, k, v, g, beta, S0 = kda_inputs(T=6, seed=2)
    o, S = run("kda_recurrence", q, k, v, g, beta, S0)
    o1, S1 = run("kda_recurrence", *(x[:, :2] for x in (q, k, v, g, beta)), S0)
    o2, S2 = run("kda_recurrence", *(x[:, 2:] for x in (q, k, v, g, beta)), S1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o)
    torch.testing.assert_close(S2, S)


def naive_short_conv(x, w, state):
    """y[t, c] = Σ_{j=0}^{W-1} w[c, 0, j] · u[t - (W-1) + j, c], u = the input history (state rows then x)."""
    B, T, C = x.shape
    W = w.shape[-1]
    hist = torch.cat([state.transpose(1, 2), x], 1)  # [B, W+T, C]; x_t sits at W + t
    y = torch.zeros(B, T, C)
    for t in range(T):
        for j in range(W):
            y[:, t] += w[:, 0, j] * hist[:, W + t - (W - 1) + j]
    return y, hist[:, -W:].transpose(1, 2)


def test_causal_conv1d_matches_loop_and_state_carries():
    g_ = gen(3)
    x, w, st = torch.randn(2, 5, 6, generator=g_), torch.randn(6, 1, 4, generator=g_), torch.randn(2, 6, 4, generator=g_)
    y, s = run("causal_conv1d", x, w, st)
    y_ref, s_ref = naive_short_conv(x, w, st)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref)
    # decode one token at a time from the same state gives the same outputs
    s2, ys = st, []
    for t in range(5):
        yt, s2 = run("causal_conv1d", x[:, t:t + 1], w, s2)
        ys.append(yt)
    torch.testing.assert_close(torch.cat(ys, 1), y, rtol=1e-5, atol=1e-5)


def test_norms_follow_spec_formulas():
    x = torch.randn(3, 8, generator=gen(4))
    w = torch.rand(8, generator=gen(5))
    (y,) = run("rms_norm", x, w, eps=1e-5)
    for i in range(3):
        rms = math.sqrt(sum(float(a) ** 2 for a in x[i]) / 8 + 1e-5)
        torch.testing.assert_close(y[i], x[i] / rms * w, rtol=1e-5, atol=1e-6)
    (z,) = run("l2norm", x)
    for i in range(3):
        torch.testing.assert_close(z[i], x[i] / math.sqrt(sum(float(a) ** 2 for a in x[i]) + 1e-6))


def test_kda_fused_equals_spec_composition():
    B, T, H, K, W = 2, 4, 2, 4, 4
    HK = H * K
    g_ = gen(6)
    r = lambda *s: torch.randn(*s, generator=g_)  # noqa: E731
    q, k, v, f, beta, gate = r(B, T, HK), r(B, T, HK), r(B, T, HK), r(B, T, HK), r(B, T, H), r(B, T, HK)
    cw = [r(HK, 1, W) * 0.5 for _ in range(3)]
    A_log, dt_bias, o_norm = r(H + 1), r(HK), torch.rand(K, generator=g_) + 0.5
    S0, cs = r(B, H, K, K), r(B, 3 * HK, W)
    for gate_kind in ("lower_bound", "softplus"):
        y, S, cs2 = run("kda_fused", q, k, v, f, beta, gate, *cw, A_log, dt_bias, o_norm, S0, cs,
                        heads=H, head_dim=K, gate=gate_kind, lower_bound=-5.0, eps=1e-5)
        # spec, step by step, with the naive helpers of this file
        convs = [naive_short_conv(x, w, cs[:, i * HK:(i + 1) * HK]) for i, (x, w) in enumerate(zip((q, k, v), cw))]
        qc, kc, vc = (torch.nn.functional.silu(c[0]).view(B, T, H, K) for c in convs)
        qc = qc / torch.sqrt((qc ** 2).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        kc = kc / torch.sqrt((kc ** 2).sum(-1, keepdim=True) + 1e-6)
        a = torch.exp(A_log[:H]).view(1, 1, H, 1)
        fb = (f + dt_bias).view(B, T, H, K)
        gg = -5.0 * torch.sigmoid(a * fb) if gate_kind == "lower_bound" else -a * torch.log1p(torch.exp(fb))
        o, S_ref = naive_delta_rule(qc, kc, vc, gg, torch.sigmoid(beta), S0)
        o = o.float()
        o = o / torch.sqrt((o ** 2).mean(-1, keepdim=True) + 1e-5) * o_norm * torch.sigmoid(gate.view(B, T, H, K))
        torch.testing.assert_close(y, o.reshape(B, T, HK), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(S.double(), S_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cs2, torch.cat([c[1] for c in convs], 1))


# ---- DSA / MLA ----------------------------------------------------------------------------------------------------
def test_dsa_index_topk_ties_go_to_lowest_position_and_invalid_is_minus_one():
    B, T, L, J, D = 1, 3, 6, 2, 4
    q = torch.ones(B, T, J, D)
    w = torch.ones(B, T, J)
    k = torch.ones(B, L, D)  # every visible key scores the same: ties everywhere
    (idx,) = run("dsa_index_topk", q, w, k, topk=4)
    assert idx.dtype == torch.int64 and idx.shape == (B, T, 4)
    # query t sits at position L - T + t = 3 + t and sees keys 0..3+t: the lowest 4 positions win
    assert idx[0].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    (idx,) = run("dsa_index_topk", q[:, :1], w[:, :1], k[:, :2], topk=4)  # 2 visible keys, 4 slots
    assert idx[0, 0].tolist() == [0, 1, -1, -1]


def test_dsa_index_topk_matches_naive_scores():
    B, T, L, J, D, topk = 2, 4, 9, 3, 5, 3
    g_ = gen(7)
    q, w, k = torch.randn(B, T, J, D, generator=g_), torch.randn(B, T, J, generator=g_), torch.randn(B, L, D, generator=g_)
    (idx,) = run("dsa_index_topk", q, w, k, topk=topk)
    for b in range(B):
        for t in range(T):
            pos = L - T + t
            scores = []
            for s in range(pos + 1):
                val = sum(float(w[b, t, j]) * max(0.0, float(q[b, t, j] @ k[b, s])) for j in range(J))
                scores.append((-val, s))
            want = [s for _, s in sorted(scores)[:topk]]
            assert idx[b, t].tolist() == want
            assert all(0 <= i <= pos for i in idx[b, t].tolist())  # >= topk visible keys: never -1


def naive_attention(q, k, v, scale, allowed):
    """q [T,D], k [S,D], v [S,Dv], allowed [T,S] -> [T,Dv], one softmax row at a time."""
    out = torch.zeros(q.shape[0], v.shape[1], dtype=torch.float64)
    for t in range(q.shape[0]):
        s = [(float(q[t] @ k[j]) * scale, j) for j in range(k.shape[0]) if allowed[t, j]]
        m = max(x for x, _ in s)
        z = sum(math.exp(x - m) for x, _ in s)
        for x, j in s:
            out[t] += math.exp(x - m) / z * v[j].double()
    return out


def test_mla_attention_unabsorbed_absorbed_and_sparse():
    B, T, S, H, D, Dv = 1, 3, 5, 2, 6, 4
    g_ = gen(8)
    q, kv = torch.randn(B, T, H, D, generator=g_), torch.randn(B, S, D, generator=g_)
    (o,) = run("mla_attention", q, kv, absorbed=True, v_dim=Dv, scale=0.4)
    allowed = torch.tensor([[s <= S - T + t for s in range(S)] for t in range(T)])
    for h in range(H):
        torch.testing.assert_close(o[0, :, h].double(), naive_attention(q[0, :, h], kv[0], kv[0, :, :Dv], 0.4, allowed))
    # the unabsorbed form with k = kv and v = kv[:Dv] for every head is the same computation
    k4 = kv[:, :, None].expand(B, S, H, D)
    (o2,) = run("mla_attention", q, k4, k4[..., :Dv].contiguous(), scale=0.4)
    torch.testing.assert_close(o2, o)
    # sparse: idx restricts the keys; -1 slots are ignored
    idx = torch.tensor([[[0, 2, -1], [1, 3, -1], [4, 0, 2]]])
    (o3,) = run("mla_attention", q, kv, idx, absorbed=True, v_dim=Dv, scale=0.4)
    sel = torch.zeros(T, S, dtype=torch.bool)
    for t in range(T):
        for i in idx[0, t].tolist():
            if i >= 0:
                sel[t, i] = True
    for h in range(H):
        torch.testing.assert_close(o3[0, :, h].double(), naive_attention(q[0, :, h], kv[0], kv[0, :, :Dv], 0.4,
                                                                          sel & allowed))


def test_attn_res_two_phase_equals_softmax_over_all_sources():
    B, T, D, Q, n = 2, 3, 8, 3, 4
    g_ = gen(9)
    blocks = [torch.randn(B, T, D, generator=g_) for _ in range(n)]
    partial = torch.randn(B, T, D, generator=g_)
    queries = torch.randn(Q, D, generator=g_)
    o, lse = run("attn_res_inter", queries, *blocks, eps=1e-6)
    for i in range(Q):
        (h,) = run("attn_res_merge", o, lse, partial, queries, index=i, eps=1e-6)
        srcs = blocks + [partial]
        for b in range(B):
            for t in range(T):
                logits = [float((s[b, t] / torch.sqrt((s[b, t] ** 2).mean() + 1e-6)) @ queries[i]) for s in srcs]
                m = max(logits)
                p = [math.exp(x - m) for x in logits]
                want = sum(pi / sum(p) * s[b, t] for pi, s in zip(p, srcs))
                torch.testing.assert_close(h[b, t], want, rtol=1e-5, atol=1e-5)


def test_cache_append_appends_rows_without_touching_input():
    cache = torch.zeros(1, 3, 2)
    new = torch.ones(1, 2, 2)
    (out,) = run("cache_append", cache, new)
    assert out[0, :, 0].tolist() == [0, 0, 0, 1, 1]
    assert cache.sum() == 0
    assert get_op("cache_append").effects


# ---- MoE -------------------------------------------------------------------------------------------------------------
def test_moe_route_weights_renormalise_and_bias_only_chooses():
    N, E, k = 5, 8, 3
    logits = torch.randn(N, E, generator=gen(10))
    w, ids = run("moe_route", logits, torch.zeros(E), top_k=k, scaling=2.5)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    torch.testing.assert_close(w.sum(-1), torch.full((N,), 2.5))
    s = torch.sigmoid(logits)
    for n in range(N):
        want = sorted(range(E), key=lambda e: (-float(s[n, e]), e))[:k]
        assert ids[n].tolist() == want
    bias = torch.zeros(E)
    bias[7] = 10.0  # expert 7 is now always chosen, first
    w2, ids2 = run("moe_route", logits, bias, top_k=k, scaling=2.5)
    assert (ids2[:, 0] == 7).all()
    for n in range(N):
        sel = ids2[n].tolist()
        torch.testing.assert_close(w2[n], s[n, sel] / s[n, sel].sum() * 2.5)  # bias not in the weights
    w3, _ = run("moe_route", logits, torch.zeros(E), top_k=k, scaling=2.0, renormalize=False)
    torch.testing.assert_close(w3, s.gather(1, ids) * 2.0)


def test_moe_route_ties_lowest_expert():
    _, ids = run("moe_route", torch.zeros(1, 6), torch.zeros(6), top_k=3)
    assert ids.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts_matches_per_token_loop(act):
    N, D, I, E, k = 4, 6, 5, 3, 2
    g_ = gen(11)
    z = torch.randn(N, D, generator=g_)
    w1, w3, w2 = torch.randn(E, I, D, generator=g_), torch.randn(E, I, D, generator=g_), torch.randn(E, D, I, generator=g_)
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [2, -1]])
    wts = torch.rand(N, k, generator=g_)
    (y,) = run("moe_experts", z, wts, ids, w1, w3, w2, act=act)
    for n in range(N):
        acc = torch.zeros(D)
        for i in range(k):
            e = int(ids[n, i])
            if e < 0:
                continue
            gte, up = w1[e] @ z[n], w3[e] @ z[n]
            if act == "situ":
                h = (4 * torch.tanh(gte / 4) * torch.sigmoid(gte)) * (25 * torch.tanh(up / 25))
            else:
                h = gte * torch.sigmoid(gte) * up
            acc += wts[n, i] * (w2[e] @ h)
        torch.testing.assert_close(y[n], acc, rtol=1e-4, atol=1e-4)


def mxfp4_random(E, R, C, g_):
    """Random MXFP4 weights [E, R, C]: every byte value, scales 2^-3 .. 2^2."""
    return (torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, generator=g_),
            torch.randint(124, 130, (E, R, C // 32), dtype=torch.uint8, generator=g_))


def test_mxfp4_dequantize_follows_the_ocp_table():
    """k3c.ir.formats decodes every byte like the E2M1 table of the OCP MX spec (Table 5) and like the checkpoint
    reader of models/checkpoint.py, for scales from 2^-126 to 2^125; E8M0 255 is NaN."""
    from k3c.ir.formats import mxfp4_dequantize
    from models.checkpoint import mxfp4_dequantize as reader

    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    packed = torch.arange(256, dtype=torch.uint8).repeat(2, 2)                    # [2, 512]: 1024 values
    scale = torch.tensor([[1, 64, 126, 127, 128, 200, 252, 127] * 4] * 2, dtype=torch.uint8)  # 6·2^125 fits f32
    got = mxfp4_dequantize(packed, scale)
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten(1).long()
    want = table[codes] * torch.exp2(scale.double() - 127).repeat_interleave(32, 1)
    assert torch.equal(got.double(), want)
    assert torch.equal(got, reader(packed, scale))
    assert mxfp4_dequantize(packed[:1, :16], torch.tensor([[255]], dtype=torch.uint8)).isnan().all()


def test_moe_experts_mxfp4_equals_dequantize_then_dense():
    from k3c.ir.formats import mxfp4_dequantize

    N, D, I, E, k = 5, 64, 32, 3, 2
    g_ = gen(12)
    z = torch.randn(N, D, generator=g_)
    (w1, s1), (w3, s3), (w2, s2) = mxfp4_random(E, I, D, g_), mxfp4_random(E, I, D, g_), mxfp4_random(E, D, I, g_)
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [2, -1], [0, 1]])
    wts = torch.rand(N, k, generator=g_)
    (y,) = run("moe_experts", z, wts, ids, w1, w3, w2, s1, s3, s2, weight_format="mxfp4")
    dense = [mxfp4_dequantize(w, s) for w, s in ((w1, s1), (w3, s3), (w2, s2))]
    assert torch.equal(y, run("moe_experts", z, wts, ids, *dense)[0])
    d = get_op("moe_experts")
    attrs = d.normalize_attrs({"weight_format": "mxfp4"})
    types = [TensorType(s, dt) for s, dt in [((N, D), "f32"), ((N, k), "f32"), ((N, k), "i64"), ((E, I, D // 2), "u8"),
                                            ((E, I, D // 2), "u8"), ((E, D, I // 2), "u8"), ((E, I, D // 32), "u8"),
                                            ((E, I, D // 32), "u8"), ((E, D, I // 32), "u8")]]
    assert d.infer(attrs, types) == [types[0]]
    with pytest.raises(IRError, match="takes 3 scale inputs, found 0"):
        d.infer(attrs, types[:6])
    with pytest.raises(IRError, match="w2_scale groups vs packed bytes"):
        d.infer(attrs, types[:8] + [TensorType((E, D, 2), "u8")])
    with pytest.raises(IRError, match="takes 0 scale inputs"):
        d.infer(d.normalize_attrs({}), types)


# ---- collectives ----------------------------------------------------------------------------------------------------
def test_collectives_simulated_and_tp1_identity():
    shards = [torch.arange(4.0).view(2, 2) + r for r in range(2)]
    ar = simulate_collective("all_reduce", {"group": 2}, shards)
    assert all(torch.equal(x, shards[0] + shards[1]) for x in ar)
    rs = simulate_collective("reduce_scatter", {"group": 2, "dim": 0}, shards)
    assert torch.equal(torch.cat(rs, 0), shards[0] + shards[1]) and rs[0].shape == (1, 2)
    ag = simulate_collective("all_gather", {"group": 2, "dim": 1}, [r[:, :1] for r in shards])
    assert ag[0].shape == (2, 2) and torch.equal(ag[0], ag[1])
    # reduce_scatter then all_gather = all_reduce
    torch.testing.assert_close(simulate_collective("all_gather", {"group": 2, "dim": 0}, rs)[0], ar[0])
    x = torch.randn(3, 2)
    assert torch.equal(run("all_reduce", x)[0], x)
    with pytest.raises(UnsupportedError, match="interpret_ranks"):
        run("all_reduce", x, group=2)
    with pytest.raises(IRError):
        simulate_collective("all_reduce", {"group": 3}, shards)
