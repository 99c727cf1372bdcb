import torch

from k3c.ir import Graph, TensorType, interpret, verify
from k3c.ir.nx import to_dot, to_networkx
from k3c.ir.rewrite import P, Rule, X, apply_rules, match


def test_networkx_view(graph):
    G = to_networkx(graph)
    assert G.nodes[0]["op"] == "linear" and G.nodes[0]["layer"] == 0
    assert G.edges["in:x", 0]["types"] == ["f32[B,T,8]"]
    assert G.has_edge("param:model.layers.0.proj.weight", 0)
    assert G.has_edge(2, "out:y") and G.has_edge(3, "out:z")
    assert G.number_of_nodes() == len(graph.nodes) + 1 + 1 + 2


def test_dot_clusters_by_layer(graph):
    dot = to_dot(graph)
    assert dot.startswith("digraph k3c {")
    assert 'subgraph "cluster_layer_0"' in dot
    cluster = dot.split('subgraph "cluster_layer_0"')[1].split("}")[0]
    assert '"0" [label="linear' in cluster and '"1" [label="silu' in cluster
    assert '"2" [label="mul' not in cluster
    assert "cluster_layer" not in to_dot(graph, group_by_layer=False)
    assert "cluster_legend" in dot  # one swatch per op kind drawn


def silu_rule():
    def build(g, m):
        return g.add("silu", m["x"])

    return Rule(P("mul", X("x"), P("sigmoid", X("x")), name="root"), build, "x*sigmoid(x)->silu")


def test_rewrite_to_fixpoint_and_only_where_it_matches():
    g = Graph()
    x = g.add_input("x", TensorType((4,), "f32"))
    y = g.add_input("y", TensorType((4,), "f32"))
    a = g.add("mul", x, g.add("sigmoid", x), meta={"layer": 2})
    b = g.add("mul", y, g.add("sigmoid", x))  # y * sigmoid(x): not a silu
    c = g.add("mul", a, g.add("sigmoid", a))  # matches again once a is rewritten
    g.set_output("b", b)
    g.set_output("c", c)
    ins = {"x": torch.randn(4), "y": torch.randn(4)}
    want = interpret(g, ins, {})
    n = apply_rules(g, [silu_rule()], "test_rewrite")
    verify(g)
    assert n == 2
    assert [nd.op for nd in g.nodes].count("silu") == 2
    assert sum(1 for nd in g.nodes if nd.op == "mul") == 1
    silu0 = next(nd for nd in g.nodes if nd.op == "silu")
    assert silu0.meta == {"pass": "test_rewrite", "layer": 2}
    got = interpret(g, ins, {})
    torch.testing.assert_close(got["c"], want["c"])
    torch.testing.assert_close(got["b"], want["b"])


def test_match_captures_and_attr_predicates():
    g = Graph()
    x = g.add_input("x", TensorType((2, 3), "f32"))
    s = g.add("sum", x, dims=[1], keepdim=True)
    pat = P("sum", X("x"), attrs={"dims": [1], "keepdim": lambda k: k is True})
    m = match(g, pat, g.producer(s))
    assert m is not None and m["x"] is x
    assert match(g, P("sum", X(), attrs={"dims": [0]}), g.producer(s)) is None
