"""The k3c IR: typed values with symbolic dims, nodes of registered ops, graphs, and the tools around them.

Modules: `types` (TensorType, dims, dtypes), `graph` (Value, Node, Graph + builder), `ops` (the op registry),
`printer`, `serialize` (JSON), `verify`, `interp` (reference interpreter), `nx` (networkx / DOT), `rewrite`
(pattern rewrites). See /work/shared/DESIGN.md, "The IR".
"""

from k3c.ir.types import DTYPES, Dim, TensorType, dim, dim_str, nbytes, numel, torch_dtype  # noqa: F401
from k3c.ir.graph import Graph, Node, Value  # noqa: F401
from k3c.ir.ops import Attr, OpDef, all_ops, get_op, op  # noqa: F401
from k3c.ir.printer import print_graph  # noqa: F401
from k3c.ir.serialize import dump, dumps, load, loads  # noqa: F401
from k3c.ir.verify import verify  # noqa: F401
from k3c.ir.interp import interpret  # noqa: F401

__all__ = ["DTYPES", "Dim", "TensorType", "dim", "dim_str", "nbytes", "numel", "torch_dtype", "Graph", "Node",
           "Value", "Attr", "OpDef", "all_ops", "get_op", "op", "print_graph", "dump", "dumps", "load", "loads",
           "verify", "interpret"]
