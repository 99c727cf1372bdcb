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

from k3c.errors import IRError
from k3c.ir.graph import Graph, Node, Value


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
    """Apply `rules` to fixpoint (first matching rule wins per node, rounds over the node list).

    Returns the number of rewrites. Raises `IRError` if a build returns values of the wrong count or type, or
    if no fixpoint is reached in `max_rounds` rounds (a rule that keeps re-matching its own output).
    """
    from k3c.passes.dce import dce_in_place

    total = 0
    for _ in range(max_rounds):
        changed = 0
        for node in list(graph.nodes):
            if node.outputs and graph.producer(node.outputs[0]) is not node:
                continue  # removed by an earlier rewrite
            for rule in rules:
                m = match(graph, rule.pattern, node)
                if m is None:
                    continue
                n_before = len(graph.nodes)
                with graph.inserting_before(node):
                    new = rule.build(graph, m)
                if new is None:
                    if len(graph.nodes) != n_before:
                        raise IRError(f"rule {rule.name or rule.pattern.op} declined but added nodes")
                    continue
                new = [new] if isinstance(new, Value) else list(new)
                if len(new) != len(node.outputs):
                    raise IRError(f"rule {rule.name or rule.pattern.op}: {len(new)} values for "
                                  f"{len(node.outputs)} outputs of {node.op}")
                for n in graph.nodes[graph.nodes.index(node) - (len(graph.nodes) - n_before):
                                     graph.nodes.index(node)]:
                    n.meta.setdefault("pass", pass_name)
                    for k in ("source", "layer"):
                        if k in node.meta:
                            n.meta.setdefault(k, node.meta[k])
                for old, nv in zip(node.outputs, new):
                    graph.replace_all_uses(old, nv)
                changed += 1
                break
        if changed:
            dce_in_place(graph)
        total += changed
        if not changed:
            return total
    raise IRError(f"{pass_name}: rewrite rules did not reach a fixpoint in {max_rounds} rounds")
