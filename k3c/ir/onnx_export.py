"""The IR as an ONNX model, for viewing (Netron) and for tools that read ONNX; not for execution.

`to_onnx(graph)` maps every IR node to exactly one ONNX node, named after its first output value:
- to the standard ONNX op (opset `OPSET`) when the IR op has the same semantics and arity: elementwise
  unary/binary ops with tensor operands (`add` -> Add, ...), `matmul` -> MatMul, `softmax` -> Softmax(axis),
  `cast` -> Cast(to), `permute` -> Transpose(perm), `cat` -> Concat(axis), `where` -> Where;
- otherwise to an op of domain `k3c` (version 1) with the IR op's name, and its attrs as ONNX attributes: int,
  float, str and list attrs as themselves, bools as ints, symbolic dims as strings (`"T + L"`), JSON attrs as JSON
  text.
Graph inputs and parameters are ONNX graph inputs (no weights are embedded: a full-size model has ~10^12
parameters); every value has its dtype and shape (`dim_param` for symbolic dims) in `value_info`. A node's
`doc_string` holds its layer and source line. The result passes `onnx.checker.check_model`.
`block_to_onnx(graph, blocks)` exports a `k3c.ir.views` block list instead: a collapsed model (one
`k3c.layer` node per run of a layer) or one layer's nodes.
"""

from __future__ import annotations

import json

import onnx
from onnx import TensorProto, helper

from k3c.ir.graph import Graph, Node, Value
from k3c.ir.ops import get_op
from k3c.ir.types import TensorType, dim_str
from k3c.ir.views import Block, block_label

OPSET = 21
DOMAIN = "k3c"

ELEM_TYPES = {"f32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16, "f16": TensorProto.FLOAT16,
              "f8e4m3": TensorProto.FLOAT8E4M3FN, "i64": TensorProto.INT64, "i32": TensorProto.INT32,
              "u8": TensorProto.UINT8, "bool": TensorProto.BOOL}

_UNARY = {"abs": "Abs", "exp": "Exp", "log": "Log", "neg": "Neg", "relu": "Relu", "sigmoid": "Sigmoid",
          "sqrt": "Sqrt", "tanh": "Tanh", "reciprocal": "Reciprocal", "logical_not": "Not", "copy": "Identity"}
_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "eq": "Equal", "gt": "Greater",
           "ge": "GreaterOrEqual", "lt": "Less", "le": "LessOrEqual", "maximum": "Max", "minimum": "Min",
           "logical_and": "And", "logical_or": "Or", "logical_xor": "Xor"}


def value_info(v: Value) -> onnx.ValueInfoProto:
    """`v`'s ONNX type: element type and shape, symbolic dims as `dim_param` text."""
    return _info(v.name, v.type)


def _info(name: str, t: TensorType) -> onnx.ValueInfoProto:
    shape = [d if isinstance(d, int) else dim_str(d) for d in t.shape]
    return helper.make_tensor_value_info(name, ELEM_TYPES[t.dtype], shape)


def _attr_value(kind: str, v):
    """An IR attr value as something `helper.make_attribute` accepts (None: leave the attribute out)."""
    if v is None:
        return None
    if kind == "bool":
        return int(v)
    if kind == "dim":
        return v if isinstance(v, int) else str(v)
    if kind == "dims":
        return [int(x) for x in v] if all(isinstance(x, int) for x in v) else [str(x) for x in v]
    if kind in ("ints", "floats"):
        return list(v) if v else None  # ONNX cannot type an empty list attribute
    if kind == "json":
        return json.dumps(v, sort_keys=True, separators=(",", ":"))
    return v


def _standard(n: Node) -> tuple[str, dict] | None:
    """(ONNX op type, attributes) when `n` has a standard ONNX equivalent, else None."""
    if n.op in _UNARY and not any(v is not None for v in n.attrs.values()):
        return _UNARY[n.op], {}
    if n.op in _BINARY and len(n.inputs) == 2 and n.attrs.get("scalar") is None and not n.attrs.get("reverse"):
        return _BINARY[n.op], {}
    if n.op == "matmul":
        return "MatMul", {}
    if n.op == "where" and len(n.inputs) == 3:
        return "Where", {}
    if n.op == "softmax":
        return "Softmax", {"axis": n.attrs["dim"]}
    if n.op == "cast":
        return "Cast", {"to": ELEM_TYPES[n.attrs["to"]]}
    if n.op == "permute":
        return "Transpose", {"perm": list(n.attrs["dims"])}
    if n.op == "cat":
        return "Concat", {"axis": n.attrs["dim"]}
    return None


def _doc(n: Node) -> str:
    parts = [f"layer {n.meta['layer']}"] if n.meta.get("layer") is not None else []
    if n.meta.get("source"):
        parts.append(" ".join(str(n.meta["source"]).split()))
    return " | ".join(parts)


def node_proto(n: Node) -> onnx.NodeProto:
    """The one ONNX node for IR node `n` (standard op or `k3c` domain op, see the module docstring)."""
    ins, outs, name = [v.name for v in n.inputs], [v.name for v in n.outputs], n.outputs[0].name
    std = _standard(n)
    if std is not None:
        return helper.make_node(std[0], ins, outs, name=name, doc_string=_doc(n), **std[1])
    spec = get_op(n.op).attrs
    attrs = {}
    for k, v in n.attrs.items():
        a = _attr_value(spec[k].kind if k in spec else "json", v)
        if a is not None:
            attrs[k] = a
    return helper.make_node(n.op, ins, outs, name=name, domain=DOMAIN, doc_string=_doc(n), **attrs)


def _model(name: str, nodes: list, inputs: list[Value], outputs: list[tuple[str, Value]],
           inner: list[Value], doc: str) -> onnx.ModelProto:
    seen_out: dict[str, onnx.ValueInfoProto] = {}
    for key, v in outputs:
        if v.name not in seen_out:
            info = value_info(v)
            info.doc_string = key
            seen_out[v.name] = info
    ins = {v.name: v for v in inputs}
    infos = [value_info(v) for v in inner if v.name not in ins and v.name not in seen_out]
    g = helper.make_graph(nodes, name, [value_info(v) for v in inputs], list(seen_out.values()), value_info=infos,
                          doc_string=doc)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                              producer_name="k3c", doc_string=doc)
    onnx.checker.check_model(model)
    return model


def to_onnx(graph: Graph, name: str = "k3c") -> onnx.ModelProto:
    """The whole graph, one ONNX node per IR node (see the module docstring); checked with `onnx.checker`."""
    nodes = [node_proto(n) for n in graph.nodes]
    inputs = list(graph.inputs) + list(graph.params.values())
    inner = [v for n in graph.nodes for v in n.outputs]
    return _model(name, nodes, inputs, list(graph.outputs.items()), inner, f"{name}: {len(graph.nodes)} IR nodes")


def block_to_onnx(graph: Graph, blocks: list[Block], name: str = "k3c") -> onnx.ModelProto:
    """An ONNX model of `blocks` (from `k3c.ir.views`): a one-block list is that block's nodes, inputs and outputs
    (a layer alone); several blocks are collapsed, each run of a layer one `k3c.layer` node (attributes: layer,
    label, nodes) and each lone node itself."""
    if len(blocks) == 1:
        b = blocks[0]
        nodes = [node_proto(n) for n in b.nodes]
        inner = [v for n in b.nodes for v in n.outputs]
        return _model(f"{name}_{b.name}", nodes, b.inputs, [(v.name, v) for v in b.outputs], inner,
                      f"{name} {b.name}: {len(b.nodes)} IR nodes")
    nodes, inner = [], []
    for b in blocks:
        if b.layer is None:
            nodes.append(node_proto(b.nodes[0]))
        else:
            nodes.append(helper.make_node("layer", [v.name for v in b.inputs], [v.name for v in b.outputs],
                                          name=b.name, domain=DOMAIN, layer=b.layer, label=block_label(b),
                                          nodes=len(b.nodes)))
        inner += b.outputs if b.layer is not None else b.nodes[0].outputs
    read = {v for b in blocks for v in b.inputs}
    inputs = [v for v in list(graph.inputs) + list(graph.params.values()) if v in read]
    return _model(f"{name}_layers", nodes, inputs, list(graph.outputs.items()), inner,
                  f"{name}: {len(graph.nodes)} IR nodes in {len(blocks)} blocks")
