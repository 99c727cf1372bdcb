"""absorb_mla: MLA attention as one mla_attention node, absorbed (MQA over the latent) for decode / when cheaper.

Also holds the helpers the other model-pass tests share (`imported`, `tiny_model`, `run_graph`, `rel_err`): each
tiny preset is imported once per session (torch.export is the slow part).
"""

from __future__ import annotations

import functools

import pytest
import torch

from k3c.errors import CheckpointError
from k3c.frontend import graph_inputs, import_model
from k3c.ir.graph import Graph
from k3c.ir.interp import interpret
from k3c.passes import mla_forms
from k3c.passes.mla_forms import MLAMatch, lower_mla_layers, mla_flops
from k3c.passes.derived import copy_derived, materialize_params
from k3c.passes.pipeline import run_pipeline
from models.k3 import K3Config, K3ForCausalLM

PRESETS = ("k3-tiny", "k3.1-pro-tiny", "kimi-linear-tiny")


# ---- shared helpers ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def imported(preset: str, entry: str) -> Graph:
    """The preset's graph for `entry` after the cleanup phase (cached: do not mutate, copy first)."""
    g, _ = run_pipeline(import_model(preset, entry), ["cleanup"])
    return g


@functools.lru_cache(maxsize=None)
def tiny_model(preset: str) -> K3ForCausalLM:
    return K3ForCausalLM(K3Config.from_pretrained(preset)).init_random_(0).eval()


def fresh(g: Graph) -> Graph:
    """A mutable copy of `g` keeping its derived-parameter records."""
    return copy_derived(g, g.copy())


def run_graph(g: Graph, model: K3ForCausalLM, tokens: torch.Tensor, cache: dict | None = None, trace=None,
              params: dict | None = None) -> dict:
    """Interpret `g` on `tokens` [B,T] and a model cache, with the graph's derived params materialised."""
    named = params if params is not None else {k: v.detach() for k, v in model.named_parameters()}
    with torch.no_grad():
        return interpret(g, graph_inputs(model, tokens, cache), materialize_params(g, named), trace=trace)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_same_outputs(before: dict, after: dict, tol: float = 1e-5) -> None:
    assert set(before) == set(after)
    for k in before:
        if before[k].is_floating_point():
            assert rel_err(after[k], before[k]) <= tol, (k, rel_err(after[k], before[k]))
        else:
            assert torch.equal(after[k], before[k]), k


def prefix_cache(model: K3ForCausalLM, B: int, L: int, seed: int = 1) -> dict:
    """The model's cache after a random L-token prompt (B sequences)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _, cache = model(torch.randint(0, model.config.vocab_size, (B, L), generator=gen))
    return cache


def tokens(model: K3ForCausalLM, B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


#: The bounds `k3c compile` plans at by default for prefill (--max-seq 4096 --max-prefill 1024).
BOUNDS = {"B": 1, "T": 1024, "L": 3072}


def absorbed(g: Graph, **kw) -> Graph:
    out = fresh(g)
    lower_mla_layers(out, BOUNDS, **kw)
    return out


# ---- tests ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_absorb_is_exact_on_every_preset(preset, entry):
    model, g = tiny_model(preset), imported(preset, entry)
    after, _ = run_pipeline(g, {"model": ["absorb_mla"]})
    n_mla = sum(model.config.layer_kind(i) != "kda" for i in range(model.config.num_hidden_layers))
    assert sum(n.op == "mla_attention" for n in after.nodes) == n_mla
    for B in (1, 3):
        if entry == "decode":
            cache, tok = prefix_cache(model, B, 7), tokens(model, B, 1)
        else:
            cache, tok = None, tokens(model, B, 9)
        want = run_graph(g, model, tok, cache)
        got = run_graph(after, model, tok, cache)
        assert_same_outputs(want, got)
        with torch.no_grad():
            ref, _ = model(tok, cache)
        assert rel_err(got["logits"], ref) < 1e-4


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("form", ["absorbed", "naive"])
def test_prefill_both_forms_exact_with_a_cache(preset, form):
    """Chunked prefill (cache of 5 tokens, 6 new) in either form equals the unrewritten graph."""
    model, g = tiny_model(preset), imported(preset, "prefill")
    after = absorbed(g, form=form)
    atts = [n for n in after.nodes if n.op == "mla_attention"]
    assert atts and all(n.attrs["absorbed"] == (form == "absorbed") for n in atts)
    cache, tok = prefix_cache(model, 3, 5), tokens(model, 3, 6)
    assert_same_outputs(run_graph(g, model, tok, cache), run_graph(after, model, tok, cache))


def test_decode_is_mqa_over_the_cached_latent():
    cfg = tiny_model("k3-tiny").config
    g = imported("k3-tiny", "decode")
    after, _ = run_pipeline(g, {"model": ["absorb_mla"]})
    r, rope, H = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
    atts = [n for n in after.nodes if n.op == "mla_attention"]
    assert len(atts) == 3
    for n in atts:
        q, kv = n.inputs[0], n.inputs[1]
        assert n.attrs["absorbed"] and n.attrs["v_dim"] == r
        assert q.type.shape[1:] == (1, H, r + rope)  # latent query, one per head
        assert kv.type.shape[2] == r + rope and after.is_output(kv)  # exactly the cache entry written this step
        assert n.meta["mla_form"]["chosen"] == "absorbed"
    # kv_b_proj is folded away: its weight is no longer read, the folded ones are derived from it
    assert not any(k.endswith("kv_b_proj.weight") for k in after.params)
    der = after.derived_params
    for i in (3, 7, 9):
        base = f"model.layers.{i}.self_attn.kv_b_proj"
        assert der[base + ".w_uk"] == {"op": "mla_w_uk", "from": [base + ".weight"],
                                       "attrs": {"heads": H, "nope": cfg.qk_nope_head_dim, "v_dim": cfg.v_head_dim}}
        assert der[base + ".w_uv"]["op"] == "mla_w_uv"
        assert after.params[base + ".w_uk"].type.shape == (H, cfg.qk_nope_head_dim, r)
    assert not any(n.op in ("masked_fill", "scatter") or (n.op == "softmax" and n.inputs[0].type.rank == 4)
                   for n in after.nodes)


def test_materialize_params_computes_the_per_head_split():
    model, g = tiny_model("k3-tiny"), imported("k3-tiny", "decode")
    after = absorbed(g)
    named = {k: v.detach() for k, v in model.named_parameters()}
    p = materialize_params(after, named)
    assert set(p) == set(after.params)
    cfg = model.config
    H, nope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    w = named["model.layers.3.self_attn.kv_b_proj.weight"].reshape(H, nope + vd, -1)
    assert torch.equal(p["model.layers.3.self_attn.kv_b_proj.w_uk"], w[:, :nope])
    assert torch.equal(p["model.layers.3.self_attn.kv_b_proj.w_uv"], w[:, nope:])
    del named["model.layers.3.self_attn.kv_b_proj.weight"]
    with pytest.raises(CheckpointError, match="kv_b_proj.weight"):
        materialize_params(after, named)


def test_prefill_form_follows_the_flop_count_at_the_bounds():
    g = imported("k3-tiny", "prefill")
    small, large = fresh(g), fresh(g)
    bounds = {small: {"B": 1, "T": 4, "L": 4096}, large: {"B": 1, "T": 4096, "L": 4096}}
    lower_mla_layers(small, bounds[small])
    lower_mla_layers(large, bounds[large])
    for graph, want in ((small, True), (large, False)):
        for n in (n for n in graph.nodes if n.op == "mla_attention"):
            f = n.meta["mla_form"]
            assert n.attrs["absorbed"] is want
            assert (f["absorbed_flops"] <= f["naive_flops"]) is want and f["T"] == bounds[graph]["T"]


def test_long_context_prefill_is_absorbed_when_the_naive_kv_is_over_budget(monkeypatch):
    """At T = 4096 the naive form has fewer FLOPs; its decompressed K/V, B·S·H·(2·nope + rope + vd) values, decides."""
    cfg = K3Config.from_pretrained("k3-tiny")
    g = imported("k3-tiny", "prefill")
    bounds = {"B": 2, "T": 4096, "L": 4096}
    item = 4  # the imported graph is f32
    kv = 2 * 8192 * cfg.num_attention_heads * (2 * cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * item
    for budget, want, why in ((kv, False, "fewer FLOPs"), (kv - 1, True, "naive K/V over budget")):
        monkeypatch.setattr(mla_forms, "NAIVE_KV_BUDGET_BYTES", budget)
        graph = fresh(g)
        lower_mla_layers(graph, bounds)
        nodes = [n for n in graph.nodes if n.op == "mla_attention"]
        assert nodes and all(n.attrs["absorbed"] is want for n in nodes)
        assert all(n.meta["mla_form"]["naive_kv_bytes"] == kv and n.meta["mla_form"]["why"] == why for n in nodes)


def test_flop_model_crossover_at_k3_sizes():
    """Dense K3 MLA (r 512, rope 64, nope = vd = 128, 64 heads): absorbed wins for short query blocks only."""
    m = MLAMatch(*([None] * 11), H=64, nope=128, rope=64, vd=128, r=512, scale=1.0, idx=None)
    assert mla_flops(m, 1, 100_000)["absorbed"] < mla_flops(m, 1, 100_000)["naive"]
    assert mla_flops(m, 160, 100_000)["absorbed"] < mla_flops(m, 160, 100_000)["naive"]
    assert mla_flops(m, 200, 100_000)["absorbed"] > mla_flops(m, 200, 100_000)["naive"]


def test_unrelated_softmax_is_left_alone():
    """A softmax that is not an MLA core (the AttnRes one, mask not causal) is not rewritten."""
    g = imported("k3-tiny", "prefill")
    after = absorbed(g)
    n_soft = sum(n.op == "softmax" for n in g.nodes)
    assert sum(n.op == "softmax" for n in after.nodes) == n_soft - 3
