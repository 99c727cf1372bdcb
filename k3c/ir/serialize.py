"""JSON serialization of graphs with an exact round trip: `print_graph(load(dump(g))) == print_graph(g)`.

Format (`FORMAT_VERSION` 1): {"format": "k3c-ir", "version", "symbols", "inputs": [{name, type}],
"params": [{key, name, type}], "nodes": [{op, inputs: [names], attrs, outputs: [{name, type}], meta}],
"outputs": {name: value name}}. A type is {"shape": [int | "sympy string"], "dtype"}. Attrs and meta are stored
as they are (they must be JSON data); floats round-trip exactly (Python's repr), ±inf/NaN as JSON extensions.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3c.errors import IRError
from k3c.ir.graph import Graph, Node, Value, check_json
from k3c.ir.kernels import KernelSpan
from k3c.ir.types import TensorType

FORMAT = "k3c-ir"
FORMAT_VERSION = 1


#: Graph annotations that travel with the graph (the arena plan is written to plan.json instead): the derived
#: parameter recipes (JSON data) and the kernel schedule (`KernelSpan`s, as lists).
JSON_ANNOTATIONS = ("derived_params", "kernels")


def to_dict(graph: Graph) -> dict:
    """The JSON-able dict of `graph`; raises `IRError` if an attr or meta entry is not JSON data."""
    def val(v: Value) -> dict:
        return {"name": v.name, "type": v.type.to_json()}

    nodes = []
    for n in graph.nodes:
        check_json(n.attrs, f"{n.op}.attrs")
        check_json(n.meta, f"{n.op}.meta")
        nodes.append({"op": n.op, "inputs": [v.name for v in n.inputs], "attrs": n.attrs,
                      "outputs": [val(v) for v in n.outputs], "meta": n.meta})
    return {"format": FORMAT, "version": FORMAT_VERSION, "symbols": sorted(graph.symbols),
            "inputs": [val(v) for v in graph.inputs],
            "params": [{"key": k, **val(v)} for k, v in graph.params.items()],
            "nodes": nodes, "outputs": {k: v.name for k, v in graph.outputs.items()},
            **{k: _annotation_json(k, getattr(graph, k)) for k in JSON_ANNOTATIONS if getattr(graph, k, None)}}


def _annotation_json(key: str, value):
    return [s.to_json() for s in value] if key == "kernels" else value


def from_dict(obj: dict) -> Graph:
    """Rebuild a graph from `to_dict` output; raises `IRError` on a wrong format/version or a dangling name."""
    if obj.get("format") != FORMAT:
        raise IRError(f"not a k3c IR document (format={obj.get('format')!r})")
    if obj.get("version") != FORMAT_VERSION:
        raise IRError(f"k3c IR format version {obj.get('version')} is not supported (this k3c reads "
                      f"{FORMAT_VERSION})")
    g = Graph(obj["symbols"])
    values: dict[str, Value] = {}

    def define(d: dict) -> Value:
        if d["name"] in values:
            raise IRError(f"value %{d['name']} is defined twice")
        v = values[d["name"]] = Value(d["name"], TensorType.from_json(d["type"]))
        return v

    def use(name: str, where: str) -> Value:
        try:
            return values[name]
        except KeyError:
            raise IRError(f"{where} reads %{name}, which is not defined before it") from None

    g.inputs = [define(d) for d in obj["inputs"]]
    g.params = {d["key"]: define(d) for d in obj["params"]}
    for d in obj["nodes"]:
        ins = [use(x, d["op"]) for x in d["inputs"]]
        g.nodes.append(Node(d["op"], ins, d["attrs"], [define(o) for o in d["outputs"]], d["meta"]))
    g.outputs = {k: use(name, f"output {k}") for k, name in obj["outputs"].items()}
    for k in JSON_ANNOTATIONS:
        if k in obj:
            setattr(g, k, [KernelSpan.from_json(x) for x in obj[k]] if k == "kernels" else obj[k])
    g.rebuild_index()
    return g


def dumps(graph: Graph, indent: int | None = None) -> str:
    """`graph` as a JSON string."""
    return json.dumps(to_dict(graph), indent=indent)


def loads(text: str) -> Graph:
    """A graph from a JSON string; raises `IRError` for malformed documents."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise IRError(f"k3c IR JSON is malformed: {e}") from None
    return from_dict(obj)


def dump(graph: Graph, path: str | Path | None = None) -> str:
    """Serialize `graph`; also write it to `path` when given. Returns the JSON text."""
    text = dumps(graph)
    if path is not None:
        Path(path).write_text(text)
    return text


def load(src: str | Path) -> Graph:
    """Load a graph from JSON text or from a path to a JSON file."""
    if isinstance(src, Path) or (isinstance(src, str) and not src.lstrip().startswith("{")):
        src = Path(src).read_text()
    return loads(src)
