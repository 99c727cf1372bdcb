import pytest

from k3c.errors import IRError, UnsupportedError
from k3c.ir import Graph, TensorType
from k3c.ir.types import dim, nbytes, numel


def test_dims_parse_simplify_and_count_bytes():
    assert dim("L+T") == dim("T + L")
    assert dim("(B*T*96)/96") == dim("B*T")
    assert str(dim("N+S")) == "N + S"  # sympy's own N and S are not taken for symbols
    t = TensorType(("B", "L+T", 576), "bf16")
    assert str(t) == "bf16[B,L+T,576]"
    assert nbytes(t, {"B": 2, "L": 10, "T": 6}) == 2 * 16 * 576 * 2
    assert numel(TensorType((), "f32")) == 1
    with pytest.raises(UnsupportedError):
        TensorType((2,), "f64")
    with pytest.raises(IRError):
        dim("T + 0.5")


def test_builder_def_use_and_names(graph):
    lin = graph.nodes[0]
    assert lin.outputs[0].name == "l0.proj"
    silu = graph.nodes[1]
    assert graph.producer(silu.inputs[0]) is lin
    assert graph.users(lin.outputs[0]) == [silu]
    assert graph.producer(graph.inputs[0]) is None
    assert graph.fresh_name("l0.proj") == "l0.proj.1"
    with pytest.raises(UnsupportedError, match="nope"):
        graph.add("nope", graph.inputs[0])
    with pytest.raises(IRError, match="unknown attr"):
        graph.add("silu", graph.inputs[0], axis=1)


def test_insert_before_replace_and_remove(graph):
    silu = graph.nodes[1]
    h = silu.inputs[0]
    with graph.inserting_before(silu):
        n1 = graph.add("neg", h)
        n2 = graph.add("neg", n1)
    assert [n.op for n in graph.nodes[:4]] == ["linear", "neg", "neg", "silu"]
    graph.replace_all_uses(h, n2, exclude=[graph.producer(n1)])
    assert silu.inputs[0] is n2
    assert graph.users(h) == [graph.nodes[1]]
    assert graph.producer(n1).inputs == [h]
    with pytest.raises(IRError, match="still used"):
        graph.remove_nodes([graph.nodes[1]])
    with pytest.raises(IRError, match="is f32.B,T,4. but %x"):
        graph.replace_all_uses(h, graph.inputs[0])
    graph.replace_all_uses(n2, h)
    assert graph.users(n2) == []
    graph.remove_nodes([graph.nodes[1], graph.nodes[2]])
    assert [n.op for n in graph.nodes] == ["linear", "silu", "mul", "sum"]
    assert graph.users(h) == [silu]


def test_copy_is_deep_and_toposort_restores_order(graph):
    g2 = graph.copy()
    assert str(g2) == str(graph)
    g2.nodes[0].attrs["x"] = 1
    g2.nodes[0].meta["pass"] = "changed"
    assert "x" not in graph.nodes[0].attrs and graph.nodes[0].meta["pass"] == "frontend"
    g2.nodes.reverse()
    g2.toposort()
    assert [n.op for n in g2.nodes] == ["linear", "silu", "mul", "sum"]


def test_copy_does_not_share_nested_attrs_and_keeps_outputs():
    g = Graph()
    x = g.add_input("x", TensorType(("B", 4), "f32"))
    y = g.add("sum", x, dims=[-1], meta={"tags": {"kind": ["a"]}})
    g.set_output("y", y)
    g2 = g.copy()
    g2.nodes[0].attrs["dims"].append(0)
    g2.nodes[0].meta["tags"]["kind"].append("b")
    assert g.nodes[0].attrs["dims"] == [-1] and g.nodes[0].meta["tags"] == {"kind": ["a"]}
    assert g2.is_output(g2.nodes[0].outputs[0]) and not g2.is_output(y) and not g2.is_output(g2.inputs[0])
    with pytest.raises(IRError, match="graph output"):
        g2.remove_nodes(g2.nodes)


def test_nbytes_needs_every_symbol():
    t = TensorType(("B", "L+T", 8), "bf16")
    assert nbytes(t, {"B": 1, "L": 3, "T": 1}) == 64 and nbytes(t, {"B": 2, "L": 3, "T": 1}) == 128
    with pytest.raises(IRError, match="needs values for L"):
        nbytes(t, {"B": 1, "T": 1})


def test_after_cursor_keeps_call_order(make_graph):
    g = make_graph()
    lin = g.nodes[0]
    with g.inserting_after(lin):
        a = g.add("neg", lin.outputs[0])
        g.add("exp", a)
    assert [n.op for n in g.nodes[:3]] == ["linear", "neg", "exp"]


def test_large_chain_builds_fast():
    import time

    g = Graph()
    v = g.add_input("x", TensorType(("B", "T", 64), "bf16"))
    t0 = time.perf_counter()
    for i in range(15000):
        v = g.add("neg", v, meta={"layer": i // 160})
    g.set_output("y", v)
    g2 = g.copy()
    from k3c.ir import verify
    from k3c.ir.rewrite import dce_in_place

    verify(g2)
    dce_in_place(g2)
    assert time.perf_counter() - t0 < 20
    assert len(g2.nodes) == 15000
