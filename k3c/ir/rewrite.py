"""A small pattern-rewrite engine for pattern passes (in the spirit of tinygrad's PatternMatcher / TVM DPL).

A pattern is a tree rooted at a node:

    P("mul", X("x"), P("sigmoid", X("x")), name="root")     # x * sigmoid(x), the same x twice

- `P(op, *children, name=None, attrs=None, where=None, single_use=False)` matches a node whose op is `op` (or
  in a tuple of ops) with exactly `len(children)` inputs (`children=None`: any inputs, not matched). `attrs`
  maps attr names to a required value or a predicate `f(value) -> bool`; `where(node) -> bool` adds any
  test. `single_use` requires an interior node's outputs to have exactly one user (so the rewrite makes it
  dead). A matched node is captured under `name`.
- `X(name=None, where=None)` matches any input value (captured under `name`; `where(value) -> bool`).
  A name used twice must capture the same object.

`Rule(pattern, build)`: `build(graph, match) -> Value | list[Value] | None` creates the replacement (new nodes are
inserted just before the root) and returns the values replacing the root's outputs, or None to decline.
`apply_rules(graph, rules, pass_name)` applies the rules to fixpoint and removes nodes the rewrites left dead;
it stamps new nodes' `meta["pass"]` (and copies the root's source/layer) and returns the number of rewrites.
Dead pure nodes are removed after every round that rewrote something (so the replaced roots disappear).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from k3c.errors import IRError, UnsupportedError
from k3c.ir.graph import Graph, Node, Value
from k3c.ir.types import dims_equal


@dataclass
class X:
    """Pattern leaf: any value."""

    name: str | None = None
    where: Callable[[Value], bool] | None = None


@dataclass
class P:
    """Pattern node (see the module docstring)."""

    op: str | tuple
    children: tuple | None = ()
    name: str | None = None
    attrs: dict | None = None
    where: Callable[[Node], bool] | None = None
    single_use: bool = False

    def __init__(self, op, *children, name=None, attrs=None, where=None, single_use=False, any_inputs=False):
        self.op = op
        self.children = None if any_inputs else tuple(children)
        self.name, self.attrs, self.where, self.single_use = name, attrs, where, single_use


@dataclass
class Match:
    """A successful match: `root` node, captures by name (`m["x"]`), and every matched node (`nodes`)."""

    root: Node
    captures: dict[str, Any] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.captures[name]


def _capture(m: Match, name: str | None, obj: Any) -> bool:
    if name is None:
        return True
    prev = m.captures.get(name)
    if prev is not None and prev is not obj:
        return False
    m.captures[name] = obj
    return True


def _match_node(graph: Graph, pat: P, node: Node, m: Match, root: bool) -> bool:
    ops = pat.op if isinstance(pat.op, tuple) else (pat.op,)
    if node.op not in ops:
        return False
    if pat.children is not None and len(pat.children) != len(node.inputs):
        return False
    for k, want in (pat.attrs or {}).items():
        if k not in node.attrs:
            return False
        have = node.attrs[k]
        if callable(want):
            if not want(have):
                return False
        elif type(want) is not type(have) or want != have:
            return False
    if pat.where is not None and not pat.where(node):
        return False
    if pat.single_use and not root:
        for v in node.outputs:
            if len(graph.users(v)) != 1 or graph.is_output(v):
                return False
    if not _capture(m, pat.name, node):
        return False
    m.nodes.append(node)
    for child, v in zip(pat.children or (), node.inputs):
        if isinstance(child, X):
            if child.where is not None and not child.where(v):
                return False
            if not _capture(m, child.name, v):
                return False
        else:
            prod = graph.producer(v)
            if prod is None or len(prod.outputs) != 1 or not _match_node(graph, child, prod, m, False):
                return False
    return True


def match(graph: Graph, pattern: P, node: Node) -> Match | None:
    """Match `pattern` rooted at `node`; returns the `Match` or None."""
    m = Match(node)
    return m if _match_node(graph, pattern, node, m, True) else None


@dataclass
class Rule:
    """`pattern` and its `build(graph, match)` (see the module docstring); `name` shows in meta/debugging."""

    pattern: P
    build: Callable[[Graph, Match], Any]
    name: str = ""


def apply_rules(graph: Graph, rules: list[Rule], pass_name: str = "rewrite", max_rounds: int = 50) -> int:
    """Apply `rules` to fixpoint: first matching rule wins per node, rounds over the node list, dead nodes removed
    after each round that rewrote, new nodes stamped with the pass and the root's source and layer. O(nodes) per
    round: rules are dispatched on the root op, and the nodes a rewrite builds are placed just before its root when
    the round ends (one list rebuild) instead of one list search per insertion.

    A build must add nodes with `graph.add_node` without `before`/`after`. Returns the number of rewrites; raises
    `IRError` like `apply_rules` (wrong count of values, a declining build that added nodes, no fixpoint).
    """
    by_op: dict[str, list[Rule]] = {}
    for r in rules:
        for o in (r.pattern.op if isinstance(r.pattern.op, tuple) else (r.pattern.op,)):
            by_op.setdefault(o, []).append(r)
    total = 0
    for _ in range(max_rounds):
        order = list(graph.nodes)
        placed: dict[int, list[Node]] = {}
        changed = 0
        for node in order:
            candidates = by_op.get(node.op)
            if not candidates:
                continue
            for rule in candidates:
                m = match(graph, rule.pattern, node)
                if m is None:
                    continue
                n0 = len(graph.nodes)
                new = rule.build(graph, m)
                added = graph.nodes[n0:]
                del graph.nodes[n0:]
                if new is None:
                    if added:
                        raise IRError(f"rule {rule.name or rule.pattern.op} declined but added nodes")
                    continue
                new = [new] if isinstance(new, Value) else list(new)
                if len(new) != len(node.outputs):
                    raise IRError(f"rule {rule.name or rule.pattern.op}: {len(new)} values for "
                                  f"{len(node.outputs)} outputs of {node.op}")
                for n in added:
                    n.meta.setdefault("pass", pass_name)
                    for k in ("source", "layer"):
                        if k in node.meta:
                            n.meta.setdefault(k, node.meta[k])
                placed.setdefault(id(node), []).extend(added)
                for old, nv in zip(node.outputs, new):
                    graph.replace_all_uses(old, nv, check_type=not _same_type(old.type, nv.type))
                changed += 1
                break
        if not changed:
            return total
        graph.nodes = [x for n in order for x in (*placed.get(id(n), ()), n)]
        dce_in_place(graph)
        total += changed
    raise IRError(f"{pass_name}: rewrite rules did not reach a fixpoint in {max_rounds} rounds")


def _same_type(a, b) -> bool:
    return a.dtype == b.dtype and a.rank == b.rank and all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def shape_error(graph: Graph, pass_name: str, block: str, what: str, found: Value | Node | None = None) -> IRError:
    """The error a structural matcher raises: `<pass>: <block> does not have the expected shape: <what>; found ...`,
    naming the node found (or the graph input / parameter a value comes from)."""
    from k3c.ir.graph import describe

    if isinstance(found, Value):
        p = graph.producer(found)
        found = p if p is not None else f"%{found.name} ({found.type}, a graph input or parameter)"
    got = f"; found {describe(found) if isinstance(found, Node) else found}" if found is not None else ""
    return IRError(f"{pass_name}: {block} does not have the expected shape: {what}{got}")


# ---- dead code ---------------------------------------------------------------------------------------------------
def _has_effects(op: str) -> bool:
    from k3c.ir.ops import get_op

    try:
        return get_op(op).effects
    except UnsupportedError:
        return True


def dce_in_place(graph: Graph) -> int:
    """Remove from `graph` itself the nodes none of whose outputs reach a graph output or a live node (nodes with
    effects, or of ops the registry does not know, stay live); returns how many were removed. One reverse sweep."""
    live: set[Value] = set(graph.outputs.values())
    dead = []
    for node in reversed(graph.nodes):
        if _has_effects(node.op) or any(v in live for v in node.outputs):
            live.update(node.inputs)
        else:
            dead.append(node)
    graph.remove_nodes(dead)
    return len(dead)
