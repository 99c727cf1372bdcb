"""fuse_gemms: linears reading one input become one GEMM over concatenated weights and a split into column views.
Interpreted before / after on each tiny preset, the outputs agree; the GEMMs left per layer kind are counted; the
fused weight is the concatenation of its sources, which leave the graph; under tensor parallelism the fused graph
still gives the tp = 1 outputs on simulated ranks; the memory plan binds the split parts as views in decode only."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from k3c.context import CompileContext
from k3c.frontend import import_model
from k3c.ir.interp import interpret
from k3c.ir.interp_ranks import interpret_ranks
from k3c.passes.derived import copy_derived, materialize_params
from k3c.passes.fuse_gemms import fused_key
from k3c.passes.pipeline import random_inputs, run_pipeline
from k3c.passes.plan_memory import liveness
from test_parallel import _shard_input, _unshard_output

CTX = CompileContext(max_batch=3, max_seq=64, max_prefill=16)
FUSE = {"kernels": ["fuse_gemms"]}
BINDINGS = {"decode": {"B": 3, "T": 1, "L": 4}, "prefill": {"B": 2, "T": 5, "L": 0}}


@functools.lru_cache(maxsize=None)
def model_graph(preset: str, entry: str):
    """(random fp32 model, its graph after the cleanup and model phases); cached, do not mutate."""
    from models.config import K3Config
    from models.k3 import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_pretrained(preset)).eval()
    g, _ = run_pipeline(import_model(model, entry), ["cleanup", "model"], ctx=CTX.for_entry(entry), verify="end")
    return model, g


def fused(g, entry: str, tp: int = 1):
    phases = {"parallel": ["shard_tp", "shard_experts", "split_allreduce"], **FUSE} if tp > 1 else FUSE
    out, _ = run_pipeline(g, phases, ctx=CTX.for_entry(entry).replace(tp=tp, ep=1))
    return out


def named(model) -> dict:
    return {k: p.detach() for k, p in model.named_parameters()}


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("preset,entry", [("k3-tiny", "decode"), ("k3.1-pro-tiny", "decode"),
                                          ("kimi-linear-tiny", "prefill")])
def test_fused_graph_gives_the_same_outputs(preset, entry):
    model, g = model_graph(preset, entry)
    gf = fused(g, entry)
    b = BINDINGS[entry]
    inputs, _ = random_inputs(g, b, seed=1)
    want = interpret(g, inputs, materialize_params(g, named(model)), bindings=b)
    got = interpret(gf, inputs, materialize_params(gf, named(model)), bindings=b)
    assert set(got) == set(want)
    for k, t in want.items():
        assert rel(got[k], t) <= 1e-5, k


def _gemms_per_layer(g) -> dict[int, int]:
    """Linear nodes reading a parameter weight, by layer index in the weight's key (lm_head not counted)."""
    out: dict[int, int] = {}
    for n in g.nodes:
        if n.op == "linear" and n.inputs[1] in g.params.values():
            m = re.match(r"model\.layers\.(\d+)\.", n.inputs[1].name)
            if m:
                out[int(m[1])] = out.get(int(m[1]), 0) + 1
    return out


def test_gemms_left_per_layer_kind():
    _, g = model_graph("k3.1-pro-tiny", "decode")
    before, after = _gemms_per_layer(g), _gemms_per_layer(fused(g, "decode"))
    # layer 0: KDA (q, k, v, f_a, b, g from the normed input; f_b after f_a; o) + dense MLP (gate, up; down)
    assert (before[0], after[0]) == (8 + 3, 3 + 2)
    # KDA + MoE: attention as above; the router (an f32 graph reads its weight directly; bf16 casts it to f32
    # first, which is not a parameter), the routed latent down-projection and the shared experts' gate / up read
    # the normed input (fused), the routed up-projection and the shared down-projection do not
    kda_moe = [i for i in (1, 2, 5, 6) if i in before]
    for i in kda_moe:
        assert (before[i], after[i]) == (8 + 6, 3 + 3), i
    # DSA (layer 3): kv_a + index key (one GEMM, place_dsa), indexer weights, q_a and the output gate read the normed
    # input -> one GEMM; indexer wq_b and q_b read q_a's normed output -> one; o -> one; + MoE as above
    assert (before[3], after[3]) == (7 + 6, 3 + 3)


def test_fused_weight_is_the_concatenation_and_sources_leave():
    model, g = model_graph("k3-tiny", "decode")
    gf = fused(g, "decode")
    key = "model.layers.1.self_attn.q_proj-k_proj-v_proj-f_a_proj-b_proj-g_proj.weight"
    assert key in gf.params
    srcs = [f"model.layers.1.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj",
                                                              "g_proj")]
    assert not any(s in gf.params for s in srcs)
    w = materialize_params(gf, named(model))[key]
    assert torch.equal(w, torch.cat([named(model)[s] for s in srcs]))
    # deterministic: fusing a copy gives the same keys and derivations
    again = fused(copy_derived(g, g.copy()), "decode")
    assert sorted(again.params) == sorted(gf.params) and again.derived_params == gf.derived_params


def test_fused_key():
    assert fused_key(["m.l1.q.weight", "m.l1.k.weight"]) == "m.l1.q-k.weight"
    assert fused_key(["a.x.w.shard", "a.y.z.w.shard"]) == "a.x-y.z.w.shard"


def test_tensor_parallel_fused_graph_equals_tp1():
    model, g = model_graph("k3-tiny", "decode")
    tp = 2
    gt = fused(g, "decode", tp=tp)
    # the KDA projections: column-split shards (each rank its block) beside the replicated low-rank f_a
    rec = next(v for k, v in gt.derived_params.items()
               if k in gt.params and k.startswith("model.layers.1.self_attn.q_proj"))
    assert rec["op"] == "cat" and "model.layers.1.self_attn.q_proj.weight.shard" in rec["from"] \
        and "model.layers.1.self_attn.f_a_proj.weight" in rec["from"]
    b = BINDINGS["decode"]
    inputs, _ = random_inputs(g, b, seed=1)
    want = interpret(g, inputs, materialize_params(g, named(model)), bindings=b)
    ins = [{k: _shard_input(k, t, tp, r) for k, t in inputs.items()} for r in range(tp)]
    outs = interpret_ranks(gt, ins, [materialize_params(gt, named(model), rank=r) for r in range(tp)], bindings=b)
    for k, t in want.items():
        assert rel(_unshard_output(k, outs, tp), t) <= 1e-5, k


def test_split_parts_are_views_in_decode_only():
    for entry, views in (("decode", True), ("prefill", False)):
        _, g = model_graph("k3.1-pro-tiny", entry)
        gf = fused(g, entry)
        parts = {v.name for n in gf.nodes if n.op == "split" for v in n.outputs}
        buffers = {b.name for b in liveness(gf, BINDINGS[entry])}
        assert parts and (not parts & buffers) == views, entry
