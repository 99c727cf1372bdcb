"""ONNX export (`k3c.ir.onnx_export`) and the per-layer / collapsed views (`k3c.ir.views`, DOT)."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest

from k3c.errors import ConfigError
from k3c.frontend import import_model
from k3c.ir import nx, views
from k3c.ir.onnx_export import DOMAIN, block_to_onnx, to_onnx
from k3c.passes.pipeline import run_pipeline


@pytest.fixture(scope="module")
def tiny():
    """k3-tiny prefill after the model phase (what `k3c inspect` shows by default)."""
    g, _ = run_pipeline(import_model("k3-tiny", "prefill"), phases=["cleanup", "model"], verify="end")
    return g


def test_one_onnx_node_per_ir_node_and_checker_passes(tiny):
    m = to_onnx(tiny, "k3-tiny")
    onnx.checker.check_model(m)
    assert len(m.graph.node) == len(tiny.nodes)
    assert [n.name for n in m.graph.node] == [n.outputs[0].name for n in tiny.nodes]
    # every IR op is either a standard ONNX op or the same-named k3c op
    ops = Counter(n.op for n in tiny.nodes)
    k3c_ops = Counter(n.op_type for n in m.graph.node if n.domain == DOMAIN)
    std = sum(1 for n in m.graph.node if n.domain == "")
    assert sum(k3c_ops.values()) + std == len(tiny.nodes)
    assert k3c_ops["kda_fused"] == ops["kda_fused"] > 0 and k3c_ops["moe_experts"] == ops["moe_experts"] > 0


def test_standard_ops_and_attributes(graph):
    m = to_onnx(graph)
    by_name = {n.name: n for n in m.graph.node}
    types = [(n.op_type, n.domain) for n in m.graph.node]
    # linear has no ONNX equivalent (x @ w^T at any rank), silu neither; mul by a scalar attr is not Mul
    assert types == [("linear", DOMAIN), ("silu", DOMAIN), ("mul", DOMAIN), ("sum", DOMAIN)]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in by_name[graph.nodes[2].outputs[0].name].attribute}
    assert attrs["scalar"] == pytest.approx(2.0) and attrs["reverse"] == 0
    x = m.graph.input[0]
    assert x.name == "x" and [d.dim_param or d.dim_value for d in x.type.tensor_type.shape.dim] == ["B", "T", 8]
    assert x.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [o.name for o in m.graph.output] == [graph.outputs["y"].name, graph.outputs["z"].name]


def test_binary_tensor_ops_map_to_standard_onnx():
    from k3c.ir import Graph, TensorType

    g = Graph()
    a, b = g.add_input("a", TensorType(("B", 4), "bf16")), g.add_input("b", TensorType((4,), "bf16"))
    s = g.add("softmax", g.add("add", a, b), dim=-1)
    g.set_output("y", g.add("cast", s, to="f32"))
    m = to_onnx(g)
    assert [n.op_type for n in m.graph.node] == ["Add", "Softmax", "Cast"]
    assert onnx.helper.get_attribute_value(m.graph.node[1].attribute[0]) == -1
    assert onnx.helper.get_attribute_value(m.graph.node[2].attribute[0]) == onnx.TensorProto.FLOAT


def test_layer_view_and_collapsed_view(tiny):
    layer_ids = views.layers(tiny)
    n3 = sum(1 for n in tiny.nodes if n.meta.get("layer") == 3)
    m = block_to_onnx(tiny, [views.layer_block(tiny, 3)])
    assert len(m.graph.node) == n3
    # the layer reads the residual stream from outside and its parameters; its outputs leave it
    assert any(i.name.startswith("model.layers.3.") for i in m.graph.input)
    blocks = views.collapse(tiny)
    outside = sum(1 for n in tiny.nodes if n.meta.get("layer") is None)
    runs = 1 + sum(1 for a, b in zip(tiny.nodes, tiny.nodes[1:]) if a.meta.get("layer") != b.meta.get("layer")
               or a.meta.get("layer") is None)
    assert len(blocks) == runs and runs >= len(layer_ids) + outside
    assert sum(len(b.nodes) for b in blocks) == len(tiny.nodes)
    c = block_to_onnx(tiny, blocks)
    assert {n.name for n in c.graph.node if n.op_type == "layer"} >= {f"layer_{i}" for i in layer_ids}
    with pytest.raises(ConfigError, match="--layer 99: no IR node belongs to that layer"):
        views.layer_block(tiny, 99)


def test_dot_views_have_legend_and_one_box_per_layer(tiny):
    coll = nx.collapsed_dot(tiny)
    assert "cluster_legend" in coll
    assert sum(1 for ln in coll.splitlines() if ln.strip().startswith('"layer_')) >= len(views.layers(tiny))
    one = nx.block_dot(tiny, views.layer_block(tiny, 0))
    boxes = [ln for ln in one.splitlines() if "shape=box" in ln and ln.strip().startswith('"') and "legend:" not in ln]
    assert len(boxes) == sum(1 for n in tiny.nodes if n.meta.get("layer") == 0)
    assert "cluster_legend" in nx.to_dot(tiny)


@pytest.mark.slow
def test_full_size_export_passes_the_checker():
    """k3.1-pro (93 layers, 11k nodes at import): one ONNX node per IR node, valid, every layer in the collapse."""
    g, _ = run_pipeline(import_model("k3.1-pro", "prefill"), phases=["cleanup", "model"], verify="off")
    m = to_onnx(g, "k3.1-pro")
    onnx.checker.check_model(m)
    assert len(m.graph.node) == len(g.nodes)
    assert {n.name for n in block_to_onnx(g, views.collapse(g)).graph.node if n.op_type == "layer"} >= {
        f"layer_{i}" for i in range(93)}
