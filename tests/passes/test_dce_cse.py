import torch

from k3c.context import CompileContext
from k3c.ir import Graph, TensorType, interpret, verify
from k3c.passes.cse import cse
from k3c.passes.dce import dce


def test_dce_removes_dead_nodes_only():
    g = Graph()
    x = g.add_input("x", TensorType(("T", 4), "f32"))
    cache = g.add_input("cache", TensorType((1, 8, 4), "f32"))
    live = g.add("exp", x)
    dead1 = g.add("neg", x)
    g.add("exp", dead1)  # dead chain of two
    g.add("cache_append", cache, g.add("unsqueeze", x, dim=0))  # side effect: kept with its input
    g.set_output("y", live)
    g = dce(g, CompileContext())
    verify(g)
    assert [n.op for n in g.nodes] == ["exp", "unsqueeze", "cache_append"]


def test_cse_merges_duplicate_expression_and_nothing_else():
    g = Graph()
    x = g.add_input("x", TensorType(("T", 4), "f32"))
    cache = g.add_input("cache", TensorType((1, 8, 4), "f32"))
    a1 = g.add("mul", g.add("exp", x), scalar=2.0)
    a2 = g.add("mul", g.add("exp", x), scalar=2.0)  # duplicate of a1 (two nodes)
    b = g.add("mul", g.add("exp", x), scalar=2.0000001)  # different attr
    c = g.add("sum", x, dims=[0])
    d = g.add("sum", x, dims=[1])  # different attr
    e1 = g.add("add", a1, b)
    e2 = g.add("add", b, a1)  # no commutativity
    u = g.add("unsqueeze", x, dim=0)
    w1 = g.add("cache_append", cache, u)
    w2 = g.add("cache_append", cache, u)  # effects: never merged
    for i, v in enumerate([a1, a2, b, c, d, e1, e2, w1, w2]):
        g.set_output(f"o{i}", v)
    ins = {"x": torch.randn(3, 4), "cache": torch.zeros(1, 8, 4)}
    want = interpret(g, ins, {})
    n_before = len(g.nodes)
    g = cse(g, CompileContext())
    verify(g)
    assert len(g.nodes) == n_before - 3  # a2 (its exp and mul) and the exp under b
    assert g.outputs["o0"] is g.outputs["o1"]
    assert g.outputs["o0"] is not g.outputs["o2"]
    assert g.outputs["o3"] is not g.outputs["o4"]
    assert g.outputs["o5"] is not g.outputs["o6"]
    assert g.outputs["o7"] is not g.outputs["o8"]
    assert [n.op for n in g.nodes].count("cache_append") == 2
    got = interpret(g, ins, {})
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def test_cse_int_vs_float_attr_is_exact():
    g = Graph()
    x = g.add_input("x", TensorType((4,), "f32"))
    a = g.add("constant", value=[1, 2], shape=[2], dtype="f32")
    b = g.add("constant", value=[1.0, 2.0], shape=[2], dtype="f32")
    g.set_output("a", a)
    g.set_output("b", b)
    g.set_output("x", x)
    g = cse(g, CompileContext())
    assert len(g.nodes) == 2
