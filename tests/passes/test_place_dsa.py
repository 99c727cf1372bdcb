"""place_dsa: the DSA indexer joined with the latent KV write, scheduled early, read directly by the sparse
attention, with the dense guard while the context has <= top-k keys (k3.1-pro-tiny: top-k 16, DSA layers 3, 7, 9)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from k3c.errors import IRError
from k3c.ir.graph import Graph
from k3c.ir.ops import get_op
from k3c.ir.types import TensorType
from k3c.passes.pipeline import run_pipeline
from test_absorb_mla import assert_same_outputs, imported, prefix_cache, rel_err, run_graph, tiny_model, tokens

P = "k3.1-pro-tiny"
K = 16
DSA_LAYERS = (3, 7, 9)


@functools.lru_cache(maxsize=None)
def placed(entry: str, passes: tuple = ("absorb_mla", "place_dsa")) -> Graph:
    g, _ = run_pipeline(imported(P, entry), {"model": list(passes)})
    return g


def _check(entry: str, B: int, T: int, L: int, model=None, seed: int = 0) -> dict:
    """Interpret before/after place_dsa (and the model) on a cache of L tokens + T new ones; returns after's outputs."""
    model = model or tiny_model(P)
    cache = prefix_cache(model, B, L, seed + 1) if L else None
    tok = tokens(model, B, T, seed)
    trace_log = []
    got = run_graph(placed(entry), model, tok, cache, trace=_no_negative_gather(trace_log))
    want = run_graph(imported(P, entry), model, tok, cache)
    assert_same_outputs(want, got, tol=1e-5)
    with torch.no_grad():
        ref, ref_cache = model(tok, cache)
    assert rel_err(got["logits"], ref) < 1e-4
    for i in DSA_LAYERS:
        assert torch.equal(got[f"layers.{i}.index_k"], ref_cache[f"layers.{i}.index_k"]) or \
            rel_err(got[f"layers.{i}.index_k"], ref_cache[f"layers.{i}.index_k"]) < 1e-5
    got["_idx"] = trace_log
    return got


def _no_negative_gather(log: list):
    """Interpreter trace: fail if a gather-like op reads a negative index; record every dsa_index_topk result."""
    def trace(node, ins, outs):
        if node.op in ("gather", "index_select", "embedding"):
            assert int(ins[1].min()) >= 0, f"{node.op} read a negative index"
        if node.op == "dsa_index_topk":
            log.append(outs[0])
    return trace


# ---- numerics at the top-k boundary ------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, K - 1, K, K + 1])
def test_prefill_context_lengths(T):
    got = _check("prefill", 3, T, 0, seed=T)
    idx = got["_idx"][0]  # [B,T,K]
    assert (idx[:, -1] >= 0).sum(-1).tolist() == [min(T, K)] * 3  # the last row sees min(T, K) keys
    if T <= K:
        assert (idx[:, 0] == -1).any()  # there are -1 slots, and they reached no gather


@pytest.mark.parametrize("L", [0, K - 2, K - 1, K])
def test_decode_context_lengths(L):
    """Decode with contexts 1, k-1, k (dense guard) and k+1 (right after crossing top-k keys: sparse)."""
    got = _check("decode", 3, 1, L, seed=L)
    idx = got["_idx"][0]
    assert ((idx >= 0).sum(-1) == min(L + 1, K)).all()


def test_batch_one():
    _check("prefill", 1, K + 3, 0)
    _check("decode", 1, 1, K + 3)


def test_ties_go_to_the_lowest_positions():
    """indexer.wk = 0: every index key is k_norm's bias, so all scores tie; the lowest positions win."""
    model = copy.deepcopy(tiny_model(P))
    with torch.no_grad():
        for i in DSA_LAYERS:
            model.model.layers[i].self_attn.indexer.wk.weight.zero_()
    T = K + 8
    got = _check("prefill", 2, T, 0, model=model)
    for idx in got["_idx"]:
        assert torch.equal(idx[:, K:], torch.arange(K).expand(2, T - K, K))  # > k equal scores: positions 0..k-1


def test_chunked_prefill_carries_index_keys():
    """Prefill 10 tokens, then 12 more with the cache the compiled graph wrote: equals one 22-token prefill."""
    model = tiny_model(P)
    tok = tokens(model, 2, 22, seed=5)
    g = placed("prefill")
    first = run_graph(g, model, tok[:, :10])
    cache = {k: v for k, v in first.items() if k != "logits"}
    second = run_graph(g, model, tok[:, 10:], cache)
    with torch.no_grad():
        ref, ref_cache = model(tok)
    assert rel_err(second["logits"], ref[:, 10:]) < 1e-4
    for i in DSA_LAYERS:
        assert second[f"layers.{i}.index_k"].shape[1] == 22
        assert rel_err(second[f"layers.{i}.index_k"], ref_cache[f"layers.{i}.index_k"]) < 1e-5


# ---- the guard ---------------------------------------------------------------------------------------------------
def _op(name, *ins, **attrs):
    opdef = get_op(name)
    return opdef.ref(opdef.normalize_attrs(attrs), *ins)[0]


@pytest.mark.parametrize("S", [1, K - 1, K, K + 1, 3 * K])
def test_guard_dense_path_is_exactly_the_sparse_one_while_s_le_k(S):
    gen = torch.Generator().manual_seed(S)
    B, T, H, D, J, Dk = 2, min(S, 5), 3, 12, 4, 8
    q, kv = torch.randn(B, T, H, D, generator=gen), torch.randn(B, S, D, generator=gen)
    idx = _op("dsa_index_topk", torch.randn(B, T, J, Dk, generator=gen), torch.randn(B, T, J, generator=gen),
              torch.randn(B, S, Dk, generator=gen), topk=K)
    kw = dict(absorbed=True, v_dim=8, scale=0.3)
    dense = _op("mla_attention", q, kv, **kw)
    sparse = _op("mla_attention", q, kv, idx, **kw)
    guarded = _op("mla_attention", q, kv, idx, dense_max_keys=K, **kw)
    if S <= K:
        assert torch.equal(sparse, dense) and torch.equal(guarded, dense)  # bit-exact
    else:
        assert torch.equal(guarded, sparse) and not torch.allclose(guarded, dense)


def test_guard_needs_indices():
    with pytest.raises(IRError, match="dense_max_keys"):
        get_op("mla_attention").infer(get_op("mla_attention").normalize_attrs(
            {"absorbed": True, "v_dim": 4, "scale": 1.0, "dense_max_keys": 4}),
            [TensorType(("B", 1, 2, 8), "f32"), TensorType(("B", "L", 8), "f32")])


def test_a_wrong_guard_is_caught():
    """The equality tests can fail: a guard that keeps the dense path past top-k changes the outputs."""
    model, g = tiny_model(P), copy.deepcopy(placed("decode"))
    for n in g.nodes:
        if n.op == "mla_attention":
            n.attrs["dense_max_keys"] = 10 ** 6
    cache, tok = prefix_cache(model, 2, K + 4), tokens(model, 2, 1)
    want = run_graph(imported(P, "decode"), model, tok, cache)
    assert rel_err(run_graph(g, model, tok, cache)["logits"], want["logits"]) > 1e-4


# ---- structure ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_structure(entry):
    g = placed(entry)
    pos = {id(n): i for i, n in enumerate(g.nodes)}
    tops = [n for n in g.nodes if n.op == "dsa_index_topk"]
    assert sorted(n.meta["layer"] for n in tops) == list(DSA_LAYERS)  # exactly one per DSA layer
    for t in tops:
        i = t.meta["layer"]
        users = g.users(t.outputs[0])
        assert [u.op for u in users] == ["mla_attention"]  # idx goes straight to the attention, nowhere else
        att = users[0]
        assert att.attrs["dense_max_keys"] == K and att.inputs[-1] is t.outputs[0]
        assert pos[id(t)] < pos[id(att)]
        q_b = next(n for n in g.nodes
                   if n.op == "linear" and n.inputs[1].name == f"model.layers.{i}.self_attn.q_b_proj.weight")
        assert pos[id(t)] < pos[id(q_b)]  # scored as soon as x and the q-LoRA latent exist
        # the index key write sits with the latent KV write, both fed by one projection of x
        kv_cat, ik_cat = g.producer(g.outputs[f"layers.{i}.kv"]), g.producer(g.outputs[f"layers.{i}.index_k"])
        assert pos[id(ik_cat)] - pos[id(kv_cat)] == 2  # kv write, k_norm, index write
        split = g.producer(g.producer(ik_cat.inputs[1]).inputs[0])
        lin = g.producer(split.inputs[0])
        assert split.op == "split" and lin.op == "linear"
        key = f"model.layers.{i}.self_attn.kv_a_proj_with_indexer_wk.weight"
        assert lin.inputs[1] is g.params[key]
        assert g.derived_params[key] == {"op": "cat", "attrs": {"dim": 0}, "from": [
            f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", f"model.layers.{i}.self_attn.indexer.wk.weight"]}
        assert f"model.layers.{i}.self_attn.indexer.wk.weight" not in g.params
    assert not any(n.op in ("scatter", "gather", "index_select") for n in g.nodes if n.meta.get("layer") in DSA_LAYERS)


def test_place_dsa_without_absorb_mla():
    """Run alone, place_dsa itself replaces the dense mask scatter by an mla_attention reading idx."""
    g = placed("prefill", ("place_dsa",))
    assert sum(n.op == "mla_attention" for n in g.nodes) == 3
    assert not any(n.op == "scatter" for n in g.nodes)
    model = tiny_model(P)
    tok = tokens(model, 2, K + 2, seed=9)
    assert_same_outputs(run_graph(imported(P, "prefill"), model, tok), run_graph(g, model, tok))


@pytest.mark.parametrize("entry,keys", [("prefill", "fp8"), ("decode", "fp8"), ("decode", "fp8-rerank")])
def test_fp8_index_keys(entry, keys):
    """--dsa-index-keys fp8 (k3c.frontend.index_keys): the index key projection still joins the latent KV GEMM,
    looking through the keys' fp8_quantize (fp8-rerank: fp8_split); the quantize and the appends (keys, scales,
    residuals) run with the latent append, before the indexer; the outputs are kept (interpreted before/after on
    random inputs with the model's weights, past top-k)."""
    from k3c.frontend import import_model
    from k3c.passes.pipeline import make_numeric_check

    model = tiny_model(P)
    check = make_numeric_check({"B": 2, "T": K + 2 if entry == "prefill" else 1, "L": 0 if entry == "prefill" else
                                K + 2}, params={k: p.detach() for k, p in model.named_parameters()})
    g, _ = run_pipeline(import_model(P, entry, dsa_index_keys=keys), ["cleanup"])
    g, _ = run_pipeline(g, {"model": ["absorb_mla", "place_dsa"]}, numeric_check=check)
    pos = {id(n): i for i, n in enumerate(g.nodes)}
    for i in DSA_LAYERS:
        cat = g.producer(g.outputs[f"layers.{i}.index_k"])
        quant = g.producer(cat.inputs[1])
        side = [g.producer(g.outputs[f"layers.{i}.index_k{s}"]) for s in ("_scale", "_lo")[:len(quant.outputs) - 1]]
        assert (quant.op, cat.op, [c.op for c in side]) == ({"fp8": "fp8_quantize", "fp8-rerank": "fp8_split"}[keys],
                                                            "cat", ["cat"] * (1 + (keys == "fp8-rerank")))
        assert any(k.endswith(f"layers.{i}.self_attn.kv_a_proj_with_indexer_wk.weight") for k in g.params)
        (top,) = g.users(cat.outputs[0])
        assert top.op == "dsa_index_topk" and top.inputs[2:] == [cat.outputs[0], *(c.outputs[0] for c in side)]
        kv_append = g.producer(g.outputs[f"layers.{i}.kv"])
        order = [pos[id(n)] for n in (kv_append, quant, cat, *side, top)]
        assert order == sorted(order)
