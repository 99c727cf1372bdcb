"""The k3c graph: values, nodes and the graph that owns them, with def-use queries and a builder API.

- `Value`: a name (unique in its graph, printed `%name`) and a `TensorType`. Compared by identity.
- `Node`: `op` (a registry name), `inputs` (values), `attrs` (JSON-able data only), `outputs` (values it defines)
  and `meta` (`"pass"`: the pass that last created or changed it, `"source"`: free text such as a model line,
  `"layer"`: int or None).
- `Graph`: `inputs` (activations, caches), `params` (weights keyed by checkpoint key, the value is named by the
  key), `nodes` in topological order, `outputs` (name -> value) and `symbols` (dim symbols it may use).

Def-use maps are kept up to date by the mutation methods, so `producer()` and `users()` are O(1); passes that edit
`node.inputs` directly must use `set_input()` (or call `rebuild_index()` afterwards).
"""

from __future__ import annotations

import copy as _copy
import re
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from k3c.errors import IRError
from k3c.ir.types import DEFAULT_SYMBOLS, TensorType

_JSON_SCALARS = (int, float, str, bool, type(None))
#: Whole-graph facts that passes compute and attach as attributes, kept by `Graph.copy()`: recipes of compile-time
#: parameters (`passes/derived.py`), the kernel schedule (`form_kernels`, see `ir/kernels.py`) and the arena plan
#: (`plan_memory`). Options never live here: they reach passes through the compile context (`k3c/context.py`).
ANNOTATIONS = ("derived_params", "kernels", "memory_plan")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class Value:
    """An SSA value: `name` (unique within its graph, no leading `%`) and `type` (`TensorType`)."""

    __slots__ = ("name", "type")

    def __init__(self, name: str, type: TensorType):
        self.name = name
        self.type = type

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Node:
    """One operation: `outputs = op(inputs) {attrs}`; `meta` carries provenance ("pass", "source", "layer")."""

    __slots__ = ("op", "inputs", "attrs", "outputs", "meta")

    def __init__(self, op: str, inputs: list[Value], attrs: dict, outputs: list[Value], meta: dict | None = None):
        self.op = op
        self.inputs = list(inputs)
        self.attrs = attrs
        self.outputs = list(outputs)
        self.meta = dict(meta or {})

    @property
    def output(self) -> Value:
        """The single output; raises `IRError` for multi-output nodes."""
        if len(self.outputs) != 1:
            raise IRError(f"{describe(self)} has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    def __repr__(self) -> str:
        return describe(self)


def describe(node: Node) -> str:
    """`op -> %out (source, layer N)`: how errors name a node."""
    outs = ", ".join(f"%{v.name}" for v in node.outputs) or "(no outputs)"
    where = [str(node.meta[k]) for k in ("source",) if node.meta.get(k)]
    if node.meta.get("layer") is not None:
        where.append(f"layer {node.meta['layer']}")
    if node.meta.get("pass"):
        where.append(f"pass {node.meta['pass']}")
    return f"{node.op} -> {outs}" + (f" ({'; '.join(where)})" if where else "")


def check_json(obj: Any, path: str = "attrs") -> None:
    """Raise `IRError` unless `obj` is JSON-able data: int/float/str/bool/None, lists and str-keyed dicts."""
    if isinstance(obj, _JSON_SCALARS):
        return
    if isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            check_json(x, f"{path}[{i}]")
        return
    if isinstance(obj, dict):
        for k, x in obj.items():
            if not isinstance(k, str):
                raise IRError(f"{path} has a non-string key {k!r}")
            check_json(x, f"{path}.{k}")
        return
    raise IRError(f"{path} holds {type(obj).__name__} {obj!r}; attrs must be plain JSON data")


def _plain(obj: Any) -> Any:
    """Deep copy of JSON data with tuples turned into lists (so attrs compare and serialise exactly)."""
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _copy_data(obj: Any) -> Any:
    """Deep copy of attrs / meta: JSON containers rebuilt, scalars shared, anything else `copy.deepcopy`'d.
    (`deepcopy` alone costs more than a pass on a full-size model: graphs are copied per pipeline and entry.)"""
    if isinstance(obj, _JSON_SCALARS):
        return obj
    if isinstance(obj, dict):
        return {k: _copy_data(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_data(x) for x in obj]
    return _copy.deepcopy(obj)


class Graph:
    """A k3c program. See the module docstring for the fields; build with `add_input`, `add_param`, `add_node`."""

    def __init__(self, symbols: Iterable[str] = DEFAULT_SYMBOLS):
        self.inputs: list[Value] = []
        self.params: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.outputs: dict[str, Value] = {}
        self.symbols: set[str] = set(symbols)
        self._names: set[str] = set()
        self._counter = 0
        self._producer: dict[Value, Node] = {}
        self._users: dict[Value, dict[Node, None]] = {}
        self._cursor: tuple[str, Node] | None = None

    # ---- names ----------------------------------------------------------------------------------------------
    def fresh_name(self, hint: str | None = None) -> str:
        """A name not yet used in this graph: `hint` itself, else `hint.1`, `hint.2`...; without a hint `0`, `1`..."""
        if hint is not None:
            hint = hint.lstrip("%")
            if not _NAME_RE.match(hint):
                raise IRError(f"value name {hint!r} may only use letters, digits, '_', '.', '-'")
            name, i = hint, 0
            while name in self._names:
                i += 1
                name = f"{hint}.{i}"
        else:
            while str(self._counter) in self._names:
                self._counter += 1
            name = str(self._counter)
        self._names.add(name)
        return name

    def _new_value(self, type: TensorType, hint: str | None) -> Value:
        v = Value(self.fresh_name(hint), type)
        self._users[v] = {}
        return v

    # ---- building -------------------------------------------------------------------------------------------
    def add_input(self, name: str, type: TensorType) -> Value:
        """Add a graph input (activation or cache) named `name` exactly; raises `IRError` if the name is taken."""
        if name in self._names:
            raise IRError(f"graph input name %{name} is already used")
        v = self._new_value(type, name)
        self.inputs.append(v)
        return v

    def add_param(self, key: str, type: TensorType) -> Value:
        """Add a weight under its checkpoint key; the value's name is the key. Raises `IRError` if taken."""
        if key in self.params or key in self._names:
            raise IRError(f"parameter {key!r} is already declared")
        v = self._new_value(type, key)
        self.params[key] = v
        return v

    def set_output(self, name: str, value: Value) -> None:
        """Make `value` the graph output `name` (replacing any previous value of that name)."""
        self.outputs[name] = value

    def add_node(self, op: str, inputs: list[Value], attrs: dict | None = None, *, name_hint: str | None = None,
                 names: list[str] | None = None, meta: dict | None = None, before: Node | None = None,
                 after: Node | None = None) -> list[Value]:
        """Create a node of registry op `op`, infer its output types and insert it; returns the output values.

        Attrs are validated against the op's schema and completed with defaults. Output names come from `names`
        (one per output), else `name_hint` (`hint`, or `hint.0`, `hint.1`... for several outputs), else numbers.
        The node is appended, or placed `before`/`after` a node, or at the cursor of `inserting_before/after`.
        Raises `UnsupportedError` for an unknown op and `IRError` for bad attrs or input types.
        """
        from k3c.ir.ops import get_op

        opdef = get_op(op)
        attrs = opdef.normalize_attrs(_plain(attrs or {}))
        in_types = [v.type for v in inputs]
        for v in inputs:
            if not isinstance(v, Value):
                raise IRError(f"{op}: input {v!r} is not a Value")
        try:
            out_types = opdef.infer(attrs, in_types)
        except IRError as e:
            src = f" ({meta['source']})" if meta and meta.get("source") else ""
            raise IRError(f"{op}{src}: {e}") from None
        if names is not None and len(names) != len(out_types):
            raise IRError(f"{op}: {len(names)} names given for {len(out_types)} outputs")
        if names is None:
            names = [name_hint if len(out_types) == 1 else (f"{name_hint}.{i}" if name_hint else None)
                     for i in range(len(out_types))]
        outputs = [self._new_value(t, n) for t, n in zip(out_types, names)]
        self.insert(Node(op, inputs, attrs, outputs, meta), before=before, after=after)
        return outputs

    def add(self, op: str, *inputs: Value, name_hint: str | None = None, meta: dict | None = None,
            **attrs) -> Value:
        """Shorthand for a single-output `add_node`: `g.add("mul", x, y)`, `g.add("sum", x, dims=[-1])`."""
        outs = self.add_node(op, list(inputs), attrs, name_hint=name_hint, meta=meta)
        if len(outs) != 1:
            raise IRError(f"{op} has {len(outs)} outputs; use add_node")
        return outs[0]

    def insert(self, node: Node, *, before: Node | None = None, after: Node | None = None) -> Node:
        """Insert an already built `node` (its outputs must be fresh values of this graph) and index its uses."""
        if before is None and after is None and self._cursor is not None:
            where, anchor = self._cursor
            if where == "before":
                before = anchor
            else:
                after = anchor
                self._cursor = ("after", node)
        if before is not None:
            self.nodes.insert(self._index(before), node)
        elif after is not None:
            self.nodes.insert(self._index(after) + 1, node)
        else:
            self.nodes.append(node)
        for v in node.outputs:
            self._users.setdefault(v, {})
            self._producer[v] = node
        for v in node.inputs:
            self._users.setdefault(v, {})[node] = None
        return node

    def _index(self, node: Node) -> int:
        for i in range(len(self.nodes) - 1, -1, -1):
            if self.nodes[i] is node:
                return i
        raise IRError(f"{describe(node)} is not in this graph")

    @contextmanager
    def inserting_before(self, node: Node) -> Iterator[None]:
        """Within the block, `add_node` without `before`/`after` inserts before `node` (in call order)."""
        saved, self._cursor = self._cursor, ("before", node)
        try:
            yield
        finally:
            self._cursor = saved

    @contextmanager
    def inserting_after(self, node: Node) -> Iterator[None]:
        """Within the block, `add_node` inserts after `node`, each new node after the previous one."""
        saved, self._cursor = self._cursor, ("after", node)
        try:
            yield
        finally:
            self._cursor = saved

    # ---- queries --------------------------------------------------------------------------------------------
    def producer(self, v: Value) -> Node | None:
        """The node defining `v`, or None for graph inputs and params."""
        return self._producer.get(v)

    def users(self, v: Value) -> list[Node]:
        """The distinct nodes reading `v`, in insertion order (graph outputs are not nodes: see `is_output`)."""
        return list(self._users.get(v, ()))

    def is_output(self, v: Value) -> bool:
        return v in self.outputs.values()  # Values compare by identity

    def values(self) -> Iterator[Value]:
        """Every value: inputs, params, then node outputs in order."""
        yield from self.inputs
        yield from self.params.values()
        for n in self.nodes:
            yield from n.outputs

    def value(self, name: str) -> Value:
        """The value named `name` (with or without `%`); raises `IRError` if absent. O(n)."""
        name = name.lstrip("%")
        for v in self.values():
            if v.name == name:
                return v
        raise IRError(f"no value %{name} in graph")

    # ---- mutation -------------------------------------------------------------------------------------------
    def set_input(self, node: Node, i: int, new: Value) -> None:
        """Replace input `i` of `node` by `new`, keeping the use index right."""
        old = node.inputs[i]
        node.inputs[i] = new
        if not any(x is old for x in node.inputs):
            self._users.get(old, {}).pop(node, None)
        self._users.setdefault(new, {})[node] = None

    def replace_all_uses(self, old: Value, new: Value, *, exclude: Iterable[Node] = (),
                         check_type: bool = True) -> None:
        """Make every node input and graph output that reads `old` read `new` instead, except in `exclude`
        (typically the nodes that compute `new` from `old`).

        Raises `IRError` if the types differ (unless `check_type=False`).
        """
        if old is new:
            return
        if check_type and old.type != new.type:
            raise IRError(f"replace_all_uses: %{old.name} is {old.type} but %{new.name} is {new.type}")
        skip = {id(n) for n in exclude}
        users = self._users.get(old, {})
        new_users = self._users.setdefault(new, {})
        kept = {}
        for node in users:
            if id(node) in skip:
                kept[node] = None
                continue
            node.inputs = [new if x is old else x for x in node.inputs]
            new_users[node] = None
        self._users[old] = kept
        for k, v in self.outputs.items():
            if v is old:
                self.outputs[k] = new

    def remove_nodes(self, nodes: Iterable[Node]) -> None:
        """Remove `nodes` in one O(n) sweep. Raises `IRError` if a remaining node or graph output reads their outputs."""
        dead = {id(n): n for n in nodes}
        if not dead:
            return
        dead_vals = {v for n in dead.values() for v in n.outputs}
        outputs = set(self.outputs.values())
        for v in dead_vals:
            for u in self._users.get(v, ()):
                if id(u) not in dead:
                    raise IRError(f"cannot remove the producer of %{v.name}: still used by {describe(u)}")
            if v in outputs:
                raise IRError(f"cannot remove the producer of %{v.name}: it is a graph output")
        self.nodes = [n for n in self.nodes if id(n) not in dead]
        for n in dead.values():
            for v in n.inputs:
                self._users.get(v, {}).pop(n, None)
            for v in n.outputs:
                self._producer.pop(v, None)
                self._users.pop(v, None)
                self._names.discard(v.name)

    def remove_node(self, node: Node) -> None:
        self.remove_nodes([node])

    def rebuild_index(self) -> None:
        """Recompute the def-use maps and name set after direct edits of `nodes`/`inputs` lists."""
        self._producer, self._users = {}, {}
        self._names = set()
        for v in list(self.inputs) + list(self.params.values()):
            self._users.setdefault(v, {})
            self._names.add(v.name)
        for n in self.nodes:
            for v in n.inputs:
                self._users.setdefault(v, {})[n] = None
            for v in n.outputs:
                self._producer[v] = n
                self._users.setdefault(v, {})
                self._names.add(v.name)

    def toposort(self) -> None:
        """Reorder `nodes` topologically, keeping the current order where the data allows (stable Kahn, O(n)).

        Raises `IRError` naming a node on a cycle or reading an undefined value.
        """
        defined = set(self.inputs) | set(self.params.values())
        produced = {v for n in self.nodes for v in n.outputs}
        waiting: dict[Value, list[Node]] = {}
        missing: dict[int, int] = {}
        ready: list[Node] = []
        for n in self.nodes:
            need = {v for v in n.inputs if v not in defined}
            for v in need:
                if v not in produced:
                    raise IRError(f"{describe(n)} reads %{v.name}, which nothing defines")
                waiting.setdefault(v, []).append(n)
            missing[id(n)] = len(need)
            if not need:
                ready.append(n)
        order_ix = {id(n): i for i, n in enumerate(self.nodes)}
        import heapq

        heap = [(order_ix[id(n)], id(n), n) for n in ready]
        heapq.heapify(heap)
        out: list[Node] = []
        while heap:
            _, _, n = heapq.heappop(heap)
            out.append(n)
            for v in n.outputs:
                for u in waiting.pop(v, ()):
                    missing[id(u)] -= 1
                    if missing[id(u)] == 0:
                        heapq.heappush(heap, (order_ix[id(u)], id(u), u))
        if len(out) != len(self.nodes):
            stuck = next(n for n in self.nodes if missing[id(n)] > 0)
            raise IRError(f"graph has a cycle through {describe(stuck)}")
        self.nodes = out

    # ---- copying --------------------------------------------------------------------------------------------
    def copy(self) -> "Graph":
        """A deep copy: new Values and Nodes with the same names, attrs and meta (deep-copied)."""
        g = Graph(self.symbols)
        vmap: dict[Value, Value] = {}

        def cp(v: Value) -> Value:
            nv = vmap.get(v)
            if nv is None:
                nv = vmap[v] = Value(v.name, v.type)
            return nv

        g.inputs = [cp(v) for v in self.inputs]
        g.params = {k: cp(v) for k, v in self.params.items()}
        g.nodes = [Node(n.op, [cp(v) for v in n.inputs], _copy_data(n.attrs), [cp(v) for v in n.outputs],
                        _copy_data(n.meta)) for n in self.nodes]
        g.outputs = {k: cp(v) for k, v in self.outputs.items()}
        g._counter = self._counter
        for attr in ANNOTATIONS:  # whole-graph facts that passes attach (see ANNOTATIONS)
            if getattr(self, attr, None) is not None:
                setattr(g, attr, _copy.deepcopy(getattr(self, attr)))
        g.rebuild_index()
        return g

    def __repr__(self) -> str:
        return (f"<Graph: {len(self.inputs)} inputs, {len(self.params)} params, {len(self.nodes)} nodes, "
                f"{len(self.outputs)} outputs>")

    def __str__(self) -> str:
        from k3c.ir.printer import print_graph

        return print_graph(self)
