import pytest
import torch

from k3c.ir import Graph, TensorType


def small_graph() -> Graph:
    """x [B,T,8] bf16, w [4,8] -> y = silu(linear(x, w)) * 2 ; also z = sum(y, -1) (f32 via cast)."""
    g = Graph()
    x = g.add_input("x", TensorType(("B", "T", 8), "f32"))
    w = g.add_param("model.layers.0.proj.weight", TensorType((4, 8), "f32"))
    h = g.add("linear", x, w, name_hint="l0.proj", meta={"source": "h = proj(x)", "layer": 0, "pass": "frontend"})
    a = g.add("silu", h, meta={"layer": 0})
    y = g.add("mul", a, scalar=2.0)
    z = g.add("sum", y, dims=[-1])
    g.set_output("y", y)
    g.set_output("z", z)
    return g


@pytest.fixture
def graph():
    return small_graph()


@pytest.fixture
def make_graph():
    """The builder of `graph`, for tests that need several fresh copies."""
    return small_graph


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(0)
