"""sink_views: a one-input elementwise op of a reshape reads the reshape's input instead, and views move below the
siblings that read their input, so `form_kernels` fuses the router's f32 cast into the MoE input's rms_norm. On a
bf16 k3.1-pro-tiny (the cast is real there) the graph before and after interprets to the same outputs, bit for
bit; afterwards no such op reads a reshape, and each MoE layer's cast is the epilogue of a rowwise launch."""

from __future__ import annotations

import torch

from k3c.ir.interp import interpret
from k3c.ir.kernels import kernel_groups
from k3c.ir.ops import get_op
from k3c.passes.derived import copy_derived, materialize_params
from k3c.passes.pipeline import random_inputs, run_pipeline
from test_fold_params import BINDINGS, CTX, graphs, weights


def _sunk():
    model, _, folded = graphs("decode")
    after, _ = run_pipeline(copy_derived(folded, folded.copy()), {"kernels": ["sink_views"]},
                            ctx=CTX.for_entry("decode"))
    return model, folded, after


def test_outputs_are_unchanged():
    model, before, after = _sunk()
    b = BINDINGS["decode"]
    inputs, _ = random_inputs(before, b, seed=2)
    want = interpret(before, inputs, materialize_params(before, weights(model)), bindings=b)
    got = interpret(after, inputs, materialize_params(after, weights(model)), bindings=b)
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k], t), k


def test_router_cast_joins_the_norm():
    _, before, after = _sunk()

    def reads_reshape(g):
        return [n for n in g.nodes if len(n.inputs) == 1 and get_op(n.op).kind == "elementwise"
                and g.producer(n.inputs[0]) is not None and g.producer(n.inputs[0]).op == "reshape"]

    assert reads_reshape(before)             # the router's cast of the reshaped MoE input
    assert not reads_reshape(after)
    formed, _ = run_pipeline(after, {"kernels": ["form_kernels"]}, ctx=CTX.for_entry("decode"))
    layers = sum(n.op == "moe_route" for n in formed.nodes)
    fused = [g for g in kernel_groups(formed) if g.kind == "rowwise" and g.nodes[0].op == "rms_norm"
             and any(n.op == "cast" and n.attrs["to"] == "f32" for n in g.nodes[1:])]
    assert layers and len(fused) == layers
