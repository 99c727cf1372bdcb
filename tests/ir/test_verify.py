import pytest

from k3c.errors import IRError
from k3c.ir import Graph, Node, TensorType, Value, verify


def test_good_graph_passes(graph):
    verify(graph)


def test_wrong_output_shape_names_the_node(graph):
    lin = graph.nodes[0]
    lin.outputs[0].type = TensorType(("B", "T", 5), "f32")
    with pytest.raises(IRError, match=r"linear -> %l0\.proj \(h = proj\(x\); layer 0; pass frontend\).*infers"):
        verify(graph)


def test_use_before_def_names_both_nodes(graph):
    graph.nodes[0], graph.nodes[1] = graph.nodes[1], graph.nodes[0]
    with pytest.raises(IRError, match=r"silu -> %0.*before it is defined \(by linear"):
        verify(graph)


def test_dangling_value(graph):
    ghost = Value("ghost", TensorType(("B", "T", 4), "f32"))
    graph.set_input(graph.nodes[1], 0, ghost)
    with pytest.raises(IRError, match=r"silu -> %0.*dangling"):
        verify(graph)


def test_undefined_graph_output_and_unknown_symbol(make_graph):
    g = make_graph()
    g.outputs["bad"] = Value("nowhere", TensorType((1,), "f32"))
    with pytest.raises(IRError, match="graph output 'bad'"):
        verify(g)
    g = Graph(symbols={"B"})
    g.add_input("x", TensorType(("B", "Q"), "f32"))
    with pytest.raises(IRError, match="unknown symbol.*Q"):
        verify(g)


def test_stale_index_and_bad_attrs(graph, make_graph):
    graph.nodes[1].inputs[0] = graph.inputs[0].__class__("y2", TensorType(("B", "T", 4), "f32"))
    with pytest.raises(IRError):
        verify(graph)
    g = make_graph()
    g.nodes[2].attrs["scalar"] = "two"
    with pytest.raises(IRError, match=r"mul -> %1.*scalar"):
        verify(g)
    g = make_graph()
    g.nodes.append(Node("silu", [g.inputs[0]], {}, [Value("q", TensorType(("B", "T", 8), "f32"))]))
    with pytest.raises(IRError, match="stale"):
        verify(g)
