import gc
import weakref

import pytest
import torch

from k3c.errors import IRError, RuntimeInputError
from k3c.ir import Graph, TensorType, interpret


def test_small_graph_equals_direct_torch(graph, rng):
    x = torch.randn(2, 3, 8, generator=rng)
    w = torch.randn(4, 8, generator=rng)
    out = interpret(graph, {"x": x}, {"model.layers.0.proj.weight": w})
    h = torch.einsum("btk,nk->btn", x, w)
    y = h / (1 + torch.exp(-h)) * 2
    torch.testing.assert_close(out["y"], y)
    torch.testing.assert_close(out["z"], y.sum(-1))


def test_symbolic_attrs_are_bound_from_inputs(rng):
    g = Graph()
    cache = g.add_input("cache", TensorType(("B", "L", 4), "f32"))
    new = g.add_input("new", TensorType(("B", "T", 4), "f32"))
    kv = g.add("cat", cache, new, dim=1)
    last = g.add("select", kv, dim=1, index="L+T-1")
    pos = g.add("arange", end="L+T")
    g.set_output("last", last)
    g.set_output("pos", pos)
    c, n = torch.randn(2, 5, 4, generator=rng), torch.randn(2, 3, 4, generator=rng)
    out = interpret(g, {"cache": c, "new": n}, {})
    assert torch.equal(out["last"], n[:, -1])
    assert out["pos"].tolist() == list(range(8))
    with pytest.raises(RuntimeInputError, match="B = 3"):
        interpret(g, {"cache": c, "new": torch.randn(3, 3, 4)}, {})
    with pytest.raises(RuntimeInputError, match="missing graph input %new"):
        interpret(g, {"cache": c}, {})
    with pytest.raises(RuntimeInputError, match="dtype"):
        interpret(g, {"cache": c.double(), "new": n}, {})


def test_values_are_freed_after_last_use_and_trace_sees_every_node():
    g = Graph()
    v = g.add_input("x", TensorType((256,), "f32"))
    for _ in range(5):
        v = g.add("exp", g.add("neg", v))
    g.set_output("y", v)
    refs, seen = [], []

    def trace(node, ins, outs):
        seen.append(node.op)
        gc.collect()
        refs.append(weakref.ref(outs[0]))
        if len(refs) >= 3:
            assert refs[-3]() is None, "a value outlived its last use"

    interpret(g, {"x": torch.randn(256)}, {}, trace=trace)
    assert seen == ["neg", "exp"] * 5


def test_bad_ref_result_is_reported_against_the_node(monkeypatch):
    from k3c.ir.ops import get_op

    g = Graph()
    x = g.add_input("x", TensorType((3,), "f32"))
    g.set_output("y", g.add("relu", x, meta={"source": "act"}))
    monkeypatch.setattr(get_op("relu"), "ref_fn", lambda a, x: [torch.zeros(4)])
    with pytest.raises(IRError, match=r"relu -> %0 \(act\): ref produced f32\[4\]"):
        interpret(g, {"x": torch.randn(3)}, {})
