"""Pass `lower_moe`: every MoE layer has one router GEMM + one moe_route + one moe_experts, the latent chain and
the shared experts' GEMMs, each labelled with its role and reading that layer's own weights; the computation is
unchanged (bit-exact); malformed blocks raise `IRError` naming the block."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from k3c.errors import IRError
from k3c.ir.interp import interpret
from k3c.frontend import graph_params
from k3c.passes.lower_moe import moe_blocks
from k3c.passes.pipeline import run_pipeline
from test_canonicalize import TINY, imported, model, model_inputs, one_torch_thread  # noqa: F401

CLEAN = {"cleanup": ["dce", "cse", "canonicalize"]}


def _param(g, v):
    """The weight behind `v` (through the router's cast to fp32 in a bf16 model)."""
    p = g.producer(v)
    return p.inputs[0] if p is not None and p.op == "cast" else v


def check_blocks(g, cfg) -> None:
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    latent = cfg.routed_expert_hidden_size is not None
    assert sorted(n.meta["layer"] for n in g.nodes if n.op == "moe_experts") == moe_layers
    for i in moe_layers:
        nodes = [n for n in g.nodes if n.meta.get("layer") == i and "moe_role" in n.meta]
        roles = Counter(n.meta["moe_role"] for n in nodes)
        by_role = {r: [n for n in nodes if n.meta["moe_role"] == r] for r in roles}
        assert len({n.meta["moe_block"] for n in nodes}) == 1
        assert Counter(n.op for n in nodes)["moe_route"] == 1 and Counter(n.op for n in nodes)["moe_experts"] == 1
        p = f"model.layers.{i}.block_sparse_moe."
        gemms = {r: [_param(g, n.inputs[1]).name for n in ns if n.op == "linear"] for r, ns in by_role.items()}
        want = {"router": [p + "gate.weight"], "shared_gate": [p + "shared_experts.gate_proj.weight"],
                "shared_up": [p + "shared_experts.up_proj.weight"],
                "shared_down": [p + "shared_experts.down_proj.weight"]}
        if latent:
            want.update(down=[p + "routed_expert_down_proj.weight"], up=[p + "routed_expert_up_proj.weight"])
            (norm,) = by_role["norm"]
            assert norm.op == "rms_norm" and norm.inputs[1].name == p + "routed_expert_norm.weight"
            assert norm.inputs[0] is by_role["experts"][0].outputs[0]
            assert by_role["up"][0].inputs[0] is norm.outputs[0]
            assert by_role["experts"][0].inputs[0] is by_role["down"][0].outputs[0]
        else:
            assert not {"down", "norm", "up"} & set(roles)
        assert {r: v for r, v in gemms.items() if v} == want
        (route,) = by_role["route"]
        assert route.attrs["top_k"] == cfg.num_experts_per_token and route.inputs[1].name == p + \
            "gate.e_score_correction_bias"
        assert route.inputs[0] is by_role["router"][-1].outputs[0] and route.inputs[0].type.dtype == "f32"
        (comb,) = by_role["combine"]
        assert comb.op == "add"
        assert roles["shared_act"] >= 1 and all(n.op in ("mul", "div", "tanh", "sigmoid", "silu")
                                                for n in by_role["shared_act"])
    # every labelled node belongs to an MoE layer; nothing outside them is labelled
    assert all(n.meta.get("layer") in moe_layers for n in g.nodes if "moe_role" in n.meta)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_blocks_labelled_and_outputs_bit_exact(name, entry):
    m = model(name)
    before, _ = run_pipeline(imported(name, entry), CLEAN)
    after, report = run_pipeline(before, {"model": ["fuse_kda", "lower_moe"]})
    check_blocks(after, m.config)
    assert report.passes[-1].nodes_before == report.passes[-1].nodes_after
    fused_only, _ = run_pipeline(before, {"model": ["fuse_kda"]})
    ins, _, _ = model_inputs(m, entry, 2)
    want = interpret(fused_only, ins, graph_params(m, fused_only))
    got = interpret(after, ins, graph_params(m, after))
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_bf16_router_keeps_its_fp32_casts():
    g, _ = run_pipeline(imported("k3-tiny", "decode", "bf16"), {**CLEAN, "model": ["lower_moe"]})
    check_blocks(g, model("k3-tiny", "bf16").config)
    routers = [n for n in g.nodes if n.meta.get("moe_role") == "router"]
    assert Counter(n.op for n in routers) == {"linear": 9, "cast": 18}  # x.float(), gate.weight.float()


@pytest.fixture(scope="module")
def clean_decode():
    g, _ = run_pipeline(imported("k3-tiny", "decode"), CLEAN)
    return g


def _block(g, layer):
    ex = next(n for n in g.nodes if n.op == "moe_experts" and n.meta["layer"] == layer)
    return ex, {n.op + str(i): n for i, n in enumerate(g.users(ex.outputs[0]))}


def test_missing_latent_norm_fails(clean_decode):
    g = clean_decode.copy()
    ex, users = _block(g, 2)
    (norm,) = users.values()
    g.replace_all_uses(norm.outputs[0], ex.outputs[0])
    g.remove_node(norm)
    with pytest.raises(IRError, match=r"lower_moe: the MoE block of moe_experts -> %\S+ \(.*layer 2.*rms_norm"):
        run_pipeline(g, {"model": ["lower_moe"]})


def test_router_not_a_gemm_fails(clean_decode):
    g = clean_decode.copy()
    ex, _ = _block(g, 3)
    route = g.producer(ex.inputs[1])
    logits = route.inputs[0]
    with g.inserting_before(route):
        scaled = g.add("mul", logits, scalar=2.0)
    g.set_input(route, 0, scaled)
    with pytest.raises(IRError, match="router logits"):
        run_pipeline(g, {"model": ["lower_moe"]})


def test_moe_blocks_api_lists_roles(clean_decode):
    blocks = moe_blocks(clean_decode)
    assert len(blocks) == 9
    assert set(blocks[0]) == {"router", "route", "down", "experts", "norm", "up", "shared_gate", "shared_up",
                              "shared_act", "shared_down", "combine"}
