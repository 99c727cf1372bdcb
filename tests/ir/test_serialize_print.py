import json

import pytest

from k3c.errors import IRError
from k3c.ir import Graph, TensorType, dump, load, print_graph
from k3c.ir.serialize import FORMAT_VERSION


def rich_graph() -> Graph:
    g = Graph()
    x = g.add_input("x", TensorType(("B", "L+T", 12), "bf16"))
    s = g.add("slice", x, dim=1, start="L", end="L+T", meta={"source": "x[:, L:]", "layer": 3})
    a, b = g.add_node("split", [s], {"sizes": [4, 8], "dim": -1}, name_hint="parts")
    m = g.add("masked_fill", b, g.add("lt", b, scalar=0.1), value=float("-inf"))
    c = g.add("cast", a, to="f32", meta={"pass": "fuse_kda"})
    k = g.add("constant", value=[0.1, 1e-20, 3.0], shape=[3], dtype="f32")
    g.set_output("a", c)
    g.set_output("m", m)
    g.set_output("k", k)
    return g


def test_json_round_trip_is_exact(tmp_path):
    g = rich_graph()
    text = dump(g)
    g2 = load(text)
    assert print_graph(g2) == print_graph(g)
    assert dump(g2) == text
    p = tmp_path / "g.json"
    dump(g, p)
    assert print_graph(load(p)) == print_graph(g)
    obj = json.loads(text)
    assert obj["version"] == FORMAT_VERSION
    assert obj["inputs"][0]["type"]["shape"] == ["B", "L+T", 12]


def test_load_rejects_other_versions_and_dangling_names():
    obj = json.loads(dump(rich_graph()))
    obj["version"] = 99
    with pytest.raises(IRError, match="version 99"):
        load(json.dumps(obj))
    obj["version"] = FORMAT_VERSION
    obj["nodes"][0]["inputs"] = ["ghost"]
    with pytest.raises(IRError, match="ghost"):
        load(json.dumps(obj))


def test_printer_lines():
    text = print_graph(rich_graph())
    lines = text.splitlines()
    assert lines[1] == "input %x : bf16[B,L+T,12]"
    assert '%0 = slice(%x) {dim=1, start="L", end="L+T"} : bf16[B,T,12]  # layer 3 | x[:, L:]' in lines
    assert "(%parts.0, %parts.1) = split(%0) {sizes=[4,8], dim=-1} : (bf16[B,T,4], bf16[B,T,8])" in lines
    assert any(ln.endswith("# fuse_kda") and ln.startswith("%") and "cast" in ln for ln in lines)
    assert "value=-Infinity" in text
    assert lines[-3:] == ["output a = %3", "output m = %2", "output k = %4"]
    assert print_graph(rich_graph()) == text  # deterministic
