"""Pass `fuse_kda`: one `kda_fused` per KDA layer wired to the layer's own projections, weights and caches;
interpreter outputs unchanged and equal to the reference model; malformed KDA layers raise `IRError` naming the
layer; random small configs (hypothesis) keep the cleanup + model passes exact."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from k3c.errors import IRError
from k3c.ir.interp import interpret
from k3c.frontend import graph_params
from k3c.passes.pipeline import run_pipeline
from test_canonicalize import (TINY, compare, imported, model, model_inputs, one_torch_thread,  # noqa: F401
                               ops_of, rel_err)

FUSE = {"cleanup": ["dce", "cse", "canonicalize"], "model": ["fuse_kda"]}
CLEAN = {"cleanup": ["dce", "cse", "canonicalize"]}


def check_structure(g, cfg, entry) -> None:
    """Each KDA layer: exactly one kda_fused, fed by that layer's projections, weights and caches; nothing of the
    mixer left (conv, l2norm, recurrence, beta sigmoid, decay gate)."""
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    fused = [n for n in g.nodes if n.op == "kda_fused"]
    assert sorted(n.meta["layer"] for n in fused) == sorted(cfg.kda_layers)
    for n in fused:
        i = n.meta["layer"]
        ops = ops_of(g, i)
        assert ops["kda_fused"] == 1
        for op in ("conv1d", "l2norm", "kda_recurrence", "softplus", "neg", "exp", "split", "transpose"):
            assert ops[op] == 0, (i, op)
        mixer_like = [m for m in g.nodes if m.meta.get("layer") == i and (
            m.op == "sigmoid" and m.outputs[0].type.rank == 3 and m.outputs[0].type.shape[-1] in (H, H * K)
            or m.op == "silu" and m.outputs[0].type.rank == 3 and m.outputs[0].type.shape[1] == 3 * H * K)]  # beta,
        # output gate and short-conv activation (the MLP's / shared experts' activations are rank 2 [N, I])
        assert not mixer_like, mixer_like
        a = n.attrs
        assert (a["heads"], a["head_dim"], a["eps"]) == (H, K, cfg.rms_norm_eps)
        if cfg.gate_lower_bound is None:
            assert a["gate"] == "softplus"
        else:
            assert a["gate"] == "lower_bound" and a["lower_bound"] == cfg.gate_lower_bound
        p = f"model.layers.{i}.self_attn."
        assert [v.name for v in n.inputs[6:12]] == [p + s for s in ("q_conv1d.weight", "k_conv1d.weight",
                                                                     "v_conv1d.weight", "A_log", "dt_bias",
                                                                     "o_norm.weight")]
        gate_w = "g_proj" if cfg.use_full_rank_gate else "g_b_proj"
        for v, w in zip(n.inputs[:6], ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", gate_w)):
            prod = g.producer(v)
            assert prod.op == "linear" and prod.inputs[1].name == p + w + ".weight", (v, w)
        assert [v.name for v in n.inputs[12:]] == [f"layers.{i}.kda_state", f"layers.{i}.conv_state"]
        assert g.outputs[f"layers.{i}.kda_state"] is n.outputs[1]
        assert g.outputs[f"layers.{i}.conv_state"] is n.outputs[2]
        (o_proj,) = g.users(n.outputs[0])
        assert o_proj.op == "linear" and o_proj.inputs[1].name == p + "o_proj.weight"
        T = 1 if entry == "decode" else n.inputs[0].type.shape[1]
        assert n.outputs[0].type.shape[1] == T


def check_against_model(m, g, entry, batch) -> None:
    """The fused graph's logits and new caches against the reference model itself (independent oracle; the model
    runs the chunked recurrence for T > 1)."""
    ins, tokens, cache = model_inputs(m, entry, batch)
    got = interpret(g, ins, graph_params(m, g))
    logits, new_cache = m(tokens, cache)
    assert rel_err(got["logits"], logits) <= 1e-4
    for k, v in got.items():
        if k != "logits":
            assert rel_err(v, new_cache[k]) <= 1e-4, k


def fuse_and_check(m, entry: str, graph) -> None:
    """Cleanup, then fuse_kda: the structure it must produce, equal outputs (batch 1 and 3), equal to the model."""
    before, _ = run_pipeline(graph, CLEAN)
    after, _ = run_pipeline(before, {"model": ["fuse_kda"]})
    check_structure(after, m.config, entry)
    for batch in (1, 3):
        compare(m, before, after, entry, batch, tol=1e-5)
    check_against_model(m, after, entry, 3)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_one_kda_fused_per_layer_and_outputs_unchanged(name, entry):
    fuse_and_check(model(name), entry, imported(name, entry))


def test_head_dim_not_a_power_of_two():
    cfg = dict(heads=3, head_dim=12, layers=4, kda_layers=(1, 2, 4), eps=1e-3)  # eps: not kda_fused's default
    m = model("k3", **cfg)
    assert (m.config.kda_head_dim, m.config.kda_num_heads, m.config.rms_norm_eps) == (12, 3, 1e-3)
    for entry in ("prefill", "decode"):
        fuse_and_check(m, entry, imported("k3", entry, **cfg))


def test_bf16_projections_absorb_the_casts():
    m = model("k3-tiny", "bf16")
    before, _ = run_pipeline(imported("k3-tiny", "decode", "bf16"), CLEAN)
    after, _ = run_pipeline(before, {"model": ["fuse_kda"]})
    check_structure(after, m.config, "decode")
    for n in after.nodes:
        if n.op == "kda_fused":
            assert [v.type.dtype for v in n.inputs[:6]] == ["bf16"] * 6 and n.outputs[0].type.dtype == "bf16"
            # the conv state is stored in bf16 (it holds bf16 projection outputs): its casts fold in too
            assert n.inputs[13].type.dtype == n.outputs[2].type.dtype == "bf16"
    compare(m, before, after, "decode", 2, tol=1e-2)


def test_fuses_the_uncanonicalised_import_too():
    """Norms still decomposed (no canonicalize): the walk recognises the chains, same fused graph numerically."""
    m = model("kimi-linear-tiny")
    raw, _ = run_pipeline(imported("kimi-linear-tiny", "decode"), {"cleanup": ["dce", "cse"], "model": ["fuse_kda"]})
    check_structure(raw, m.config, "decode")
    canon, _ = run_pipeline(imported("kimi-linear-tiny", "decode"), FUSE)
    compare(m, canon, raw, "decode", 2, tol=1e-6)


# ---- malformed layers fail loudly ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clean_decode():
    g, _ = run_pipeline(imported("k3-tiny", "decode"), CLEAN)
    return g


def _layer1(g):
    rec = next(n for n in g.nodes if n.op == "kda_recurrence" and n.meta["layer"] == 1)
    return rec, g.producer


def _expect_error(g, rec, *words):
    with pytest.raises(IRError) as e:
        run_pipeline(g, {"model": ["fuse_kda"]})
    msg = str(e.value)
    assert f"%{rec.outputs[0].name}" in msg and "layer 1" in msg, msg
    for w in words:
        assert w in msg, msg


def test_wrong_q_scale_fails(clean_decode):
    g = clean_decode.copy()
    rec, prod = _layer1(g)
    prod(rec.inputs[0]).attrs["scalar"] = 0.5
    _expect_error(g, rec, "K^-0.5")


def test_missing_silu_fails(clean_decode):
    g = clean_decode.copy()
    rec, prod = _layer1(g)
    silu = next(n for n in g.nodes if n.op == "silu" and n.meta.get("layer") == 1)
    g.replace_all_uses(silu.outputs[0], silu.inputs[0])
    _expect_error(g, rec, "silu")


def test_q_and_k_swapped_in_the_split_fails(clean_decode):
    g = clean_decode.copy()
    rec, prod = _layer1(g)
    split = next(n for n in g.nodes if n.op == "split" and n.meta.get("layer") == 1)
    rq, rk = (next(u for u in g.users(split.outputs[i])) for i in (0, 1))
    g.set_input(rq, 0, split.outputs[1])
    g.set_input(rk, 0, split.outputs[0])
    _expect_error(g, rec, "split")


def test_interior_value_read_outside_fails(clean_decode):
    g = clean_decode.copy()
    rec, prod = _layer1(g)
    g.set_output("beta_probe", rec.inputs[4])  # sigmoid(b_proj(x)) escapes the layer
    _expect_error(g, rec, "graph output")


# ---- random small configs ---------------------------------------------------------------------------------------
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: each example imports a model
@given(base=st.sampled_from(["k3", "kimi-linear-48b"]), layers=st.integers(2, 5), heads=st.integers(1, 4),
       head_dim=st.sampled_from([4, 6, 8, 12, 16]), batch=st.integers(1, 3), data=st.data())
def test_random_configs_keep_outputs(base, layers, heads, head_dim, batch, data):
    kda = tuple(sorted(data.draw(st.sets(st.integers(1, layers), min_size=1, max_size=layers), label="kda_layers")))
    cfg = dict(base=base, layers=layers, kda_layers=kda, heads=heads, head_dim=head_dim)
    m = model("rand", **cfg)
    for entry in ("prefill", "decode"):
        g = imported("rand", entry, **cfg)
        after, _ = run_pipeline(g, {**CLEAN, "model": ["fuse_kda", "lower_moe", "dce"]})
        check_structure(after, m.config, entry)
        compare(m, g, after, entry, batch, tol=1e-5)
        check_against_model(m, after, entry, batch)
