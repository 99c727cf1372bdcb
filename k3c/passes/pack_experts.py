"""Pass `pack_experts`: routed experts stay in the checkpoint's MXFP4 format (k3c.ir.formats) from IR to kernel.

The frontend imports the reference model, whose routed experts are dense stacked parameters
`<moe>.experts.w1 / w3` [E, I, D] and `w2` [E, D, I] (models/layers.py `MoE`; an MXFP4 checkpoint is dequantized
when the reference loads it). With the expert format "mxfp4" every dense `moe_experts` node reading such
parameters becomes

    moe_experts(z, weights, ids, w1p, w3p, w2p, w1s, w3s, w2s) {weight_format="mxfp4", scale_max, ...same attrs}

with new parameters `<key>.weight_packed` u8 [E, R, C/2] and `<key>.weight_scale` u8 [E, R, C/32] per weight
(R × C its rows × columns), the stacked form of the checkpoint's `experts.<e>.<w>.weight_packed / weight_scale`
(models/checkpoint.py `load_mxfp4_experts` reads them); the dense parameters are dropped. Numerically the identity
when the dense weights are the dequantized packed ones (exact: E2M1 · 2^k is representable in f32 and bf16).
The format "bf16" (dense) leaves the graph unchanged. The format is `CompileContext.experts_dtype`, which the
driver resolves from the checkpoint (`k3c.compile.experts_dtype`: MXFP4 when its config says so). `scale_max` is
`CompileContext.mxfp4_scale_max`, the largest scale byte the driver found in the checkpoint (255 when unknown): a
fact about the weights that lets the Triton decoder use one multiply per pair of values. Raises
`IRError` for a weight that is not a parameter or whose rows do not split into 32-value groups.
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.errors import IRError
from k3c.ir.formats import MXFP4_GROUP
from k3c.ir.graph import Graph, describe
from k3c.ir.types import TensorType
from k3c.passes.derived import prune_unused_params
from k3c.passes.pipeline import register_pass

EXPERT_DTYPES = ("mxfp4", "bf16")


def packed_keys(key: str) -> tuple[str, str]:
    """The parameter keys of dense expert weight `key` in MXFP4: (packed, scale)."""
    return f"{key}.weight_packed", f"{key}.weight_scale"


def pack_experts_in_place(graph: Graph, experts_dtype: str = "mxfp4", scale_max: int | None = None) -> int:
    """Rewrite every dense `moe_experts` node of `graph` to MXFP4 weights (module docstring) when `experts_dtype`
    is "mxfp4", with `scale_max` (None: 255, nothing known) the largest E8M0 scale byte of those weights; returns
    the number of nodes rewritten. Raises `IRError` (bad weights) or for an unknown dtype."""
    if experts_dtype not in EXPERT_DTYPES:
        raise IRError(f"pack_experts: experts dtype {experts_dtype!r} is not one of {', '.join(EXPERT_DTYPES)}")
    if experts_dtype != "mxfp4":
        return 0
    key_of = {v: k for k, v in graph.params.items()}
    dropped, count = set(), 0
    for node in [n for n in graph.nodes if n.op == "moe_experts" and n.attrs["weight_format"] == "dense"]:
        ins = list(node.inputs[:3])
        scales = []
        for w in node.inputs[3:6]:
            key = key_of.get(w)
            if key is None:
                raise IRError(f"pack_experts: {describe(node)} reads expert weight %{w.name}, not a parameter")
            *lead, cols = w.type.shape
            if not isinstance(cols, int) or cols % MXFP4_GROUP:
                raise IRError(f"pack_experts: expert weight {key} {w.type}: rows of {cols} values do not split "
                              f"into groups of {MXFP4_GROUP}")
            pk, sk = packed_keys(key)
            for k, c in ((pk, cols // 2), (sk, cols // MXFP4_GROUP)):
                if k not in graph.params:
                    graph.add_param(k, TensorType((*lead, c), "u8"))
            ins.append(graph.params[pk])
            scales.append(graph.params[sk])
            dropped.add(key)
        attrs = {**node.attrs, "weight_format": "mxfp4", "scale_max": 255 if scale_max is None else scale_max}
        (y,) = graph.add_node("moe_experts", ins + scales, attrs, meta=dict(node.meta), before=node)
        graph.replace_all_uses(node.outputs[0], y)
        graph.remove_node(node)
        count += 1
    prune_unused_params(graph, sorted(dropped))
    return count


@register_pass("pack_experts")
def pack_experts(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `pack_experts` (see the module docstring) with `ctx.experts_dtype`; None (the driver did not say what
    the checkpoint stores) leaves the experts as the model holds them, dense. In place."""
    pack_experts_in_place(graph, ctx.experts_dtype or "bf16", ctx.mxfp4_scale_max)
    return graph
