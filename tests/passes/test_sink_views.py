"""sink_views: an elementwise op reading a reshape of a fusible producer's value is computed in that value's shape,
and views move below the siblings that read their input, so `form_kernels` fuses the router's f32 cast into the MoE
input's rms_norm and the MoE output's two adds (routed + shared, then the residual) into one launch. On a bf16
k3.1-pro-tiny (the cast is real there) the graph before and after interprets to the same outputs, bit for bit;
afterwards each MoE layer has its cast in the launch of its norm and both adds in one launch (the AttnRes row
launch where the norm reads a merge: `attn_res_row`)."""

from __future__ import annotations

from k3c.ir.kernels import kernel_groups
from k3c.ir.ops import get_op
from k3c.passes.derived import copy_derived
from k3c.passes.pipeline import run_pipeline
from test_fold_params import CTX, assert_same_outputs, graphs


def _sunk():
    model, _, folded = graphs("decode")
    after, _ = run_pipeline(copy_derived(folded, folded.copy()), {"kernels": ["sink_views"]},
                            ctx=CTX.for_entry("decode"))
    return model, folded, after


def test_outputs_are_unchanged():
    model, before, after = _sunk()
    assert_same_outputs(model, before, after, "decode", seed=2)


def test_router_cast_joins_the_norm():
    _, before, after = _sunk()

    def reads_reshape(g):
        return [n for n in g.nodes if len(n.inputs) == 1 and get_op(n.op).kind == "elementwise"
                and g.producer(n.inputs[0]) is not None and g.producer(n.inputs[0]).op == "reshape"]

    assert reads_reshape(before)             # the router's cast of the reshaped MoE input
    assert not reads_reshape(after)
    formed, _ = run_pipeline(after, {"kernels": ["form_kernels"]}, ctx=CTX.for_entry("decode"))
    layers = sum(n.op == "moe_route" for n in formed.nodes)
    groups = kernel_groups(formed)
    # the MoE input's norm reads the AttnRes merge: its row launch is the merge's (attn_res_row)
    fused = [g for g in groups if g.kind in ("rowwise", "attn_res_row") and "rms_norm" in [n.op for n in g.nodes]
             and any(n.op == "cast" and n.attrs["to"] == "f32" for n in g.nodes)]
    assert layers and len(fused) == layers
    tails = [g for g in groups if (g.kind, [n.op for n in g.nodes][:2]) in (("pointwise", ["add", "add"]),
                                                                          ("attn_res_row", ["add", "add"]))
             and any("shared_experts" in v.name for v in g.inputs)]
    assert len(tails) == layers
