"""fold_params: weight-only computation becomes derived parameters. On a bf16 k3.1-pro-tiny (casts are real
there), the graph before and after interprets to the same outputs; no elementwise node reads only parameters
afterwards (decode; prefill shares the keys, so the same derivations); the folded router weight and AttnRes products equal what the model's own weights give; prefill and
decode name the folded weights alike, and the bf16 router weight leaves the graph."""

from __future__ import annotations

import functools

import torch

from k3c.context import CompileContext
from k3c.frontend import import_model
from k3c.ir.interp import interpret
from k3c.ir.ops import get_op
from k3c.passes.derived import copy_derived, materialize_params
from k3c.passes.pipeline import PHASES, random_inputs, run_pipeline

CTX = CompileContext(max_batch=2, max_seq=32, max_prefill=8, dtype="bf16")
BINDINGS = {"decode": {"B": 2, "T": 1, "L": 3}}
MODEL = [p for p in PHASES["model"] if p not in ("fold_params", "dce")]


@functools.lru_cache(maxsize=None)
def graphs(entry: str):
    """(bf16 model, graph after cleanup + the model phase without fold_params, the same after fold_params)."""
    from models.config import K3Config
    from models.k3 import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_pretrained("k3.1-pro-tiny")).eval().to(torch.bfloat16)
    ctx = CTX.for_entry(entry)
    before, _ = run_pipeline(import_model(model, entry), {"cleanup": PHASES["cleanup"], "model": MODEL}, ctx=ctx,
                             verify="end")
    after, _ = run_pipeline(copy_derived(before, before.copy()), {"model": ["fold_params"]}, ctx=ctx)
    return model, before, after


def weights(model) -> dict:
    return {k: p.detach() for k, p in model.named_parameters()}


def assert_same_outputs(model, before, after, entry: str, seed: int) -> None:
    """`before` and `after` (graphs of `model`'s `entry`) interpret to bit-equal outputs on random inputs."""
    b = BINDINGS[entry]
    inputs, _ = random_inputs(before, b, seed=seed)
    want = interpret(before, inputs, materialize_params(before, weights(model)), bindings=b)
    got = interpret(after, inputs, materialize_params(after, weights(model)), bindings=b)
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k], t), k


def test_folded_graph_gives_the_same_outputs(entry="decode"):
    model, before, after = graphs(entry)
    assert_same_outputs(model, before, after, entry, seed=1)


def test_weight_only_nodes_are_folded():
    model, before, after = graphs("decode")
    params = set(after.params.values())
    left = [n for n in after.nodes if get_op(n.op).kind == "elementwise" and all(v in params for v in n.inputs)]
    assert not left, [n.op for n in left]
    assert len(after.nodes) < len(before.nodes)
    w = weights(model)
    folded = materialize_params(after, w)
    gates = [k for k in after.params if k.endswith("gate.weight.cast-f32")]
    assert gates and all(k[:-len(".cast-f32")] not in after.params for k in gates)  # stored once, as f32
    for k in gates:
        assert torch.equal(folded[k], w[k[:-len(".cast-f32")]].float())
    # Block AttnRes: the per-sublayer query rows (norm weight x projection row, models/layers.py) are stacked into
    # one folded [Q, D] weight per block: every sublayer after the first, then the output, in order
    n_layers = model.config.num_hidden_layers
    names = [f"model.layers.{i}.{s}" for i in range(n_layers) for s in ("self_attention_res", "mlp_res")][1:]
    want = torch.stack([w[f"{s}_norm.weight"].float() * w[f"{s}_proj.weight"][0].float()
                        for s in names + ["model.output_attn_res"]])
    queries = [n.inputs[0] for n in after.nodes if n.op == "attn_res_inter"]
    assert queries and all(q in params for q in queries)
    keys = list(dict.fromkeys(q.name for q in queries))
    assert torch.equal(torch.cat([folded[k] for k in keys]), want)


def test_prefill_and_decode_share_the_folded_keys():
    derived = {e: {k for k in graphs(e)[2].params if "cast-f32" in k} for e in ("decode", "prefill")}
    assert derived["decode"] and derived["decode"] == derived["prefill"]
